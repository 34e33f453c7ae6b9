"""One transfer handler per (source medium, destination medium), as vLLM's offloading registers them.

The directory's steps map onto media one to one: a PUT is caller -> host slot, a GET host slot -> caller (or
object -> caller, when loads are not staged), a COPY slot <-> object (a disk file, a shared-store key) or
object -> object, a DELETE removes an object.
`build_handlers` makes one handler for every pair of tiers a plan can name, from the stores grouped by
protocol, so that the mover looks a step's handler up by its (src, dst) and never asks a store its type.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.directory import CALLER, Op, Status, Step
from kvtier.mover.copy import CallerBlock, copy_blocks, copy_from_slot, copy_into_slot, device_stream
from kvtier.mover.deadline import Gate
from kvtier.mover.pages import PagedBlocks
from kvtier.stores.base import ObjectStore, ReadStatus, SlotStore, Stores

Result = tuple[Status, int]  # the step's status and the payload bytes it moved
Reporter = Callable[[Sequence[Step], Status], None]  # where a driver learns how steps ended: one status for all


@dataclass
class CallerIO:
    """The caller's tensors of one plan, by step index: PUT sources (`blocks`), GET destinations (`out`), on an
    accelerator the event its copies must wait for (`kvtier.mover.copy.ready_event`), and for a load under a
    deadline the gate its copies into `out` pass (`kvtier.mover.deadline`). `report`: where this plan's steps
    are reported, when not the mover's own reporter (a load's keeps count of what it reported)."""

    blocks: Sequence[CallerBlock] = ()
    out: Sequence[CallerBlock] = ()
    ready: Any = None
    gate: Gate | None = None
    report: Reporter | None = None


@contextmanager
def into_caller(io: CallerIO, index: int) -> Iterator[bool]:
    """May the caller's block `index` be written (until the block ends)? Not once its load's deadline passed."""
    if io.gate is None:
        yield True
    else:
        with io.gate.open(index) as allowed:
            yield allowed


class Handler(Protocol):
    def run(self, step: Step, io: CallerIO) -> Result:
        """Move one step's bytes; raise OSError when the destination could not be written."""
        ...


class CallerToSlot:
    """PUT: a caller's block into its host slot."""

    def __init__(self, slab: SlotStore) -> None:
        self.slab = slab

    def run(self, step: Step, io: CallerIO) -> Result:
        with device_stream(io.blocks, io.ready):
            copy_into_slot(self.slab.slot(slot_of(step.dst_slot)), io.blocks[step.index], non_blocking=True)
        return Status.OK, self.slab.payload_nbytes

    def run_many(self, steps: Sequence[Step], io: CallerIO) -> None:
        """Every part of every block in one copy call, an engine's pages as one batch (`kvtier.mover.pages`); on
        a device, on our stream, complete on return."""
        _batch(self.slab, io.blocks, [(step.index, slot_of(step.dst_slot)) for step in steps], True, io.ready)


class SlotToCaller:
    """GET: a host slot into the caller's block."""

    def __init__(self, slab: SlotStore) -> None:
        self.slab = slab

    def run(self, step: Step, io: CallerIO) -> Result:
        with into_caller(io, step.index) as allowed:
            if not allowed:
                return Status.FAILED, 0
            with device_stream(io.out, io.ready):
                copy_from_slot(io.out[step.index], self.slab.slot(slot_of(step.src_slot)), non_blocking=True)
        return Status.OK, self.slab.payload_nbytes

    def run_many(self, steps: Sequence[Step], io: CallerIO) -> None:
        _batch(self.slab, io.out, [(step.index, slot_of(step.src_slot)) for step in steps], False, io.ready)


class SlotToObject:
    """COPY host -> disk or shared (a demotion, a write-through): the slot's bytes under the block's key."""

    def __init__(self, slab: SlotStore, store: ObjectStore) -> None:
        self.slab, self.store = slab, store

    def run(self, step: Step, io: CallerIO) -> Result:
        self.store.write(step.key, step.parent, self.slab.view(slot_of(step.src_slot)))
        return Status.OK, self.slab.payload_nbytes


class ObjectToSlot:
    """COPY disk or shared -> host (a promotion, a fetch): a block that is gone, torn or foreign is
    SOURCE_LOST (the store has removed it), and counted when it was an integrity failure."""

    def __init__(self, store: ObjectStore, slab: SlotStore, integrity_failure: Callable[[], None]) -> None:
        self.store, self.slab, self.integrity_failure = store, slab, integrity_failure

    def run(self, step: Step, io: CallerIO) -> Result:
        return _read(self.store, step.key, self.slab.view(slot_of(step.dst_slot)), self.integrity_failure)


class ObjectToObject:
    """COPY disk -> disk (a demotion between local tiers): read into memory, checked, then written."""

    def __init__(self, src: ObjectStore, dst: ObjectStore, integrity_failure: Callable[[], None]) -> None:
        self.src, self.dst, self.integrity_failure = src, dst, integrity_failure

    def run(self, step: Step, io: CallerIO) -> Result:
        bounce = memoryview(bytearray(self.src.payload_nbytes))
        status, nbytes = _read(self.src, step.key, bounce, self.integrity_failure)
        if status is Status.OK:
            self.dst.write(step.key, step.parent, bounce)
        return status, nbytes


class ObjectToCaller:
    """GET object -> caller (a load not staged through host): read and checked in a buffer of the thread's own,
    then copied into the caller's block. DELETE: a dropped block's file or shared key."""

    def __init__(self, store: ObjectStore, integrity_failure: Callable[[], None]) -> None:
        self.store, self.integrity_failure = store, integrity_failure
        self._local = threading.local()

    def run(self, step: Step, io: CallerIO) -> Result:
        if step.op is Op.DELETE:
            self.store.delete(step.key)
            return Status.OK, 0
        bounce = thread_buffer(self._local, self.store.payload_nbytes)[: self.store.payload_nbytes]
        status, nbytes = _read(self.store, step.key, bounce, self.integrity_failure)
        if status is Status.OK:
            with into_caller(io, step.index) as allowed:
                if not allowed:  # its load's deadline passed: the caller's block is no longer ours
                    return Status.FAILED, 0
                with device_stream(io.out, io.ready):
                    copy_from_slot(io.out[step.index], torch.frombuffer(bounce, dtype=torch.uint8))
        return status, nbytes


def build_handlers(stores: Stores, put: CallerToSlot, get: SlotToCaller,
                   integrity_failure: Callable[[str], None]) -> dict[tuple[str, str], Handler]:
    """Every (src, dst) pair of tier names a plan can hold, with its handler (`put` and `get` are the caller's:
    the mover also runs them in batches). `integrity_failure(tier)` counts a block found torn or foreign there."""
    host, slab = stores.host_name, stores.host
    handlers: dict[tuple[str, str], Handler] = {(CALLER, host): put, (host, CALLER): get}
    for name, store in stores.objects():
        counted = _counter(integrity_failure, name)
        handlers[(host, name)] = SlotToObject(slab, store)
        handlers[(name, host)] = ObjectToSlot(store, slab, counted)
        handlers[(name, CALLER)] = ObjectToCaller(store, counted)
    for src_name, src in stores.local.items():
        for dst_name, dst in stores.local.items():
            if src_name != dst_name:
                handlers[(src_name, dst_name)] = ObjectToObject(src, dst, _counter(integrity_failure, src_name))
    return handlers


def _batch(slab: SlotStore, blocks: Sequence[CallerBlock], moves: list[tuple[int, int]], to_slab: bool,
           ready: Any) -> None:
    with device_stream(blocks, ready):
        if isinstance(blocks, PagedBlocks):
            blocks.move(slab, moves, to_slab)
        else:
            copy_blocks(slab, blocks, moves, to_slab, non_blocking=True)


def thread_buffer(local: threading.local, nbytes: int) -> memoryview:
    """A buffer of at least `nbytes`, the calling thread's own (`local`), kept for its next use: a new mapping
    per use costs its page faults, several times the copy. Page-aligned, so that O_DIRECT reads straight into it."""
    buffer = getattr(local, "buffer", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = local.buffer = memoryview(mmap.mmap(-1, nbytes))
    return buffer


def _read(store: ObjectStore, key: bytes, into: memoryview, integrity_failure: Callable[[], None]) -> Result:
    result = store.read(key, into)
    if result is ReadStatus.OK:
        return Status.OK, store.payload_nbytes
    if result.is_integrity_failure:
        integrity_failure()
    return Status.SOURCE_LOST, 0


def _counter(integrity_failure: Callable[[str], None], tier: str) -> Callable[[], None]:
    return lambda: integrity_failure(tier)


def slot_of(slot: int | None) -> int:
    """A step's host slot, which the directory always sets where a step touches the host tier."""
    if slot is None:
        raise ValueError("a step into or out of a host slot names no slot")
    return slot
