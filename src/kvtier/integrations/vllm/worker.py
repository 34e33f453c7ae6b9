"""The connector's worker half: stores and mover over this worker's shard. It executes; it never decides.

The engine's KV memory is treated as opaque pages: every layer tensor is viewed as bytes
`(outer, num_blocks, page)`, whatever the backend's layout, so layout changes in vLLM do not break us.
A kvtier block in a host slot is its engine blocks one after another, each as all its layers' pages.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.config import KVTierConfig
from kvtier.directory import Op, Plan, Status, Step
from kvtier.integrations.vllm.flush import flush
from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMetadata, LoadJob, LoadTiming, StoreJob
from kvtier.integrations.vllm.setup import Geometry
from kvtier.integrations.vllm.stats import Deltas, add_breaker, label
from kvtier.metrics import Metrics
from kvtier.mover import Loaded, Mover
from kvtier.mover.copy import ready_event
from kvtier.mover.pages import Pages
from kvtier.stores.base import Stores
from kvtier.wiring import build_mover, build_stores

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # longest an idle step waits for a store or a load: a new request is not held back long
LOAD_THREADS = 2  # per tier: asynchronous loads of one tier waiting on it at once (each within its deadline)


def engine_pages(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Every layer's KV as uint8 `(num_blocks, page)` views, in layer order (no copy)."""
    pages: list[torch.Tensor] = []
    for name, tensor in kv_caches.items():
        if not tensor.is_contiguous():
            raise ValueError(f"kvtier: KV cache of layer {name} is not contiguous: {tuple(tensor.shape)}")
        dim = next((d for d, size in enumerate(tensor.shape) if size == num_blocks), None)
        if dim is None:
            raise ValueError(f"kvtier: no dimension of {num_blocks} blocks in layer {name}: {tuple(tensor.shape)}")
        outer = math.prod(tensor.shape[:dim])
        raw = tensor.reshape(-1).view(torch.uint8).view(outer, num_blocks, -1)
        pages.extend(raw[o] for o in range(outer))  # e.g. K and V halves when they are outermost
    return pages


@dataclass
class _Loading:
    """An asynchronous load's parts (one per tier) not done yet: it is reported once the last is."""

    job: LoadJob
    parts: int


class WorkerSide:
    def __init__(self, config: KVTierConfig, geo: Geometry, rank: int) -> None:
        self.config = config
        self.geo = geo
        self.rank = rank
        self.pages: Pages | None = None
        self.mover: Mover | None = None
        self.stores: Stores | None = None
        self.metrics = Metrics(None, geo.block_tokens, keep_observed=True)
        self._lock = threading.Lock()
        self._sent = threading.Condition(self._lock)  # a held request's blocks are all copied out, or a load is done
        self._loads_running = 0  # asynchronous loads not yet reported
        self._completions: dict[int, Status] = {}
        self._transfers: list[LoadTiming] = []  # each tier's part of each load, timed
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._deltas = Deltas()
        self._puts_left: dict[str, set[int]] = {}  # request id -> PUT steps still copying its engine blocks
        # vLLM's CPU backend binds its compute threads to cores; ours may run on any core of the machine
        self._cpus = set(range(os.cpu_count() or 1))
        self._loaders: dict[str, ThreadPoolExecutor] = {}  # tier -> the threads its asynchronous loads wait on

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self.pages = Pages(engine_pages(kv_caches, num_blocks))
        found = self.pages.engine_block_nbytes
        if found != self.geo.engine_block_nbytes:
            raise ValueError(f"kvtier: engine block is {found} B in the KV tensors, {self.geo.engine_block_nbytes} B"
                             " by the KV-cache config")
        self.stores = build_stores(self.config, self.geo.block_nbytes, self.geo.namespace(self.rank), self.rank,
                                   self.geo.world_size, self.geo.owner)
        self.metrics.shared.update(self.stores.shared)
        self.mover = build_mover(self.config, self.stores, self._report, self.metrics, cpus=self._cpus)

    # ---------------------------------------------------------------- per engine step

    def start(self, meta: KVTierMetadata) -> None:
        assert self.mover is not None, "register_kv_caches first"
        if meta.reset and self.stores is not None:  # a stop's flush must not write the old blocks back to disk
            self.stores.host.forget_labels()
        if meta.deletes:
            self.mover.delete(meta.deletes)
        for store in meta.stores:
            self._store(store)
        for load in meta.loads:
            self._load(load)

    def _store(self, job: StoreJob) -> None:
        steps = [s for c in job.chains for s in c]
        puts = {s.id for s in steps if s.op is Op.PUT}
        if job.holds:
            with self._lock:
                self._puts_left[job.request_id] = set(puts)
        assert self.mover is not None
        if not self.mover.reserve_store():  # the scheduler bounds stores too; this is the backstop
            self.metrics.count("stores_dropped", "queue_full", len(puts))
            self._report(steps, Status.FAILED)
            return
        assert self.pages is not None
        self.mover.store(Plan(chains=job.chains), self.pages.blocks(job.sources), ready=ready_event(self.pages.tensors))

    def _load(self, job: LoadJob) -> None:
        """A synchronous load (host hits) runs here, in the engine's thread, before the forward that needs it. An
        asynchronous one (a slower tier) runs in the background: vLLM goes on stepping the other requests and
        waits for this one to be reported in `get_finished`, so a slow disk stalls only the requests it serves.
        Each tier's part waits on threads of that tier's own, at most its deadline (`load_timeout_s`, then its
        blocks are errors: vLLM recomputes them), so that a hung disk never holds up a Redis load."""
        assert self.pages is not None
        ready = ready_event(self.pages.tensors)  # here, in the engine's thread: after what its stream queued on them
        started = time.monotonic()
        if job.sync:
            self._part_done(_Loading(job, 1), *self._run_part(job, job.chains, ready, started))
            return
        parts: defaultdict[str, list[list[Step]]] = defaultdict(list)
        for chain in job.chains:
            parts[job.sources[chain[-1].index]].append(chain)
        loading = _Loading(job, len(parts))
        with self._lock:
            self._loads_running += 1
        if not parts:
            self._part_done(loading, set(), [])
        for tier, chains in parts.items():
            self._loader(tier).submit(self._run_async_part, loading, chains, ready, started)

    def _loader(self, tier: str) -> ThreadPoolExecutor:
        pool = self._loaders.get(tier)
        if pool is None:
            pool = self._loaders[tier] = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix=f"kvtier-load-{tier}",
                                                            initializer=lambda: os.sched_setaffinity(0, self._cpus))
        return pool

    def _run_async_part(self, loading: _Loading, chains: list[list[Step]], ready: Any, started: float) -> None:
        self._part_done(loading, *self._run_part(loading.job, chains, ready, started))

    def _run_part(self, job: LoadJob, chains: list[list[Step]], ready: Any,
                  started: float) -> tuple[set[int], list[LoadTiming]]:
        """Run some of a load's chains: the engine blocks they failed to fill, and each tier's timing."""
        assert self.mover is not None
        indices = [chain[-1].index for chain in chains]  # each chain ends in its block's GET
        handed = False  # to the mover, which reports every step of a plan it took
        try:
            assert self.pages is not None
            out = self.pages.blocks(job.targets)
            handed = True
            loaded = self.mover.load(Plan(chains=chains), out, ready, since=started)
        except Exception:  # nothing may stay unreported: vLLM would wait for this request forever
            log.exception("kvtier: a load for request %s failed", job.request_id)
            if not handed:  # nor the scheduler for its steps (pins, queued bytes)
                self._report([step for chain in chains for step in chain], Status.FAILED)
            loaded = Loaded([False] * len(job.targets), {}, set())
        failed = {b for i in indices if not loaded.delivered[i] for b in job.targets[i] if b is not None}
        timings = []  # what the decision learns tiers' speeds from, and the guard whom to charge
        for tier, blocks in Counter(job.sources[i] for i in indices).items():
            whole = all(loaded.delivered[i] for i in indices if job.sources[i] == tier)
            outcome = "expired" if tier in loaded.expired else "ok" if whole else "failed"
            seconds = loaded.seconds.get(tier, time.monotonic() - started)
            timings.append(LoadTiming(job.request_id, tier, blocks, seconds, outcome))
        return failed, timings

    def _part_done(self, loading: _Loading, failed: set[int], timings: list[LoadTiming]) -> None:
        job = loading.job
        with self._lock:  # errors before the request is reported: vLLM reads them after get_finished
            self._transfers.extend(timings)
            self._load_errors |= failed
            loading.parts -= 1
            if loading.parts > 0:
                return
            self._load_errors |= set(job.unavailable)
            if not job.sync:  # vLLM waits for an asynchronous load to be reported; a synchronous one it ran
                self._recving.add(job.request_id)
                self._loads_running -= 1
                self._sent.notify_all()

    def _report(self, steps: Sequence[Step], status: Status) -> None:
        with self._lock:
            for step in steps:
                self._completions[step.id] = status
                if step.op is Op.PUT:
                    for request_id, left in list(self._puts_left.items()):
                        if step.id in left:
                            left.discard(step.id)
                            if not left:
                                del self._puts_left[request_id]
                                self._sending.add(request_id)
                                self._sent.notify_all()
                            break

    def wait_if_idle(self, meta: KVTierMetadata) -> None:
        """An idle engine step (requests waiting for blocks our stores hold, or for our loads) would loop at once,
        holding the GIL our copy threads need and waking the engine's OpenMP team: on such a step, wait a moment
        for a held request to be released or a load to finish instead."""
        if meta.idle:
            with self._sent:
                self._sent.wait_for(self._news, timeout=IDLE_WAIT_S)

    def _news(self) -> bool:
        """Something to report (a request sent or received), or nothing in flight to wait for."""
        return bool(self._sending or self._recving) or not (self._puts_left or self._loads_running)

    # ---------------------------------------------------------------- what vLLM collects after each step

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            # a held request with nothing left to copy (its PUTs all dropped) is done at once
            for request_id in [r for r, left in self._puts_left.items() if not left]:
                del self._puts_left[request_id]
                self._sending.add(request_id)
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def worker_meta(self) -> KVTierWorkerMetadata | None:
        with self._lock:
            done, self._completions = self._completions, {}
            transfers, self._transfers = self._transfers, []
        if not done and not transfers:
            return None
        return KVTierWorkerMetadata(list(done), {i: s for i, s in done.items() if s is not Status.OK}, transfers)

    def stats_payload(self) -> dict:
        """What the data plane did since the last call."""
        moves = self.metrics.moves
        with moves.lock:
            payload = {"counters": {
                "moves": self._deltas.take("moves", moves.moves),
                "move_bytes": self._deltas.take("move_bytes", moves.bytes),
                "integrity_failures": self._deltas.take("integrity_failures", moves.integrity_failures),
                "stores_dropped": self._deltas.take("stores_dropped", moves.stores_dropped),
            }, "gauges": {}}
        observed = self.metrics.take_observed()
        if observed:
            payload["histograms"] = {"move_seconds": {label(pair): values for pair, values in observed.items()}}
        shared = self.stores.shared if self.stores is not None else {}
        for name, store in shared.items():
            add_breaker(payload, store, name, f"rank{self.rank}", self._deltas)
        return payload

    def shutdown(self) -> None:
        """vLLM tears the worker down (a graceful stop: SIGTERM with `--shutdown-timeout` > 0): transfers in flight
        finish, then the host tier's blocks go to the first disk tier, for `shutdown_flush_s` at most."""
        for pool in self._loaders.values():
            pool.shutdown(wait=True)
        if self.mover is not None:
            self.mover.close()
        if self.stores is not None:
            written, held = self.flush(self.config.shutdown_flush_s)
            log.info("kvtier: shutdown: %d of the host tier's %d blocks written to disk (the others were there, or"
                     " past its bound)", written, held)
            self.stores.close()

    def flush(self, budget_s: float) -> tuple[int, int]:
        """The host tier's blocks to the first disk tier, within its bound (`kvtier.integrations.vllm.flush`):
        (written, blocks in host). A restart's scan finds them."""
        assert self.stores is not None
        disk = next(iter(self.stores.local.values()), None)
        if disk is None:
            return 0, len(self.stores.host.labelled())
        return flush(self.stores.host, disk, budget_s)
