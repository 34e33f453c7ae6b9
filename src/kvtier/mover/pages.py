"""An engine's KV memory as pages, and the copies of many blocks between those pages and host slots in one call.

The engine keeps each layer's KV as `(num_blocks, page)` byte rows (`pages`, one or more per layer). A caller
block is a run of engine block ids (None: bytes the caller already has, left as they are); in a host slot it is
those engine blocks one after another, each as all its pages in order.

Made into per-part tensors (`Pages.parts`), a block of a real model is hundreds of small copies, each paying for
a torch view on each side and a dispatch: more than its bytes cost. On the CPU `Pages.move` copies a batch as
plain `memmove`s between addresses instead (libc's, through ctypes, which releases the GIL and starts no
thread). Anywhere else, and for the mover's single-step copies, the parts stay.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.stores.base import SlotStore

EngineBlocks = Sequence[int | None]  # one caller block: its engine block ids, in order


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

    def move(self, slab: SlotStore, pairs: Sequence[tuple[EngineBlocks, int]], to_slab: bool) -> bool:
        """Copy each (engine blocks, slot) pair's bytes into the slot (`to_slab`) or out of it. False (nothing
        copied) off the CPU: the caller copies the parts instead."""
        if self._rows is None:
            return False
        for engine_blocks, _ in pairs:  # raw addresses: every index is checked before anything is copied
            if len(engine_blocks) * self.engine_block_nbytes > slab.payload_nbytes:
                raise ValueError(f"kvtier: {len(engine_blocks)} engine blocks do not fit a slot of "
                                 f"{slab.payload_nbytes} bytes")
            if any(b is not None and not 0 <= b < self.num_blocks for b in engine_blocks):
                raise ValueError(f"kvtier: engine block id out of range [0, {self.num_blocks}): {engine_blocks}")
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
        return True


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

    def move(self, slab: SlotStore, pairs: Sequence[tuple[int, int]], to_slab: bool) -> bool:
        """`Pages.move` for (index of a block here, slot) pairs."""
        return self.pages.move(slab, [(self.runs[i], slot) for i, slot in pairs], to_slab)
