"""`scheduler_ms_per_request`: what one long request costs vLLM's scheduler thread in kvtier's directory.

The connector plans on the scheduler thread: a request's lookup, its load plan (`plan_load`) when it is
scheduled, its store plan (`plan_store`) when it finishes, and the completions the workers report back
(`load`: lookup + plan_load + completions + finish_load; `store`: plan_store + completions). For
a 32k- and a 128k-token prompt in 16-token blocks (vLLM's GPU block size), on a warm host tier, with and
without eviction (a store into a full tier evicts as many blocks as it stores), each is timed and set beside
vLLM's own hashing of the same prompt, measured in the same run (`hash_block_tokens` with its default
sha256, block by block as `get_request_block_hasher` does): a ratio, lower is better (target <= 0.25 for
store and for load at 128k tokens). Medians of alternating rounds, spread kept. A row of `kvtier bench`:

    python -m kvtier.bench.scheduler
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

from kvtier.directory import Directory, TierSpec
from kvtier.layout import ALIGN
from kvtier.sim.instant_mover import complete_instantly
from kvtier.stores.base import TierKind
from kvtier.timing import alternate, fresh_keys

BLOCK_TOKENS = 16
PROMPTS = {"32k": 32 * 1024, "128k": 128 * 1024}
TARGET = 0.25


def vllm_hashing(n_tokens: int) -> Callable[[], float]:
    """Seconds vLLM spends hashing an `n_tokens` prompt into 16-token block hashes (its default hash)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    tokens = list(range(n_tokens))

    def one() -> float:
        start = time.perf_counter()
        parent = None
        for i in range(0, n_tokens, BLOCK_TOKENS):
            parent = hash_block_tokens(hash_fn, parent, tokens[i : i + BLOCK_TOKENS], None)
        return time.perf_counter() - start

    return one


class _Directory:
    """A warm host tier and the rounds that plan a request's store or load on it, completions included."""

    def __init__(self, blocks: int, evict: bool, rounds: int) -> None:
        room = 2 * blocks if evict else (rounds + 3) * blocks
        self.directory = Directory([TierSpec("host", room * ALIGN, ALIGN, kind=TierKind.HOST)])
        self.blocks = blocks
        while evict and len(self.directory) < room:  # full before the first round: a store evicts what it adds
            others = fresh_keys(min(blocks, room - len(self.directory)))
            complete_instantly(self.directory, self.directory.plan_store(others))
        self.loaded = fresh_keys(blocks)
        complete_instantly(self.directory, self.directory.plan_store(self.loaded))

    def store(self) -> float:
        keys = fresh_keys(self.blocks)
        start = time.perf_counter()
        complete_instantly(self.directory, self.directory.plan_store(keys))
        return time.perf_counter() - start

    def load(self) -> float:
        start = time.perf_counter()
        found = len(self.directory.lookup(self.loaded))  # the connector's get_num_new_matched_tokens
        plan = self.directory.plan_load(self.loaded[:found])
        complete_instantly(self.directory, plan)
        self.directory.finish_load(plan)
        elapsed = time.perf_counter() - start
        if len(plan.keys) != self.blocks:
            raise RuntimeError(f"scheduler bench: a load found {len(plan.keys)} of {self.blocks} blocks")
        return elapsed


def _case(n_tokens: int, evict: bool, rounds: int, tick: Callable[[], None] = lambda: None) -> dict:
    blocks = n_tokens // BLOCK_TOKENS
    d = _Directory(blocks, evict, rounds)
    hashing = vllm_hashing(n_tokens)
    figures: dict = {"tokens": n_tokens, "blocks": blocks, "evict": evict}
    for name, ours in (("load", d.load), ("store", d.store)):  # loads first: stores that evict take the chain
        pairs = alternate(ours, hashing, rounds, tick)
        ratios = [o / b for o, b in zip(pairs["ours_s"], pairs["baseline_s"])]
        figures[f"{name}_ms"] = round(statistics.median(pairs["ours_s"]) * 1e3, 2)
        figures[f"{name}_vllm_hashing_ms"] = round(statistics.median(pairs["baseline_s"]) * 1e3, 2)
        figures[f"{name}_ratio"] = round(statistics.median(ratios), 3)
        figures[f"{name}_ratio_runs"] = [round(r, 3) for r in ratios]
    return figures


def round_count(quick: bool) -> int:
    return 3 if quick else 7


def ticks(quick: bool) -> int:
    """How often `run` calls its `tick`: for a progress bar's total."""
    return len(PROMPTS) * 2 * 2 * (round_count(quick) + 1)


def run(quick: bool = False, tick: Callable[[], None] = lambda: None) -> dict:
    """Every case; `scheduler_vs_vllm_hashing`: the worst store or load ratio at 128k tokens."""
    was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection inside one round is another thread's cost, not the plan's
    try:
        cases = [_case(n, evict, round_count(quick), tick) for n in PROMPTS.values() for evict in (False, True)]
    finally:
        if was_enabled:
            gc.enable()
    long = [c for c in cases if c["tokens"] == PROMPTS["128k"]]
    worst = max(max(c["store_ratio"], c["load_ratio"]) for c in long)
    return {"block_tokens": BLOCK_TOKENS, "cases": cases, "scheduler_vs_vllm_hashing": worst, "target": TARGET,
            "what": "lookup + plan_load / plan_store + every step's completion (kvtier.sim.instant_mover), warm host "
                    "tier, against vLLM's hash_block_tokens (sha256) of the same prompt"}


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick=True), indent=2))
