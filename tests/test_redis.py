"""The shared tier against a real redis-server: exact bytes, integrity, the chain invariant, the bound, and
what happens when Redis dies, hangs or comes back."""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest
import torch

from kvtier.config import ConfigError, parse_config
from kvtier.stores import blockformat
from kvtier.stores.base import ReadStatus
from kvtier.stores.breaker import BreakerState, CircuitBreaker
from kvtier.stores.redis import PutStatus, RedisStore
from kvtier.wiring import redis_store
from tests.conftest import random_blocks, same_bytes
from tests.redis_server import RedisServer, stored_bytes

NS, OTHER_NS = "ab" * 16, "cd" * 16
PAYLOAD = 16 << 10


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def key_of(path: tuple) -> bytes:
    """A chained key, as vLLM's block hashes are: it names the block and its whole prefix."""
    return hashlib.blake2b(repr(path).encode(), digest_size=16).digest()


def chain(n: int, tag: str = "a") -> list[bytes]:
    return [key_of((tag, *range(i + 1))) for i in range(n)]


def items_of(keys: list[bytes], payloads: list[torch.Tensor]) -> list[tuple[bytes, bytes | None, torch.Tensor]]:
    return [(k, keys[i - 1] if i else None, p) for i, (k, p) in enumerate(zip(keys, payloads))]


def payloads(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PAYLOAD,), dtype=torch.uint8, generator=gen) for _ in range(n)]


def make_store(server: RedisServer, namespace: str = NS, blocks: int = 64, **kw) -> RedisStore:
    kw.setdefault("breaker", CircuitBreaker(failure_threshold=2, cooldown_s=0.2))
    value = blockformat.HEADER_NBYTES + PAYLOAD
    kw.setdefault("socket_timeout_s", 0.3)
    return RedisStore(server.url, namespace, PAYLOAD, blocks * value, connect_timeout_s=0.3, **kw)


def value_key(namespace: str, key: bytes) -> bytes:
    return b"kvtier:" + namespace.encode() + key.hex().encode()


# -- round trip and integrity ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_bit_identical(redis_server, dtype):
    blocks = random_blocks(4, dtype=dtype)
    nbytes = flat(blocks[0]).numel()
    store = RedisStore(redis_server.url, NS, nbytes, 1 << 20)
    keys = chain(4)
    assert store.put_many(items_of(keys, [flat(b) for b in blocks])) == [PutStatus.STORED] * 4
    out = [torch.empty_like(b) for b in blocks]
    assert store.get_many(keys, [flat(o) for o in out]) == [ReadStatus.OK] * 4
    assert all(same_bytes(a, b) for a, b in zip(out, blocks))
    buf = bytearray(nbytes)  # plain buffers work too
    assert store.read(keys[2], buf) is ReadStatus.OK and bytes(buf) == bytes(flat(blocks[2]).numpy())
    assert store.put_many(items_of(keys[:1], [flat(blocks[0])])) == [PutStatus.EXISTS]
    assert store.exists_many(keys + chain(1, "b")) == [True] * 4 + [False]
    assert store.lookup(keys + chain(2, "b")) == 4


def test_damaged_or_foreign_values_are_misses_and_removed(redis_server):
    store, other = make_store(redis_server), make_store(redis_server, OTHER_NS)
    client = redis_server.client()
    keys = chain(6)
    data = payloads(6)
    assert store.put_many(items_of(keys, data)) == [PutStatus.STORED] * 6
    good = client.get(value_key(NS, keys[0]))
    h = blockformat.HEADER_NBYTES

    flipped = bytes([data[5][100].item() ^ 0xFF])
    client.setrange(value_key(NS, keys[5]), h + 100, flipped)  # a payload byte
    client.setrange(value_key(NS, keys[4]), 15, b"\x00")  # a header byte (of the namespace: 0xab)
    client.set(value_key(NS, keys[3]), client.get(value_key(NS, keys[3]))[:-1])  # truncated payload
    client.set(value_key(NS, keys[2]), good[:100])  # truncated inside the header
    client.set(value_key(OTHER_NS, keys[0]), good)  # copied under another namespace
    client.set(value_key(NS, chain(1, "x")[0]), good)  # copied under another key

    into = [torch.zeros(PAYLOAD, dtype=torch.uint8) for _ in range(4)]
    statuses = store.get_many([keys[5], keys[4], keys[3], keys[2]], into)
    assert statuses == [ReadStatus.CORRUPT] * 4
    assert all(not t.any() for t in into), "nothing is served from a damaged value"
    assert other.read(keys[0], into[0]) is ReadStatus.FOREIGN
    assert store.read(chain(1, "x")[0], into[1]) is ReadStatus.FOREIGN
    # removed; and keys[2]'s removal took its (intact-looking) descendants with it: no orphans
    assert store.exists_many(keys) == [True, True, False, False, False, False]
    assert not client.exists(value_key(OTHER_NS, keys[0]), value_key(NS, chain(1, "x")[0]))
    assert store.read(keys[1], into[0]) is ReadStatus.OK and torch.equal(into[0], data[1])
    assert store.stats()["integrity_failures"] == 5
    check_invariants(client, store)



def test_reads_land_in_the_buffers_and_odd_replies_keep_the_connection_in_step(redis_server):
    """Reads take each value off the socket into its buffer (`kvtier.stores.resp`): a nil, an error reply in a
    GET's place (a key of another type) and a value of another size are misses, and the connection stays usable:
    the good blocks around them arrive whole, on the same single pooled connection."""
    store = make_store(redis_server, pool_size=1)
    client = redis_server.client()
    keys, data = chain(3), payloads(4, seed=3)
    alone = chain(1, "b")[0]  # a chain of its own: removing keys[2] (and its descendants) leaves it
    assert store.put_many(items_of(keys, data[:3]) + [(alone, None, data[3])]) == [PutStatus.STORED] * 4
    missing = chain(1, "never")[0]
    client.delete(value_key(NS, keys[1]))
    client.rpush(value_key(NS, keys[1]), b"not a string")  # GET answers -WRONGTYPE
    client.append(value_key(NS, keys[2]), b"longer")  # a value of another size
    for _ in range(2):  # the second round proves the connection is still in step
        into = [torch.zeros(PAYLOAD, dtype=torch.uint8) for _ in range(5)]
        statuses = store.get_many([keys[0], keys[1], missing, keys[2], alone], into)
        assert statuses[0] is ReadStatus.OK and same_bytes(into[0], data[0])
        assert statuses[1] is ReadStatus.MISSING and statuses[2] is ReadStatus.MISSING
        assert statuses[3] in (ReadStatus.CORRUPT, ReadStatus.MISSING)  # CORRUPT, then removed
        assert statuses[4] is ReadStatus.OK and same_bytes(into[4], data[3])
        assert not into[1].any() and not into[2].any() and not into[3].any()


# -- chain invariant and capacity -----------------------------------------------------------------------


def test_chain_invariant(redis_server):
    store = make_store(redis_server, blocks=4)
    a, b = chain(3, "a"), chain(2, "b")
    data = payloads(5)
    assert store.put_many([(a[1], a[0], data[0])]) == [PutStatus.ORPHAN]  # parent not in the tier
    assert store.put_many(items_of(a, data[:3])) == [PutStatus.STORED] * 3
    assert store.delete_many([a[1]]) == 2  # a block goes with its descendants
    assert store.exists_many(a) == [True, False, False]
    # a chain longer than the tier: deeper blocks would need their own ancestors evicted
    long = chain(6, "long")
    statuses = store.put_many(items_of(long, payloads(6)))
    assert statuses == [PutStatus.STORED] * 4 + [PutStatus.NO_ROOM, PutStatus.ORPHAN]
    assert store.exists_many(a) == [False] * 3, "evicted, leaves first"
    assert store.lookup(long) == 4
    # the least recently used leaf goes first; a parent only after its last child
    store.delete_many(long[:1])
    assert store.put_many(items_of(a, data[:3])) == [PutStatus.STORED] * 3
    assert store.put_many(items_of(b, data[3:])) == [PutStatus.STORED] * 2  # b[1] evicts a[2]
    assert store.exists_many(a + b) == [True, True, False, True, True]
    store.get_many(b, [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in b])  # b is now the most recent
    c = chain(2, "c")
    assert store.put_many(items_of(c, data[:2])) == [PutStatus.STORED] * 2  # evict a[1], then a[0] (a leaf now)
    assert store.exists_many(a + b + c) == [False] * 3 + [True] * 4
    check_invariants(redis_server.client(), store)


def test_bound_holds_with_many_engines_over_capacity(redis_server):
    """Three engines (two namespaces) store far more than the tier holds, with branching prefixes; a watcher
    sums the values in Redis atomically all along: never above max_bytes, and no block outlives its parent."""
    stores = [make_store(redis_server, ns, blocks=20) for ns in (NS, NS, OTHER_NS)]
    limit = stores[0].max_bytes
    client = redis_server.client()
    samples: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            samples.append(stored_bytes(client))
            time.sleep(0.002)

    def engine(store: RedisStore, seed: int) -> None:
        rng = random.Random(seed)
        data = payloads(8, seed)
        for _ in range(40):
            path = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 8)))
            keys = [key_of(path[: i + 1]) for i in range(len(path))]
            store.put_many(items_of(keys, data[: len(keys)]))
            found = store.lookup(keys)
            store.get_many(keys[:found], [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in range(found)])

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=engine, args=(s, i)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    stored = sum(s.stats().get("put_stored", 0) for s in stores)
    assert stored * stores[0].value_nbytes > 3 * limit, "the workload must be larger than the tier"
    assert samples and max(samples) <= limit
    assert sum(s.stats().get("evictions", 0) for s in stores) > 0
    check_invariants(client, stores[0])


def check_invariants(client, store: RedisStore) -> None:
    """What the scripts promise: the count is exact, every block's parent is in the tier, leaves are leaves."""
    check_accounting(client, store.key_prefix, store.max_bytes)


def check_accounting(client, p: str, max_bytes: int) -> None:
    """`check_invariants` of the accounting under prefix `p` (one node's tier, or one partition of a cluster's)."""
    meta = {k.decode(): v.decode().split(" ") for k, v in client.hgetall(p + "!meta").items()}
    values = {k.decode()[len(p) :] for k in client.keys(p + "*") if b"!" not in k}
    assert values == set(meta), "every value is accounted for and every entry has its value"
    assert int(client.get(p + "!used") or 0) == sum(int(size) for size, _ in meta.values())
    assert int(client.get(p + "!used") or 0) <= max_bytes
    parents = {parent for _, parent in meta.values() if parent}
    assert parents <= set(meta), "no block outlives its parent"
    leaves = {k.decode() for k in client.zrange(p + "!leaves", 0, -1)}
    assert leaves == set(meta) - parents
    assert not client.keys(p + "!tmp:*")


# -- failures -------------------------------------------------------------------------------------------


def test_kill_mid_workload_then_restart(redis_server):
    """Redis dies under load: no call raises or hangs past the timeouts, the breaker opens, nothing wrong is
    ever served; Redis comes back on the same port: the breaker closes and the tier works again."""
    store = make_store(redis_server)
    data = payloads(4)
    worst, served_wrong, errors, states = [0.0], [0], [], set()
    stop = threading.Event()

    def workload() -> None:
        i = 0
        while not stop.is_set():
            keys = chain(4, f"w{i % 8}")
            out = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in keys]
            try:
                start = time.monotonic()
                store.put_many(items_of(keys, data))
                statuses = store.get_many(keys, out)
                worst[0] = max(worst[0], time.monotonic() - start)
            except Exception as e:  # the test is that there are none
                errors.append(e)
                return
            served_wrong[0] += sum(s is ReadStatus.OK and not torch.equal(o, d) for s, o, d in zip(statuses, out, data))
            states.add(store.breaker.state)
            i += 1
            time.sleep(0.01)

    worker = threading.Thread(target=workload)
    worker.start()
    time.sleep(0.3)
    redis_server.kill()
    time.sleep(0.8)
    assert store.breaker.state is not BreakerState.CLOSED
    redis_server.start()  # same port, empty
    time.sleep(0.8)
    stop.set()
    worker.join()
    assert not errors and served_wrong[0] == 0
    assert worst[0] < 2 * (0.3 + 0.3) + 0.5, f"a call took {worst[0]:.2f} s"
    stats = store.stats()
    assert BreakerState.OPEN in states and store.breaker.state is BreakerState.CLOSED
    assert stats["breaker_opens"] >= 1 and stats["breaker_closes"] >= 1 and stats["breaker_rejected"] > 0
    assert stats.get("put_dropped", 0) > 0 and stats.get("get_skipped", 0) > 0
    assert store.put_many(items_of(chain(2, "after"), data[:2])) == [PutStatus.STORED] * 2
    check_invariants(redis_server.client(), store)


def test_hung_server_times_out_then_breaker_skips(redis_server):
    store = make_store(redis_server)
    keys, data = chain(2), payloads(2)
    assert store.put_many(items_of(keys, data)) == [PutStatus.STORED] * 2
    redis_server.pause()
    try:
        took = []
        for _ in range(4):
            start = time.monotonic()
            assert store.exists_many(keys) == [False, False]
            took.append(time.monotonic() - start)
        assert store.breaker.state is BreakerState.OPEN
        assert max(took[:2]) < 0.3 + 0.3 + 0.3, took  # a timeout each, no more
        assert max(took[2:]) < 0.05, took  # open: not even tried
    finally:
        redis_server.resume()
    time.sleep(0.25)
    assert store.exists_many(keys) == [True, True]
    assert store.breaker.state is BreakerState.CLOSED


def test_a_redis_smaller_than_max_bytes_refuses_one_put_then_the_tier_fits_itself_to_it(tmp_path, redis_server):
    """Redis keeps each value in its allocator's next size class (a power-of-two payload plus our header: 1.25x),
    so a maxmemory sized from max_bytes alone is reached before the tier's own bound. Redis then refuses a put
    (OOM): that put is FAILED, and the tier lowers its cap to what Redis held less one put, and evicts below it
    (RECLAIM). From then on every put fits. Before, every later put was refused and the tier stored nothing."""
    server = RedisServer(redis_server.binary, tmp_path / "small", extra=("--maxmemory", "3mb")).start()
    try:
        store = make_store(server, blocks=200)  # misconfigured: 200 values need about 4.2 MB of Redis memory
        client = server.client()
        data = payloads(8)
        chains = [chain(8, f"oom{i}") for i in range(30)]  # 240 blocks
        statuses = [store.put_many(items_of(keys, data)) for keys in chains]
        failed = [i for i, s in enumerate(statuses) if PutStatus.FAILED in s]
        assert failed, "Redis refused a put (the fault is there)"
        assert all(s == [PutStatus.STORED] * 8 for s in statuses[failed[-1] + 1 :]) and failed[-1] < 20, failed
        assert store.stats()["oom_reclaims"] == len(failed)
        assert all(s.count(PutStatus.FAILED) in (0, 8) for s in statuses)  # a refused put stores none of its blocks
        cap = int(client.get(store.key_prefix + "!cap"))
        assert store.value_nbytes <= int(client.get(store.key_prefix + "!used")) <= cap < store.max_bytes
        assert store.capacity_bytes() == cap  # what the metrics show as the tier's capacity
        assert store.breaker.state is BreakerState.CLOSED
        out = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in range(8)]
        assert store.get_many(chains[-1], out) == [ReadStatus.OK] * 8
        assert all(same_bytes(o, d) for o, d in zip(out, data))
        check_invariants(client, store)
        assert store.delete_many(chains[-1][:1]) == 8  # deleting still works
    finally:
        server.stop()


def test_puts_refused_together_lower_the_cap_once(redis_server):
    """Several writers (mover threads, ranks, engines) whose puts Redis refuses for memory at the same moment were
    refused for one shortage: the tier's cap goes down by one put, as for a single refusal. Before, each refusal
    reclaimed after the one before it (cap = used - put, then evict to cap - put), so k refusals lowered the cap by
    2k-1 puts and evicted 2k puts, for oom_cap_s, for every engine: 8 writers took a 48-block tier to 1 block."""
    writers = 8
    stores = [make_store(redis_server, blocks=200, socket_timeout_s=5.0) for _ in range(writers)]
    client = redis_server.client()
    data = payloads(8)
    for i in range(6):
        assert stores[0].put_many(items_of(chain(8, f"fill{i}"), data)) == [PutStatus.STORED] * 8
    used = int(client.get(stores[0].key_prefix + "!used"))
    assert all(s.used_bytes() == used for s in stores)  # every writer connected (a connection's setup waits for Redis)
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + 4096))  # full: no put fits
    redis_server.pause()  # every writer's put is sent before Redis reads any of them, as in a burst
    try:
        results: list[list[PutStatus]] = []
        puts = [items_of(chain(8, f"burst{n}"), data) for n in range(writers)]
        threads = [threading.Thread(target=lambda s=s, p=p: results.append(s.put_many(p)))
                   for s, p in zip(stores, puts)]
        for t in threads:
            t.start()
        time.sleep(0.5)
    finally:
        redis_server.resume()
    for t in threads:
        t.join()
    put = 8 * stores[0].value_nbytes
    refused = sum(r == [PutStatus.FAILED] * 8 for r in results)
    assert refused >= 2, "several puts were refused together (the fault is there)"
    assert sum(s.stats().get("oom_reclaims", 0) for s in stores) == 1
    assert int(client.get(stores[0].key_prefix + "!cap")) == used - put  # 41 blocks of 48; before: 1
    assert int(client.get(stores[0].key_prefix + "!used")) == used - 2 * put
    client.config_set("maxmemory", "0")
    assert stores[0].put_many(items_of(chain(8, "after"), data)) == [PutStatus.STORED] * 8
    check_invariants(client, stores[0])
    for s in stores:
        s.close()


def test_the_cap_a_full_redis_set_expires_so_the_tier_uses_memory_added_later(tmp_path, redis_server):
    """The cap holds `oom_cap_s`. Then the tier grows back towards max_bytes: with Redis still short of memory that
    costs one refused put, which sets the cap again; once memory was added, the tier fills it (past the old cap)
    without anyone deleting a key."""
    server = RedisServer(redis_server.binary, tmp_path / "small", extra=("--maxmemory", "3mb")).start()
    try:
        store = make_store(server, blocks=200, oom_cap_s=0.6)  # 200 values need about 4.2 MB of Redis memory
        client = server.client()
        data = payloads(8)

        def fill(tag: str, n: int) -> list[list[PutStatus]]:
            return [store.put_many(items_of(chain(8, f"{tag}{i}"), data)) for i in range(n)]

        def refused(statuses: list[list[PutStatus]]) -> int:
            return sum(PutStatus.FAILED in s for s in statuses)

        assert refused(fill("a", 20)) >= 1 and client.exists(store.key_prefix + "!cap")
        first_cap = store.capacity_bytes()
        assert first_cap < store.max_bytes and refused(fill("b", 10)) == 0  # under the cap: every put fits
        time.sleep(0.8)
        assert store.capacity_bytes() == store.max_bytes, "the cap expired"
        reclaims = store.stats()["oom_reclaims"]
        again = fill("c", 10)
        assert refused(again) >= 1 and all(s == [PutStatus.STORED] * 8 for s in again[-3:])  # short still: capped again
        assert store.capacity_bytes() < store.max_bytes and store.stats()["oom_reclaims"] == reclaims + refused(again)
        client.config_set("maxmemory", "64mb")  # memory added
        time.sleep(0.8)
        assert refused(fill("d", 30)) == 0
        assert int(client.get(store.key_prefix + "!used")) > first_cap + 8 * store.value_nbytes
        assert store.capacity_bytes() == store.max_bytes and not client.exists(store.key_prefix + "!cap")
        check_invariants(client, store)
    finally:
        server.stop()


# -- the breaker on its own -------------------------------------------------------------------------------


def test_breaker_states():
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=1.0, clock=lambda: now[0])
    assert breaker.allow()
    breaker.failure()
    breaker.success()  # a success resets the count: failures must be consecutive
    breaker.failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    now[0] = 1.0
    assert breaker.allow() and breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow(), "one probe at a time"
    breaker.failure()
    assert breaker.state is BreakerState.OPEN
    now[0] = 2.5
    assert breaker.allow()
    breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    stats = breaker.stats()
    assert (stats.opens, stats.closes, stats.failures, stats.rejected) == (2, 1, 4, 2)


# -- configuration --------------------------------------------------------------------------------------


def test_redis_tier_config(redis_server):
    tier = {"type": "redis", "url": redis_server.url, "max_bytes": 1 << 20, "key_prefix": "kvt:",
            "breaker_failures": 5, "oom_cap_s": 30, "trusted_network": True}  # a throwaway server on 127.0.0.1
    config = parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]})
    store = redis_store(config.secondary_tiers[0], NS, PAYLOAD)
    assert store.breaker.failure_threshold == 5 and store._oom_cap_ms == b"30000"
    store.write(chain(1)[0], None, payloads(1)[0])  # as DiskStore.write: returns once stored...
    with pytest.raises(OSError, match="orphan"):  # ...and raises OSError when not, so the mover sees FAILED
        store.write(chain(2, "z")[1], chain(2, "z")[0], payloads(1)[0])
    assert redis_server.client().exists(b"kvt:" + NS.encode() + chain(1)[0].hex().encode())
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.url: must start with redis://"):
        parse_config({"cpu_bytes_to_use": 1, "secondary_tiers": [{**tier, "url": "http://u:secret@h"}]})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.ssl_ca_certs: needs a rediss://"):
        parse_config({"cpu_bytes_to_use": 1, "secondary_tiers": [{**tier, "ssl_ca_certs": "/ca.pem"}]})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.oom_cap_s"):
        parse_config({"cpu_bytes_to_use": 1, "secondary_tiers": [{**tier, "oom_cap_s": 0}]})
    with pytest.raises(ConfigError) as err:
        parse_config({"cpu_bytes_to_use": 1, "secondary_tiers": [{**tier, "url": "redis://u:secret@h:0x"}]})
    assert "secret" not in str(err.value)
    tls = parse_config({"cpu_bytes_to_use": 1, "secondary_tiers": [
        {**tier, "url": "rediss://user:pw@cache:6380/0", "ssl_ca_certs": "/ca.pem"}]}).secondary_tiers[0]
    assert tls.connection_kwargs() == {"ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": "required"}


def test_a_cluster_node_is_refused_at_startup_naming_the_url(redis_cluster):
    """The single-node tier against a node of a real 6-node cluster: its scripts' undeclared keys would reach other
    nodes' slots (every put failed, every read missed, the breaker closed), so the tier is refused at startup, its
    url named without the password; a url that does not answer is not judged (the breaker's job)."""
    seed = redis_cluster.nodes[0]
    with seed.client() as c:
        assert c.info("cluster")["cluster_enabled"] == 1 and c.cluster("info")["cluster_state"] == "ok"
    with seed.client() as c:  # a password, to see it left out of the error
        c.config_set("requirepass", "secret")
    url = f"redis://default:secret@127.0.0.1:{seed.port}/0"
    tier = {"type": "redis", "url": url, "max_bytes": 1 << 20, "trusted_network": True}
    config = parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]})
    with pytest.raises(ValueError, match=rf"redis tier url redis://default:\*+@127.0.0.1:{seed.port}/0: a Redis "
                       "Cluster node") as err:
        redis_store(config.secondary_tiers[0], NS, PAYLOAD)
    assert "secret" not in str(err.value)
    seed.stop()
    down = parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}).secondary_tiers[0]
    store = redis_store(down, NS, PAYLOAD)  # not answering: built, and its calls are statuses
    assert store.cluster_enabled() is None and store.exists_many(chain(1)) == [False]
    store.close()


def test_bench_measures_both_sides(redis_server):
    from kvtier.bench.redis_tier import _one_size

    figures = _one_size(redis_server.url, 64 << 10, n_blocks=8, batch=4, runs=2)
    assert figures["put_ratio"] > 0 and figures["get_ratio"] > 0
