"""`scheduler_ms_per_request`: what one long request costs vLLM's scheduler thread in kvtier's directory.

The connector plans on the scheduler thread: a request's lookup, its load plan (`plan_load`) when it is
scheduled, its store plan (`plan_store`) when it finishes, and the completions the workers report back, taken
as the connector's scheduler half takes one rank's reports (`InFlight`; `load`: lookup + plan_load +
completions, the last of which unpins the load; `store`: plan_store + completions). For
a 32k- and a 128k-token prompt in 16-token blocks (vLLM's GPU block size), on a warm host tier, with and
without eviction (a store into a full tier evicts as many blocks as it stores), and for the store of host + disk
(a full host tier demoting what it evicts to a full disk tier, which evicts as many), each is timed and set beside
vLLM's own hashing of the same prompt, measured in the same run (`hash_block_tokens` with its default
sha256, block by block as `get_request_block_hasher` does): a ratio, lower is better (target <= 0.25 for
store and for load at 128k tokens). The 128k prompt is measured again in kvtier blocks of 256 tokens, 16 of vLLM's
each (`block_size: 256`, what a long-context deployment sets): the directory then sees 16 times fewer blocks,
while vLLM still hashes every 16 tokens. Medians of alternating rounds, spread kept. A row of `kvtier bench`,
with the connector's rows (`kvtier.bench.connector`):

    python -m kvtier.bench.scheduler
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.directory import Directory, Plan, TierSpec
from kvtier.layout import ALIGN
from kvtier.sim.instant_mover import complete_instantly
from kvtier.stores.base import TierKind
from kvtier.timing import alternate, fresh_keys

if TYPE_CHECKING:
    from kvtier.integrations.vllm.inflight import Kind

BLOCK_TOKENS = 16  # vLLM's GPU block size, and kvtier's block_size by default inside vLLM
LARGE_BLOCK_TOKENS = 256  # kvtier blocks of 16 engine blocks (LMCache's default chunk)
PROMPTS = {"32k": 32 * 1024, "128k": 128 * 1024}
TARGET = 0.25
GC_BLOCKS = 100_000  # the directory of `collector`: a 200 GiB host tier of Llama-3.1-8B's 16-token blocks
DISK_ROOM = 4  # the disk tier below host, in prompts


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


class WarmDirectory:
    """A warm host tier (and a disk tier below it, with `demote`) and the rounds that plan a request's store or
    load on it, completions included: reported by one rank and taken as the connector's scheduler half takes them
    (`InFlight`: the plan shipped, the rank's report counted, the steps completed)."""

    def __init__(self, blocks: int, evict: bool, rounds: int, demote: bool = False) -> None:
        from kvtier.integrations.vllm.inflight import InFlight

        room = 2 * blocks if evict or demote else (rounds + 3) * blocks
        specs = [TierSpec("host", room * ALIGN, ALIGN, kind=TierKind.HOST)]
        if demote:  # admitting all, as `min_sightings: 1` does
            specs.append(TierSpec("disk", DISK_ROOM * blocks * ALIGN, ALIGN, kind=TierKind.DISK))
            room += DISK_ROOM * blocks
        self.directory = Directory(specs)
        self.inflight = InFlight(self.directory, world_size=1, block_nbytes=ALIGN)
        self.blocks = blocks
        while (evict or demote) and len(self.directory) < room:  # full before the first round: a store evicts
            others = fresh_keys(min(blocks, room - len(self.directory)))  # as many as it adds (in each tier)
            complete_instantly(self.directory, self.directory.plan_store(others))
        self.loaded = fresh_keys(blocks)
        complete_instantly(self.directory, self.directory.plan_store(self.loaded))

    def store(self) -> float:
        keys = fresh_keys(self.blocks)
        start = time.perf_counter()
        self._completed(self.directory.plan_store(keys), "store")
        return time.perf_counter() - start

    def load(self) -> float:
        start = time.perf_counter()
        found = len(self.directory.lookup(self.loaded))  # the connector's get_num_new_matched_tokens
        plan = self.directory.plan_load(self.loaded[:found])
        self._completed(plan, "load")  # its last report unpins the load (`finish_load`)
        elapsed = time.perf_counter() - start
        if len(plan.keys) != self.blocks:
            raise RuntimeError(f"scheduler bench: a load found {len(plan.keys)} of {self.blocks} blocks")
        return elapsed

    def _completed(self, plan: Plan, kind: Kind) -> None:
        """`plan` shipped and every step of it reported OK; then the same for the deletes it left."""
        self._reported(plan, kind)
        garbage = self.directory.take_garbage()
        if garbage:
            self._reported(Plan([[step] for step in garbage]), "delete")

    def _reported(self, plan: Plan, kind: Kind) -> None:
        self.inflight.ship(plan, kind)
        if len(self.inflight.report(Counter(step.id for chain in plan.chains for step in chain), {})) != 1:
            raise RuntimeError(f"scheduler bench: a {kind} plan was not done once every step was reported")


def _case(n_tokens: int, evict: bool, rounds: int, tick: Callable[[], None] = lambda: None,
          demote: bool = False, block_tokens: int = BLOCK_TOKENS) -> dict:
    """One prompt's load and store on a host tier with room or evicting; with `demote`, the store of host + disk.
    `block_tokens`: kvtier's block size (vLLM hashes 16-token blocks whatever it is)."""
    blocks = n_tokens // block_tokens
    d = WarmDirectory(blocks, evict, rounds, demote)
    hashing = vllm_hashing(n_tokens)
    figures: dict = {"tokens": n_tokens, "block_tokens": block_tokens, "blocks": blocks, "evict": evict or demote,
                     "demote": demote}
    parts = [("store", d.store)] if demote else [("load", d.load), ("store", d.store)]  # a load: the same as evicting
    for name, ours in parts:  # loads first: stores that evict take the chain
        figures.update(paired(name, ours, hashing, rounds, tick))
    return figures


def paired(name: str, ours: Callable[[], float], hashing: Callable[[], float], rounds: int,
            tick: Callable[[], None]) -> dict:
    """`ours` and vLLM's hashing in alternating rounds: the medians, their ratio, and each round's ratio."""
    pairs = alternate(ours, hashing, rounds, tick)
    ratios = [o / b for o, b in zip(pairs["ours_s"], pairs["baseline_s"])]
    return {f"{name}_ms": round(statistics.median(pairs["ours_s"]) * 1e3, 2),
            f"{name}_vllm_hashing_ms": round(statistics.median(pairs["baseline_s"]) * 1e3, 2),
            f"{name}_ratio": round(statistics.median(ratios), 3), f"{name}_ratio_runs": [round(r, 3) for r in ratios]}


def collector(blocks: int = GC_BLOCKS, rounds: int = 3, stores: int = 12) -> dict:
    """What the directory's blocks cost the garbage collector, the rest of the heap frozen: vLLM freezes its own
    after startup and keeps the collector on while it serves, so a collection falls on whichever thread allocates
    when one comes due, the scheduler's. With a host tier of `blocks` blocks: the objects per block the collector
    tracks, a full collection's pause, and 128k-token stores that evict as many blocks, `stores` with the
    collector off, then `stores` with it on (their medians, and the full collections that ran among them)."""
    thaw = gc.get_freeze_count() == 0  # a heap frozen before stays frozen
    was_enabled = gc.isenabled()
    full: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.collect()
    gc.freeze()
    try:
        before = len(gc.get_objects())
        directory = Directory([TierSpec("host", blocks * ALIGN, ALIGN, kind=TierKind.HOST)])
        for start in range(0, blocks, 8192):
            complete_instantly(directory, directory.plan_store(fresh_keys(min(8192, blocks - start))))
        tracked = len(gc.get_objects()) - before
        pauses = []
        for _ in range(rounds):
            start_s = time.perf_counter()
            gc.collect()
            pauses.append(time.perf_counter() - start_s)

        def store() -> float:
            keys = fresh_keys(PROMPTS["128k"] // BLOCK_TOKENS)
            start_s = time.perf_counter()
            complete_instantly(directory, directory.plan_store(keys))
            return time.perf_counter() - start_s

        gc.disable()
        off = [store() for _ in range(stores)]
        gc.collect()  # what the stores above left is not the ones below's to collect
        gc.enable()
        gc.callbacks.append(count)
        on = [store() for _ in range(stores)]
    finally:
        if count in gc.callbacks:
            gc.callbacks.remove(count)
        (gc.enable if was_enabled else gc.disable)()
        if thaw:
            gc.unfreeze()
    return {"blocks": len(directory), "tracked_objects_per_block": round(tracked / blocks, 2),
            "full_collection_ms": round(statistics.median(pauses) * 1e3, 1),
            "full_collection_ms_runs": [round(p * 1e3, 1) for p in pauses], "stores": stores,
            "store_ms_collector_off": round(statistics.median(off) * 1e3, 1),
            "store_ms_collector_on": round(statistics.median(on) * 1e3, 1),
            "store_ms_collector_on_max": round(max(on) * 1e3, 1),
            "full_collections_while_storing": len(full)}


def round_count(quick: bool) -> int:
    return 3 if quick else 7


def ticks(quick: bool) -> int:
    """How often `run` calls its `tick`: for a progress bar's total."""
    parts = len(PROMPTS) * 2 * 2 + 1 + 3  # load and store, with room and evicting; host + disk; large blocks' three
    return parts * (round_count(quick) + 1) + 1


def run(quick: bool = False, tick: Callable[[], None] = lambda: None) -> dict:
    """Every case; `scheduler_vs_vllm_hashing`: the worst store or load ratio at 128k tokens in 16-token blocks,
    `large_blocks_vs_vllm_hashing` the same in 256-token kvtier blocks."""
    was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: the plans' own cost; what the collector adds for their objects is `collector`
    try:
        cases = [_case(n, evict, round_count(quick), tick) for n in PROMPTS.values() for evict in (False, True)]
        cases.append(_case(PROMPTS["128k"], True, round_count(quick), tick, demote=True))
        for demote in (False, True):
            cases.append(_case(PROMPTS["128k"], True, round_count(quick), tick, demote, LARGE_BLOCK_TOKENS))
    finally:
        if was_enabled:
            gc.enable()
    pause = collector(GC_BLOCKS // 4 if quick else GC_BLOCKS, stores=4 if quick else 12)
    tick()

    def worst(block_tokens: int) -> float:
        return max(max(c["store_ratio"], c.get("load_ratio", 0.0)) for c in cases
                   if c["tokens"] == PROMPTS["128k"] and c["block_tokens"] == block_tokens)

    return {"block_tokens": BLOCK_TOKENS, "cases": cases, "scheduler_vs_vllm_hashing": worst(BLOCK_TOKENS),
            "large_blocks_vs_vllm_hashing": worst(LARGE_BLOCK_TOKENS), "target": TARGET, "collector": pause,
            "what": "lookup + plan_load / plan_store + every step's completion as the connector takes one rank's "
                    "reports (InFlight), warm host tier (and a full disk tier below it: demote), against vLLM's "
                    "hash_block_tokens (sha256) of the same prompt"}


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick=True), indent=2))
