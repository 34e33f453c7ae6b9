"""The rollout's exactness check: what a tier serves must be what vLLM itself would have computed.

A prefix-cache hit and a full recompute of the same prompt differ on their own (other kernel shapes), so a
configuration is not compared with whatever recomputed what a tier restored. The reference is vLLM with an
engine cache that holds every prefix of the workload (also the "buy a bigger GPU" comparison): a request that
gets the same number of cached tokens there as in a configuration went through the same kernels, so its tokens
and logprobs must be bit-identical. The other requests are reported (same tokens or not) as information only.

That holds for requests computed one at a time. Requests computed together share matmuls whose shapes depend
on the whole batch, and the batch differs between configurations (the others' cached lengths differ): plain
vLLM against itself then disagrees in the last bits (benchmarks/README.md has the figures). With concurrency,
the check is reported, not required.
"""

from __future__ import annotations

from collections.abc import Sequence


def check(reference: Sequence[dict], runs: Sequence[dict]) -> dict:
    """`reference` and `runs`: per request, its `cached` tokens, output `tokens` and their `logprobs`."""
    compared = [(r, ref) for r, ref in zip(runs, reference) if r["cached"] == ref["cached"]]
    identical = sum(1 for r, ref in compared if r["tokens"] == ref["tokens"] and r["logprobs"] == ref["logprobs"])
    others = [(r, ref) for r, ref in zip(runs, reference) if r["cached"] != ref["cached"]]
    max_diff = max((abs(a - b) for r, ref in compared for a, b in zip(r["logprobs"], ref["logprobs"])), default=0.0)
    return {
        "compared": len(compared),  # requests with the reference's cached length: must be bit-identical
        "identical": identical,
        "exact": identical == len(compared),
        "max_logprob_diff": max_diff,
        "others": len(others),  # requests with another cached length: information only
        "others_same_tokens": sum(1 for r, ref in others if r["tokens"] == ref["tokens"]),
    }
