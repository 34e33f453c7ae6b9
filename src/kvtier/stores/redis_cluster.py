"""The shared tier on a Redis Cluster: the single-node tier (`kvtier.stores.redis`) cut into partitions.

One Redis holds one machine's memory and one NIC. A cluster spreads keys over primaries by hash slot, and a
script or a MULTI may only touch the keys of one slot. The tier's accounting (`!used`, `!meta`, `!leaves`, ...)
is global on one node; here each of `partitions` partitions has its own, under a prefix whose hash tag puts all
its keys in one slot:

    <key_prefix>{<tag>}:!used, ...:!meta, ...:<namespace><key hex>     (one slot per partition)

Tags are chosen so that partition p's slot falls in the p-th of `partitions` equal slot ranges: as the cluster
spreads slot ranges over its primaries, it spreads the partitions with them. Each partition is bounded by
max_bytes / partitions, so the tier as a whole stays within max_bytes; a partition keeps the chain invariant on
its own (its scripts are the single node's). A chain lives in one partition, picked by its `route` (the key of
its first `partition_tokens` tokens, `keys.chain_route`), which every engine computes alike: chains that share
those tokens share a partition, and a prefix shorter than them is copied into each partition that uses it.
The partition prefix does not hold the namespace: every namespace (model, rank) shares the partitions and their
bound, as on one node.

The slot map comes from redis-py's `RedisCluster` (CLUSTER SLOTS); the calls themselves are the single node's
pre-packed round trips, sent to the slot's primary on a pool and a circuit breaker per node. Topology changes:

- MOVED (a slot now served elsewhere: a reshard finished, a replica was promoted): the call is sent once more to
  the node the reply names, and the map is refreshed in the background.
- ASK (a slot in migration, the key already moved): reads follow it (`ASKING` + the read on the importing
  node). Writes and scripts never do: a put's new keys are asked away, so its MULTI aborts (FAILED, counted)
  and nothing is applied mid-migration; a script declares the partition's accounting keys, so it runs only on
  the node that holds all of them. Running either on the importing node would create keys the migration then
  collides with.
- A node that does not answer opens its breaker (its partitions miss and drop, counted) and the map is
  refreshed: once a replica is promoted, its partitions are served again, less the writes the old primary had
  not replicated. A shard lost with no replica leaves its partitions misses while the cluster still answers
  (`cluster-require-full-coverage no`; by default the cluster refuses every call until the shard is back).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import AskError, ClusterDownError, MovedError, RedisClusterException, TryAgainError

from kvtier.stores.breaker import BreakerState, CircuitBreaker
from kvtier.stores.redis import Chunks, Partition, RedisStore, _Skipped, connection_pool, exchange
from kvtier.stores.resp import Replies, command

_STALE = (MovedError, ClusterDownError, TryAgainError)  # the map is out of date, or the slot is moving
_REFRESH_MIN_S = 0.2  # a burst of redirects refreshes the map once


@dataclass(frozen=True)
class ClusterPartition(Partition):
    """A partition of the cluster's tier: its accounting and values live in `slot`."""

    slot: int = 0


@dataclass
class _Node:
    """One primary as the tier reaches it: its own connections and breaker, so that one node down is that
    node's partitions missing, not the whole tier."""

    pool: redis.BlockingConnectionPool
    breaker: CircuitBreaker


class RedisClusterStore(RedisStore):
    """The shared tier over a Redis Cluster; `url` names any node of it. Same batch API as `RedisStore`, with
    every call routed by its chain's `route` to one partition (module docstring)."""

    def __init__(self, url: str, namespace: str, payload_nbytes: int, max_bytes: int, partitions: int = 64,
                 key_prefix: str = "kvtier:", socket_timeout_s: float = 1.0, connect_timeout_s: float = 0.5,
                 pool_size: int = 16, breaker: CircuitBreaker | None = None, auth_key: bytes | None = None,
                 oom_cap_s: float = 600.0, **connection_kwargs: Any) -> None:
        """`breaker`: the thresholds each node's own breaker takes. Raises ValueError naming what is wrong when
        the seed cannot be reached, is not a cluster node, or the cluster does not serve every slot."""
        super().__init__(url, namespace, payload_nbytes, max_bytes, key_prefix, socket_timeout_s, connect_timeout_s,
                         pool_size, breaker, auth_key, oom_cap_s, **connection_kwargs)
        share = max_bytes // partitions
        if share < self.value_nbytes:
            raise ValueError(f"partitions ({partitions}): max_bytes / partitions = {share} bytes holds no block of "
                             f"{self.value_nbytes} bytes; use fewer partitions or a larger max_bytes")
        self._url, self._pool_size = url, pool_size
        self._timeouts = (socket_timeout_s, connect_timeout_s)
        self._connection_kwargs = connection_kwargs
        self.partitions = [ClusterPartition(key_prefix.encode() + b"{" + tag + b"}:", share, slot)
                           for tag, slot in partition_tags(partitions)]
        self._cluster = _topology(url, socket_timeout_s, connect_timeout_s, self._connection_kwargs)
        self._owners: list[str] = []  # slot -> the name (host:port) of its primary
        self._nodes: dict[str, _Node] = {}
        self._retired = Counter[str]()  # the breaker counts of nodes let go
        self._nodes_lock = threading.Lock()
        self._refreshed, self._refreshing = 0.0, threading.Lock()
        self._stale = threading.Event()
        self._closed = threading.Event()
        self._take_map()
        uncovered = [s for s, owner in enumerate(self._owners) if not owner]
        if uncovered:
            self.close()
            raise ValueError(f"url: the cluster at {urlsplit(url).hostname}:{urlsplit(url).port} serves no node for "
                             f"{len(uncovered)} of {REDIS_CLUSTER_HASH_SLOTS} slots (first: {uncovered[0]}): a "
                             "shard is down or the cluster is not fully set up")
        self._refresher = threading.Thread(target=self._refresh_loop, name="kvtier-redis-cluster-map", daemon=True)
        self._refresher.start()

    def cluster_enabled(self) -> bool:
        return True

    # -- where a chain lives -----------------------------------------------------------------------------

    def _where(self, route: bytes | None) -> ClusterPartition:
        if route is None:
            raise ValueError("a clustered redis tier needs each call's route (keys.chain_route of its chain)")
        digest = hashlib.blake2b(route, digest_size=8, person=b"kvtier-part").digest()
        return self.partitions[int.from_bytes(digest, "big") % len(self.partitions)]

    def owner(self, part: ClusterPartition) -> str:
        """host:port of the primary that serves a partition, as the map has it now."""
        return self._owners[part.slot]

    # -- the round trips, routed ----------------------------------------------------------------------

    def _exchange(self, part: Partition, chunks: Chunks, read: int | Callable[[Any], list[Any]]) -> list[Any]:
        """A call sent to its partition's primary; once more to the node a MOVED names (the map is refreshed in
        the background); `_Skipped` when that node is down or its breaker open (the map is refreshed too)."""
        assert isinstance(part, ClusterPartition)
        name = self._owners[part.slot]
        if not name:  # no node serves the slot (a shard lost with its replicas): a miss, as for a node down
            self._stale.set()
            raise _Skipped(by_breaker=True)
        for attempt in range(2):
            try:
                replies = exchange(*self._node(name), chunks(), read)
            except _Skipped:
                self._stale.set()
                raise
            moved = _first(replies, _STALE)
            if moved is None:
                return replies
            self._stale.set()
            self._count("redirects")
            if attempt or not isinstance(moved, MovedError):
                return replies  # TRYAGAIN, CLUSTERDOWN, or moved twice: the caller sees the error replies
            name = f"{moved.host}:{moved.port}"
            self._owners[part.slot] = name
        return replies

    def _exists(self, part: Partition, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        replies = self._exchange(part, lambda: [b"".join(command(b"EXISTS", part.prefix + self._id(k)) for k in keys)],
                                 len(keys))
        asked = _asked(replies)
        if asked:  # in migration: those keys are asked of the importing node
            target = replies[asked[0]]
            got = self._asking(target, [part.prefix + self._id(keys[i]) for i in asked], b"EXISTS", len(asked))
            for i, r in zip(asked, got):
                replies[i] = r
        return [r == 1 for r in replies]

    def _values(self, part: Partition, keys: Sequence[bytes], headers: Sequence[memoryview],
                outs: Sequence[memoryview]) -> list[Any]:
        replies = super()._values(part, keys, headers, outs)
        asked = _asked(replies)
        if asked:  # in migration: read those values off the importing node (no touch: it is the source's job)
            target = replies[asked[0]]

            def read(conn: Any) -> list[Any]:
                got = Replies(conn._sock)
                out = []
                for i in asked:
                    got.skip()  # ASKING's +OK
                    out.append(got.bulk_into(headers[i], outs[i]))
                return out

            for i, r in zip(asked, self._asking(target, [part.prefix + self._id(keys[i]) for i in asked], b"GET",
                                                read)):
                replies[i] = r
        return replies

    def _asking(self, target: AskError, names: list[bytes], verb: bytes,
                read: int | Callable[[Any], list[Any]]) -> list[Any]:
        """`verb` of each key on the node an ASK names, each behind its ASKING; misses if that node is away."""
        self._count("asks", len(names))
        packed = [b"".join(command(b"ASKING") + command(verb, n) for n in names)]
        try:
            replies = exchange(*self._node(f"{target.host}:{target.port}"), packed,
                               read if callable(read) else 2 * read)
        except _Skipped:
            return [None] * len(names)
        return replies if callable(read) else replies[1::2]

    # -- accounting over all partitions ----------------------------------------------------------------

    def used_bytes(self) -> int | None:
        """Bytes of the partitions whose nodes answer (what max_bytes bounds: a lost shard's bytes leave the
        count with it); None when none answers."""
        used = [u for u in (self._used(part) for part in self.partitions) if u is not None]
        return sum(used) if used else None

    def capacity_bytes(self) -> int:
        return sum(self._capacity(part) for part in self.partitions)

    def stats(self) -> dict[str, Any]:
        """The store's counters, and the breakers of the nodes that serve partitions now together: the worst
        state, the summed counts (`nodes`: how many)."""
        counts = super().stats()
        with self._nodes_lock:
            breakers = [node.breaker.stats() for node in self._nodes.values()]
            retired = dict(self._retired)
        order = [BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN]
        worst = max((b.state for b in breakers), key=order.index, default=BreakerState.CLOSED)
        counts.update({f"breaker_{n}": retired.get(n, 0) + sum(getattr(b, n) for b in breakers)
                       for n in ("opens", "closes", "failures", "rejected")})
        counts.update(breaker_state=worst.value, nodes=len(breakers))
        return counts

    def close(self) -> None:
        self._closed.set()
        self._stale.set()
        with self._nodes_lock:
            for node in self._nodes.values():
                node.pool.disconnect()
            self._nodes.clear()
        self._cluster.close()
        super().close()

    # -- the map -------------------------------------------------------------------------------------------

    def _node(self, name: str) -> tuple[redis.BlockingConnectionPool, CircuitBreaker]:
        with self._nodes_lock:
            node = self._nodes.get(name)
            if node is None:
                host, _, port = name.rpartition(":")
                parts = urlsplit(self._url)
                netloc = (parts.netloc.rpartition("@")[0] + "@" if "@" in parts.netloc else "") + f"{host}:{port}"
                pool = connection_pool(urlunsplit((parts.scheme, netloc, "", "", "")), self._pool_size,
                                       *self._timeouts, self._connection_kwargs)
                node = self._nodes[name] = _Node(pool, CircuitBreaker(self.breaker.failure_threshold,
                                                                      self.breaker.cooldown_s))
            return node.pool, node.breaker

    def _take_map(self) -> None:
        """The slot map redis-py's client holds now: each slot's primary (empty where none serves it). Nodes
        that serve no partition any more (a dead primary, one whose slots moved away) are let go."""
        cache = self._cluster.nodes_manager.slots_cache
        self._owners = [cache[s][0].name if cache.get(s) else "" for s in range(REDIS_CLUSTER_HASH_SLOTS)]
        serving = {self._owners[p.slot] for p in self.partitions}
        with self._nodes_lock:
            for name in [n for n in self._nodes if n not in serving]:
                node = self._nodes.pop(name)
                node.pool.disconnect()
                b = node.breaker.stats()  # its counts stay in the totals
                self._retired.update(opens=b.opens, closes=b.closes, failures=b.failures, rejected=b.rejected)

    def refresh(self) -> bool:
        """Ask the cluster for its slot map now (CLUSTER SLOTS); False when no node answered."""
        with self._refreshing:
            self._refreshed = time.monotonic()
            try:
                self._cluster.nodes_manager.initialize()
            except (RedisClusterException, redis.RedisError, OSError):
                return False
            self._take_map()
            self._count("map_refreshes")
            return True

    def _refresh_loop(self) -> None:
        """Refreshes the map whenever a call saw it stale, at most every `_REFRESH_MIN_S`, off the callers'
        threads (a refresh against a cluster that is down waits out its connect timeouts)."""
        while not self._closed.is_set():
            self._stale.wait()
            if self._closed.is_set():
                return
            self._stale.clear()
            time.sleep(max(0.0, self._refreshed + _REFRESH_MIN_S - time.monotonic()))
            self.refresh()


def partition_tags(partitions: int) -> list[tuple[bytes, int]]:
    """(hash tag, slot) per partition: partition p's slot lies in the p-th of `partitions` equal slot ranges."""
    found: dict[int, tuple[bytes, int]] = {}
    n = 0
    while len(found) < partitions:
        tag = b"%d" % n
        slot = key_slot(b"{" + tag + b"}")
        found.setdefault(slot * partitions // REDIS_CLUSTER_HASH_SLOTS, (tag, slot))
        n += 1
    return [found[p] for p in range(partitions)]


def _topology(url: str, socket_timeout_s: float, connect_timeout_s: float, kwargs: dict[str, Any]) -> RedisCluster:
    """redis-py's cluster client, for the slot map only; a seed that is away or not a cluster node is a
    ValueError naming the field."""
    try:
        return RedisCluster.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
                                     require_full_coverage=False, **kwargs)
    except RedisClusterException as e:
        where = f"{urlsplit(url).hostname}:{urlsplit(url).port}"
        if "not enabled" in str(e):
            raise ValueError(f"cluster: true, but the node at {where} (url) is not a Redis Cluster node "
                             "(cluster_enabled:0); set cluster: false for a single Redis") from None
        raise ValueError(f"url: no node of a Redis Cluster answers at {where}: {e}") from None
    except (redis.RedisError, OSError) as e:
        raise ValueError(f"url: no node of a Redis Cluster answers at {urlsplit(url).hostname}:"
                         f"{urlsplit(url).port}: {e}") from None


def _asked(replies: list[Any]) -> list[int]:
    """Where the replies are ASK redirects (a key of a slot in migration, already moved); MOVED is not one."""
    return [i for i, r in enumerate(replies) if isinstance(r, AskError) and not isinstance(r, MovedError)]


def _first(replies: list[Any], kinds: tuple[type, ...]) -> Any:
    """The first reply (or reply inside an EXEC's) of one of `kinds`, or None."""
    for r in replies:
        if isinstance(r, kinds):
            return r
        if isinstance(r, list):
            inner = _first(r, kinds)
            if inner is not None:
                return inner
    return None
