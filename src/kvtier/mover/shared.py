"""The mover's side of a shared tier (Redis): its steps run in batches of one round trip, on pools of their own.

A step that touches the shared tier is cut out of its chain. A store's shared steps (write-through
host->redis, parents first) run after the rest of the plan, as one background job: `put_chain` per batch (the
store skips what it holds and what it would refuse as an orphan); a full write queue drops the job, counted,
so that a slow Redis never holds up local stores. A load's fetches run after the steps before them in their
chains (evictions), in parallel batches: into host slots, then their GETs (redis->host, staged loads), or
through a buffer of the thread's own into the caller's blocks (redis->caller). Every call is bounded by the
store's timeouts; with its breaker open nothing is tried: fetches fail (the prefix ends there) and writes are
dropped, counted in `kvtier_stores_dropped_total{reason}`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack

import torch

from kvtier.directory import CALLER, Status, Step
from kvtier.metrics import Metrics
from kvtier.mover.copy import copy_from_slot, device_stream
from kvtier.mover.handlers import CallerIO, Reporter, into_caller, slot_of, thread_buffer
from kvtier.stores.base import PutStatus, ReadStatus, SlotStore, Stores

SHARED_BATCH_BYTES = 32 << 20  # payload bytes in one pipelined call to a shared tier
Cut = tuple[list[Step], Step, list[Step]]  # a chain cut around its one shared step: (before, step, after)
log = logging.getLogger(__name__)


class SharedTraffic:
    def __init__(
        self, stores: Stores, report: Reporter, metrics: Metrics, pool: Callable[[int, str, bool], ThreadPoolExecutor],
        n_read_threads: int, n_write_threads: int, queue_depth: int,
    ) -> None:
        """`pool(threads, name, background)`: the mover's thread pools, set up as its own are."""
        self.stores = stores.shared
        self.slab: SlotStore = stores.host
        self.report = report
        self.metrics = metrics
        self._reads = pool(n_read_threads, "kvtier-shared-read", False) if self.stores else None
        self._writes = pool(n_write_threads, "kvtier-shared-write", True) if self.stores else None
        self._slots = threading.BoundedSemaphore(queue_depth)  # write jobs waiting or running
        self._local = threading.local()  # each thread's buffer for fetches into the caller's blocks

    def lookup(self, tier: str, keys: Sequence[bytes], route: bytes | None) -> int:
        """How many leading blocks of `keys` the shared tier holds now (one round trip; 0 with its breaker
        open or Redis away). Another engine may evict them a moment later: a fetch then fails, a miss.
        `route`: what picks the chain's partition (`keys.chain_route` of the whole chain)."""
        return self.stores[tier].lookup(keys, route) if keys else 0

    def cut(self, chains: list[list[Step]], last_only: bool) -> tuple[list[list[Step]], list[Cut]]:
        """Chains that touch no shared tier, and the others cut around their one shared step. A chain that does
        not fit that shape (or, with `last_only`, whose shared step is not its last) runs as it is."""
        if not self.stores:
            return list(chains), []
        plain, cut = [], []
        for chain in chains:
            at = [i for i, step in enumerate(chain) if step.src in self.stores or step.dst in self.stores]
            if len(at) != 1 or (last_only and at[0] != len(chain) - 1):
                plain.append(chain)
            else:
                i = at[0]
                cut.append((chain[:i], chain[i], chain[i + 1 :]))
        return plain, cut

    # ---------------------------------------------------------------- writes

    def write_through(self, steps: list[Step], failed: set[bytes], done: Future) -> None:
        """Queue a store's write-through; drop it (counted) when that queue is full. `failed`: keys whose PUT
        failed, whose write-through is skipped. `done` is set when every step has been reported."""
        if not self._slots.acquire(blocking=False):
            self._drop(steps, "queue_full")
            done.set_result(None)
            return

        def job() -> None:
            try:
                self._write_all(steps, failed)
            except Exception:  # a bug: its steps were reported FAILED; make it loud, keep the mover going
                log.exception("kvtier shared-tier write job failed")
            finally:
                self._slots.release()
                done.set_result(None)

        try:
            assert self._writes is not None
            self._writes.submit(job)
        except RuntimeError:  # shut down
            self._slots.release()
            self._drop(steps, "closed")
            done.set_result(None)

    def _write_all(self, steps: list[Step], failed: set[bytes]) -> None:
        """Write-through, parents first, batch by batch; every step is reported once."""
        unreported = {id(s): s for s in steps}

        def report(group: Sequence[Step], status: Status, reason: str | None = None) -> None:
            for s in group:
                del unreported[id(s)]
            if reason is not None:
                self._drop(group, reason)
            elif group:
                self.report(group, status)

        held: set[bytes] = set()  # keys the tier holds (found, or put by this job)
        try:
            report([s for s in steps if s.needs_prev and s.key in failed], Status.FAILED)  # the PUT failed
            for group in self.batches([s for s in steps if id(s) in unreported]):
                self._write_batch(group, report, held)
        except Exception:
            report(list(unreported.values()), Status.FAILED, "failed")
            raise

    def _write_batch(self, steps: list[Step], report: Callable[..., None], held: set[bytes]) -> None:
        tier = steps[0].dst
        store = self.stores[tier]
        start = time.perf_counter()
        statuses = store.put_chain([(s.key, s.parent, self.slab.view(slot_of(s.src_slot))) for s in steps], held,
                                   steps[0].route)
        stored = sum(1 for st in statuses if st is PutStatus.STORED)
        if stored:
            each = (time.perf_counter() - start) / stored
            self.metrics.observe_move(steps[0].src, tier, store.payload_nbytes, each, count=stored)
        report([s for s, st in zip(steps, statuses) if st.held], Status.OK)
        for status in set(statuses) - {PutStatus.STORED, PutStatus.EXISTS}:
            group = [s for s, st in zip(steps, statuses) if st is status]
            report(group, Status.FAILED, "breaker_open" if status is PutStatus.DROPPED else status.value)

    def _drop(self, steps: Sequence[Step], reason: str) -> None:
        if steps:
            label = reason if reason == "breaker_open" else f"{steps[0].dst}_{reason}"
            self.metrics.count("stores_dropped", label, len(steps))
            self.report(steps, Status.FAILED)

    # ---------------------------------------------------------------- reads

    def fetch(self, steps: list[Step], failed: set[bytes], io: CallerIO, delivered: list[bool]) -> None:
        """Fetch blocks into their host slots or the caller's blocks (`io.out`, then `delivered`), batches in
        parallel; a key that did not arrive joins `failed`."""
        groups = self.batches(steps)
        if len(groups) == 1:
            self._fetch_batch(groups[0], failed, io, delivered)
            return
        assert self._reads is not None
        futures: list[Future] = []
        try:
            for group in groups:
                futures.append(self._reads.submit(self._fetch_batch, group, failed, io, delivered))
        finally:
            wait(futures)  # none still running when this returns or raises: the caller fails what is unreported
        for future in futures:
            future.result()

    def _fetch_batch(self, steps: list[Step], failed: set[bytes], io: CallerIO, delivered: list[bool]) -> None:
        """One pipelined call straight into the host slots (or this thread's buffer). A block that is gone,
        corrupt or foreign (the store removes those) is SOURCE_LOST: its GET is skipped and the prefix ends there."""
        tier, dst = steps[0].src, steps[0].dst
        store = self.stores[tier]
        start = time.perf_counter()
        try:
            into = self._buffers(len(steps), store.payload_nbytes) if dst == CALLER else \
                [self.slab.view(slot_of(s.dst_slot)) for s in steps]
            statuses = store.get_many([s.key for s in steps], into, steps[0].route)
            if dst == CALLER:
                self._deliver(steps, statuses, into, io, delivered)
        except Exception:  # no buffer (ENOMEM), or a bug; not an outage (the store turns those into misses)
            log.exception("kvtier shared-tier fetch failed")
            statuses = [ReadStatus.MISSING] * len(steps)
        each = (time.perf_counter() - start) / len(steps)
        ok = [s for s, st in zip(steps, statuses) if st is ReadStatus.OK]
        lost = [s for s, st in zip(steps, statuses) if st is not ReadStatus.OK]
        bad = sum(1 for st in statuses if st.is_integrity_failure)
        if bad:
            self.metrics.count("integrity_failures", tier, bad)
        if ok:
            self.metrics.observe_move(tier, dst, store.payload_nbytes, each, count=len(ok))
        failed.update(s.key for s in lost)
        report = io.report or self.report
        if ok:
            report(ok, Status.OK)
        if lost:
            report(lost, Status.SOURCE_LOST)

    def _buffers(self, n: int, nbytes: int) -> list[memoryview]:
        """`n` buffers of `nbytes`, in one buffer of this thread's own."""
        buffer = thread_buffer(self._local, n * nbytes)
        return [buffer[i * nbytes : (i + 1) * nbytes] for i in range(n)]

    @staticmethod
    def _deliver(steps: list[Step], statuses: list[ReadStatus], buffers: list[memoryview], io: CallerIO,
                 delivered: list[bool]) -> None:
        """The blocks that arrived, from their buffers into the caller's blocks."""
        arrived = [(s, b) for s, st, b in zip(steps, statuses, buffers) if st is ReadStatus.OK]
        with ExitStack() as gates:  # past its load's deadline, a block is no longer ours to write
            arrived = [(s, b) for s, b in arrived if gates.enter_context(into_caller(io, s.index))]
            with device_stream(io.out, io.ready):
                for step, buffer in arrived:
                    copy_from_slot(io.out[step.index], torch.frombuffer(buffer, dtype=torch.uint8))
        for step, _ in arrived:
            delivered[step.index] = True

    # ---------------------------------------------------------------- both

    def batches(self, steps: list[Step]) -> list[list[Step]]:
        """Consecutive runs of steps between the same two tiers and of one route, each within SHARED_BATCH_BYTES."""
        groups: list[list[Step]] = []
        for step in steps:
            tier = step.src if step.src in self.stores else step.dst
            per = max(1, SHARED_BATCH_BYTES // self.stores[tier].payload_nbytes)
            last = groups[-1] if groups else None
            if last is None or len(last) >= per or (step.src, step.dst, step.route) != (last[0].src, last[0].dst,
                                                                                        last[0].route):
                groups.append([step])
            else:
                last.append(step)
        return groups

    def close(self) -> None:
        for pool in (self._reads, self._writes):
            if pool is not None:
                pool.shutdown(wait=True)
