"""The mover: the data plane. Executes the directory's plans on bounded thread pools and reports each step.

- Steps of one chain run in order; chains run in parallel (reads on `n_read_threads`, writes on
  `n_write_threads`). Each step runs through the handler of its (src, dst) pair (`kvtier.mover.handlers`).
- Plain caller<->host copies (a chain of one PUT or one GET) are batched: every part of every block in one
  `torch._foreach_copy_`, or, for an engine's pages on the CPU, one loop of memory copies (`pages`).
- Stores never wait for I/O in the caller (CPU blocks are copied into host in its thread, a memory copy;
  everything else runs in the background): at most `queue_depth` store plans wait; beyond that
  `reserve_store` says no and the caller counts a dropped store. Loads are waited for: the request needs
  the bytes.
- A slot is never reused while a transfer touches it: the directory only hands out a slot after its
  previous content left (in the same chain, earlier) and marks copies READY only on completion.
- A shared tier's steps run in batches on pools of their own (`kvtier.mover.shared`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

from kvtier.directory import Op, Plan, Status, Step
from kvtier.metrics import Metrics
from kvtier.mover.copy import CallerBlock, on_cpu
from kvtier.mover.handlers import CallerIO, CallerToSlot, Reporter, SlotToCaller, build_handlers
from kvtier.mover.shared import SharedTraffic
from kvtier.stores.base import Stores

WRITE_NICENESS = 10  # background writers: the CPU scheduler prefers the engine's threads when both want a core
log = logging.getLogger(__name__)


class Mover:
    def __init__(
        self,
        stores: Stores,
        report: Reporter,
        metrics: Metrics,
        n_read_threads: int = 8,
        n_write_threads: int = 4,
        queue_depth: int = 64,
        cpus: set[int] | None = None,
        n_shared_read_threads: int = 4,
        n_shared_write_threads: int = 2,
    ) -> None:
        """`cpus`: where the mover's threads may run. An engine that pins its compute threads to some cores
        (vLLM's CPU backend does) would otherwise hand that pinning to our threads, which then queue behind
        its spinning OpenMP threads."""
        self.stores = stores
        self.report = self._labelling(report)
        self.metrics = metrics
        self._cpus = cpus
        self._put, self._get = CallerToSlot(stores.host), SlotToCaller(stores.host)
        self._handlers = build_handlers(stores, self._put, self._get,
                                        lambda tier: metrics.count("integrity_failures", tier))
        self._reads = self._pool(n_read_threads, "kvtier-read", background=False)
        self._writes = self._pool(n_write_threads, "kvtier-write", background=True)
        self._store_slots = threading.BoundedSemaphore(queue_depth)
        self._shared = SharedTraffic(stores, self.report, metrics, self._pool, n_shared_read_threads,
                                     n_shared_write_threads, queue_depth)
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()

    def _labelling(self, report: Reporter) -> Reporter:
        """`report`, after the host slab has recorded which block each slot a step wrote now holds."""
        host, slab = self.stores.host_name, self.stores.host

        def labelled(steps: Sequence[Step], status: Status) -> None:
            for step in steps:
                if step.dst == host and step.dst_slot is not None:
                    slab.label(step.dst_slot, (step.key, step.parent) if status is Status.OK else None)
            report(steps, status)

        return labelled

    def _pool(self, threads: int, name: str, background: bool) -> ThreadPoolExecutor:
        """A pool whose threads run on `cpus`; background ones yield the CPU to the engine's compute threads."""
        def start_thread() -> None:
            if self._cpus:
                os.sched_setaffinity(0, self._cpus)
            if background:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITE_NICENESS)

        return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=start_thread)

    # ---------------------------------------------------------------- entry points

    def reserve_store(self) -> bool:
        """Take one place in the store queue, or say no at once (the caller then drops the store)."""
        return self._store_slots.acquire(blocking=False)

    def release_store(self) -> None:
        self._store_slots.release()

    def store(self, plan: Plan, blocks: Sequence[CallerBlock], ready: Any = None) -> None:
        """Run a store plan: PUTs of CPU blocks into host at once, in the caller's thread; the rest in the
        background. The place `reserve_store` took is freed when its local part is done. Its shared-tier
        writes follow as one job. `ready`: on an accelerator, `ready_event(blocks)`, recorded by the caller."""
        io = CallerIO(blocks=blocks, ready=ready)
        plain, cut = self._shared.cut(plan.chains, last_only=True)
        local = plain + [before for before, _, _ in cut if before]
        failed: set[bytes] = set()  # keys whose PUT failed: their write-through steps are skipped
        if on_cpu(blocks):
            # Memory to memory: a copy costs the same CPU in any thread, and in the caller's it runs between the
            # engine's steps instead of against its compute threads (which it would stall). What follows a PUT
            # (write-through to disk) runs in the background; a chain that must first make room does too.
            batch, chains = _leading(local, Op.PUT)
            if batch:
                self._run_batch(batch, self._put, io, None, failed)
            tasks = [partial(self._run_chain, chain, io, None, failed) for chain in chains]
        else:
            batch, chains = _singles(local, Op.PUT, self.stores.host_name)
            tasks = [partial(self._run_chain, chain, io, None, failed) for chain in chains]
            if batch:
                tasks.append(partial(self._run_batch, batch, self._put, io, None, failed))
        shared = [step for _, step, _ in cut]
        shared_done: Future | None = None
        if shared:
            shared_done = Future()  # tracked from now on, so that flush() also waits for the shared job
            self._track(shared_done)
        remaining = [len(tasks)]
        lock = threading.Lock()

        def local_done() -> None:
            self._store_slots.release()
            if shared_done is not None:
                self._shared.write_through(shared, failed, shared_done)

        def one_done(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                local_done()

        if not tasks:
            local_done()
        for task in tasks:
            future = self._writes.submit(task)
            self._track(future)
            future.add_done_callback(one_done)

    def load(self, plan: Plan, out: Sequence[CallerBlock], ready: Any = None) -> list[bool]:
        """Run a load plan and wait for it; True for each `out[i]` that now holds its block.

        Host hits are copied in the caller's thread; promotions and reads from slower tiers run on the read pool;
        fetches from a shared tier run as batches once the evictions that make room for them are done.
        `ready`: on an accelerator, `ready_event(out)`, recorded by the caller (in its thread).
        """
        unreported = _Unreported(plan, self.report)
        io = CallerIO(out=out, ready=ready, report=unreported)
        running: list[Future] = []
        try:
            delivered = [False] * len(out)
            plain, cut = self._shared.cut(plan.chains, last_only=False)
            batch, chains = _singles(plain, Op.GET, self.stores.host_name)
            for chain in chains:
                running.append(self._reads.submit(self._run_chain, chain, io, delivered))
            failed: set[bytes] = set()  # keys whose fetch failed: their GETs are skipped
            befores: list[Future] = []
            for before in (before for before, _, _ in cut if before):
                befores.append(self._reads.submit(self._run_chain, before, io, delivered, failed))
            running += befores
            if batch:
                self._run_batch(batch, self._get, io, delivered)
            if cut:
                for f in befores:
                    f.result()
                self._shared.fetch([step for _, step, _ in cut], failed, io, delivered)
                for _, _, after in cut:
                    if after:
                        self._run_chain(after, io, delivered, failed)
            for f in running:
                f.result()
        except BaseException:  # a bug or a closed pool: what runs still reports, then the rest fails
            wait(running)
            unreported.fail()
            raise
        return delivered

    def lookup_shared(self, tier: str, keys: Sequence[bytes]) -> int:
        return self._shared.lookup(tier, keys)

    def delete(self, steps: Sequence[Step]) -> None:
        """Garbage deletes (dropped blocks' files), in the background."""
        if steps:
            self._track(self._writes.submit(self._run_chain, list(steps), CallerIO(), None))

    def flush(self) -> None:
        """Wait until every submitted plan has completed."""
        while True:
            with self._pending_lock:
                pending = list(self._pending)
            if not pending:
                return
            wait(pending)

    def close(self) -> None:
        self.flush()
        for pool in (self._reads, self._writes):
            pool.shutdown(wait=True)
        self._shared.close()

    # ---------------------------------------------------------------- execution

    def _run_batch(
        self, steps: list[Step], handler: CallerToSlot | SlotToCaller, io: CallerIO,
        delivered: list[bool] | None = None, failed: set[bytes] | None = None,
    ) -> None:
        """Many caller<->host copies in one go, straight between the caller's tensors and the slots."""
        start = time.perf_counter()
        try:
            handler.run_many(steps, io)
            status = Status.OK
        except Exception:
            log.exception("kvtier: a batch of %d %s steps failed", len(steps), steps[0].op.value)
            status = Status.FAILED
        if status is Status.OK:
            each = (time.perf_counter() - start) / len(steps)
            self.metrics.observe_move(steps[0].src, steps[0].dst, self.stores.host.payload_nbytes, each,
                                      count=len(steps))
            if delivered is not None:
                for step in steps:
                    delivered[step.index] = True
        elif failed is not None:
            failed.update(step.key for step in steps)
        (io.report or self.report)(steps, status)

    def _run_chain(
        self, chain: list[Step], io: CallerIO, delivered: list[bool] | None = None, failed: set[bytes] | None = None,
    ) -> None:
        if failed is None:
            failed = set()  # keys whose bytes did not arrive where later steps of the chain read them
        full: set[str] = set()  # tiers where a delete that made room for a later step of the chain failed
        for step in chain:
            if (step.needs_prev and step.key in failed) or step.dst in full:
                status = Status.FAILED
            else:
                start = time.perf_counter()
                status, nbytes = self._run_step(step, io)
                if status is Status.OK and step.op is not Op.DELETE:
                    self.metrics.observe_move(step.src, step.dst, nbytes, time.perf_counter() - start)
                elif status is Status.FAILED and step.op in (Op.PUT, Op.COPY):  # ENOSPC, EIO...: counted, served on
                    self.metrics.count("stores_dropped", f"{step.dst}_failed")
                if status is Status.OK and step.op is Op.GET and delivered is not None:
                    delivered[step.index] = True
            if status is not Status.OK:
                if step.op is Op.DELETE:
                    full.add(step.src)
                else:
                    failed.add(step.key)
            (io.report or self.report)((step,), status)

    def _run_step(self, step: Step, io: CallerIO) -> tuple[Status, int]:
        """Any failure is the step's status, never an exception: the chain goes on (skipping what needed
        this step), every step is reported, and nothing waits for a report that never comes."""
        try:
            return self._handlers[(step.src, step.dst)].run(step, io)
        except OSError:
            return Status.FAILED, 0
        except Exception:  # a bug, not an I/O error: loud, but still only this step's failure
            log.exception("kvtier: %s %s->%s failed", step.op.value, step.src, step.dst)
            return Status.FAILED, 0

    def _track(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._untrack)

    def _untrack(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.discard(future)
        if (exc := future.exception()) is not None:  # a bug, not an I/O error: make it loud
            log.error("kvtier mover job failed", exc_info=exc)


class _Unreported:
    """A load's reporter that keeps the steps it has not reported: if the load raises, they are reported FAILED
    (once what is running is done), so that nothing waits for them, their pins and queued bytes included."""

    def __init__(self, plan: Plan, report: Reporter) -> None:
        self._left = {step.id: step for chain in plan.chains for step in chain}
        self._report = report
        self._lock = threading.Lock()

    def __call__(self, steps: Sequence[Step], status: Status) -> None:
        with self._lock:
            for step in steps:
                self._left.pop(step.id, None)
        self._report(steps, status)

    def fail(self) -> None:
        with self._lock:
            left, self._left = list(self._left.values()), {}
        if left:
            self._report(left, Status.FAILED)


def _singles(chains: list[list[Step]], caller_op: Op, host: str) -> tuple[list[Step], list[list[Step]]]:
    """Single-step caller<->host chains (`caller_op`) go into one batch; everything else keeps its chain."""
    batch, rest = [], []
    for chain in chains:
        if len(chain) == 1 and chain[0].op is caller_op and host in (chain[0].src, chain[0].dst):
            batch.append(chain[0])
        else:
            rest.append(chain)
    return batch, rest


def _leading(chains: list[list[Step]], caller_op: Op) -> tuple[list[Step], list[list[Step]]]:
    """The caller<->host steps (`caller_op`) that start their chains, and what is left to run after them."""
    batch: list[Step] = []
    rest: list[list[Step]] = []
    for chain in chains:
        if chain[0].op is caller_op:
            batch.append(chain[0])
            chain = chain[1:]
        if chain:
            rest.append(chain)
    return batch, rest
