"""An engine's KV memory as pages, and the copies of many blocks between those pages and host slots in one call.

The engine keeps each layer's KV as `(num_blocks, page)` byte rows (`pages`, one or more per layer). A caller
block is a run of engine block ids (None: bytes the caller already has, left as they are); in a host slot it is
those engine blocks one after another, each as all its pages in order.

Made into per-part tensors (`Pages.parts`), a block of a real model is hundreds of small copies, each paying for
a torch view on each side and a dispatch (off the CPU, a transfer of its own): more than its bytes cost. So
`Pages.move` copies a batch otherwise. On the CPU, as plain `memmove`s between addresses (libc's, through ctypes,
which releases the GIL and starts no thread). On a device, staged (`Pages.move_staged`): the batch's engine
blocks are gathered from every page into one buffer on the device, one kernel per page, and cross as one copy per
slot (a load crosses first, then is scattered). The mover's single-step copies keep the parts.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.stores.base import SlotStore

EngineBlocks = Sequence[int | None]  # one caller block: its engine block ids, in order
STAGING_BYTES = 64 << 20  # device memory a staged batch passes through, one chunk of engine blocks at a time


class Pages:
    """The engine's pages: uint8 `(num_blocks, page)` tensors, contiguous, on one device."""

    def __init__(self, pages: Sequence[torch.Tensor]) -> None:
        if not pages:
            raise ValueError("kvtier: no KV pages")
        self.tensors = list(pages)
        self.num_blocks = self.tensors[0].shape[0]
        if any(p.dim() != 2 or p.dtype != torch.uint8 or not p.is_contiguous() or p.shape[0] != self.num_blocks
               for p in self.tensors):
            raise ValueError("kvtier: KV pages must be contiguous uint8 (num_blocks, page) tensors of as many blocks")
        self.engine_block_nbytes = sum(p.shape[1] for p in self.tensors)
        # For `move_staged`: each page as 8-byte words where every page allows it (a gather or scatter kernel moves
        # one element per thread, so bytes would take eight times the elements), with its columns in an engine block
        words = all(p.shape[1] % 8 == 0 and p.data_ptr() % 8 == 0 for p in self.tensors)
        self._word = torch.int64 if words else torch.uint8
        size, first = self._word.itemsize, 0
        self._columns: list[tuple[torch.Tensor, slice]] = []
        for p in self.tensors:
            self._columns.append((p.view(self._word), slice(first // size, (first + p.shape[1]) // size)))
            first += p.shape[1]
        # (address of row 0, row bytes) per page, where plain memory copies reach them
        self._rows = [(p.data_ptr(), p.shape[1]) for p in self.tensors] if self.on_cpu else None

    @property
    def on_cpu(self) -> bool:
        return self.tensors[0].device.type == "cpu"

    def parts(self, engine_blocks: EngineBlocks) -> list[torch.Tensor | int]:
        """One caller block as the mover's parts (`kvtier.mover.copy`): each page of each engine block in turn."""
        return [page.shape[1] if block_id is None else page[block_id]
                for block_id in engine_blocks for page in self.tensors]

    def blocks(self, runs: Sequence[EngineBlocks]) -> PagedBlocks:
        return PagedBlocks(self, runs)

    def move(self, slab: SlotStore, pairs: Sequence[tuple[EngineBlocks, int]], to_slab: bool) -> None:
        """Copy each (engine blocks, slot) pair's bytes into the slot (`to_slab`) or out of it. Off the CPU the
        copies are queued on the current stream (the caller synchronizes it)."""
        for engine_blocks, _ in pairs:  # raw addresses and device indexes: all checked before anything is copied
            if len(engine_blocks) * self.engine_block_nbytes > slab.payload_nbytes:
                raise ValueError(f"kvtier: {len(engine_blocks)} engine blocks do not fit a slot of "
                                 f"{slab.payload_nbytes} bytes")
            if any(b is not None and not 0 <= b < self.num_blocks for b in engine_blocks):
                raise ValueError(f"kvtier: engine block id out of range [0, {self.num_blocks}): {engine_blocks}")
        if self._rows is None:
            self.move_staged(slab, pairs, to_slab)
            return
        slots = [slab.slot(slot).data_ptr() for _, slot in pairs]  # the slab checks its slots
        rows, block_nbytes, memmove = self._rows, self.engine_block_nbytes, ctypes.memmove
        for (engine_blocks, _), at in zip(pairs, slots):
            for block_id in engine_blocks:
                if block_id is None:
                    at += block_nbytes
                    continue
                for first, nbytes in rows:
                    if to_slab:
                        memmove(at, first + block_id * nbytes, nbytes)
                    else:
                        memmove(first + block_id * nbytes, at, nbytes)
                    at += nbytes

    def move_staged(self, slab: SlotStore, pairs: Sequence[tuple[EngineBlocks, int]], to_slab: bool,
                    chunk_bytes: int = STAGING_BYTES) -> None:
        """`move` through a staging buffer on the pages' device, `chunk_bytes` of engine blocks at a time (any
        device, the CPU too). The pairs are checked by `move`."""
        width = self.engine_block_nbytes
        entries = [(slot, k * width, b) for blocks, slot in pairs for k, b in enumerate(blocks) if b is not None]
        if not entries:
            return
        device = self.tensors[0].device
        per_chunk = max(1, chunk_bytes // width)
        staging = torch.empty((min(len(entries), per_chunk), width), dtype=torch.uint8, device=device)
        words = staging.view(self._word)  # the same memory, as the gathers and scatters see it
        slot_views = {slot: slab.slot(slot) for slot, _, _ in entries}  # the slab checks its slots
        for start in range(0, len(entries), per_chunk):
            chunk = entries[start : start + per_chunk]
            rows, row_words = staging[: len(chunk)], words[: len(chunk)]
            index = torch.tensor([b for _, _, b in chunk], dtype=torch.long)
            if device.type == "cuda":  # pinned, so that the index crosses without waiting for the stream
                index = index.pin_memory()
            index = index.to(device, non_blocking=True)
            crossings = [(slot_views[slot][at : at + n * width].view(n, width), rows[first : first + n])
                         for slot, at, first, n in _spans(chunk, width)]
            if to_slab:
                for page, columns in self._columns:
                    torch.index_select(page, 0, index, out=row_words[:, columns])
                for host, staged in crossings:
                    host.copy_(staged, non_blocking=True)
            else:
                for host, staged in crossings:
                    staged.copy_(host, non_blocking=True)
                for page, columns in self._columns:
                    page.index_copy_(0, index, row_words[:, columns])


def _spans(chunk: Sequence[tuple[int, int, int]], width: int) -> list[list[int]]:
    """(slot, byte offset, first row, rows) for each run of a chunk's entries that lie back to back in one slot."""
    spans: list[list[int]] = []
    for row, (slot, at, _) in enumerate(chunk):
        last = spans[-1] if spans else None
        if last is not None and last[0] == slot and last[1] + last[3] * width == at:
            last[3] += 1
        else:
            spans.append([slot, at, row, 1])
    return spans


class PagedBlocks(Sequence):
    """Caller blocks given as engine block ids: item i is block i's parts, made on demand (the mover's single-step
    copies use them); the host batch handlers hand the whole batch to `Pages.move` instead."""

    def __init__(self, pages: Pages, runs: Sequence[EngineBlocks]) -> None:
        self.pages, self.runs = pages, runs

    def __len__(self) -> int:
        return len(self.runs)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.pages.parts(run) for run in self.runs[i]]
        return self.pages.parts(self.runs[i])

    def move(self, slab: SlotStore, pairs: Sequence[tuple[int, int]], to_slab: bool) -> None:
        """`Pages.move` for (index of a block here, slot) pairs."""
        self.pages.move(slab, [(self.runs[i], slot) for i, slot in pairs], to_slab)
