"""`redis_cluster_vs_raw`, the spread over primaries, and a lookup's cost: the shared tier on a Redis Cluster.

On a real loopback cluster (`RedisClusterNodes`: three primaries, a replica each), started here:

- `redis_cluster_vs_raw`: the tier's `put_chain` / `get_many` of 1 MiB blocks (16-block chains, each routed to its
  partition) against a raw redis-py `RedisCluster` pipeline of SET / GET of the same payloads, each side with
  four chains in flight (the mover's shared-tier write threads: a chain is one primary's work, a raw pipeline
  spreads over all of them); sides alternate
  (`kvtier.timing.alternate`), the figure is the median of the paired runs' ratios (target >= 0.9).
- `spread`: the Mooncake conversation trace's chains stored through the tier (64 partitions, partition_tokens
  1024: its first two 512-token blocks pick a chain's partition; 1 KiB payloads, the trace's structure is what
  matters), then each primary's bytes (the partitions' `!used` there) and commands (`total_commands_processed`),
  as max / mean over primaries (target <= 1.25); `copies`: blocks held over distinct blocks (the trunk's copies).
  Routed by the first block alone, every chain of this trace (they all start with block 0) lands on one primary.
- `lookup_vs_one_node`: a 64-block `lookup` on the cluster against the same on a single redis-server (the
  one-node tier), median microseconds per call of alternating rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import torch
from redis.cluster import RedisCluster

from kvtier.bench.redis_server import throwaway_cluster, throwaway_redis
from kvtier.keys import chain_route
from kvtier.stores.base import PutStatus, ReadStatus
from kvtier.stores.redis import RedisStore
from kvtier.stores.redis_cluster import RedisClusterStore
from kvtier.timing import alternate, timed
from kvtier.traces.mooncake import read_mooncake

NAMESPACE = "0" * 32
BLOCK_BYTES = 1 << 20
CHAIN = 16
THREADS = 4  # chains in flight on each side: the mover's shared-tier write threads (n_write_threads)
TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' hash_ids each stand for 512 tokens
PARTITION_TOKENS = 1024
PARTITIONS = 64


class _Sides:
    """The same 1 MiB blocks through raw RedisCluster pipelines and through the tier, THREADS chains at a time."""

    def __init__(self, url: str, n_blocks: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.payloads = [torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=gen)
                         for _ in range(n_blocks)]
        self.into = [torch.empty(BLOCK_BYTES, dtype=torch.uint8) for _ in range(n_blocks)]
        self.keys = [i.to_bytes(16, "big") for i in range(n_blocks)]
        self.chains = [range(i, min(i + CHAIN, n_blocks)) for i in range(0, n_blocks, CHAIN)]
        self.client = RedisCluster.from_url(url)
        self.store = RedisClusterStore(url, NAMESPACE, BLOCK_BYTES,
                                       4 * PARTITIONS * n_blocks * (BLOCK_BYTES + 4096), PARTITIONS,
                                       socket_timeout_s=30)
        self.pool = ThreadPoolExecutor(THREADS)

    def raw_put(self, c: range) -> None:
        pipe = self.client.pipeline()
        for i in c:
            pipe.set(b"raw:" + self.keys[i].hex().encode(), self.payloads[i].numpy().data)
        pipe.execute()

    def raw_get(self, c: range) -> None:
        pipe = self.client.pipeline()
        for i in c:
            pipe.get(b"raw:" + self.keys[i].hex().encode())
        if any(v is None for v in pipe.execute()):
            raise RuntimeError("raw GET missed")

    def tier_put(self, c: range) -> None:
        keys = self.keys
        items = [(keys[i], keys[i - 1] if i != c.start else None, self.payloads[i]) for i in c]
        if any(s is not PutStatus.STORED for s in self.store.put_chain(items, set(), keys[c.start])):
            raise RuntimeError("tier put failed")

    def tier_get(self, c: range) -> None:
        statuses = self.store.get_many([self.keys[i] for i in c], [self.into[i] for i in c], self.keys[c.start])
        if any(s is not ReadStatus.OK for s in statuses):
            raise RuntimeError("tier get missed")

    def round_of(self, put: Callable[[range], None], get: Callable[[range], None]) -> Callable[[], tuple[float, float]]:
        def one_round() -> tuple[float, float]:
            self.client.flushdb(target_nodes=RedisCluster.PRIMARIES)  # both sides store into an empty cluster
            return (timed(lambda: list(self.pool.map(put, self.chains)))[0],
                    timed(lambda: list(self.pool.map(get, self.chains)))[0])
        return one_round

    def close(self) -> None:
        self.client.flushdb(target_nodes=RedisCluster.PRIMARIES)
        self.client.close()
        self.store.close()
        self.pool.shutdown()


def _throughput(url: str, n_blocks: int, runs: int) -> dict:
    """The tier against raw RedisCluster pipelines on the same payloads (module doc)."""
    sides = _Sides(url, n_blocks)
    try:
        pairs = alternate(sides.round_of(sides.tier_put, sides.tier_get), sides.round_of(sides.raw_put, sides.raw_get),
                          runs, lambda: None)
        if not all(torch.equal(a, b) for a, b in zip(sides.into, sides.payloads)):
            raise RuntimeError("tier get returned other bytes")
    finally:
        sides.close()
    ratios = {op: [raw[i] / ours[i] for ours, raw in zip(pairs["ours_s"], pairs["baseline_s"])]
              for i, op in enumerate(("put", "get"))}
    total = BLOCK_BYTES * n_blocks
    return {"block_bytes": BLOCK_BYTES, "blocks": n_blocks, "chain": CHAIN, "threads": THREADS,
            "runs": len(ratios["put"]),
            "tier_put_GBps": round(total / statistics.median(t[0] for t in pairs["ours_s"]) / 1e9, 3),
            "raw_put_GBps": round(total / statistics.median(t[0] for t in pairs["baseline_s"]) / 1e9, 3),
            "tier_get_GBps": round(total / statistics.median(t[1] for t in pairs["ours_s"]) / 1e9, 3),
            "raw_get_GBps": round(total / statistics.median(t[1] for t in pairs["baseline_s"]) / 1e9, 3),
            **{f"{op}_ratio": round(statistics.median(r), 3) for op, r in ratios.items()},
            **{f"{op}_ratio_runs": [round(x, 3) for x in r] for op, r in ratios.items()}}


def _spread(url: str, trace: Path, max_requests: int | None) -> dict:
    """Each primary's share of the trace's bytes and commands, stored through the tier (module doc)."""
    payload = 1024
    route_blocks = -(-PARTITION_TOKENS // TRACE_BLOCK_TOKENS)
    store = RedisClusterStore(url, NAMESPACE, payload, 1 << 40, PARTITIONS, socket_timeout_s=30)
    data = torch.zeros(payload, dtype=torch.uint8)
    primaries = sorted({store.owner(p) for p in store.partitions})

    def commands() -> dict[str, int]:
        out = {}
        for name in primaries:
            host, _, port = name.rpartition(":")
            with redis.Redis(host=host, port=int(port)) as c:
                out[name] = int(c.info("stats")["total_commands_processed"])
        return out

    before, held, distinct, requests = commands(), 0, set(), 0
    for request in read_mooncake(trace):
        if max_requests is not None and requests >= max_requests:
            break
        keys = [b.to_bytes(16, "big") for b in request.blocks]
        if not keys:
            continue
        distinct.update(keys)
        items = [(k, keys[i - 1] if i else None, data) for i, k in enumerate(keys)]
        statuses = store.put_chain(items, set(), chain_route(keys, route_blocks))
        held += sum(s is PutStatus.STORED for s in statuses)
        requests += 1
    after = commands()
    used: dict[str, int] = dict.fromkeys(primaries, 0)
    for part in store.partitions:
        used[store.owner(part)] += store._used(part) or 0
    store.close()
    ops = {n: after[n] - before[n] for n in primaries}

    def skew(values: dict[str, int]) -> float:
        return round(max(values.values()) / (sum(values.values()) / len(values)), 3)

    return {"requests": requests, "partitions": PARTITIONS, "partition_tokens": PARTITION_TOKENS,
            "bytes_per_primary": used, "commands_per_primary": ops, "bytes_max_over_mean": skew(used),
            "commands_max_over_mean": skew(ops), "copies": round(held / len(distinct), 4), "target": 1.25}


def _lookups(cluster_url: str, node_url: str, rounds: int, calls: int = 200) -> dict:
    """Median microseconds of a 64-block lookup (all held), on the cluster and on one node, alternating rounds."""
    keys = [i.to_bytes(16, "big") for i in range(64)]
    data = torch.zeros(1024, dtype=torch.uint8)
    items = [(k, keys[i - 1] if i else None, data) for i, k in enumerate(keys)]
    cluster = RedisClusterStore(cluster_url, NAMESPACE, 1024, 1 << 30, PARTITIONS)
    node = RedisStore(node_url, NAMESPACE, 1024, 1 << 30)
    cluster.put_chain(items, set(), keys[0])
    node.put_chain(items, set())

    def per_call(store: RedisStore) -> Callable[[], float]:
        def one_round() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                if store.lookup(keys, keys[0]) != len(keys):
                    raise RuntimeError("lookup missed")
            return (time.perf_counter() - start) / calls
        return one_round

    try:
        pairs = alternate(per_call(cluster), per_call(node), rounds, lambda: None)
    finally:
        cluster.close()
        node.close()
    ours, base = statistics.median(pairs["ours_s"]), statistics.median(pairs["baseline_s"])
    return {"blocks": len(keys), "cluster_us": round(ours * 1e6, 1), "one_node_us": round(base * 1e6, 1),
            "cluster_over_one_node": round(ours / base, 3), "rounds": len(pairs["ours_s"])}


def run(trace: Path | None, quick: bool = False) -> dict:
    """The three figures on one fresh cluster (module doc); `spread` needs the trace (else it says why not)."""
    with throwaway_cluster() as url:
        throughput = _throughput(url, 32 if quick else 64, 3 if quick else 7)
        result: dict[str, Any] = {"redis_cluster_vs_raw": throughput, "target": 0.9,
                                  "min_ratio": min(throughput["put_ratio"], throughput["get_ratio"])}
        result["spread"] = (_spread(url, trace, 2000 if quick else None) if trace is not None
                            else {"skipped": "the Mooncake conversation trace is not in $KVTIER_TRACES_DIR"})
        with throwaway_redis() as node_url:
            result["lookup_vs_one_node"] = _lookups(url, node_url, 3 if quick else 7)
    return result


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(Path(sys.argv[1]) if len(sys.argv) > 1 else None, quick=True), indent=2))
