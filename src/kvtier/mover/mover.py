"""The mover: the data plane. Executes the directory's plans on bounded thread pools and reports each step.

- Steps of one chain run in order; chains run in parallel (reads on `n_read_threads`, writes on
  `n_write_threads`). Each step runs through the handler of its (src, dst) pair (`kvtier.mover.handlers`).
- Plain caller<->host copies (a chain of one PUT or one GET) are batched: every part of every block in one
  `torch._foreach_copy_`, or, for an engine's pages on the CPU, one loop of memory copies (`pages`).
- Stores never wait for I/O in the caller (CPU blocks are copied into host in its thread, a memory copy;
  everything else runs in the background): at most `queue_depth` store plans wait; beyond that
  `reserve_store` says no and the caller counts a dropped store. Loads are waited for: the request needs
  the bytes, but each tier's part for at most that tier's `load_timeout_s` (`kvtier.mover.deadline`): a hung
  tier costs a request its deadline, and its blocks are recomputed. Each local tier reads on a pool of its
  own, so that one tier's hung reads never hold up another's.
- A slot is never reused while a transfer touches it: the directory only hands out a slot after its
  previous content left (in the same chain, earlier) and marks copies READY only on completion.
- A shared tier's steps run in batches on pools of their own (`kvtier.mover.shared`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvtier.directory import CALLER, Op, Plan, Status, Step
from kvtier.metrics import Metrics
from kvtier.mover.copy import CallerBlock, on_cpu
from kvtier.mover.deadline import Deadlines, Gate
from kvtier.mover.handlers import CallerIO, CallerToSlot, Reporter, SlotToCaller, build_handlers
from kvtier.mover.shared import Cut, SharedTraffic
from kvtier.stores.base import Stores

WRITE_NICENESS = 10  # background writers: the CPU scheduler prefers the engine's threads when both want a core
log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """What a load delivered: `delivered[i]` once `out[i]` holds its block; per tier, how long its part took from
    the load's start (to its deadline, for a part that passed it: those tiers are `expired`)."""

    delivered: list[bool]
    seconds: dict[str, float] = field(default_factory=dict)
    expired: set[str] = field(default_factory=set)


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
        read_threads: Mapping[str, int] | None = None,
        load_timeouts: Mapping[str, float] | None = None,
    ) -> None:
        """`cpus`: where the mover's threads may run. An engine that pins its compute threads to some cores
        (vLLM's CPU backend does) would otherwise hand that pinning to our threads, which then queue behind
        its spinning OpenMP threads. `read_threads`: a local tier's own read pool (others share one of
        `n_read_threads`); `load_timeouts`: the longest a tier's part of a load may take, seconds (none: no limit)."""
        self.stores = stores
        self._deadlines = Deadlines()
        self._reported = self._labelling(report)
        self.report = self._once(self._reported)
        self.metrics = metrics
        self.load_timeouts = dict(load_timeouts or {})
        self._cpus = cpus
        self._put, self._get = CallerToSlot(stores.host), SlotToCaller(stores.host)
        self._handlers = build_handlers(stores, self._put, self._get,
                                        lambda tier: metrics.count("integrity_failures", tier))
        self._reads = self._pool(n_read_threads, "kvtier-read", background=False)
        self._tier_reads = {name: self._pool(n, f"kvtier-read-{name}", background=False)
                            for name, n in (read_threads or {}).items()}
        self._writes = self._pool(n_write_threads, "kvtier-write", background=True)
        self._store_slots = threading.BoundedSemaphore(queue_depth)
        self._shared = SharedTraffic(stores, self.report, metrics, self._pool, n_shared_read_threads,
                                     n_shared_write_threads, queue_depth)
        # a shared tier's part of each load (evictions, fetches, GETs) runs here, so that it can be waited for
        self._shared_loads = self._pool(n_shared_read_threads, "kvtier-shared-load", background=False)
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

    def _once(self, report: Reporter) -> Reporter:
        """`report`, less the steps a load's deadline has reported already (`kvtier.mover.deadline`)."""
        def once(steps: Sequence[Step], status: Status) -> None:
            steps = self._deadlines.reported(steps)
            if steps:
                report(steps, status)

        return once

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

    def load(self, plan: Plan, out: Sequence[CallerBlock], ready: Any = None, since: float | None = None) -> Loaded:
        """Run a load plan and wait for it: each tier's part until it is done or its `load_timeout_s` from `since`
        (a `time.monotonic()`; default: now) passed, whichever comes first.

        Host hits are copied in the caller's thread; promotions and reads from slower tiers run on their tier's
        read pool; fetches from a shared tier run as batches once the evictions that make room for them are done.
        `ready`: on an accelerator, `ready_event(out)`, recorded by the caller (in its thread).
        """
        start = time.monotonic() if since is None else since
        unreported = _Unreported(plan, self.report)
        io = CallerIO(out=out, ready=ready, gate=Gate(), report=unreported)
        futures: dict[str, list[Future]] = {}
        try:
            loaded = self._load(plan, io, start, futures)
        except BaseException:  # a bug or a closed pool: what runs still reports, then the rest fails
            wait([f for fs in futures.values() for f in fs])
            unreported.fail()
            raise
        assert io.gate is not None
        closed = io.gate.closed
        loaded.delivered = [ok and i not in closed for i, ok in enumerate(loaded.delivered)]
        return loaded

    def _load(self, plan: Plan, io: CallerIO, start: float, futures: dict[str, list[Future]]) -> Loaded:
        """`load`'s work; `futures` (each tier's jobs) filled as they are submitted, for `load` to wait for."""
        delivered = [False] * len(io.out)
        plain, cut = self._shared.cut(plan.chains, last_only=False)
        batch, chains = _singles(plain, Op.GET, self.stores.host_name)
        parts: defaultdict[str, list[list[Step]]] = defaultdict(list)  # tier -> its chains
        for chain in chains:
            parts[self._tier_of(chain, plan)].append(chain)
        if cut:
            parts[cut[0][1].src] = [[*before, step, *after] for before, step, after in cut]
        ended = self._submit(parts, cut, io, delivered, futures)
        loaded = Loaded(delivered)
        if batch:
            self._run_batch(batch, self._get, io, delivered)
            loaded.seconds[self.stores.host_name] = time.monotonic() - start
        for tier, fs in futures.items():
            timeout = self.load_timeouts.get(tier)
            _, pending = wait(fs, timeout=None if timeout is None else max(0.0, start + timeout - time.monotonic()))
            if pending:
                loaded.expired.add(tier)
                self._expire(tier, parts[tier], io, time.monotonic() - start)
            now = time.monotonic()  # a job's callback may run just after wait() saw it done: now, then
            loaded.seconds[tier] = (now if pending or len(ended[tier]) < len(fs) else max(ended[tier])) - start
        for f in (f for fs in futures.values() for f in fs if f.done()):
            f.result()  # a bug in a chain's runner: loud, as ever
        return loaded
    def _submit(self, parts: dict[str, list[list[Step]]], cut: list[Cut], io: CallerIO, delivered: list[bool],
                futures: dict[str, list[Future]]) -> dict[str, list[float]]:
        """Each tier's part of a load on its pool, watched by the deadlines, into `futures`; when each job ended."""
        ended: dict[str, list[float]] = {}
        for tier, tier_chains in parts.items():
            self._deadlines.watch(step for chain in tier_chains for step in chain)
            if cut and tier == cut[0][1].src:
                futures[tier] = [self._shared_loads.submit(self._run_shared_part, cut, io, delivered)]
            else:
                pool = self._tier_reads.get(tier, self._reads)
                futures[tier] = [pool.submit(self._run_chain, chain, io, delivered) for chain in tier_chains]
            ended[tier] = []
            for f in futures[tier]:
                f.add_done_callback(partial(_ended, ended[tier]))
        return ended

    def _tier_of(self, chain: list[Step], plan: Plan) -> str:
        """The tier a load's chain reads its block from: its deadline and its read pool are that tier's."""
        last = chain[-1]
        if 0 <= last.index < len(plan.sources):
            return plan.sources[last.index]
        host = self.stores.host_name
        return next((s.src for s in chain if s.src not in (host, CALLER)), host)

    def _run_shared_part(self, cut: list[Cut], io: CallerIO, delivered: list[bool]) -> None:
        """A load's shared-tier part: the evictions that make room, the fetches, then the GETs that follow them."""
        failed: set[bytes] = set()  # keys whose fetch failed (or never started): their GETs are skipped
        befores = [self._reads.submit(self._run_chain, before, io, delivered, failed) for before, _, _ in cut if before]
        for f in befores:
            f.result()
        fetches = [step for _, step, _ in cut if self._deadlines.start(step)]
        started = {id(step) for step in fetches}
        failed.update(step.key for _, step, _ in cut if id(step) not in started)  # expired before it started
        if fetches:
            self._shared.fetch(fetches, failed, io, delivered)
        for _, _, after in cut:
            if after:
                self._run_chain(after, io, delivered, failed)

    def _expire(self, tier: str, chains: list[list[Step]], io: CallerIO, seconds: float) -> None:
        """A tier's part of a load passed its deadline: what it has not done is failed (module docstring)."""
        gone = self._deadlines.expire(s for chain in chains for s in chain)
        assert io.gate is not None
        io.gate.close(s.index for s in gone if s.dst == CALLER)
        log.warning("kvtier: a load's %s part passed its deadline (%.3g s): %d steps failed, its blocks recomputed",
                    tier, seconds, len(gone))
        if isinstance(io.report, _Unreported):
            io.report.forget(gone)  # reported here, past the load's once-only reporter
        if gone:
            self._reported(gone, Status.FAILED)

    def lookup_shared(self, tier: str, keys: Sequence[bytes], route: bytes | None = None) -> int:
        return self._shared.lookup(tier, keys, route)

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
        for pool in (self._reads, *self._tier_reads.values(), self._shared_loads, self._writes):
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
        """A chain's steps in order. Where it deletes from a disk tier to make room for a block it writes there,
        it runs inside that store's `reusing()`: the deleted block's file becomes the written one's."""
        with ExitStack() as stack:
            for name in self._reused(chain):
                stack.enter_context(self.stores.local[name].reusing())
            self._run_steps(chain, io, delivered, failed)

    def _reused(self, chain: list[Step]) -> set[str]:
        """The disk tiers `chain` deletes from and then writes to."""
        deleted = {step.src for step in chain if step.op is Op.DELETE}
        if not deleted:
            return deleted
        return deleted & {step.dst for step in chain if step.op is Op.COPY} & self.stores.local.keys()

    def _run_steps(
        self, chain: list[Step], io: CallerIO, delivered: list[bool] | None, failed: set[bytes] | None,
    ) -> None:
        if failed is None:
            failed = set()  # keys whose bytes did not arrive where later steps of the chain read them
        full: set[str] = set()  # tiers where a delete that made room for a later step of the chain failed
        for step in chain:
            status: Status | None
            if (step.needs_prev and step.key in failed) or step.dst in full:
                status = Status.FAILED
            elif not self._deadlines.start(step):
                status = None  # its load's deadline passed: reported then, never run
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
            if status is not None:
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


def _ended(ended: list[float], _: Future) -> None:
    ended.append(time.monotonic())


class _Unreported:
    """A load's reporter that keeps the steps it has not reported: if the load raises, they are reported FAILED
    (once what is running is done), so that nothing waits for them, their pins and queued bytes included. Steps
    are known by identity (a plan built by hand may leave every id 0)."""

    def __init__(self, plan: Plan, report: Reporter) -> None:
        self._left = {id(step): step for chain in plan.chains for step in chain}
        self._report = report
        self._lock = threading.Lock()

    def __call__(self, steps: Sequence[Step], status: Status) -> None:
        self.forget(steps)
        self._report(steps, status)

    def forget(self, steps: Sequence[Step]) -> None:
        with self._lock:
            for step in steps:
                self._left.pop(id(step), None)

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
