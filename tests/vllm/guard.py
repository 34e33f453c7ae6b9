"""The guard and the decision in a real engine, against a disk tier slowed on purpose: prints one JSON line.

    python -m tests.vllm.guard MODEL_DIR CONFIG_JSON DELAY [REQUESTS]

Eight prompts (a 2,048-token prefix of its own and a short suffix each) are served once, which leaves them on
disk (the host tier holds two, the engine three). Then they are served in turn, one at a time, with every disk
read slowed by DELAY (seconds; or `Nx`: N times the slowest recompute of the first serving, whatever this
machine's speed): REQUESTS of them if given; else until the guard turns the disk off (or 40 s pass) and
4 s more, then at full speed until the guard has it back on (or 40 s pass). Each request: its phase, TTFT,
cached tokens, blocks read from disk, logprobs, the guard's state of the disk before and after it, and
`kvtier_tier_enabled{tier="disk"}` as vLLM's Prometheus registry shows it after it.
At the end the first prompt is served twice: the second is vLLM's own prefix-cache hit, the exactness reference.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from tests.vllm.scenario import kvtier_series, prompt

PROMPTS = [f"G{i}" for i in range(8)]
PREFIX, SUFFIX = 2048, 64


def tokens(name: str) -> list[int]:
    return prompt(f"prefix-{name}", PREFIX) + prompt(f"suffix-{name}", SUFFIX)


def main() -> None:
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.tiny_model import start_engine
    from kvtier.rollout.faults import slow_reads
    from vllm import SamplingParams

    delay_file = Path(tempfile.mkdtemp(prefix="kvtier-delay-")) / "delay"
    slow_reads(delay_file)
    llm = start_engine(sys.argv[1], json.loads(sys.argv[2]))
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    control = side.control
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True)
    results = []

    def serve(name: str, phase: str) -> None:
        state = None if control.guard is None else control.guard.state("disk").value  # when it is routed
        lookups = side.stats.lookup_tokens
        disk_before = lookups["disk"]
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens(name))], params, use_tqdm=False)[0]
        enabled = kvtier_series().get('kvtier_tier_enabled{tier="disk"}')
        results.append({"prompt": name, "phase": phase, "ttft": out.metrics.first_token_latency,
                        "cached": out.num_cached_tokens, "disk_tokens": lookups["disk"] - disk_before,
                        "disk_enabled": enabled, "state": state,
                        "state_after": None if control.guard is None else control.guard.state("disk").value,
                        "logprobs": [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]})

    for name in PROMPTS:
        serve(name, "store")
        time.sleep(0.3)  # idle time: the stores and demotions complete
    guard = control.guard

    def until(phase: str, done, limit_s: float, then_s: float = 0.0, requests: int | None = None) -> None:
        started, reached = time.monotonic(), None
        i = 0
        while time.monotonic() - started < limit_s and (requests is None or i < requests):
            serve(PROMPTS[i % len(PROMPTS)], phase)
            i += 1
            if reached is None and done():
                reached = time.monotonic()
            if reached is not None and time.monotonic() - reached >= then_s:
                return

    delay = sys.argv[3]
    if delay.endswith("x"):  # relative to recomputing here: CPUs without AVX-512 prefill far slower
        delay = str(float(delay[:-1]) * max(r["ttft"] for r in results[1:]))
    delay_file.write_text(delay)
    if len(sys.argv) > 4:
        until("slow", lambda: False, 600, requests=int(sys.argv[4]))
    else:
        until("slow", lambda: not guard.enabled("disk"), 40, then_s=4)
        delay_file.write_text("0")
        until("healed", lambda: guard.enabled("disk"), 40)
    serve(PROMPTS[0], "engine hit")  # twice in a row: the second is vLLM's own cache hit of the same length
    serve(PROMPTS[0], "engine hit")
    transitions = [] if guard is None else [{"tier": t.tier, "to": t.to.value, "reason": t.reason}
                                           for t in guard.history]
    print(json.dumps({"requests": results, "delay_s": float(delay), "transitions": transitions,
                      "prometheus": kvtier_series(),
                      "decisions": {f"{t}|{d}": n for (t, d), n in control.decider.decisions.items()}}))


if __name__ == "__main__":
    main()
