"""One vLLM engine (CPU, in-process) running a request sequence; prints its outputs as JSON on the last line.

Each engine gets a fresh process, as a served engine would: the tests fork it from `tests.vllm.zygote`.
    python -m tests.vllm.scenario MODEL_DIR CONFIG_JSON|off PROMPTS...
PROMPTS name seeded 2048-token prompts: A, B, C, D (`L@4064`: a 4,064-token one); `A+B` submits A and B
together. The engine's KV cache holds 48 blocks of 128 tokens, so three other prompts evict a fourth;
KVTIER_TEST_ENGINE='{"block_size": 32, "engine_blocks": 130}' sets other vLLM engine arguments and blocks.
`!redis-kill` and `!redis-start` kill and restart (same port, empty) the test's redis-server, named by
KVTIER_TEST_REDIS="binary|port|dir|pid"; `!reset` resets vLLM's prefix cache and the connector's; `!sleep:S`
waits S seconds. Between requests the engine steps until the connector's stores are done, as a served engine
does.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path


def prompt(name: str, n: int = 2048) -> list[int]:
    """The seeded prompt `name` of `n` tokens; `name@length` says its length itself."""
    name, _, length = name.partition("@")
    rng = random.Random(name)
    return [rng.randrange(3, 32000) for _ in range(int(length or n))]


def redis_action(action: str, restarted):
    """Kill the test's redis-server (SIGKILL, as a crash), or start it again on its port."""
    from tests.redis_server import RedisServer

    binary, port, directory, pid = os.environ["KVTIER_TEST_REDIS"].split("|")
    if action == "!redis-kill":
        if restarted is not None:
            restarted.kill()
        else:
            os.kill(int(pid), signal.SIGKILL)
        return restarted
    if action == "!redis-start":
        return RedisServer(binary, Path(directory), port=int(port)).start()
    raise ValueError(f"unknown action {action}")


ENGINE_SERIES = ("vllm:prefix_cache_hits_total",)  # tokens vLLM's own cache held: the rest came from kvtier


def kvtier_series() -> dict[str, float]:
    """The engine's kvtier samples in Prometheus' registry, and `ENGINE_SERIES`: `name{label="value",...}` without
    vLLM's labels."""
    from prometheus_client import REGISTRY

    out = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if (s.name.startswith("kvtier_") or s.name in ENGINE_SERIES) and not s.name.endswith("_created"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())
                                  if k not in ("engine", "model_name"))
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def drain(llm) -> None:
    """Let finished requests' stores complete before the next request, as a served engine does between requests:
    it keeps stepping while the connector has work in flight (`has_pending_push_work`). In-process, the engine
    steps only while a request runs, so we step it here. A separate engine process steps on its own, out of our
    sight: a short pause stands in."""
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        time.sleep(0.2)
        return
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    deadline = time.monotonic() + 60
    while connector is not None and connector.has_pending_push_work():
        if time.monotonic() > deadline:
            raise RuntimeError("the connector's stores did not complete in 60 s")
        llm.llm_engine.step()


def main() -> None:
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.tiny_model import start_engine
    from vllm import SamplingParams

    model, config, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    kv = None if config == "off" else json.loads(config)
    llm = start_engine(model, kv, **json.loads(os.environ.get("KVTIER_TEST_ENGINE", "{}")))
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, detokenize=False)
    results = []
    redis = None  # the server this process restarted, stopped when it ends
    for names_together in names:
        if names_together.startswith("!sleep:"):  # idle time, e.g. for a breaker's cooldown to pass
            time.sleep(float(names_together.removeprefix("!sleep:")))
            continue
        if names_together.startswith("!redis-"):
            redis = redis_action(names_together, redis)
            continue
        if names_together == "!reset":  # what an RL framework does after a weight update, once idle
            for _ in range(20):  # vLLM resets only with every block free: let finished stores release theirs
                llm.generate([TokensPrompt(prompt_token_ids=[5] * 8)], SamplingParams(max_tokens=2), use_tqdm=False)
                if llm.reset_prefix_cache(reset_connector=True):
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError("reset_prefix_cache kept failing")
            continue
        together = names_together.split("+")
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompt(n)) for n in together], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        for name, out in zip(together, outs):
            completion = out.outputs[0]
            results.append({
                "prompt": name, "tokens": list(completion.token_ids), "cached": out.num_cached_tokens,
                "logprobs": [next(iter(d.values())).logprob for d in completion.logprobs], "seconds": seconds,
            })
        drain(llm)
    figures = {}
    if kv is not None and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
        from vllm.distributed.kv_transfer import get_kv_transfer_group  # the worker half lives in this process

        figures = get_kv_transfer_group().worker_side.metrics.snapshot()
    print(json.dumps({"requests": results, "kvtier": figures, "prometheus": kvtier_series()}))
    if redis is not None:
        redis.stop()


if __name__ == "__main__":
    main()
