"""`engine_pages_vs_copy`: the connector's copies between an engine's KV pages and host slots, against a plain
`copy_` of the same bytes into a preallocated buffer and back.

The connector's worker hands the mover its blocks as engine block ids over the engine's per-layer pages; the host
batch handlers move a whole batch with `Pages.move`. `parts` is the same batch given as per-part tensors (what the
worker did before): one small copy per page of each engine block. Both store, then load, every block, through the
mover's own batch handlers. Two geometries: the tiny model the tests serve, and Llama-3.1-8B on vLLM's default
16-token engine blocks (64 pages of 32 KiB per engine block, 16 engine blocks per 256-token kvtier block).
On a GPU (`gpu_check`) the pages live there, the slab is pinned, and the baseline is one `copy_` of the same bytes
between the GPU and a pinned buffer, each way.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtier.directory import CALLER, Op, Step
from kvtier.mover.copy import ready_event
from kvtier.mover.handlers import CallerIO, CallerToSlot, SlotToCaller
from kvtier.mover.pages import Pages
from kvtier.stores.host import HostSlab
from kvtier.timing import alternate, summary

KiB = 1 << 10
GEOMETRIES = {  # name: (pages per engine block, page bytes, engine blocks per kvtier block)
    "tiny model": (8, 32 * KiB, 2),  # 128-token engine blocks (vLLM's CPU backend)
    "llama-3.1-8b": (64, 32 * KiB, 16),  # 16-token engine blocks (vLLM's default)
}


def pages_case(name: str, blocks: int, reps: int, tick: Callable[[], None], device: str = "cpu") -> dict:
    """Store then load `blocks` kvtier blocks of geometry `name`: pages vs copy_, then parts vs copy_."""
    n_pages, page_nbytes, per_block = GEOMETRIES[name]
    engine_blocks = 2 * blocks * per_block
    pages = Pages([torch.randint(0, 256, (engine_blocks, page_nbytes), dtype=torch.uint8, device=device)
                   for _ in range(n_pages)])
    on_gpu = pages.tensors[0].device.type == "cuda"
    rng = random.Random(0)  # an engine's free blocks and a slab's free slots come in no particular order
    ids = rng.sample(range(engine_blocks), blocks * per_block)
    runs: list[list[int | None]] = [list(ids[i * per_block : (i + 1) * per_block]) for i in range(blocks)]
    slab = HostSlab(2 * blocks, per_block * pages.engine_block_nbytes)
    slots = rng.sample(range(2 * blocks), blocks)
    puts = [Step(Op.PUT, b"%d" % i, CALLER, "host", None, s, i, None, False, i) for i, s in enumerate(slots)]
    gets = [Step(Op.GET, b"%d" % i, "host", CALLER, s, None, i, None, False, blocks + i) for i, s in enumerate(slots)]
    put, get = CallerToSlot(slab), SlotToCaller(slab)
    nbytes = blocks * per_block * pages.engine_block_nbytes
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    buffer, back = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu), torch.empty_like(source)

    def round_trip(paged: bool) -> float:
        def caller() -> Any:
            return pages.blocks(runs) if paged else [pages.parts(run) for run in runs]

        begin = time.perf_counter()
        put.run_many(puts, CallerIO(blocks=caller(), ready=ready_event(pages.tensors)))
        get.run_many(gets, CallerIO(out=caller(), ready=ready_event(pages.tensors)))
        return time.perf_counter() - begin

    def base() -> float:
        begin = time.perf_counter()
        buffer.copy_(source, non_blocking=on_gpu)
        back.copy_(buffer, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - begin

    try:
        before = [p[ids].clone() for p in pages.tensors]
        put.run_many(puts, CallerIO(blocks=pages.blocks(runs), ready=ready_event(pages.tensors)))
        for p in pages.tensors:
            p[ids] = 0
        get.run_many(gets, CallerIO(out=pages.blocks(runs), ready=ready_event(pages.tensors)))
        if not all(torch.equal(p[ids], b) for p, b in zip(pages.tensors, before)):
            raise RuntimeError("pages bench: a block came back different")
        paged = alternate(lambda: round_trip(True), base, reps, tick)
        parts = alternate(lambda: round_trip(False), base, reps, tick)
    finally:
        slab.close()
    return {"geometry": name, "device": device, "blocks": blocks, "parts_per_block": n_pages * per_block,
            "page_bytes": page_nbytes, **summary(paged, 2 * nbytes), "parts": summary(parts, 2 * nbytes)}
