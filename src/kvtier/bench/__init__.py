"""`kvtier bench`: every figure is a ratio against a baseline measured in the same run, on the same machine.

Every benchmark measures through `kvtier.timing` (pairing, medians, one percentile, the machine); a file a
figure: `host` (host tier vs copy_), `disk` (disk tier vs raw O_DIRECT), `lookup` (directory lookups vs
dict.get), `simulator` (vs libCacheSim), `redis_tier` (vs raw redis-py, on a server `redis_server` starts),
`vllm_engine` (TTFT on a real vLLM engine), `cluster` (the tables of docs/scaling.md). `tiers.run` is the
`kvtier bench` command; `tables` prints its results. Nothing is imported here: `kvtier --help` stays fast.
"""
