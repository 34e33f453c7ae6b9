"""Bit-exact byte copies between the caller's tensors and host slots.

A caller's block is one tensor, or the parts its bytes are made of, in order (an engine's per-layer pages);
an int part is that many bytes left as they are (bytes the caller already has). Both sides of a copy always
get the same element type, so nothing is ever converted.

One block at a time (`copy_into_slot`, `copy_from_slot`) runs in the mover's threads, behind a promotion or a
demotion; on the CPU it is a numpy copy, not a torch kernel: a torch kernel in a thread starts an OpenMP team
of its own in it, and more OpenMP threads than cores stall the engine's team too. Batches (`copy_blocks`) run in
the caller's thread, whose team the engine already has.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvtier.mover.pages import PagedBlocks
from kvtier.stores.base import SlotStore

CallerBlock = torch.Tensor | Sequence[torch.Tensor | int]
_local = threading.local()  # each mover thread's copy streams
_GRAIN = 32768  # at::internal::GRAIN_SIZE: torch copies in parallel only above this many elements


def copy_into_slot(slot: torch.Tensor, block: CallerBlock, non_blocking: bool = False) -> None:
    """A caller's block into a host slot."""
    for part, region in regions(block, slot):
        _copy_bytes(region, part, non_blocking)


def copy_from_slot(block: CallerBlock, slot: torch.Tensor, non_blocking: bool = False) -> None:
    """The reverse of `copy_into_slot`: an int part is skipped."""
    for part, region in regions(block, slot):
        _copy_bytes(part, region, non_blocking)


def copy_blocks(slab: SlotStore, blocks: Sequence[CallerBlock], moves: Sequence[tuple[int, int]], to_slab: bool,
                non_blocking: bool = False) -> None:
    """For each (index, slot) of `moves`, `blocks[index]` into that slot (`to_slab`) or out of it, in one copy call.

    A tensor (contiguous, a slot's bytes) is paired with its slot as `slab.slots_as` shapes it, so that the copy
    needs no view per block; a block of parts is paired part by part with the slot's bytes (`regions`). Every
    pair is checked before anything is copied."""
    slot_side: list[torch.Tensor] = []
    caller_side: list[torch.Tensor] = []
    kind, typed, count = None, None, 0  # the kind of tensor block last seen, and the slots shaped like it
    for index, slot in moves:
        block = blocks[index]
        if isinstance(block, torch.Tensor):
            if block.nbytes != slab.payload_nbytes or not block.is_contiguous():
                raise ValueError(f"block {index}: {block.nbytes} bytes for a slot's {slab.payload_nbytes}, "
                                 f"or not contiguous")
            if (block.dtype, block.shape) != kind:
                kind = (block.dtype, block.shape)
                typed = slab.slots_as(*kind)
                count = len(typed)
            assert typed is not None
            if not 0 <= slot < count:
                raise ValueError(f"slot {slot} out of range [0, {count})")
            slot_side.append(typed[slot])
            caller_side.append(block)
            continue
        for part, region in regions(block, slab.slot(slot)):
            region, part = _words(region, part)
            slot_side.append(region)
            caller_side.append(part)
    if slot_side:
        dst, src = (slot_side, caller_side) if to_slab else (caller_side, slot_side)
        torch._foreach_copy_(dst, src, non_blocking=non_blocking)


def regions(block: CallerBlock, slot: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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


def on_cpu(blocks: Sequence[CallerBlock] | None) -> bool:
    first = _first_tensor(blocks)
    return first is not None and first.device.type == "cpu"


def ready_event(blocks: Sequence[CallerBlock] | None) -> Any:
    """Where the caller's blocks live on an accelerator: an event on the caller's current stream, recorded in
    the caller's thread, after the work it queued on those blocks (the KV the engine computed, or is still
    reading in a block it freed). Copies wait for it; None on the CPU."""
    first = _first_tensor(blocks)
    if first is None or first.device.type != "cuda":
        return None
    return torch.cuda.current_stream(first.device).record_event()


@contextmanager
def device_stream(blocks: Sequence[CallerBlock] | None, ready: Any) -> Iterator[None]:
    """Copies to or from an accelerator run on a stream of ours (one per device and thread), ordered after
    `ready` (see `ready_event`), and are complete when the block ends. On the CPU: nothing to do."""
    first = _first_tensor(blocks)
    if first is None or first.device.type != "cuda":
        yield
        return
    stream = _stream(first.device)
    if ready is not None:
        stream.wait_event(ready)
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def _stream(device: torch.device) -> Any:
    streams = _local.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy `src`'s bytes over `dst`'s, bit for bit (both contiguous, the same number of bytes)."""
    d, s = _words(dst, src)
    if d.device.type == "cpu" and s.device.type == "cpu":
        np.copyto(d.numpy(), s.numpy())  # no OpenMP team in a mover thread: see the module's docstring
    else:
        d.copy_(s, non_blocking=non_blocking)


def _words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides as the same element type: 8-byte words where both allow it and the copy is large (torch copies
    words faster than the same bytes), else bytes: torch splits a copy across its threads only above
    `_GRAIN` elements, and a block too small to split as words is split as bytes (benchmarks/README.md)."""
    nbytes = src.numel() * src.element_size()
    if nbytes > 8 * _GRAIN and nbytes % 8 == 0:
        try:
            d, s = _as(dst, torch.int64), _as(src, torch.int64)
        except RuntimeError:  # an offset that is not a multiple of 8 bytes (or not contiguous: raises below)
            d, s = _as(dst, torch.uint8), _as(src, torch.uint8)
    else:
        d, s = _as(dst, torch.uint8), _as(src, torch.uint8)
    if d.numel() != s.numel() or not (d.is_contiguous() and s.is_contiguous()):
        raise ValueError(f"block part of {nbytes} bytes for {dst.numel() * dst.element_size()} (or not contiguous)")
    return d, s


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t`'s bytes as one flat view of `dtype` (no copy; never a conversion)."""
    return t if t.dtype is dtype and t.dim() == 1 else t.view(-1).view(dtype)


def _first_tensor(blocks: Sequence[CallerBlock] | None) -> torch.Tensor | None:
    if isinstance(blocks, PagedBlocks):  # where its blocks live, without making the first one's parts
        return blocks.pages.tensors[0]
    first = blocks[0] if blocks else None
    if first is not None and not isinstance(first, torch.Tensor):
        first = next((p for p in first if isinstance(p, torch.Tensor)), None)
    return first
