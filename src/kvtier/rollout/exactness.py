"""The rollout's exactness check: what a tier serves must be what vLLM itself would have computed.

A prefix-cache hit and a full recompute of the same prompt differ on their own (other kernel shapes), so a
configuration is not compared with whatever recomputed what a tier restored. The reference is vLLM with an
engine cache that holds every prefix of the workload (also the "buy a bigger GPU" comparison).

The same cached length is not enough either: a cached block's KV depends on the prefill that computed it (its
length and where it started set the kernels' shapes), so vLLM's own hit on a block computed inside another
prompt can differ from the reference's in the last bits (benchmarks/README.md has the figures). A request is
therefore compared only when its cached blocks have the same lineage in both runs: computed by the same
request, from the same cached length, on inputs of the same lineage, and never recomputed since. Such a
request went through the same kernels on the same KV, wherever that KV was kept, so its tokens and logprobs
must be bit-identical. The other requests are reported (same tokens or not) as information only.

That holds for requests computed one at a time. Requests computed together share matmuls whose shapes depend
on the whole batch, and the batch differs between configurations: plain vLLM against itself then disagrees in
the last bits. With concurrency, the check is reported, not required.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.keys import chain_keys


def check(reference: Sequence[dict], runs: Sequence[dict], prompts: Sequence[Sequence[int]], block_tokens: int) -> dict:
    """`reference` and `runs`: per request of `prompts` (sent in that order, one at a time), its `cached` tokens,
    output `tokens` and their `logprobs`; `block_tokens`: the engine's cache block."""
    same = [a is not None and a == b for a, b in zip(lineage(runs, prompts, block_tokens),
                                                      lineage(reference, prompts, block_tokens))]
    compared = [(r, ref) for r, ref, s in zip(runs, reference, same) if s]
    identical = sum(1 for r, ref in compared if r["tokens"] == ref["tokens"] and r["logprobs"] == ref["logprobs"])
    others = [(r, ref) for r, ref, s in zip(runs, reference, same) if not s]
    max_diff = max((abs(a - b) for r, ref in compared for a, b in zip(r["logprobs"], ref["logprobs"])), default=0.0)
    return {
        "compared": len(compared),  # requests whose cached KV has the reference's lineage: must be bit-identical
        "identical": identical,
        "exact": identical == len(compared),
        "max_logprob_diff": max_diff,
        "others": len(others),  # the other requests: information only
        "others_same_tokens": sum(1 for r, ref in others if r["tokens"] == ref["tokens"]),
        "others_same_cached": sum(1 for r, ref in others if r["cached"] == ref["cached"]),
    }


def lineage(results: Sequence[dict], prompts: Sequence[Sequence[int]], block_tokens: int) -> list[int | None]:
    """Per request, a fingerprint of the computation that made its output: which request it is, how much it
    found cached, and the fingerprints of the computations that made those cached blocks (None: a cached block
    of unknown or mixed origin, one computed twice)."""
    made_by: dict[bytes, int | None] = {}  # a block (its key, which names its prefix) -> its prefill's fingerprint
    out: list[int | None] = []
    for index, (result, tokens) in enumerate(zip(results, prompts)):
        keys = chain_keys(tokens, block_tokens)
        cached = min(result["cached"] // block_tokens, len(keys))
        inputs = tuple(made_by.get(key) for key in keys[:cached])
        fingerprint = None if None in inputs else hash((index, cached, inputs))
        out.append(fingerprint)
        for key in keys[cached:]:
            made_by[key] = fingerprint if key not in made_by else None
    return out
