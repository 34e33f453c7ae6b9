"""`kvtier demo`: the rollout one change at a time, on a real vLLM engine (`rollout`), or in-process behind an
engine stand-in that checks every restored block against its recomputation (`in_process`)."""
