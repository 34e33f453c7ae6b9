"""What the rollout sends: the built-in mix, or any trace `analyze` reads, as token-id prompts.

The built-in mix: shared system prompts, RAG documents over them, multi-turn sessions that come back after
other traffic, and unique prompts, long and short. A trace's blocks become tokens: each (prefix-chained) block
id is drawn into `block_tokens` token ids by a generator seeded with the id, so two requests share tokens
exactly where the trace says they share a prefix; a request longer than its blocks gets a unique tail.
`salt` gives the same structure with other tokens: each concurrency level gets a workload of its own, so no
level is served from what an earlier level left in a cache.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvtier.rollout.client import Prompt

VOCAB = 32000  # token ids are drawn from [3, VOCAB): Llama-family vocabularies and the tiny model


def builtin(n_requests: int, salt: int, max_tokens: int, max_prompt: int) -> list[Prompt]:
    from kvtier.traces.workloads import shared_prefix_workload

    # Prefixes come back after more traffic than the small engine cache holds: the case tiers are for.
    requests = shared_prefix_workload(n_requests, seed=salt, system_prompts=6, system_tokens=1024, documents=4,
                                      document_tokens=1024, sessions=4, turn_tokens=256, unique_tokens=2048,
                                      mix=(0.25, 0.25, 0.3, 0.2))
    prompts = []
    for i, r in enumerate(requests):
        tokens = list(r.tokens[:max_prompt])
        if r.kind == "unique" and i % 2:
            tokens = tokens[:128]  # short requests among the long ones
        prompts.append(Prompt(tokens, r.kind, max_tokens))
    return prompts


def from_trace(path: Path, n_requests: int | None, salt: int, max_tokens: int, max_prompt: int) -> list[Prompt]:
    """The first `n_requests` of the trace (all when None); outputs capped at `max_tokens`, prompts at
    `max_prompt` tokens (their prefix kept, so their reuse is kept)."""
    from kvtier.traces.read import read_trace

    prompts: list[Prompt] = []
    for i, request in enumerate(read_trace(path)):
        if n_requests is not None and i >= n_requests:
            break
        tokens: list[int] = []
        for block in request.blocks:
            tokens += _block_tokens(block, request.block_tokens, salt)
            if len(tokens) >= request.input_tokens:
                break
        tail = random.Random(f"{salt}/tail/{i}")
        tokens += [tail.randrange(3, VOCAB) for _ in range(request.input_tokens - len(tokens))]
        tokens = tokens[: min(request.input_tokens, max_prompt)] or [3]
        prompts.append(Prompt(tokens, "trace", max(1, min(request.output_tokens, max_tokens))))
    if not prompts:
        raise ValueError(f"{path}: no requests in the trace")
    return prompts


def _block_tokens(block: int, n: int, salt: int) -> list[int]:
    rng = random.Random(block * 1_000_003 + salt)
    return [rng.randrange(3, VOCAB) for _ in range(n)]
