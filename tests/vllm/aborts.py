"""Aborts and preemptions in a real engine while kvtier loads and stores: prints one JSON line of findings.

    python -m tests.vllm.aborts MODEL_DIR CONFIG_JSON

A is served once, alone. Then P, Q, R and S (1,900 tokens each, 300 to generate) arrive together against 48
engine blocks of 128 tokens: three fit, and as they decode vLLM must preempt; Q is aborted while it decodes and
S while it waits, through vLLM's abort API. Fillers then push A out of the engine; A comes back and is aborted
while kvtier loads it, then comes back alone (from kvtier's tiers). Afterwards: vLLM's free blocks, kvtier's pins
and pending work.
"""

from __future__ import annotations

import json
import sys
import time

from tests.vllm.scenario import prompt


def main() -> None:
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.tiny_model import ENGINE_BLOCKS, start_engine
    from vllm import SamplingParams

    llm = start_engine(sys.argv[1], json.loads(sys.argv[2]), max_num_seqs=4, max_num_batched_tokens=8192)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preempted = []
    preempt = scheduler._preempt_request

    def counting_preempt(request, *args, **kwargs):
        preempted.append(request.request_id.split("-")[0])
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counting_preempt

    def drive(requests: dict[str, tuple[int, int]], aborts: dict[int, str] | None = None) -> dict:
        """name -> (prompt tokens, tokens to generate); `aborts`: step -> the name aborted after it."""
        for name, (n, generate) in requests.items():
            params = SamplingParams(max_tokens=generate, temperature=0.0, logprobs=1, detokenize=False,
                                    ignore_eos=True)
            engine.add_request(name, TokensPrompt(prompt_token_ids=prompt(name, n)), params)
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            steps += 1
            if aborts and steps in aborts:
                engine.abort_request([aborts[steps]])
        return done

    def idle() -> None:  # an engine with nothing to do steps only for requests: this one lets stores finish
        for _ in range(3):
            drive({"idle": (8, 2)})
            time.sleep(0.1)

    drive({"A": (2048, 4)})
    first = drive({name: (1900, 300) for name in "PQRS"}, aborts={40: "Q", 60: "S"})
    for filler in ("E", "F", "G"):
        drive({filler: (2048, 4)})
    idle()
    drive({"A": (2048, 4)}, aborts={1: "A"})  # aborted right after the step that starts its load from kvtier
    idle()
    again = drive({"A": (2048, 4)})["A"]
    idle()
    connector = scheduler.connector.scheduler_side
    print(json.dumps({
        "finished": sorted(first),
        "preempted": sorted(set(preempted)),
        "again": {"cached": again.num_cached_tokens, "tokens": list(again.outputs[0].token_ids),
                  "logprobs": [next(iter(d.values())).logprob for d in again.outputs[0].logprobs]},
        "vllm_free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        "vllm_blocks": ENGINE_BLOCKS,
        "kvtier_pinned": len(connector.directory.pinned()),
        "kvtier_pending": connector.has_pending_work(),
        "kvtier_orphans": connector.directory.orphans(),
    }))


if __name__ == "__main__":
    main()
