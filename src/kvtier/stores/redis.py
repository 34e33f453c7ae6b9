"""The shared tier: blocks in Redis (or Valkey), read and written by many engines on many machines.

A value is blockformat's header followed by the payload (`RedisStore.value_nbytes`); key =
`key_prefix + namespace + key.hex()`. A value that is torn, flipped, of another namespace or of another key
is a miss (CORRUPT / FOREIGN), is removed, and is never served.

Capacity: kvtier's own accounting, kept *inside Redis* and changed only by Lua scripts, not Redis
`maxmemory`. Other engines add and remove blocks in the same Redis, so no engine's local count can be right;
a shared count updated atomically by every writer is. Redis' own eviction would also be blind to the prefix
tree (it samples keys, so it drops parents before their children and leaves orphans), would evict other
applications' keys too, and is often not ours to configure (managed Redis refuses CONFIG SET). So, under
`key_prefix`:

    !used            bytes of all committed values (header + payload), never above max_bytes (nor !cap)
    !cap             once Redis refused a put for memory: the lower bound the tier keeps for oom_cap_s (below)
    !reclaims        how many times the cap was set: puts refused together lower it once (below)
    !meta  hash      id -> "<value bytes> <parent id>"       (id = namespace + key hex)
    !tick  hash      id -> last use, from the shared !clock counter
    !leaves zset     blocks that have no child in the tier, by last use: the only eviction candidates
    !kids:<id> set   the children of a block that are in the tier

Eviction takes the least recently used *leaf*: a parent is evicted only after its last child left. A store
whose parent is not in the tier is refused (`ORPHAN`), and deleting a block deletes its descendants. So every
block in the tier has its whole prefix in the tier: the chain invariant holds for all engines together.

A put is one round trip: MULTI, SET of each value under a temporary name (the payload is sent straight from
the caller's tensor, never copied into one buffer with the header), then the commit script, EXEC. The script
evicts to make room, then renames the value into place or drops it. Inside MULTI no other client sees the
temporary values, so no observer ever sees more than max_bytes of values under the prefix. A read is one round
trip too (the GETs and the touch script), its values read off the socket straight into the caller's buffers
(`kvtier.stores.resp`).

Redis keeps each value in its allocator's next size class (1.25x a power-of-two payload) and needs room for a
put's temporary values before its commit evicts: give it a `maxmemory` of 1.35x the tiers' max_bytes, plus one put
per writer and a few MB, and `maxmemory-policy noeviction` (or `volatile-*`: our blocks have no TTL), so that it
never drops our blocks itself. A put Redis refuses for memory anyway is FAILED (`oom_refused`), and `RECLAIM`
makes what the tier held less one put its cap (`!cap`, for every engine) and evicts below it, so the next puts
fit (`oom_reclaims`). Puts refused together, from several writers, lower it once: each put reads `!reclaims` as
it is sent, and its refusal reclaims only if no other reclaim ran since. After `oom_cap_s` the cap expires and the
tier grows back (memory added to Redis is used; memory still short costs one refused put). Under an `allkeys-*`
policy Redis may drop values itself: reads of those miss, `lookup` stops at the first missing block, and the
count over-states until our own eviction reaches the entry. On a Redis Cluster the tier is cut into partitions,
each this accounting under its own hash tag (`kvtier.stores.redis_cluster`); a cluster node's url without
`cluster: true` is refused at startup (`cluster_enabled`).

Every call goes through a circuit breaker: with Redis down or slow, lookups return misses and stores are
dropped at once (counted), instead of costing a timeout each."""

from __future__ import annotations

import re
import secrets
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvtier.stores import blockformat
from kvtier.stores.base import PutStatus, ReadStatus
from kvtier.stores.breaker import CircuitBreaker
from kvtier.stores.buffers import Buffer, byte_view
from kvtier.stores.redis_scripts import COMMIT, DROP, RECLAIM, TOUCH
from kvtier.stores.resp import Replies, bulk, command, responses

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError)  # the server is not answering: breaker failures
_PENDING_TTL_MS = 600_000  # a temporary value left by a failed commit expires on its own
_ACCOUNTING = (b"!used", b"!clock", b"!meta", b"!tick", b"!leaves")  # what every script reads or writes
Chunks = Callable[[], Iterable[bytes | memoryview]]  # a call's bytes, made again if it is sent again (a redirect)


@dataclass(frozen=True)
class Partition:
    """One accounting of the tier (`!used`, `!meta`, ... and the values, under `prefix`) and its share of
    max_bytes: a single node's whole tier, or one partition of a cluster's (`kvtier.stores.redis_cluster`)."""

    prefix: bytes
    max_bytes: int

    def script(self, body: bytes, *args: bytes) -> bytes:
        """EVAL of one of the tier's scripts on this partition, its accounting keys declared: a cluster routes the
        call by them, and runs it only where all of them are (not on either side of a slot in migration, unless
        all are still on its source). Every other key a script touches is under the same prefix: the same slot."""
        return command(b"EVAL", body, b"%d" % len(_ACCOUNTING), *(self.prefix + k for k in _ACCOUNTING),
                       self.prefix, *args)


class _Skipped(Exception):
    """Redis was not asked (the breaker is open) or did not answer (a failure the breaker counted)."""

    def __init__(self, by_breaker: bool) -> None:
        super().__init__("breaker open" if by_breaker else "redis unavailable")
        self.by_breaker = by_breaker


class NotStored(OSError):
    def __init__(self, status: PutStatus) -> None:
        super().__init__(f"block not stored in the redis tier: {status.value}")
        self.status = status


class RedisStore:
    """Blocks of one namespace in a Redis shared by many engines. Every method takes a batch and costs one
    round trip (a read that finds damaged values, two), and is safe to call from many mover threads at once:
    each call takes its own pooled connection."""

    def __init__(
        self,
        url: str,
        namespace: str,
        payload_nbytes: int,
        max_bytes: int,
        key_prefix: str = "kvtier:",
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.5,
        pool_size: int = 16,
        breaker: CircuitBreaker | None = None,
        auth_key: bytes | None = None,
        oom_cap_s: float = 600.0,
        **connection_kwargs: Any,
    ) -> None:
        """`connection_kwargs` go to redis-py's connection (ssl_ca_certs, ssl_certfile, ...); TLS and
        credentials can also come in the URL (rediss://user:password@host:port/db). `auth_key`: blocks are
        signed with it, and served only if signed with it (`blockformat.mac_of`)."""
        if not re.fullmatch(r"[0-9a-f]{32}", namespace):
            raise ValueError(f"namespace must be 32 lowercase hex chars (Namespace.digest()), got {namespace!r}")
        self.namespace, self.payload_nbytes, self.max_bytes = namespace, payload_nbytes, max_bytes
        self.value_nbytes = blockformat.HEADER_NBYTES + payload_nbytes
        if payload_nbytes <= 0 or max_bytes < self.value_nbytes:
            raise ValueError(f"max_bytes ({max_bytes}) holds no block of {self.value_nbytes} bytes")
        self.key_prefix = key_prefix
        self._ns = bytes.fromhex(namespace)
        self._auth = auth_key
        self._oom_cap_ms = b"%d" % max(1, round(oom_cap_s * 1000))
        self.breaker = breaker or CircuitBreaker()
        self._pool = connection_pool(url, pool_size, socket_timeout_s, connect_timeout_s, connection_kwargs)
        self._whole = Partition(key_prefix.encode(), max_bytes)
        self._counts, self._counts_lock = Counter[str](), threading.Lock()

    def cluster_enabled(self) -> bool | None:
        """Whether the server is a Redis Cluster node (`INFO cluster`); None when it does not answer (the breaker
        handles that later). On a cluster node the scripts' undeclared keys reach other nodes' slots: every put
        fails and every read misses, so the caller refuses the url at startup instead."""
        try:
            info = redis.Redis(connection_pool=self._pool).info("cluster")
        except (*_UNAVAILABLE, redis.exceptions.ResponseError):
            return None
        return bool(info.get("cluster_enabled"))

    @property
    def authenticated(self) -> bool:
        """Whether only blocks signed with this store's key are served (a block without the MAC is a miss)."""
        return self._auth is not None

    @property
    def footprint(self) -> int:
        """Bytes one block counts against max_bytes: its header and payload."""
        return self.value_nbytes

    def close(self) -> None:
        self._pool.disconnect()

    # -- names ------------------------------------------------------------------------------------------

    def _id(self, key: bytes) -> bytes:
        blockformat.check_key(key)
        return self.namespace.encode() + key.hex().encode()

    def _where(self, route: bytes | None) -> Partition:
        """The accounting a chain of this route lives in: on one node, the whole tier's."""
        return self._whole

    # -- the batch API the mover drives -----------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, bytes | None, Buffer]],
                 route: bytes | None = None) -> list[PutStatus]:
        """Store (key, parent, payload) blocks, parents before their children; one status per block.

        A payload is a CPU uint8 tensor (or buffer) of payload_nbytes; it is sent without being copied.
        `route`: what picks the chain's partition (`keys.chain_route`); one node has one.
        """
        if not items:
            return []
        part = self._where(route)
        token = secrets.token_hex(8).encode()
        views = [byte_view(payload, self.payload_nbytes, "payload") for _, _, payload in items]
        tmps = [part.prefix + b"!tmp:" + token + b":%d" % i for i in range(len(items))]
        commit_args = [b"%d" % part.max_bytes]
        for tmp, (key, parent, _) in zip(tmps, items):
            commit_args += [tmp, self._id(key), self._id(parent) if parent is not None else b""]

        def chunks() -> Iterator[bytes | memoryview]:
            """Each block's header is made (its checksum taken) just before it is sent, so that Redis reads one
            block while the next is hashed. RESP between two payloads goes out as one chunk: one send per gap."""
            small = command(b"GET", part.prefix + b"!reclaims") + command(b"MULTI")  # what a refusal saw: _reclaim
            for tmp, (key, parent, _), view in zip(tmps, items, views):
                header = bytearray(blockformat.HEADER_NBYTES)
                mac = blockformat.mac_of(self._auth, self._ns, key, parent, view) if self._auth else blockformat.NO_MAC
                blockformat.pack_header(header, self._ns, key, parent, self.payload_nbytes,
                                        blockformat.payload_checksum(view), mac)
                yield small + b"*5\r\n$3\r\nSET\r\n" + bulk(tmp) + b"$%d\r\n" % self.value_nbytes + header
                yield view
                small = b"\r\n" + bulk(b"PX") + bulk(b"%d" % _PENDING_TTL_MS)
            yield small + part.script(COMMIT, *commit_args) + command(b"EXEC")

        try:
            replies = self._exchange(part, chunks, len(items) + 4)
        except _Skipped as skipped:
            return self._count_all([PutStatus.DROPPED if skipped.by_breaker else PutStatus.FAILED] * len(items))
        executed = replies[-1]
        if not isinstance(executed, list) or not isinstance(executed[-1], list):  # EXECABORT: nothing applied
            if any(isinstance(r, OutOfMemoryError) for r in replies):
                seen = replies[0] if isinstance(replies[0], bytes) else b"0"
                self._reclaim(part, len(items) * self.value_nbytes, seen)
            return self._count_all([PutStatus.FAILED] * len(items))
        *statuses, evicted = executed[-1]
        self._count("evictions", int(evicted))
        return self._count_all([PutStatus(s.decode()) for s in statuses])

    def _reclaim(self, part: Partition, nbytes: int, seen: bytes = b"") -> None:
        """Redis refused a put of `nbytes` for memory (its maxmemory is below what max_bytes lets the tier hold):
        lower the tier's cap for every engine and free room below it (`RECLAIM`), so that the next puts fit.
        `seen`: the tier's reclaim count when the put was sent; if another refusal's reclaim ran since, that one
        answered this shortage and nothing more is lowered (`oom_refused` counts every refusal)."""
        self._count("oom_refused")
        try:
            (evicted,) = self._exchange(part, lambda: [part.script(RECLAIM, b"%d" % nbytes, b"%d" % self.value_nbytes,
                                                                     self._oom_cap_ms, seen)], 1)
        except _Skipped:
            return
        if isinstance(evicted, int) and evicted >= 0:
            self._count("oom_reclaims")
            self._count("evictions", evicted)

    def put_chain(self, items: Sequence[tuple[bytes, bytes | None, Buffer]], held: set[bytes],
                  route: bytes | None = None) -> list[PutStatus]:
        """Write-through of (key, parent, payload) blocks, parents first, sending only what is needed.

        One EXISTS round trip asks for the blocks and for those of their parents not in `held` (the keys the
        tier is known to hold, e.g. from an earlier batch of the same chain; updated here). Blocks the tier
        has are EXISTS and not sent; a block whose parent it lacks is ORPHAN and not sent (the commit would
        refuse it); the rest go in one `put_many`. With the breaker open nothing is sent: all DROPPED.
        """
        keys = [key for key, _, _ in items]
        mine = set(keys)
        parents = list(dict.fromkeys(parent for _, parent, _ in items
                                     if parent is not None and parent not in held and parent not in mine))
        part = self._where(route)
        try:
            present = self._exists(part, keys + parents)
        except _Skipped as skipped:  # don't send the bytes
            return self._count_all([PutStatus.DROPPED if skipped.by_breaker else PutStatus.FAILED] * len(items))
        held.update(k for k, p in zip(keys + parents, present) if p)
        statuses: list[PutStatus | None] = [PutStatus.EXISTS if key in held else None for key in keys]
        send: list[int] = []
        for i, (key, parent, _) in enumerate(items):
            if statuses[i] is not None:
                continue
            if parent is None or parent in held:
                send.append(i)
                held.add(key)  # for its children: the commit refuses them (ORPHAN) if this put fails
            else:
                statuses[i] = PutStatus.ORPHAN
        for i, status in zip(send, self.put_many([items[i] for i in send], route)):
            statuses[i] = status
            if not status.held:
                held.discard(items[i][0])
        return [s if s is not None else PutStatus.FAILED for s in statuses]

    def get_many(self, keys: Sequence[bytes], into_buffers: Sequence[Buffer],
                 route: bytes | None = None) -> list[ReadStatus]:
        """Read blocks into `into_buffers` (CPU uint8 tensors or writable buffers of payload_nbytes).

        Anything but OK leaves that buffer undefined. Hits are touched (LRU); a CORRUPT or FOREIGN value is
        removed together with its descendants: it can never be served.
        """
        if len(keys) != len(into_buffers):
            raise ValueError(f"{len(keys)} keys but {len(into_buffers)} buffers")
        if not keys:
            return []
        part = self._where(route)
        outs = [byte_view(b, self.payload_nbytes, "into", writable=True) for b in into_buffers]
        headers = [memoryview(bytearray(blockformat.HEADER_NBYTES)) for _ in keys]
        try:
            replies = self._values(part, keys, headers, outs)
        except _Skipped:
            self._count("get_skipped", len(keys))
            return [ReadStatus.MISSING] * len(keys)
        statuses = [self._judge(*args) for args in zip(keys, replies, headers, outs)]
        bad = [k for k, s in zip(keys, statuses) if s.is_integrity_failure]
        if bad:
            self._count("integrity_failures", len(bad))
            self.delete_many(bad, route)
        return self._count_all(statuses, "get")

    def _values(self, part: Partition, keys: Sequence[bytes], headers: Sequence[memoryview],
                outs: Sequence[memoryview]) -> list[Any]:
        """The GETs of `keys` and the touch of those held, in one round trip: each value's bytes straight into its
        header and buffer (`kvtier.stores.resp`); a reply per key as `Replies.bulk_into` gives it."""
        def chunks() -> list[bytes]:
            gets = [command(b"GET", part.prefix + self._id(k)) for k in keys]
            return [b"".join(gets) + part.script(TOUCH, *(self._id(k) for k in keys))]

        def read(conn: Any) -> list[Any]:
            replies = Replies(conn._sock)
            got = [replies.bulk_into(header, out) for header, out in zip(headers, outs)]
            replies.skip()
            return got

        return self._exchange(part, chunks, read)

    def _judge(self, key: bytes, got: bytes | Literal[True] | None, header: memoryview, out: memoryview) -> ReadStatus:
        """A GET's reply: True, a value of a block's size already in `header` and `out`; bytes, a value of another
        size; None, nil or an error. Only an OK read leaves bytes in `out`: what a bad value wrote is zeroed."""
        if got is None or isinstance(got, Exception):
            return ReadStatus.MISSING
        if got is True:
            status = self._verify(key, header, out, size_ok=True)
            if status is not ReadStatus.OK:
                np.frombuffer(out, dtype=np.uint8)[:] = 0
            return status
        value = memoryview(got)
        return self._verify(key, value[: blockformat.HEADER_NBYTES], value[blockformat.HEADER_NBYTES :],
                            size_ok=len(value) == self.value_nbytes)

    def _verify(self, key: bytes, header: memoryview, payload: memoryview, size_ok: bool) -> ReadStatus:
        parsed = blockformat.parse_header(header)
        status = blockformat.classify(parsed, self._ns, key.__eq__, self.payload_nbytes, size_ok)
        if status is not ReadStatus.OK:
            return status
        if parsed is None or not blockformat.payload_ok(parsed, payload):
            return ReadStatus.CORRUPT
        if not blockformat.authentic(parsed, payload, self._auth):
            return ReadStatus.UNAUTHENTICATED
        return ReadStatus.OK

    def exists_many(self, keys: Sequence[bytes], route: bytes | None = None) -> list[bool]:
        """Which blocks are in the tier now (another engine may add or evict them a moment later)."""
        try:
            return self._exists(self._where(route), keys)
        except _Skipped:
            self._count("exists_skipped", len(keys))
            return [False] * len(keys)

    def _exists(self, part: Partition, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        replies = self._exchange(part, lambda: [b"".join(command(b"EXISTS", part.prefix + self._id(k)) for k in keys)],
                                 len(keys))
        return [r == 1 for r in replies]

    def lookup(self, chain: Sequence[bytes], route: bytes | None = None) -> int:
        """How many leading blocks of a chain (parents first) the tier holds: the usable prefix."""
        found = self.exists_many(chain, route)
        return found.index(False) if False in found else len(found)

    def delete_many(self, keys: Sequence[bytes], route: bytes | None = None) -> int:
        """Remove blocks and all their descendants; returns how many blocks went."""
        if not keys:
            return 0
        part = self._where(route)
        try:
            (removed,) = self._exchange(part, lambda: [part.script(DROP, *(self._id(k) for k in keys))], 1)
        except _Skipped:
            removed = None
        if not isinstance(removed, int):
            self._count("delete_skipped", len(keys))
            return 0
        self._count("deleted", removed)
        return removed

    # -- single-block forms: the ObjectStore protocol, as DiskStore has it --------------------------------

    def write(self, key: bytes, parent: bytes | None, src: Buffer) -> None:
        """As DiskStore.write: returns when the tier has the block, raises OSError (with the PutStatus)
        when it does not, so the mover reports the step FAILED."""
        status = self.put_many([(key, parent, src)])[0]
        if not status.held:
            raise NotStored(status)

    def read(self, key: bytes, into: Buffer) -> ReadStatus:
        return self.get_many([key], [into])[0]

    def delete(self, key: bytes) -> bool:
        return self.delete_many([key]) > 0

    # -- accounting and health --------------------------------------------------------------------------

    def used_bytes(self) -> int | None:
        """Bytes of all engines' blocks under key_prefix (what max_bytes bounds); None if Redis is away."""
        return self._used(self._whole)

    def _used(self, part: Partition) -> int | None:
        try:
            (used,) = self._exchange(part, lambda: [command(b"GET", part.prefix + b"!used")], 1)
        except _Skipped:
            return None
        return int(used) if isinstance(used, bytes) else 0 if used is None else None

    def capacity_bytes(self) -> int:
        """max_bytes, or the lower cap `_reclaim` set while it holds; max_bytes if Redis is away."""
        return self._capacity(self._whole)

    def _capacity(self, part: Partition) -> int:
        try:
            (cap,) = self._exchange(part, lambda: [command(b"GET", part.prefix + b"!cap")], 1)
        except _Skipped:
            return part.max_bytes
        return min(part.max_bytes, int(cap)) if isinstance(cap, bytes) else part.max_bytes

    def stats(self) -> dict[str, Any]:
        """Plain counters for metrics: the breaker's and this store's (puts by status, gets by status, ...)."""
        b = self.breaker.stats()
        with self._counts_lock:
            counts = dict(self._counts)
        return {"breaker_state": b.state.value, "breaker_opens": b.opens, "breaker_closes": b.closes,
                "breaker_failures": b.failures, "breaker_rejected": b.rejected, **counts}

    # -- plumbing ---------------------------------------------------------------------------------------

    def _exchange(self, part: Partition, chunks: Chunks, read: int | Callable[[Any], list[Any]]) -> list[Any]:
        """Send a call's pre-packed commands (`chunks()`) where `part` lives and read its replies (`exchange`)."""
        return exchange(self._pool, self.breaker, chunks(), read)

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._counts_lock:
                self._counts[name] += n

    def _count_all(self, statuses: list, family: str = "put") -> list:
        """Count each status as `<family>_<status>` (put_stored, get_ok, get_corrupt, ...)."""
        with self._counts_lock:
            for s in statuses:
                self._counts[f"{family}_{s.value}"] += 1
        return statuses


def connection_pool(url: str, size: int, socket_timeout_s: float, connect_timeout_s: float,
                    connection_kwargs: dict[str, Any]) -> redis.BlockingConnectionPool:
    """Connections to one node, opened lazily, at most `size`; a call waits for one at most its own timeouts."""
    return redis.BlockingConnectionPool.from_url(
        url, max_connections=size, timeout=connect_timeout_s + socket_timeout_s, socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s, retry=Retry(NoBackoff(), 0), health_check_interval=0,
        **connection_kwargs,
    )


def exchange(pool: redis.BlockingConnectionPool, breaker: CircuitBreaker, chunks: Iterable[bytes | memoryview],
             read: int | Callable[[Any], list[Any]]) -> list[Any]:
    """Send pre-packed commands on one pooled connection, then read that many replies (`responses`), or what
    `read(connection)` reads, through the breaker. Raises _Skipped when the node was not tried or not answering."""
    if not breaker.allow():
        raise _Skipped(by_breaker=True)
    try:
        conn = pool.get_connection()
    except _UNAVAILABLE:
        breaker.failure()
        raise _Skipped(by_breaker=False) from None
    try:
        conn.send_packed_command(chunks, check_health=False)
        replies = responses(conn, read) if isinstance(read, int) else read(conn)
    except _UNAVAILABLE:
        conn.disconnect()
        breaker.failure()
        raise _Skipped(by_breaker=False) from None
    except BaseException:
        conn.disconnect()  # replies may be left unread: never hand this connection out again as it is
        raise
    finally:
        pool.release(conn)
    breaker.success()
    return replies
