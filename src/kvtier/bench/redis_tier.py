"""`redis_vs_raw`: what the Redis tier costs over plain redis-py, on the same bytes and the same server.

For 256 KiB, 1 MiB and 4 MiB blocks: the tier's `put_many` / `get_many` (header, checksums, accounting
script, copy into the caller's buffer) against a raw redis-py pipeline of SET / GET of the same payloads.
Sides alternate (`kvtier.timing.alternate`: a warm-up round, then ABBA) so that drift on a shared machine
hits both alike; we report the median of the paired runs' ratios (target >= 0.9), with each side's median
throughput beside it. The server is emptied before each side's puts, so that both store into the same state:
storing makes the server fault in and zero new pages, about half of its CPU time (benchmarks/README.md). Starts
its own redis-server on a free port (`kvtier.bench.redis_server`, the starter the tests use too).

With hiredis (a dependency of kvtier), redis-py packs each SET into one buffer, copying the value, while the
tier sends payloads straight from the caller's buffer (what that does to the put ratio: benchmarks/README.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import redis
import torch
from redis.utils import HIREDIS_AVAILABLE

from kvtier.bench.redis_server import throwaway_redis
from kvtier.stores.base import ReadStatus
from kvtier.stores.redis import PutStatus, RedisStore
from kvtier.timing import alternate, timed

SIZES = {"256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}
NAMESPACE = "0" * 32


class _Sides:
    """The same blocks through raw redis-py and through the tier: each side puts, then gets, every batch."""

    def __init__(self, url: str, nbytes: int, n_blocks: int, batch: int) -> None:
        gen = torch.Generator().manual_seed(nbytes)
        self.payloads = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(n_blocks)]
        self.views = [p.numpy().data for p in self.payloads]
        self.into = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n_blocks)]
        self.keys = [i.to_bytes(16, "big") for i in range(n_blocks)]
        self.raw_keys = [b"raw:" + k.hex().encode() for k in self.keys]
        self.batches = [range(i, min(i + batch, n_blocks)) for i in range(0, n_blocks, batch)]
        self.client = redis.Redis.from_url(url)
        self.store = RedisStore(url, NAMESPACE, nbytes, max_bytes=4 * n_blocks * (nbytes + 4096), socket_timeout_s=30)

    def raw_put(self) -> None:
        for b in self.batches:
            pipe = self.client.pipeline(transaction=False)
            for i in b:
                pipe.set(self.raw_keys[i], self.views[i])
            pipe.execute()

    def raw_get(self) -> None:
        for b in self.batches:
            pipe = self.client.pipeline(transaction=False)
            for i in b:
                pipe.get(self.raw_keys[i])
            if any(v is None for v in pipe.execute()):
                raise RuntimeError("raw GET missed")

    def tier_put(self) -> None:
        keys = self.keys
        for b in self.batches:  # each batch one chain, as a request's blocks are
            items = [(keys[i], keys[i - 1] if i != b.start else None, self.payloads[i]) for i in b]
            if any(s is not PutStatus.STORED for s in self.store.put_many(items)):
                raise RuntimeError("tier put failed")

    def tier_get(self) -> None:
        for b in self.batches:
            statuses = self.store.get_many([self.keys[i] for i in b], [self.into[i] for i in b])
            if any(s is not ReadStatus.OK for s in statuses):
                raise RuntimeError("tier get missed")

    def round_of(self, put: Callable[[], None], get: Callable[[], None]) -> Callable[[], tuple[float, float]]:
        def one_round() -> tuple[float, float]:
            self.client.flushdb()  # both sides store into an empty server (module doc)
            return timed(put)[0], timed(get)[0]
        return one_round

    def close(self) -> None:
        self.client.flushdb()
        self.client.close()
        self.store.close()


def _one_size(url: str, nbytes: int, n_blocks: int, batch: int, runs: int) -> dict:
    """Median put and get throughput (bytes/s) of raw redis-py and of the tier, alternating runs."""
    sides = _Sides(url, nbytes, n_blocks, batch)
    try:
        pairs = alternate(sides.round_of(sides.tier_put, sides.tier_get), sides.round_of(sides.raw_put, sides.raw_get),
                          runs, lambda: None)
        times = {f"{name}_{op}": [t[i] for t in pairs[key]] for name, key in (("tier", "ours_s"), ("raw", "baseline_s"))
                 for i, op in enumerate(("put", "get"))}
        if not all(torch.equal(a, b) for a, b in zip(sides.into, sides.payloads)):
            raise RuntimeError("tier get returned other bytes")
    finally:
        sides.close()
    total = nbytes * n_blocks
    gbps = {name: total / statistics.median(t) / 1e9 for name, t in times.items()}
    paired = {op: [raw / tier for raw, tier in zip(times[f"raw_{op}"], times[f"tier_{op}"])] for op in ("put", "get")}
    return {
        "block_bytes": nbytes, "blocks": n_blocks, "batch": batch, "runs": len(times["raw_put"]),
        "raw_put_GBps": round(gbps["raw_put"], 3), "tier_put_GBps": round(gbps["tier_put"], 3),
        "raw_get_GBps": round(gbps["raw_get"], 3), "tier_get_GBps": round(gbps["tier_get"], 3),
        "put_ratio": round(statistics.median(paired["put"]), 3),
        "get_ratio": round(statistics.median(paired["get"]), 3),
        "put_ratio_runs": [round(r, 3) for r in paired["put"]],
        "get_ratio_runs": [round(r, 3) for r in paired["get"]],
    }


def run(quick: bool = False) -> dict:
    """{"redis_vs_raw": {size: figures}, "min_ratio": the worst put or get ratio, "target": 0.9}."""
    total = (32 if quick else 128) << 20  # bytes moved per run and direction
    runs = 3 if quick else 11  # single rounds range widely (the server's page faults): benchmarks/README.md
    results = {}
    with throwaway_redis() as url:
        for name, nbytes in SIZES.items():
            n_blocks = total // nbytes
            results[name] = _one_size(url, nbytes, n_blocks, batch=min(16, n_blocks), runs=runs)
    worst = min(min(r["put_ratio"], r["get_ratio"]) for r in results.values())
    parser = "hiredis" if HIREDIS_AVAILABLE else "python"  # redis-py's reply parser, for both sides
    return {"redis_vs_raw": results, "min_ratio": worst, "target": 0.9, "parser": parser}


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick=True), indent=2))
