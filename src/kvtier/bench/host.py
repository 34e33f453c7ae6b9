"""`host_vs_copy`: TieredCache with only the host tier (store all, flush, load all into preallocated tensors)
against a plain per-block torch `copy_` into a preallocated buffer and back: the same blocks, the same bytes
twice. One case per block size; the headline is the minimum over sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.layout import round_up
from kvtier.timing import alternate, fresh_keys, summary

TOKEN_BYTES = 2 * 8 * 128 * 2  # K and V, 8 heads of 128, bf16: one token of one layer


def host_case(source: torch.Tensor, block_bytes: int, reps: int, tick: Callable[[], None]) -> dict:
    """Store n blocks, flush, load them back, against copy_ into a preallocated buffer and back.

    The headline loads into preallocated tensors (`load(keys, out=...)`), as the baseline copies into
    preallocated ones; `new_tensors` is the same run with `load(keys)` allocating its result.
    """
    n = max(1, source.numel() // block_bytes)
    shape = (2, 8, block_bytes // TOKEN_BYTES, 128)
    blocks_t = source[: n * block_bytes].view(torch.bfloat16).view(n, *shape)
    blocks = list(blocks_t)
    config = parse_config({"cpu_bytes_to_use": n * round_up(block_bytes), "block_size": shape[2]})
    cache = TieredCache(config, shape, torch.bfloat16)  # room for exactly n: each round evicts the last one's
    buf, out, ours_out = (torch.empty_like(blocks_t) for _ in range(3))
    buf_rows, out_rows, ours_rows = list(buf), list(out), list(ours_out)
    checked: list[bool] = []

    def ours(into: list[torch.Tensor] | None) -> float:
        keys = fresh_keys(n)
        start = time.perf_counter()
        accepted = cache.store(keys, blocks)
        cache.flush()
        got = cache.load(keys, out=into)
        elapsed = time.perf_counter() - start
        if accepted != n or len(got) != n:
            raise RuntimeError(f"host bench: stored {accepted}, loaded {len(got)} of {n} blocks")
        if len(checked) < 2:
            checked.append(all(same_bits(a, b) for a, b in zip(got, blocks)))
            ours_out.zero_()
        return elapsed

    def base() -> float:
        start = time.perf_counter()
        for dst, src in zip(buf_rows, blocks):
            dst.copy_(src)
        for dst, src in zip(out_rows, buf_rows):
            dst.copy_(src)
        return time.perf_counter() - start

    try:
        times = alternate(lambda: ours(ours_rows), base, reps, tick)
        new_tensors = alternate(lambda: ours(None), base, reps, tick)
    finally:
        cache.close()
    if not all(checked):
        raise RuntimeError("host bench: a loaded block differs from the stored one")
    nbytes = 2 * n * block_bytes
    return {"block_bytes": block_bytes, "blocks": n, **summary(times, nbytes),
            "new_tensors": summary(new_tensors, nbytes)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
