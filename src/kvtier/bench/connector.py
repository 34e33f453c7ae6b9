"""What the vLLM connector's scheduler half costs vLLM's scheduler thread for one long request, hooks and all.

`kvtier.bench.scheduler` times the directory's part; a request through the connector also costs the hooks'
own work per block (its keys, the engine blocks of each kvtier block, the tokens each tier serves) and the
reports of its steps. `hooks` drives `SchedulerSide` as `KVTierConnector` does, with vLLM's own `Request`
(its block hashes made by vLLM when it is created, as the engine makes them), the default configuration and a
warm host tier with room:

- `hit`: a prompt the host tier holds: `get_num_new_matched_tokens`, `update_state_after_alloc`, the step's
  metadata, the rank's reports of the load, and `request_finished` (its blocks are there: touched);
- `miss`: a new prompt: the lookup that finds nothing, `request_finished` (its store planned), the step's
  metadata and the reports of the store.

Each beside vLLM's hashing of the same prompt, in alternating rounds. What the rank does in between (its copies,
and the list of the step ids it reports) is not the scheduler's and is not timed.

With tensor parallelism vLLM's multiprocess executor also pickles each step's metadata on that thread, for its
ranks: `sent` times a request's load job and store job so, and unpickled, as each rank does.
"""

from __future__ import annotations

import gc
import itertools
import os
import pickle
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kvtier.bench.scheduler import BLOCK_TOKENS, PROMPTS, WarmDirectory, paired, round_count, vllm_hashing
from kvtier.config import parse_config
from kvtier.layout import ALIGN
from kvtier.timing import fresh_keys, timed


def hooks(n_tokens: int, rounds: int, tick: Callable[[], None] = lambda: None) -> dict:
    """A hit and a miss of an `n_tokens` prompt through the connector's scheduler half (module doc)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvtier.integrations.vllm.messages import KVTierWorkerMetadata
    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.setup import Geometry

    blocks = n_tokens // BLOCK_TOKENS
    geometry = Geometry(engine_block_size=BLOCK_TOKENS, block_tokens=BLOCK_TOKENS, engine_block_nbytes=ALIGN,
                        world_size=1, model="bench", dtype="bfloat16", kv_layout="bench", hash_algo="sha256",
                        tenant_salt="")
    # the default load policy (`auto`): a hit weighs every prefix of what it found against recomputing it
    config = parse_config({"cpu_bytes_to_use": (rounds + 4) * blocks * ALIGN, "block_size": BLOCK_TOKENS})
    half = SchedulerSide(config, geometry)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_TOKENS, hash_fn)
    engine_ids = list(range(blocks))
    engine_blocks = KVCacheBlocks(([KVCacheBlock(i) for i in engine_ids],))
    counter = itertools.count()
    step = SchedulerOutput.make_empty()
    step.total_num_scheduled_tokens = 1  # a step that computes: no worker waits for its stores

    def request(tokens: list[int]) -> Any:
        return Request(f"r{next(counter)}", tokens + [0], SamplingParams(max_tokens=1), None, block_hasher=hasher)

    def prompt() -> list[int]:
        return list(os.urandom(n_tokens))  # a prompt no other round shares

    def reports(timed: float, meta: Any, jobs: str, finished: set[str]) -> float:
        """The step's metadata shipped, its steps reported by the rank: the scheduler's part, timed."""
        ids = [step.id for job in getattr(meta, jobs) for chain in job.chains for step in chain]
        start = time.perf_counter()
        half.update_connector_output(KVTierWorkerMetadata(ids), finished)
        return timed + time.perf_counter() - start

    stored: list[list[int]] = []

    def miss() -> float:
        new = request(prompt())
        start = time.perf_counter()
        half.get_num_new_matched_tokens(new, 0)
        half.update_state_after_alloc(new, engine_blocks, 0)
        new.num_computed_tokens = n_tokens
        half.request_finished(new, engine_ids)
        meta = half.build_connector_meta(step)
        elapsed = reports(time.perf_counter() - start, meta, "stores", set())
        stored.append(new.prompt_token_ids[:-1])
        return elapsed

    def hit() -> float:
        again = request(stored.pop(0))
        start = time.perf_counter()
        promised, _ = half.get_num_new_matched_tokens(again, 0)
        half.update_state_after_alloc(again, engine_blocks, promised or 0)
        meta = half.build_connector_meta(step)
        elapsed = reports(time.perf_counter() - start, meta, "loads", {again.request_id})
        if promised != n_tokens:
            raise RuntimeError(f"connector bench: {promised} tokens promised of a stored {n_tokens}")
        start = time.perf_counter()
        again.num_computed_tokens = n_tokens
        half.request_finished(again, engine_ids)
        half.build_connector_meta(step)
        return elapsed + time.perf_counter() - start

    hashing = vllm_hashing(n_tokens)
    figures: dict = {"tokens": n_tokens, "block_tokens": BLOCK_TOKENS, "blocks": blocks}
    figures.update(paired("miss", miss, hashing, rounds, tick))  # misses first: they store what hits find
    figures.update(paired("hit", hit, hashing, rounds, tick))
    return figures


def sent(n_tokens: int, rounds: int, tick: Callable[[], None] = lambda: None) -> dict:
    """A request's load job and store job (a warm host tier, 16-token blocks) as vLLM's multiprocess executor
    (tensor parallel > 1) sends them to its ranks each step: pickled on the scheduler's thread, timed beside vLLM's
    hashing of the prompt; and unpickled, as each rank does before its forward."""
    from kvtier.integrations.vllm.messages import KVTierMetadata, LoadJob, StoreJob

    blocks = n_tokens // BLOCK_TOKENS
    d = WarmDirectory(blocks, evict=False, rounds=1)
    load = d.directory.plan_load(d.loaded)
    store = d.directory.plan_store(fresh_keys(blocks))
    engine_blocks: list[list[int | None]] = [[i] for i in range(blocks)]  # one engine block per kvtier block
    messages = {"load": KVTierMetadata(loads=[LoadJob("r", load.chains, engine_blocks, list(load.sources))]),
                "store": KVTierMetadata(stores=[StoreJob("r", store.chains, engine_blocks)])}
    hashing = vllm_hashing(n_tokens)
    figures: dict = {"tokens": n_tokens, "block_tokens": BLOCK_TOKENS, "blocks": blocks}
    for name, message in messages.items():
        figures.update(_sent_and_received(name, message, hashing, rounds, tick))
    return figures


def _sent_and_received(name: str, message: object, hashing: Callable[[], float], rounds: int,
                       tick: Callable[[], None]) -> dict:
    """`message` pickled beside vLLM's hashing, and unpickled: `sent`'s figures for one job."""
    dump = partial(pickle.dumps, message, pickle.HIGHEST_PROTOCOL)
    figures = paired(f"{name}_sent", lambda: timed(dump)[0], hashing, rounds, tick)
    data = dump()
    received = [timed(partial(pickle.loads, data))[0] for _ in range(rounds)]
    figures[f"{name}_received_ms"] = round(statistics.median(received) * 1e3, 2)
    figures[f"{name}_sent_bytes"] = len(data)
    return figures


def connector_ticks(quick: bool) -> int:
    """How often `connector_rows` calls its `tick`: for a progress bar's total."""
    return 4 * (round_count(quick) + 1)  # a miss and a hit, the load job and the store job


def connector_rows(quick: bool = False, tick: Callable[[], None] = lambda: None) -> dict:
    """The rows `kvtier bench` shows under the directory's: a 128k-token request through the hooks (`connector`)
    and its jobs as sent (`sent`), with the collector off as the directory's rounds are."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return {"connector": hooks(PROMPTS["128k"], round_count(quick), tick),
                "sent": sent(PROMPTS["128k"], round_count(quick), tick)}
    finally:
        if was_enabled:
            gc.enable()

