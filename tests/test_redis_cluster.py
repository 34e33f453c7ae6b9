"""The shared tier on a real Redis Cluster (six loopback redis-server nodes, three primaries with a replica each):
exact bytes, partitions over every primary, each partition's bound and chain invariant, and the drills of a
topology that changes under a running workload: a primary killed, slots resharded, a node added, one shard
full, the whole cluster down. Every drill: no call raises, none blocks past the tier's timeouts, no wrong block is
served, and every partition's accounting is exact and within its bound afterwards."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.config import ConfigError, parse_config
from kvtier.keys import chain_route
from kvtier.stores import blockformat
from kvtier.stores.base import PutStatus, ReadStatus
from kvtier.stores.breaker import BreakerState, CircuitBreaker
from kvtier.stores.redis_cluster import ClusterPartition, RedisClusterStore, partition_tags
from kvtier.wiring import redis_store
from tests.conftest import PUBLIC_TRACES
from tests.test_redis import NS, PAYLOAD, chain, check_accounting, items_of, payloads

VALUE = blockformat.HEADER_NBYTES + PAYLOAD
TIMEOUT_S = 0.3
ROUTE_BLOCKS = 2


def make_store(url: str, blocks_per_partition: int = 16, partitions: int = 12, **kw) -> RedisClusterStore:
    kw.setdefault("breaker", CircuitBreaker(failure_threshold=2, cooldown_s=0.2))
    return RedisClusterStore(url, NS, PAYLOAD, blocks_per_partition * VALUE * partitions, partitions,
                             socket_timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S, **kw)


def node_client(name: str) -> redis.Redis:
    host, _, port = name.rpartition(":")
    return redis.Redis(host=host, port=int(port), socket_timeout=2)


def check_partitions(store: RedisClusterStore) -> int:
    """Every partition's accounting is exact and within its share, read on the node that owns it now; the bytes
    of all partitions together (what the tier's max_bytes bounds)."""
    store.refresh()
    total = 0
    for part in store.partitions:
        with node_client(store.owner(part)) as c:
            check_accounting(c, part.prefix.decode(), part.max_bytes)
            total += int(c.get(part.prefix + b"!used") or 0)
    assert total <= store.max_bytes
    return total


class Workload:
    """Threads that store and read back chains of many routes, checking every byte they are served, until
    stopped; what a drill runs under."""

    def __init__(self, store: RedisClusterStore, threads: int = 3, chains: int = 24) -> None:
        self.store, self.data = store, payloads(4, seed=7)
        self.chains = [chain(4, f"w{i}") for i in range(chains)]
        self.worst, self.wrong, self.ok, self.errors = 0.0, 0, 0, []
        self.puts: dict[PutStatus, int] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(t,), daemon=True) for t in range(threads)]

    def __enter__(self) -> Workload:
        for t in self._threads:
            t.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self, seed: int) -> None:
        i = seed
        while not self._stop.is_set():  # half the calls store a new chain: puts go on through the drill
            keys = self.chains[i % len(self.chains)] if i % 2 else chain(4, f"n{seed}-{i}")
            route = chain_route(keys, ROUTE_BLOCKS)
            out = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in keys]
            try:
                start = time.monotonic()
                for s in self.store.put_chain(items_of(keys, self.data), set(), route):
                    self.puts[s] = self.puts.get(s, 0) + 1
                statuses = self.store.get_many(keys, out, route)
                self.store.lookup(keys, route)
                self.worst = max(self.worst, time.monotonic() - start)
            except Exception as e:  # the test is that there are none
                self.errors.append(e)
                return
            self.wrong += sum(s is ReadStatus.OK and not torch.equal(o, d) for s, o, d in zip(statuses, out, self.data))
            self.ok += sum(s is ReadStatus.OK for s in statuses)
            i += 1

    def check(self) -> None:
        assert not self.errors, self.errors[:3]
        assert self.wrong == 0, "a wrong block was served"
        assert self.ok > 0
        # a call is a few round trips (EXISTS, the put, the reads, a redirect each): each within the timeouts
        assert self.worst < 8 * (2 * TIMEOUT_S) + 1.0, f"a call took {self.worst:.2f} s"


def wait_failover(cluster, port: int, timeout_s: float = 30) -> None:
    """Until the cluster's slot map names no slot of the dead primary at `port` (its replica took them)."""
    live = next(n for n in cluster.nodes if n.port != port and n.proc is not None)
    deadline = time.monotonic() + timeout_s
    while True:
        with live.client() as c:
            slots = c.execute_command("CLUSTER", "SLOTS")
        if all(int(r[2][1]) != port for r in slots) and len(slots) >= 3:
            cluster.wait_ok(timeout_s)
            return
        assert time.monotonic() < deadline, "no replica was promoted"
        time.sleep(0.1)


def written_everywhere(store: RedisClusterStore, tag: str) -> None:
    """Every partition takes a new chain again and serves it back bit for bit (the drill is over)."""
    data = payloads(2, seed=3)
    covered: set[int] = set()
    deadline = time.monotonic() + 20
    i = 0
    while len(covered) < len(store.partitions):
        keys = chain(2, f"{tag}{i}")
        route = chain_route(keys, ROUTE_BLOCKS)
        part = store.partitions.index(store._where(route))
        i += 1
        if part in covered:
            continue
        statuses = store.put_chain(items_of(keys, data), set(), route)
        out = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in keys]
        if statuses == [PutStatus.STORED] * 2 and store.get_many(keys, out, route) == [ReadStatus.OK] * 2:
            assert all(torch.equal(o, d) for o, d in zip(out, data))
            covered.add(part)
        assert time.monotonic() < deadline, f"partitions {set(range(len(store.partitions))) - covered} never took a put"


# -- layout -------------------------------------------------------------------------------------------


def test_chains_round_trip_bit_identically_and_partitions_cover_every_primary(redis_cluster):
    store = make_store(redis_cluster.seed_url)
    primaries = {store.owner(p) for p in store.partitions}
    assert len(primaries) == 3, "partitions spread over every primary"
    assert len({p.slot for p in store.partitions}) == len(store.partitions)
    data = payloads(4)
    for i in range(12):
        keys = chain(4, f"c{i}")
        route = chain_route(keys, ROUTE_BLOCKS)
        assert store.put_chain(items_of(keys, data), set(), route) == [PutStatus.STORED] * 4
        out = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in keys]
        assert store.get_many(keys, out, route) == [ReadStatus.OK] * 4
        assert all(torch.equal(o, d) for o, d in zip(out, data))
        assert store.lookup(keys, route) == 4
        elsewhere = next(r for r in (chain(1, f"x{j}")[0] for j in range(99))
                         if store._where(r) is not store._where(route))
        assert store.lookup(keys, elsewhere) == 0, "a chain lives in one partition"
        # its blocks share its partition's slot, on the primary that owns it
        with node_client(store.owner(store._where(route))) as c:
            assert c.exists(store._where(route).prefix + store._id(keys[-1])) == 1
    assert store.used_bytes() == check_partitions(store) == 48 * VALUE
    assert store.capacity_bytes() == store.max_bytes
    store.close()


def test_partition_tags_fall_in_equal_slot_ranges():
    for n in (1, 3, 64, 1000):
        tags = partition_tags(n)
        assert [slot * n // 16384 for _, slot in tags] == list(range(n))


def test_each_partition_is_bounded_and_keeps_whole_chains_with_many_writers(redis_cluster):
    """Four writers store four times what the tier holds, over every partition: each partition's accounting is
    exact, within its share, and no block outlives its parent; evictions were counted."""
    stores = [make_store(redis_cluster.seed_url, blocks_per_partition=6, partitions=6) for _ in range(4)]
    data = payloads(4)

    def write(store: RedisClusterStore, w: int) -> None:
        for i in range(40):
            keys = chain(4, f"b{w}-{i}")
            store.put_chain(items_of(keys, data), set(), chain_route(keys, ROUTE_BLOCKS))

    threads = [threading.Thread(target=write, args=(s, w)) for w, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert check_partitions(stores[0]) <= stores[0].max_bytes
    assert sum(s.stats().get("evictions", 0) for s in stores) > 0
    for s in stores:
        s.close()


# -- configuration ------------------------------------------------------------------------------------


def test_bad_cluster_config_is_an_error_naming_the_field(redis_cluster, redis_server):
    tier = {"type": "redis", "max_bytes": 1 << 24, "trusted_network": True, "cluster": True,
            "connect_timeout_s": 0.3, "socket_timeout_s": 0.3}

    def build(**fields):
        config = parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{**tier, **fields}]})
        return redis_store(config.secondary_tiers[0], NS, PAYLOAD)

    with pytest.raises(ValueError, match=r"cluster: true, but the node at 127.0.0.1:\d+ \(url\) is not a Redis"):
        build(url=redis_server.url)
    dead = redis_cluster.node()  # started, then stopped: nothing answers on its port
    dead.stop()
    with pytest.raises(ValueError, match=rf"url: no node of a Redis Cluster answers at 127.0.0.1:{dead.port}"):
        build(url=dead.url)
    with pytest.raises(ValueError, match=r"partitions \(64\): max_bytes / partitions"):
        build(url=redis_cluster.seed_url, max_bytes=8 * VALUE)
    with pytest.raises(ConfigError, match="key_prefix"):
        build(url=redis_cluster.seed_url, key_prefix="a{b}:")
    with pytest.raises(ConfigError, match="unix socket"):
        build(url="unix:///tmp/redis.sock")
    store = build(url=redis_cluster.seed_url)
    assert isinstance(store, RedisClusterStore) and len(store.partitions) == 64
    store.close()
    # a shard whose slots nobody serves: the cluster is not whole, and the tier says so at startup
    with redis_cluster.nodes[0].client() as c:
        c.execute_command("CLUSTER", "DELSLOTSRANGE", "0", "99")
    with pytest.raises(ValueError, match=r"url: the cluster at 127.0.0.1:\d+ serves no node for 100 of 16384 slots"):
        build(url=redis_cluster.seed_url)


# -- drills under a running workload --------------------------------------------------------------------


def test_a_primary_killed_under_load_costs_only_its_writes_in_flight(redis_cluster):
    store = make_store(redis_cluster.seed_url)
    victim = store.owner(store.partitions[0])
    node = next(n for n in redis_cluster.nodes if f"127.0.0.1:{n.port}" == victim)
    with Workload(store) as load:
        node.kill()
        wait_failover(redis_cluster, node.port)
        time.sleep(1.0)
    load.check()
    assert store.owner(store.partitions[0]) != victim, "the map follows the promoted replica"
    stats = store.stats()
    lost = load.puts.get(PutStatus.FAILED, 0) + load.puts.get(PutStatus.DROPPED, 0)
    assert lost > 0 and stats["breaker_opens"] >= 1, "the writes the dead primary missed are counted"
    written_everywhere(store, "after-kill")
    check_partitions(store)
    store.close()


def test_slots_resharded_and_a_node_added_under_load(redis_cluster):
    """`redis-cli --cluster reshard` moves slots between primaries while engines read and write: MOVED and ASK
    are followed, puts into a slot in migration fail (counted) and are never half-applied. Then a fourth primary
    joins and takes slots: the partitions in them are served from it."""
    store = make_store(redis_cluster.seed_url)
    owners = {store.owner(p) for p in store.partitions}
    source, target = sorted(owners)[:2]
    ids = {name: redis_cluster.cli("-h", "127.0.0.1", "-p", name.split(":")[1], "cluster", "myid").strip()
           for name in owners}
    with Workload(store) as load:
        redis_cluster.cli("--cluster", "reshard", source, "--cluster-from", ids[source], "--cluster-to", ids[target],
                          "--cluster-slots", "3000", "--cluster-yes", "--cluster-pipeline", "2")
        redis_cluster.wait_agreed()
        new = redis_cluster.node()
        redis_cluster.cli("--cluster", "add-node", f"127.0.0.1:{new.port}", source)
        redis_cluster.wait_ok(30)
        redis_cluster.wait_agreed()
        new_id = redis_cluster.cli("-h", "127.0.0.1", "-p", str(new.port), "cluster", "myid").strip()
        redis_cluster.cli("--cluster", "reshard", target, "--cluster-from", ids[target], "--cluster-to", new_id,
                          "--cluster-slots", "4000", "--cluster-yes", "--cluster-pipeline", "2")
        redis_cluster.wait_ok(30)
        time.sleep(1.0)
    load.check()
    assert store.stats().get("redirects", 0) > 0, "the workload met the moved slots"
    store.refresh()
    assert f"127.0.0.1:{new.port}" in {store.owner(p) for p in store.partitions}, "the new node took partitions"
    written_everywhere(store, "after-reshard")
    check_partitions(store)
    store.close()


def test_one_shard_full_lowers_only_its_partitions_caps(redis_cluster):
    """One primary's maxmemory is far below what its partitions may hold: its puts are refused for memory
    (counted), the partitions there lower their own caps and fit; the other primaries' partitions keep theirs."""
    store = make_store(redis_cluster.seed_url, blocks_per_partition=48, partitions=6)
    small = store.owner(store.partitions[0])
    with node_client(small) as c:
        used = int(c.info("memory")["used_memory"])
        c.config_set("maxmemory", str(used + 24 * VALUE))
        c.config_set("maxmemory-policy", "noeviction")
    with Workload(store, chains=60) as load:
        time.sleep(3)
    load.check()
    stats = store.stats()
    assert stats.get("oom_refused", 0) > 0 and stats.get("oom_reclaims", 0) > 0
    caps = {p.slot: store._capacity(p) for p in store.partitions}
    assert all(caps[p.slot] < p.max_bytes for p in store.partitions if store.owner(p) == small)
    assert all(caps[p.slot] == p.max_bytes for p in store.partitions if store.owner(p) != small)
    check_partitions(store)
    store.close()


def test_the_whole_cluster_down_opens_the_breakers_and_calls_stay_statuses(redis_cluster):
    store = make_store(redis_cluster.seed_url)
    data = payloads(4)
    keys = chain(4, "d")
    route = chain_route(keys, ROUTE_BLOCKS)
    assert store.put_chain(items_of(keys, data), set(), route) == [PutStatus.STORED] * 4
    redis_cluster.stop()
    start = time.monotonic()
    for _ in range(20):
        out = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in keys]
        assert store.get_many(keys, out, route) == [ReadStatus.MISSING] * 4
        assert store.lookup(keys, route) == 0
        assert all(s in (PutStatus.DROPPED, PutStatus.FAILED)
                   for s in store.put_chain(items_of(chain(4, "e"), data), set(), route))
    assert time.monotonic() - start < 20 * 0.2 + 10 * TIMEOUT_S, "an open breaker answers at once"
    assert store.stats()["breaker_state"] == BreakerState.OPEN.value
    assert store.used_bytes() is None
    store.close()


# -- a random walk against the cluster ------------------------------------------------------------------


class ClusterStoreMachine(RuleBasedStateMachine):
    """Random puts, reads, lookups and deletes of chains over several routes against one small cluster tier:
    every OK read is exactly the bytes last stored under its key, a lookup's prefix reads back whole, and every
    partition's accounting is exact and within its share after each step."""

    cluster = None  # set by the test: one cluster for every example

    @initialize()
    def setup(self) -> None:
        self.store = make_store(self.cluster.seed_url, blocks_per_partition=5, partitions=3,
                                key_prefix=f"m{id(self)}:")
        self.data = {}

    def teardown(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            for part in store.partitions:
                with node_client(store.owner(part)) as c:
                    for k in c.keys(part.prefix + b"*"):
                        c.delete(k)
            store.close()

    @rule(tag=st.integers(0, 5), n=st.integers(1, 4), seed=st.integers(0, 3))
    def put(self, tag: int, n: int, seed: int) -> None:
        keys, data = chain(n, f"h{tag}"), payloads(n, seed)
        statuses = self.store.put_chain(items_of(keys, data), set(), chain_route(chain(4, f"h{tag}"), ROUTE_BLOCKS))
        for k, d, s in zip(keys, data, statuses):
            if s is PutStatus.STORED:
                self.data[k] = d

    @rule(tag=st.integers(0, 5))
    def read(self, tag: int) -> None:
        keys = chain(4, f"h{tag}")
        route = chain_route(keys, ROUTE_BLOCKS)
        n = self.store.lookup(keys, route)
        out = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in keys[:n]]
        statuses = self.store.get_many(keys[:n], out, route)
        assert statuses == [ReadStatus.OK] * n, "a looked-up prefix reads back whole"
        assert all(torch.equal(o, self.data[k]) for k, o in zip(keys, out))

    @precondition(lambda self: bool(getattr(self, "data", None)))
    @rule(tag=st.integers(0, 5), at=st.integers(0, 3))
    def delete(self, tag: int, at: int) -> None:
        keys = chain(4, f"h{tag}")
        self.store.delete_many([keys[at]], chain_route(keys, ROUTE_BLOCKS))

    @invariant()
    def accounting(self) -> None:
        if hasattr(self, "store"):
            for part in self.store.partitions:
                assert isinstance(part, ClusterPartition)
                with node_client(self.store.owner(part)) as c:
                    check_accounting(c, part.prefix.decode(), part.max_bytes)


def test_random_walk_against_the_cluster(redis_cluster):
    ClusterStoreMachine.cluster = redis_cluster
    machine = ClusterStoreMachine.TestCase
    machine.settings = settings(max_examples=15, stateful_step_count=25, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    machine().runTest()


# -- the bench's figures --------------------------------------------------------------------------------


def test_bench_figures_on_the_cluster(redis_cluster, redis_server):
    """`kvtier bench --redis`'s cluster figures, small: both sides move the bytes, the trace's chains spread over
    every primary (routed by their first block alone, they would all land on one), and a lookup is timed on both."""
    from kvtier.bench.redis_cluster_tier import _lookups, _spread, _throughput

    figures = _throughput(redis_cluster.seed_url, 16, runs=1)
    assert figures["put_ratio"] > 0 and figures["get_ratio"] > 0
    spread = _spread(redis_cluster.seed_url, PUBLIC_TRACES / "mooncake" / "conversation_trace.jsonl", max_requests=300)
    assert spread["requests"] == 300 and len(spread["bytes_per_primary"]) == 3
    assert all(v > 0 for v in spread["bytes_per_primary"].values()) and 1.0 <= spread["bytes_max_over_mean"] < 1.5
    assert spread["copies"] >= 1.0
    lookups = _lookups(redis_cluster.seed_url, redis_server.url, rounds=1, calls=5)
    assert lookups["cluster_us"] > 0 and lookups["one_node_us"] > 0


def test_a_shard_lost_with_its_replica_makes_only_its_partitions_misses(redis_cluster):
    """A primary and its replica both gone, the cluster told to serve what it still covers
    (`cluster-require-full-coverage no`): that shard's partitions miss and drop, its bytes leave the count, and
    every other partition keeps serving its chains bit for bit."""
    for n in redis_cluster.nodes:
        with n.client() as c:
            c.config_set("cluster-require-full-coverage", "no")
    store = make_store(redis_cluster.seed_url)
    written_everywhere(store, "before")
    victim = store.owner(store.partitions[0])
    lost = [p for p in store.partitions if store.owner(p) == victim]
    held = store.used_bytes()
    primary = next(n for n in redis_cluster.nodes if f"127.0.0.1:{n.port}" == victim)
    with primary.client() as c:
        replica = int(c.info("replication")["slave0"]["port"])
    for n in redis_cluster.nodes:
        if n.port in (primary.port, replica):
            n.kill()
    live = next(n for n in redis_cluster.nodes if n.proc is not None)
    deadline = time.monotonic() + 30
    while True:  # until the others mark the shard failed and go on serving the rest
        with live.client() as c:
            nodes = c.execute_command("CLUSTER", "NODES").decode()
            state = c.execute_command("CLUSTER", "INFO").decode()
        line = next(x for x in nodes.splitlines() if f":{primary.port}@" in x)
        if "fail" in line.split()[2] and "cluster_state:ok" in state:
            break
        assert time.monotonic() < deadline, "the cluster never dropped the lost shard"
        time.sleep(0.1)
    written_everywhere_but = [p for p in store.partitions if p not in lost]
    data = payloads(2, seed=3)
    for i in range(200):
        keys = chain(2, f"after{i}")
        route = chain_route(keys, ROUTE_BLOCKS)
        statuses = store.put_chain(items_of(keys, data), set(), route)
        out = [torch.empty(PAYLOAD, dtype=torch.uint8) for _ in keys]
        got = store.get_many(keys, out, route)
        if store._where(route) in lost:
            assert statuses in ([PutStatus.DROPPED] * 2, [PutStatus.FAILED] * 2) and got == [ReadStatus.MISSING] * 2
        else:
            assert got == [ReadStatus.OK] * 2 and all(torch.equal(o, d) for o, d in zip(out, data))
    assert written_everywhere_but
    assert 0 < store.used_bytes() < held + 200 * 2 * VALUE
    for part in written_everywhere_but:
        with node_client(store.owner(part)) as c:
            check_accounting(c, part.prefix.decode(), part.max_bytes)
    store.close()
