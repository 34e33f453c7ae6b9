"""The mover: the data plane. Executes the directory's plans on bounded thread pools and reports each step.

- Steps of one chain run in order; chains run in parallel (reads on `n_read_threads`, writes on
  `n_write_threads`).
- Plain caller<->host copies (a chain of one PUT or one GET) are batched into one `index_copy_` /
  `index_select`, so a host hit costs about what a plain `copy_` of the same bytes costs.
- Stores never block the caller: at most `queue_depth` store plans wait; beyond that `try_store` returns
  False and the caller counts a dropped store. Loads are waited for: the request needs the bytes.
- A slot is never reused while a transfer touches it: the directory only hands out a slot after its
  previous content left (in the same chain, earlier) and marks copies READY only on completion.
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
from kvtier.stores.disk import DiskStore
from kvtier.stores.host import HostSlab

Store = HostSlab | DiskStore
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
    ) -> None:
        """`cpus`: where the mover's threads may run. An engine that pins its compute threads to some cores
        (vLLM's CPU backend does) would otherwise hand that pinning to our threads, which then queue behind
        its spinning OpenMP threads."""
        self.stores = stores
        self.report = report
        self.metrics = metrics
        init = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self._reads = ThreadPoolExecutor(n_read_threads, thread_name_prefix="kvtier-read", initializer=init)
        self._writes = ThreadPoolExecutor(n_write_threads, thread_name_prefix="kvtier-write", initializer=init)
        self._store_slots = threading.BoundedSemaphore(queue_depth)
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()

    # ---------------------------------------------------------------- entry points

    def reserve_store(self) -> bool:
        """Take one place in the store queue, or say no at once (the caller then drops the store)."""
        return self._store_slots.acquire(blocking=False)

    def release_store(self) -> None:
        self._store_slots.release()

    def store(self, plan: Plan, blocks: Sequence[Block]) -> None:
        """Run a store plan in the background; the place `reserve_store` took is freed when all of it is done."""
        batch, chains = self._split(plan, Op.PUT)
        tasks = [partial(self._run_chain, chain, blocks, None) for chain in chains]
        if batch:
            tasks.append(partial(self._run_batch, batch, blocks, None))
        remaining = [len(tasks)]
        lock = threading.Lock()

        def one_done(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._store_slots.release()

        for task in tasks:
            future = self._writes.submit(task)
            self._track(future)
            future.add_done_callback(one_done)

    def load(self, plan: Plan, out: Sequence[Block]) -> list[bool]:
        """Run a load plan and wait for it; True for each `out[i]` that now holds its block.

        Host hits are copied in the caller's thread; promotions from slower tiers run on the read pool.
        """
        delivered = [False] * len(out)
        batch, chains = self._split(plan, Op.GET)
        futures = [self._reads.submit(self._run_chain, chain, None, out, delivered) for chain in chains]
        if batch:
            self._run_batch(batch, None, out, delivered)
        for f in futures:
            f.result()
        return delivered

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
        self._reads.shutdown(wait=True)
        self._writes.shutdown(wait=True)

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

    def _slotted(self, step: Step) -> bool:
        tier = step.dst if step.op is Op.PUT else step.src
        return isinstance(self.stores[tier], HostSlab)

    def _run_batch(
        self, steps: list[Step], blocks: Sequence[Block] | None, out: Sequence[Block] | None,
        delivered: list[bool] | None = None,
    ) -> None:
        """Many caller<->host copies in one go, straight between the caller's tensors and the slots."""
        start = time.perf_counter()
        put = steps[0].op is Op.PUT
        tier = steps[0].dst if put else steps[0].src
        slab: HostSlab = self.stores[tier]  # type: ignore[assignment]
        try:
            for step in steps:
                if put:
                    copy_into_slot(slab.slot(step.dst_slot), blocks[step.index], non_blocking=True)  # type: ignore[index]
                else:
                    copy_from_slot(out[step.index], slab.slot(step.src_slot), non_blocking=True)  # type: ignore[index]
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
        self.report(steps, status)

    def _run_chain(
        self, chain: list[Step], blocks: Sequence[Block] | None, out: Sequence[Block] | None,
        delivered: list[bool] | None = None,
    ) -> None:
        failed: set[bytes] = set()  # keys whose bytes did not arrive where later steps of the chain read them
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
    try:
        d, s = dst.view(-1).view(torch.int64), src.view(-1).view(torch.int64)
        if d.numel() != s.numel():  # a size mismatch fails (or broadcasts) exactly as a byte copy would
            raise RuntimeError
    except RuntimeError:  # a size or offset that is not a multiple of 8 bytes (or not contiguous: raises below)
        d, s = _flat(dst), _flat(src)
    d.copy_(s, non_blocking=non_blocking)


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


def _synchronize(blocks: Sequence[Block] | None) -> None:
    """Non-blocking copies to or from an accelerator are complete only after a sync."""
    first = blocks[0] if blocks else None
    if first is not None and not isinstance(first, torch.Tensor):
        first = next((p for p in first if isinstance(p, torch.Tensor)), None)
    if first is not None and first.device.type == "cuda":
        torch.cuda.current_stream(first.device).synchronize()
