"""The mover: the data plane. Executes the directory's plans on bounded thread pools and reports each step.

- Steps of one chain run in order; chains run in parallel (reads on `n_read_threads`, writes on
  `n_write_threads`).
- Plain caller<->host copies (a chain of one PUT or one GET) are batched: every part of every block in one
  `torch._foreach_copy_`, so a host hit costs about what a plain `copy_` of the same bytes costs.
- Stores never wait for I/O in the caller (CPU blocks are copied into host in its thread, a memory copy;
  everything else runs in the background): at most `queue_depth` store plans wait; beyond that
  `reserve_store` says no and the caller counts a dropped store. Loads are waited for: the request needs
  the bytes.
- A slot is never reused while a transfer touches it: the directory only hands out a slot after its
  previous content left (in the same chain, earlier) and marks copies READY only on completion.
- A shared tier (Redis) is driven in batches, one pipelined call per batch, on its own pools: a step that
  touches it is cut out of its chain. A store's shared steps (write-through host->redis, parents first) run
  after the rest of the plan, as one background job: per batch, an EXISTS, then one put of the missing
  blocks; its place in the store queue is given back before, so a slow Redis never holds up local
  stores (shared writes have a queue of their own, and drop, counted, when it is full). A load's fetches
  (redis->host) run after the steps before them in their chains (evictions), in parallel batches, then
  their GETs. Every call is bounded by the store's timeouts; with its breaker open nothing is tried: fetches
  fail (the prefix ends there) and writes are dropped, counted in `kvtier_stores_dropped_total{reason}`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

import torch

from kvtier.directory import CALLER, Op, Plan, Status, Step
from kvtier.metrics import Metrics
from kvtier.stores.base import ReadStatus
from kvtier.stores.breaker import BreakerState
from kvtier.stores.disk import DiskStore
from kvtier.stores.host import HostSlab
from kvtier.stores.redis import PutStatus, RedisStore

Store = HostSlab | DiskStore | RedisStore
SHARED_BATCH_BYTES = 32 << 20  # payload bytes in one pipelined call to a shared tier
WRITE_NICENESS = 10  # background writers: the CPU scheduler prefers the engine's threads when both want a core
Block = torch.Tensor | Sequence[torch.Tensor | int]  # see copy_into_slot
Report = Callable[[Sequence[Step], Status], None]  # one status for all of these steps
log = logging.getLogger(__name__)


class Mover:
    def __init__(
        self,
        stores: dict[str, Store],
        report: Report,
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
        self.report = report
        self.metrics = metrics
        def init(niceness: int = 0) -> Callable[[], None]:
            def start_thread() -> None:
                if cpus:
                    os.sched_setaffinity(0, cpus)
                if niceness:  # background writes yield the CPU to the engine's compute threads
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
            return start_thread

        self._reads = ThreadPoolExecutor(n_read_threads, thread_name_prefix="kvtier-read", initializer=init())
        self._writes = ThreadPoolExecutor(n_write_threads, thread_name_prefix="kvtier-write",
                                          initializer=init(WRITE_NICENESS))
        self._store_slots = threading.BoundedSemaphore(queue_depth)
        self._shared = {name for name, store in stores.items() if isinstance(store, RedisStore)}
        self._shared_reads = self._shared_writes = None
        if self._shared:
            self._shared_reads = ThreadPoolExecutor(n_shared_read_threads, thread_name_prefix="kvtier-shared-read",
                                                    initializer=init())
            self._shared_writes = ThreadPoolExecutor(n_shared_write_threads, thread_name_prefix="kvtier-shared-write",
                                                     initializer=init(WRITE_NICENESS))
        self._shared_slots = threading.BoundedSemaphore(queue_depth)  # shared write jobs waiting or running
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()

    # ---------------------------------------------------------------- entry points

    def reserve_store(self) -> bool:
        """Take one place in the store queue, or say no at once (the caller then drops the store)."""
        return self._store_slots.acquire(blocking=False)

    def release_store(self) -> None:
        self._store_slots.release()

    def store(self, plan: Plan, blocks: Sequence[Block]) -> None:
        """Run a store plan: PUTs of CPU blocks into host at once, in the caller's thread; the rest in the
        background. The place `reserve_store` took is freed when its local part is done. Its shared-tier writes
        follow as one job (see the module's doc)."""
        plain, cut = self._cut(plan.chains, last_only=True)
        local = plain + [before for before, _, _ in cut if before]
        failed: set[bytes] = set()  # keys whose PUT failed: their write-through steps are skipped
        if _on_cpu(blocks):
            # Memory to memory: a copy costs the same CPU in any thread, and in the caller's it runs between the
            # engine's steps instead of against its compute threads (which it would stall). What follows a PUT
            # (write-through to disk) runs in the background; a chain that must first make room does too.
            batch, chains = self._leading_puts(local)
            if batch:
                self._run_batch(batch, blocks, None, None, failed)
            tasks = [partial(self._run_chain, chain, blocks, None, None, failed) for chain in chains]
        else:
            batch, chains = self._split(Plan(chains=local), Op.PUT)
            tasks = [partial(self._run_chain, chain, blocks, None, None, failed) for chain in chains]
            if batch:
                tasks.append(partial(self._run_batch, batch, blocks, None, None, failed))
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
                self._submit_shared_writes(shared, failed, shared_done)

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

    def load(self, plan: Plan, out: Sequence[Block]) -> list[bool]:
        """Run a load plan and wait for it; True for each `out[i]` that now holds its block.

        Host hits are copied in the caller's thread; promotions from slower tiers run on the read pool;
        fetches from a shared tier run as batches once the evictions that make room for them are done.
        """
        delivered = [False] * len(out)
        plain, cut = self._cut(plan.chains, last_only=False)
        batch, chains = self._split(Plan(chains=plain), Op.GET)
        futures = [self._reads.submit(self._run_chain, chain, None, out, delivered) for chain in chains]
        failed: set[bytes] = set()  # keys whose fetch failed: their GETs are skipped
        befores = [self._reads.submit(self._run_chain, before, None, out, delivered, failed)
                   for before, _, _ in cut if before]  # fmt: skip
        if batch:
            self._run_batch(batch, None, out, delivered)
        if cut:
            for f in befores:
                f.result()
            groups = self._batches([step for _, step, _ in cut])
            if len(groups) == 1:
                self._run_shared_reads(groups[0], failed)
            else:
                assert self._shared_reads is not None
                for f in [self._shared_reads.submit(self._run_shared_reads, g, failed) for g in groups]:
                    f.result()
            for _, _, after in cut:
                if after:
                    self._run_chain(after, None, out, delivered, failed)
        for f in futures:
            f.result()
        return delivered

    def lookup_shared(self, tier: str, keys: Sequence[bytes]) -> int:
        """How many leading blocks of `keys` the shared tier holds now (one round trip; 0 with its breaker
        open or Redis away). Another engine may evict them a moment later: a fetch then fails, a miss."""
        store: RedisStore = self.stores[tier]  # type: ignore[assignment]
        return store.lookup(keys) if keys else 0

    def delete(self, steps: Sequence[Step]) -> None:
        """Garbage deletes (dropped blocks' files), in the background."""
        if steps:
            self._track(self._writes.submit(self._run_chain, list(steps), None, None))

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
        for pool in (self._reads, self._writes, self._shared_reads, self._shared_writes):
            if pool is not None:
                pool.shutdown(wait=True)

    # ---------------------------------------------------------------- execution

    def _split(self, plan: Plan, caller_op: Op) -> tuple[list[Step], list[list[Step]]]:
        """Single-step caller<->slab chains go into one batch; everything else keeps its chain."""
        batch, chains = [], []
        for chain in plan.chains:
            if len(chain) == 1 and chain[0].op is caller_op and self._slotted(chain[0]):
                batch.append(chain[0])
            else:
                chains.append(chain)
        return batch, chains

    def _leading_puts(self, chains: list[list[Step]]) -> tuple[list[Step], list[list[Step]]]:
        """The PUTs into a slab that start their chains, and what is left to run after them."""
        batch: list[Step] = []
        rest: list[list[Step]] = []
        for chain in chains:
            if chain[0].op is Op.PUT and self._slotted(chain[0]):
                batch.append(chain[0])
                chain = chain[1:]
            if chain:
                rest.append(chain)
        return batch, rest

    def _slotted(self, step: Step) -> bool:
        tier = step.dst if step.op is Op.PUT else step.src
        return isinstance(self.stores[tier], HostSlab)

    def _run_batch(
        self, steps: list[Step], blocks: Sequence[Block] | None, out: Sequence[Block] | None,
        delivered: list[bool] | None = None, failed: set[bytes] | None = None,
    ) -> None:
        """Many caller<->host copies in one go, straight between the caller's tensors and the slots."""
        start = time.perf_counter()
        put = steps[0].op is Op.PUT
        tier = steps[0].dst if put else steps[0].src
        slab: HostSlab = self.stores[tier]  # type: ignore[assignment]
        try:
            pairs = []  # (destination, source) of every part of every block: one C++ loop copies them all
            for step in steps:
                if put:
                    pairs += [(region, part) for part, region in _regions(blocks[step.index], slab.slot(step.dst_slot))]  # type: ignore[index]
                else:
                    pairs += list(_regions(out[step.index], slab.slot(step.src_slot)))  # type: ignore[index]
            _copy_all(pairs, non_blocking=True)
            _synchronize(blocks if put else out)
            status = Status.OK
        except (RuntimeError, ValueError):
            status = Status.FAILED
        if status is Status.OK:
            each = (time.perf_counter() - start) / len(steps)
            src, dst = (CALLER, tier) if put else (tier, CALLER)
            self.metrics.observe_move(src, dst, slab.payload_nbytes, each, count=len(steps))
        if status is Status.OK and delivered is not None:
            for step in steps:
                delivered[step.index] = True
        if status is not Status.OK and failed is not None:
            failed.update(step.key for step in steps)
        self.report(steps, status)

    def _run_chain(
        self, chain: list[Step], blocks: Sequence[Block] | None, out: Sequence[Block] | None,
        delivered: list[bool] | None = None, failed: set[bytes] | None = None,
    ) -> None:
        if failed is None:
            failed = set()  # keys whose bytes did not arrive where later steps of the chain read them
        for step in chain:
            if step.needs_prev and step.key in failed:
                status = Status.FAILED
            else:
                start = time.perf_counter()
                status, nbytes = self._run_step(step, blocks, out)
                if status is Status.OK and step.op is not Op.DELETE:
                    self.metrics.observe_move(step.src, step.dst, nbytes, time.perf_counter() - start)
                if status is Status.OK and step.op is Op.GET and delivered is not None:
                    delivered[step.index] = True
            if status is not Status.OK and step.op is not Op.DELETE:
                failed.add(step.key)
            self.report((step,), status)

    def _run_step(self, step: Step, blocks: Sequence[Block] | None, out: Sequence[Block] | None) -> tuple[Status, int]:
        try:
            if step.op is Op.DELETE:
                disk: DiskStore = self.stores[step.src]  # type: ignore[assignment]
                disk.delete(step.key)
                return Status.OK, 0
            if step.op is Op.PUT:
                assert blocks is not None
                target = self.stores[step.dst]
                if isinstance(target, HostSlab):
                    copy_into_slot(target.slot(step.dst_slot), blocks[step.index])
                    return Status.OK, target.payload_nbytes
                return self._write(step.dst, step, _bytes_of(blocks[step.index]))
            if step.op is Op.GET:
                assert out is not None
                slab: HostSlab = self.stores[step.src]  # type: ignore[assignment]
                copy_from_slot(out[step.index], slab.slot(step.src_slot))
                return Status.OK, slab.payload_nbytes
            # COPY between tiers
            source = self.stores[step.src]
            if isinstance(source, HostSlab):
                return self._write(step.dst, step, source.slot(step.src_slot))
            target_slab: HostSlab = self.stores[step.dst]  # type: ignore[assignment]
            result = source.read(step.key, target_slab.slot(step.dst_slot))
            if result is ReadStatus.OK:
                return Status.OK, source.payload_nbytes
            if result.is_integrity_failure:
                self.metrics.count("integrity_failures", step.src)
            return Status.SOURCE_LOST, 0
        except OSError:
            return Status.FAILED, 0

    def _write(self, tier: str, step: Step, data: torch.Tensor) -> tuple[Status, int]:
        store = self.stores[tier]
        if isinstance(store, HostSlab):
            store.write([step.dst_slot], data.unsqueeze(0))
        else:
            store.write(step.key, step.parent, data)
        return Status.OK, data.numel()

    # ---------------------------------------------------------------- the shared tier, in batches

    def _cut(
        self, chains: list[list[Step]], last_only: bool
    ) -> tuple[list[list[Step]], list[tuple[list[Step], Step, list[Step]]]]:
        """Chains that touch no shared tier, and the others cut around their one shared step: (before, step,
        after). A chain that does not fit that shape runs as it is, step by step (single-block calls)."""
        plain, cut = [], []
        for chain in chains:
            at = [i for i, step in enumerate(chain) if step.src in self._shared or step.dst in self._shared]
            if len(at) != 1 or (last_only and at[0] != len(chain) - 1):
                plain.append(chain)
            else:
                i = at[0]
                cut.append((chain[:i], chain[i], chain[i + 1 :]))
        return plain, cut

    def _batches(self, steps: list[Step]) -> list[list[Step]]:
        """Consecutive runs of steps on one shared tier, each within SHARED_BATCH_BYTES."""
        groups: list[list[Step]] = []
        for step in steps:
            tier = step.src if step.src in self._shared else step.dst
            per = max(1, SHARED_BATCH_BYTES // self.stores[tier].payload_nbytes)
            last = groups[-1] if groups else None
            if last is None or len(last) >= per or tier not in (last[0].src, last[0].dst):
                groups.append([step])
            else:
                last.append(step)
        return groups

    def _submit_shared_writes(self, steps: list[Step], failed: set[bytes], done: Future) -> None:
        """Queue a store's write-through to the shared tier; drop it (counted) when that queue is full."""
        if not self._shared_slots.acquire(blocking=False):
            self._drop_shared(steps, "queue_full")
            done.set_result(None)
            return

        def job() -> None:
            try:
                self._run_shared_writes(steps, failed)
            except Exception:  # a bug: its steps were reported FAILED; make it loud, keep the mover going
                log.exception("kvtier shared-tier write job failed")
            finally:
                self._shared_slots.release()
                done.set_result(None)

        try:
            assert self._shared_writes is not None
            self._shared_writes.submit(job)
        except RuntimeError:  # shut down
            self._shared_slots.release()
            self._drop_shared(steps, "closed")
            done.set_result(None)

    def _drop_shared(self, steps: Sequence[Step], reason: str, tier: str | None = None) -> None:
        if steps:
            label = reason if reason == "breaker_open" else f"{tier or steps[0].dst}_{reason}"
            self.metrics.count("stores_dropped", label, len(steps))
            self.report(steps, Status.FAILED)

    def _run_shared_writes(self, steps: list[Step], failed: set[bytes]) -> None:
        """Write-through, parents first: one EXISTS round trip for all, then pipelined puts of the missing
        blocks whose parent the tier holds (or gets earlier in this job). Every step is reported once."""
        unreported = {id(s): s for s in steps}

        def report(group: Sequence[Step], status: Status, reason: str | None = None) -> None:
            for s in group:
                del unreported[id(s)]
            if reason is not None:
                self._drop_shared(group, reason)
            elif group:
                self.report(group, status)

        held: set[bytes] = set()  # keys the tier holds (found, or put by this job)
        try:
            report([s for s in steps if s.needs_prev and s.key in failed], Status.FAILED)  # the PUT failed
            for group in self._batches([s for s in steps if id(s) in unreported]):
                self._write_shared_batch(group, report, held)
        except Exception:
            report(list(unreported.values()), Status.FAILED, "failed")
            raise

    def _write_shared_batch(self, steps: list[Step], report: Callable[..., None], held: set[bytes]) -> None:
        tier = steps[0].dst
        store: RedisStore = self.stores[tier]  # type: ignore[assignment]
        keys = [s.key for s in steps]
        mine = set(keys)
        parents = list(dict.fromkeys(s.parent for s in steps
                                     if s.parent is not None and s.parent not in held and s.parent not in mine))
        present = store.exists_many(keys + parents)
        if not any(present) and store.breaker.state is BreakerState.OPEN:
            report(steps, Status.FAILED, "breaker_open")  # not tried (or just failed): don't send the bytes
            return
        held.update(k for k, p in zip(keys + parents, present) if p)
        report([s for s in steps if s.key in held], Status.OK)  # another engine (or an earlier store) has it
        send: list[Step] = []
        for s in steps:
            if s.key in held:
                continue
            if s.parent is None or s.parent in held:
                send.append(s)
                held.add(s.key)  # for its children: the store refuses them (ORPHAN) if this put fails
            else:
                report([s], Status.FAILED, "orphan")  # its parent is not in the tier: it would be refused
        if not send:
            return
        start = time.perf_counter()
        statuses = store.put_many([(s.key, s.parent, self._host_bytes(s)) for s in send])
        each = (time.perf_counter() - start) / len(send)
        stored = sum(1 for st in statuses if st is PutStatus.STORED)
        if stored:
            self.metrics.observe_move(steps[0].src, tier, store.payload_nbytes, each, count=stored)
        for s, st in zip(send, statuses):
            if st not in (PutStatus.STORED, PutStatus.EXISTS):
                held.discard(s.key)
        report([s for s, st in zip(send, statuses) if st in (PutStatus.STORED, PutStatus.EXISTS)], Status.OK)
        for status in set(statuses) - {PutStatus.STORED, PutStatus.EXISTS}:
            group = [s for s, st in zip(send, statuses) if st is status]
            report(group, Status.FAILED, "breaker_open" if status is PutStatus.DROPPED else status.value)

    def _host_bytes(self, step: Step) -> torch.Tensor:
        slab: HostSlab = self.stores[step.src]  # type: ignore[assignment]
        return slab.slot(step.src_slot)

    def _run_shared_reads(self, steps: list[Step], failed: set[bytes]) -> None:
        """Fetch blocks straight into their host slots with one pipelined call. A block that is gone, corrupt
        or foreign (the store removes those) is SOURCE_LOST: its GET is skipped and the prefix ends there."""
        tier, dst = steps[0].src, steps[0].dst
        store: RedisStore = self.stores[tier]  # type: ignore[assignment]
        slab: HostSlab = self.stores[dst]  # type: ignore[assignment]
        start = time.perf_counter()
        try:
            statuses = store.get_many([s.key for s in steps], [slab.slot(s.dst_slot) for s in steps])
        except Exception:  # a bug, not an outage (the store turns those into misses): nothing is served
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
        if ok:
            self.report(ok, Status.OK)
        if lost:
            self.report(lost, Status.SOURCE_LOST)

    def _track(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._untrack)

    def _untrack(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.discard(future)
        if (exc := future.exception()) is not None:  # a bug, not an I/O error: make it loud
            log.error("kvtier mover job failed", exc_info=exc)


def _flat(block: torch.Tensor) -> torch.Tensor:
    """A block's bytes as one flat uint8 view (no copy; never a dtype conversion)."""
    return block.view(-1).view(torch.uint8)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy `src`'s bytes over `dst`'s, bit for bit (both contiguous, the same number of bytes).

    As 8-byte words where both allow it, else as bytes: torch (2.13, CPU) copies words about 10% faster than
    the same bytes. Both sides always get the same element type, so nothing is ever converted.
    """
    d, s = _words(dst, src)
    d.copy_(s, non_blocking=non_blocking)


def _copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], non_blocking: bool = False) -> None:
    """`_copy_bytes` for many (destination, source) pairs in one call: no Python per part."""
    words = [_words(d, s) for d, s in pairs]
    if words:
        torch._foreach_copy_([d for d, _ in words], [s for _, s in words], non_blocking=non_blocking)


def _words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides as the same element type: 8-byte words where both allow it, else bytes."""
    if dst.dtype is src.dtype is torch.uint8 and dst.dim() == src.dim() == 1:  # engine pages and slot regions
        if dst.numel() != src.numel() or not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError(f"block part of {src.numel()} bytes for {dst.numel()} (or not contiguous)")
        return dst, src
    try:
        d, s = dst.view(-1).view(torch.int64), src.view(-1).view(torch.int64)
    except RuntimeError:  # a size or offset that is not a multiple of 8 bytes (or not contiguous: raises below)
        d, s = _flat(dst), _flat(src)
    if d.numel() != s.numel():
        raise ValueError(f"block part of {s.numel() * s.element_size()} bytes for {d.numel() * d.element_size()}")
    return d, s


def copy_into_slot(slot: torch.Tensor, block: Block, non_blocking: bool = False) -> None:
    """A caller's block into a host slot. A block is one tensor, or the parts its bytes are made of, in order
    (an engine's per-layer pages); an int part is that many bytes left as they are."""
    for part, region in _regions(block, slot):
        _copy_bytes(region, part, non_blocking)


def copy_from_slot(block: Block, slot: torch.Tensor, non_blocking: bool = False) -> None:
    """The reverse of `copy_into_slot`: an int part is skipped (bytes the caller already has)."""
    for part, region in _regions(block, slot):
        _copy_bytes(part, region, non_blocking)


def _regions(block: Block, slot: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor part of `block` with the slot bytes it maps to."""
    if isinstance(block, torch.Tensor):
        yield block, slot
        return
    offset = 0
    for part in block:
        if isinstance(part, int):
            offset += part
            continue
        n = part.numel() * part.element_size()
        yield part, slot[offset : offset + n]
        offset += n


def _bytes_of(block: torch.Tensor) -> torch.Tensor:
    """A block's bytes on the CPU, as disk and shared stores write them."""
    flat = _flat(block.contiguous())
    return flat if flat.device.type == "cpu" else flat.cpu()


def _first_tensor(blocks: Sequence[Block] | None) -> torch.Tensor | None:
    first = blocks[0] if blocks else None
    if first is not None and not isinstance(first, torch.Tensor):
        first = next((p for p in first if isinstance(p, torch.Tensor)), None)
    return first


def _on_cpu(blocks: Sequence[Block] | None) -> bool:
    first = _first_tensor(blocks)
    return first is not None and first.device.type == "cpu"


def _synchronize(blocks: Sequence[Block] | None) -> None:
    """Non-blocking copies to or from an accelerator are complete only after a sync."""
    first = _first_tensor(blocks)
    if first is not None and first.device.type == "cuda":
        torch.cuda.current_stream(first.device).synchronize()
