"""The check to run on a CUDA machine (torch alone; no vLLM there): `python -m kvtier.bench.gpu_check`.

1. Ordering. A store must copy what the caller's stream computed, even when that work is still queued: the
   caller's stream sleeps, then fills the blocks; the store is called at once, without a sync. A load must not
   write blocks the caller's stream still reads: the stream sleeps, then snapshots the destination; the load
   is called at once. Copies on the default stream (or on ours, unordered) fail one of the two.
2. Exactness. bf16 KV blocks of Llama-3.1-8B's geometry go to the host tier and through it to a disk tier and
   back onto the GPU: bit-identical.
3. Speed. D2H (store) and H2D (load) GB/s through the host tier against plain `copy_` between the same GPU
   blocks and a pinned buffer, alternated, medians of paired runs; for 16-token blocks (vLLM's engine blocks)
   and 256-token ones (kvtier's default `block_size`).
4. An engine's pages (what the vLLM connector moves on a GPU): Llama-3.1-8B's per-layer pages of 16-token engine
   blocks, stored and loaded through the host batch handlers, staged (`Pages.move`) and as per-part copies,
   against one pinned `copy_` of the same bytes each way; bit-exact first (`kvtier.bench.pages`).
5. Where the gaps lie (`kvtier.bench.gpu_gaps`): the slab's page-locked memory against torch's pinned memory, the
   staged path's gather as bytes and as words, and one block's store and load against a synchronized `copy_`.

Prints one JSON object (a section that raised holds its error); exit code 1 if a check fails, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial

import torch

from kvtier.bench.gpu_gaps import gaps
from kvtier.bench.pages import pages_case
from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.keys import chain_keys
from kvtier.layout import KVLayout, preset, round_up

SLEEP_CYCLES = 200_000_000  # about 0.1-0.2 s of GPU time queued ahead of the copies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=64, help="KV blocks per check (default 64)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per block of checks 1-2 (default 16)")
    parser.add_argument("--speed-tokens", type=int, nargs="+", default=[16, 256],
                        help="tokens per block of each speed figure (default 16 256)")
    parser.add_argument("--reps", type=int, default=7, help="paired runs of the speed figures (default 7)")
    parser.add_argument("--page-blocks", type=int, default=16,
                        help="256-token blocks of engine pages in the pages check (default 16)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kvtier gpu_check: needs CUDA (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    layout = preset("llama-3.1-8b")
    shape = (layout.num_layers, 2, layout.num_kv_heads, args.block_tokens, layout.head_dim)
    nbytes = layout.bytes_per_block(args.block_tokens)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "block_shape": shape,
                    "block_bytes": nbytes, "blocks": args.blocks}
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-check-") as root:
        config = parse_config({"cpu_bytes_to_use": 2 * args.blocks * round_up(nbytes), "block_size": args.block_tokens,
                               "secondary_tiers": [{"type": "fs", "root_dir": root, "admission": {"min_sightings": 1},
                                                    "max_bytes": 4 * args.blocks * (nbytes + 8192)}]})
        with TieredCache(config, shape, torch.bfloat16, model="gpu-check") as cache:
            result["pinned"] = bool(getattr(cache.stores.host, "pinned", False))
            _section(result, "ordering", lambda: _ordering(cache, shape, args.blocks))
            _section(result, "exact", lambda: _exactness(cache, shape, args.blocks))
    for tokens in args.speed_tokens:
        _section(result, f"speed_{tokens}_tokens", partial(_speed, layout, tokens, args.blocks, args.reps))
    _section(result, "pages", lambda: pages_case("llama-3.1-8b", args.page_blocks, args.reps, lambda: None, "cuda"))
    _section(result, "gaps", lambda: gaps(args.blocks, args.reps))
    ordering, exact = result["ordering"], result["exact"]
    figures = [section for name, section in result.items() if name.startswith(("speed", "pages", "gaps"))]
    ok = (ordering.get("store_waited") is True and ordering.get("load_waited") is True
          and exact.get("host") is True and exact.get("disk") is True and not any("error" in s for s in figures))
    result["ok"] = ok
    print(json.dumps(result, indent=2))
    return 0 if ok else 1


def _section(result: dict, name: str, check: Callable[[], dict]) -> None:
    """One check's figures, or its error: on a lent machine every other section's figures still come back."""
    try:
        result[name] = check()
    except Exception:
        result[name] = {"error": traceback.format_exc()}


def _ordering(cache: TieredCache, shape: tuple, n: int) -> dict:
    """The two hazards of copies on a stream that does not wait for the caller's."""
    blocks = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
    torch.cuda.synchronize()
    keys = chain_keys(list(range(n * shape[3])), shape[3], extra_keys=["ordering"])
    torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream is busy...
    for block in blocks:
        block.fill_(7.0)  # ...then writes the KV the store must copy
    cache.store(keys, blocks)  # no sync: the store must wait for the fill
    cache.flush()
    back = cache.load(keys)  # to the CPU
    store_waited = len(back) == n and all(bool((b == 7.0).all()) for b in back)
    out = [torch.full(shape, 3.0, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream is busy...
    snapshots = [o.clone() for o in out]  # ...then still reads what the load will overwrite
    got = cache.load(keys, out=out)  # no sync: the load must wait for the reads
    torch.cuda.synchronize()
    load_waited = all(bool((s == 3.0).all()) for s in snapshots) and all(bool((o == 7.0).all()) for o in got)
    return {"store_waited": store_waited, "load_waited": load_waited, "loaded": len(got)}


def _exactness(cache: TieredCache, shape: tuple, n: int) -> dict:
    """Random bf16 blocks through host, then (pushed out by more blocks) through disk, back onto the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = [torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(n)]
    keys = chain_keys(list(range(n * shape[3])), shape[3], extra_keys=["exact"])
    cache.store(keys, blocks)
    cache.flush()
    host = cache.load(keys, device="cuda")
    filler = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2 * n)]
    cache.store(chain_keys(list(range(2 * n * shape[3])), shape[3], extra_keys=["filler"]), filler)
    cache.flush()
    from_disk = cache.snapshot()["moves"].get("host->disk", 0) > 0
    disk = cache.load(keys, device="cuda")

    def same(a: list[torch.Tensor]) -> bool:
        return len(a) == n and all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, blocks))

    return {"host": same(host), "disk": same(disk) and from_disk}


def _speed(layout: KVLayout, tokens: int, n: int, reps: int) -> dict:
    """Host tier only: the D2H and H2D copies themselves."""
    shape = (layout.num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim)
    config = parse_config({"cpu_bytes_to_use": n * round_up(layout.bytes_per_block(tokens)), "block_size": tokens})
    blocks = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(n)]
    out = [torch.empty_like(b) for b in blocks]
    pinned = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(n)]
    nbytes = n * blocks[0].numel() * 2
    ours_d2h, ours_h2d, base_d2h, base_h2d = [], [], [], []
    with TieredCache(config, shape, torch.bfloat16, model="gpu-speed") as cache:
        for rep in range(reps + 1):
            keys = chain_keys(list(range(n * shape[3])), shape[3], extra_keys=[f"speed-{rep}"])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cache.store(keys, blocks)
            cache.flush()
            t1 = time.perf_counter()
            cache.load(keys, out=out)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            for p, b in zip(pinned, blocks):
                p.copy_(b, non_blocking=True)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            for o, p in zip(out, pinned):
                o.copy_(p, non_blocking=True)
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            if rep:  # the first round warms up pools and pins
                ours_d2h.append(nbytes / (t1 - t0) / 1e9)
                ours_h2d.append(nbytes / (t2 - t1) / 1e9)
                base_d2h.append(nbytes / (t3 - t2) / 1e9)
                base_h2d.append(nbytes / (t4 - t3) / 1e9)
    return {
        "block_tokens": tokens, "block_bytes": nbytes // n, "blocks": n,
        "d2h_gbps": statistics.median(ours_d2h), "h2d_gbps": statistics.median(ours_h2d),
        "copy_d2h_gbps": statistics.median(base_d2h), "copy_h2d_gbps": statistics.median(base_h2d),
        "d2h_vs_copy": statistics.median(a / b for a, b in zip(ours_d2h, base_d2h)),
        "h2d_vs_copy": statistics.median(a / b for a, b in zip(ours_h2d, base_h2d)),
        "runs": {"d2h": ours_d2h, "h2d": ours_h2d, "copy_d2h": base_d2h, "copy_h2d": base_h2d},
    }


if __name__ == "__main__":
    sys.exit(main())
