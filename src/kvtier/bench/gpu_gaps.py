"""Where a GPU figure's gap lies, measured apart (a section of `gpu_check`), so that one run on a lent machine
says what to change:

- `memory`: plain per-block `copy_`s between the GPU and the host slab's own memory (an mmap page-locked with
  `cudaHostRegister`) against the same copies to and from torch's pinned memory (`cudaHostAlloc`). A gap here
  is the slab's memory, not kvtier's code.
- `gather`: the staged pages path's gather (`index_select` of a batch's engine blocks from 64 pages of 32 KiB
  into one device buffer) with the pages seen as bytes and as 8-byte words, against a device-to-device
  `copy_` of as many bytes.
- `per_call`: what one `TieredCache` store (with `flush`) and one load of a single 2 MiB block cost against a
  synchronized `copy_` each way, and cProfile's heaviest functions over those calls: where a fixed cost per call
  goes (on the CPU it is tens of microseconds).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.keys import chain_keys
from kvtier.layout import round_up
from kvtier.stores.host import HostSlab
from kvtier.timing import summary

MiB = 1 << 20


def gaps(blocks: int, reps: int) -> dict:
    return {"transparent_hugepage": _thp(), "memory": _memory(blocks, reps), "gather": _gather(reps),
            "per_call": _per_call(50)}


def _memory(n: int, reps: int) -> dict:
    """n blocks of 2 MiB each way, alternated between the slab's memory and torch's pinned memory."""
    gpu = [torch.randint(0, 256, (2 * MiB,), dtype=torch.uint8, device="cuda") for _ in range(n)]
    torch_pinned = [torch.empty(2 * MiB, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    with HostSlab(n, 2 * MiB) as slab:
        slots = [slab.slot(i) for i in range(n)]
        sides = {"slab": slots, "torch_pinned": torch_pinned}
        figures: dict = {"slab_pinned": slab.pinned}
        for direction in ("d2h", "h2d"):
            def copies(host: list[torch.Tensor], direction: str = direction) -> Callable[[], object]:
                pairs = list(zip(host, gpu) if direction == "d2h" else zip(gpu, host))
                return lambda: [dst.copy_(src, non_blocking=True) for dst, src in pairs]
            times = _paired({name: copies(host) for name, host in sides.items()}, reps)
            figures[direction] = _summary(times, n * 2 * MiB, ours="slab", base="torch_pinned")
    return figures


def _gather(reps: int) -> dict:
    """Llama-3.1-8B's pages: 64 of 32 KiB per 16-token engine block; 1,024 engine blocks gathered (64 MiB)."""
    pages = [torch.randint(0, 256, (2048, 32 * 1024), dtype=torch.uint8, device="cuda") for _ in range(64)]
    index = torch.randperm(2048, device="cuda")[:1024]
    staging = torch.empty((1024, 64 * 32 * 1024), dtype=torch.uint8, device="cuda")
    flat = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")

    def gather(word: torch.dtype) -> Callable[[], object]:
        seen = [p.view(word) for p in pages]
        rows = staging.view(word)
        width = seen[0].shape[1]
        return lambda: [torch.index_select(p, 0, index, out=rows[:, j * width : (j + 1) * width])
                        for j, p in enumerate(seen)]

    times = _paired({"bytes": gather(torch.uint8), "words": gather(torch.int64),
                     "copy": lambda: flat.copy_(staging.view(-1)[: 64 * MiB])}, reps)
    return {"bytes_vs_copy": _summary(times, 64 * MiB, ours="bytes", base="copy"),
            "words_vs_copy": _summary(times, 64 * MiB, ours="words", base="copy")}


def _per_call(calls: int) -> dict:
    shape = (32, 2, 8, 16, 128)  # one 16-token block of Llama-3.1-8B, bf16: 2 MiB
    block = torch.randn(shape, device="cuda").to(torch.bfloat16)
    out, pinned = torch.empty_like(block), torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    config = parse_config({"cpu_bytes_to_use": 4 * round_up(block.nbytes), "block_size": 16})
    timings: dict[str, list[float]] = {"store": [], "load": [], "copy_d2h": [], "copy_h2d": []}
    profile = cProfile.Profile()

    def timed(name: str, call: Callable[[], object]) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        timings[name].append(time.perf_counter() - start)

    with TieredCache(config, shape, torch.bfloat16, model="gpu-per-call") as cache:
        for call in range(calls + 1):
            keys = chain_keys(list(range(16)), 16, extra_keys=[f"per-call-{call}"])
            if call:
                profile.enable()
            timed("store", partial(store_and_flush, cache, keys, [block]))
            timed("load", partial(cache.load, keys, out=[out]))
            profile.disable()
            timed("copy_d2h", lambda: pinned.copy_(block, non_blocking=True))
            timed("copy_h2d", lambda: out.copy_(pinned, non_blocking=True))
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    return {**{f"{name}_us": statistics.median(times[1:]) * 1e6 for name, times in timings.items()},
            "profile": text.getvalue().splitlines()[-32:]}


def store_and_flush(cache: TieredCache, keys: list[bytes], blocks: list[torch.Tensor]) -> None:
    cache.store(keys, blocks)
    cache.flush()


def _paired(sides: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Each side's seconds per run (synchronized), the order rotated every round; one warm-up round."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps + 1):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            sides[name]()
            torch.cuda.synchronize()
            if rep:
                times[name].append(time.perf_counter() - start)
    return times


def _summary(times: dict[str, list[float]], nbytes: int, ours: str, base: str) -> dict:
    """`kvtier.timing.summary` of two of the sides."""
    return summary({"ours_s": times[ours], "baseline_s": times[base]}, nbytes)


def _thp() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.read_text().strip() if path.exists() else "unknown"

