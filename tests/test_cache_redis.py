"""The shared tier in the data plane: TieredCaches ("engines", each with its own host tier) sharing one real
redis-server. What one stores the other loads bit for bit; damaged or foreign values are misses; Redis dying
and coming back costs no call an exception; the shared tier stays within max_bytes. Plus the directory's
shared-tier planning under the random-traffic state machine of test_directory."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvtier.admission import AdmissionRule
from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.directory import CALLER, Directory, Op, SharedSpec, Status, Step, TierSpec
from kvtier.keys import chain_keys, chain_route
from kvtier.sim.instant_mover import complete_instantly
from kvtier.stores import blockformat
from kvtier.stores.base import TierKind
from kvtier.stores.breaker import BreakerState
from tests.conftest import SHAPE, SIGNED, random_blocks, same_bytes
from tests.redis_server import stored_bytes
from tests.test_directory import BLOCK, ROLLS, DirectoryMachine, Load, chain, tier_specs
from tests.test_redis import check_invariants

DTYPE = torch.bfloat16
PAYLOAD = 2 * 2 * 4 * 16 * 64 * 2  # SHAPE in bf16
VALUE = blockformat.HEADER_NBYTES + PAYLOAD  # what one block costs the shared tier


def keys_for(n: int, salt: int = 0) -> list[bytes]:
    return chain_keys([salt * 100_000 + i for i in range(16 * n)], 16)


def config(url: str, host_blocks: int = 32, redis_blocks: int = 64, tenant_salt: str = "", **redis_extra):
    tier = {"type": "redis", "url": url, "max_bytes": redis_blocks * VALUE, "socket_timeout_s": 0.3,
            "connect_timeout_s": 0.3, "breaker_failures": 2, "breaker_cooldown_s": 0.2, **redis_extra}
    return parse_config({"cpu_bytes_to_use": host_blocks * PAYLOAD, "block_size": 16, "tenant_salt": tenant_salt,
                         **SIGNED, "secondary_tiers": [tier]})


def engines(url: str, n: int = 2, **kw) -> list[TieredCache]:
    return [TieredCache(config(url, **kw), SHAPE, DTYPE, model="test") for _ in range(n)]


def value_key(cache: TieredCache, key: bytes) -> bytes:
    return b"kvtier:" + cache.namespace.digest().encode() + key.hex().encode()


# -- sharing ----------------------------------------------------------------------------------------------


def test_two_engines_share_prefixes_through_a_redis_cluster(redis_cluster):
    """As through one Redis, through a real 6-node cluster: what one engine stores, another loads bit for bit;
    a continuation stored with its chain's route lands in its prefix's partition and loads whole."""
    a, b = engines(redis_cluster.seed_url, cluster=True, partitions=6, partition_tokens=32, redis_blocks=96)
    try:
        keys, blocks = keys_for(8), random_blocks(8, DTYPE, seed=1)
        assert a.store(keys, blocks) == 8
        a.flush()
        assert a.snapshot()["moves"]["host->redis"] == 8
        got = b.load(keys)
        assert len(got) == 8 and all(same_bytes(x, y) for x, y in zip(got, blocks))
        assert b.snapshot()["moves"]["redis->host"] == 8
        more, more_blocks = keys_for(12)[8:], random_blocks(4, DTYPE, seed=2)
        assert b.store(more, more_blocks, parent=keys[-1], route=chain_route(keys, 2)) == 4
        b.flush()
        assert b.snapshot()["moves"]["host->redis"] == 4
        c = engines(redis_cluster.seed_url, n=1, cluster=True, partitions=6, partition_tokens=32, redis_blocks=96)[0]
        try:
            got = c.load(keys + more)
            assert len(got) == 12 and all(same_bytes(x, y) for x, y in zip(got, blocks + more_blocks))
            assert c.snapshot()["lookup_tokens"] == {"redis": 12 * 16, "miss": 0}
        finally:
            c.close()
        assert a.stores["redis"].used_bytes() == 12 * VALUE
    finally:
        a.close()
        b.close()



def test_what_one_engine_stores_the_other_loads_bit_identically(redis_server):
    a, b = engines(redis_server.url)
    try:
        keys, blocks = keys_for(8), random_blocks(8, DTYPE, seed=1)
        assert a.store(keys, blocks) == 8
        a.flush()  # the write-through to Redis runs in the background
        assert a.snapshot()["moves"]["host->redis"] == 8
        assert b.lookup(keys) == 8 and b.directory.lookup(keys) == []  # all of it is in Redis, none in b's host
        got = b.load(keys)
        assert len(got) == 8 and all(same_bytes(x, y) for x, y in zip(got, blocks))
        snap = b.snapshot()
        assert snap["lookup_tokens"] == {"redis": 8 * 16, "miss": 0}
        assert snap["moves"]["redis->host"] == 8 and snap["moves"]["host->caller"] == 8
        assert b.directory.lookup(keys) == ["host"] * 8, "fetched through b's host tier, which keeps them"
        # b continues the chain; a gets its own prefix from host and b's continuation from Redis
        more, more_blocks = keys_for(12)[8:], random_blocks(4, DTYPE, seed=2)
        assert b.store(more, more_blocks, parent=keys[-1]) == 4
        b.flush()
        assert b.snapshot()["moves"]["host->redis"] == 4, "the blocks Redis already had are not sent again"
        out = [torch.empty(SHAPE, dtype=DTYPE) for _ in range(12)]
        got = a.load(keys + more, out=out)
        assert len(got) == 12 and all(same_bytes(x, y) for x, y in zip(got, blocks + more_blocks))
        assert a.snapshot()["lookup_tokens"] == {"host": 8 * 16, "redis": 4 * 16, "miss": 0}
        for cache in (a, b):
            assert cache.snapshot()["orphan_blocks"] == 0
        check_invariants(redis_server.client(), a.stores["redis"])
        text = b.metrics.exposition().decode()
        for line in ('kvtier_lookup_tokens_total{source="redis"} 128.0',
                     'kvtier_moves_total{dst="host",src="redis"} 8.0',
                     'kvtier_moves_total{dst="redis",src="host"} 4.0', 'kvtier_tier_capacity_bytes{tier="redis"}',
                     'kvtier_tier_used_bytes{tier="redis"} ' + f"{12 * VALUE}.0", "kvtier_redis_breaker_state 0.0",
                     "kvtier_redis_breaker_opens_total 0.0"):
            assert line in text, line
    finally:
        a.close()
        b.close()


def test_a_load_not_staged_reads_redis_straight_into_the_caller_and_its_store_keeps_the_blocks(redis_server):
    """As the vLLM connector loads: no host slot on the way, the prefix ends at a damaged value, and storing what
    was used gives the blocks host copies without sending them to Redis again."""
    a = TieredCache(config(redis_server.url), SHAPE, DTYPE, model="test")
    b = TieredCache(config(redis_server.url), SHAPE, DTYPE, model="test", stage_loads=False)
    try:
        keys, blocks = keys_for(8), random_blocks(8, DTYPE, seed=4)
        a.store(keys, blocks)
        a.flush()
        client = redis_server.client()
        client.setrange(value_key(a, keys[6]), blockformat.HEADER_NBYTES + 100, b"\xff\x00")  # flip payload bytes
        out = [torch.empty(SHAPE, dtype=DTYPE) for _ in range(8)]
        got = b.load(keys, out=out)
        assert len(got) == 6 and all(same_bytes(x, y) for x, y in zip(got, blocks)), "the prefix ends at it"
        snap = b.snapshot()
        # the block after the damaged one arrives too (vLLM would recompute from the first that did not)
        assert snap["moves"]["redis->caller"] == 7 and "redis->host" not in snap["moves"]
        assert snap["integrity_failures"] == {"redis": 1}
        assert b.directory.lookup(keys) == [] and not b.directory.pinned(), "none of them is b's"
        assert b.store(keys[:6], got) == 6
        b.flush()
        assert b.directory.lookup(keys) == ["host"] * 6
        assert b.snapshot()["moves"].get("host->redis", 0) == 0, "Redis had them all"
        assert b.snapshot()["orphan_blocks"] == 0
        check_invariants(client, a.stores["redis"])
    finally:
        a.close()
        b.close()


def test_damaged_or_foreign_value_is_a_miss_never_served(redis_server):
    a, b = engines(redis_server.url)
    # another namespace
    other = TieredCache(config(redis_server.url, tenant_salt="another tenant"), SHAPE, DTYPE, model="test")
    try:
        assert other.namespace.digest() != a.namespace.digest()
        keys, blocks = keys_for(6), random_blocks(6, DTYPE, seed=3)
        a.store(keys, blocks)
        a.flush()
        client = redis_server.client()
        good = client.get(value_key(a, keys[0]))
        client.setrange(value_key(a, keys[3]), blockformat.HEADER_NBYTES + 100, b"\xff\x00")  # flip payload bytes
        got = b.load(keys)
        assert len(got) == 3 and all(same_bytes(x, y) for x, y in zip(got, blocks)), "the prefix ends at it"
        snap = b.snapshot()
        assert snap["integrity_failures"] == {"redis": 1}
        assert b.lookup(keys) == 3, "the damaged value left Redis with its descendants"
        assert snap["orphan_blocks"] == 0 and b.directory.lookup(keys) == ["host"] * 3
        # the same bytes under another namespace's name: a valid block, of someone else
        client.set(value_key(other, keys[0]), good)
        assert other.lookup(keys) == 1, "Redis has something under that name"
        assert other.load(keys) == []
        assert other.snapshot()["integrity_failures"] == {"redis": 1}
        assert other.lookup(keys) == 0 and other.directory.lookup(keys) == []
        check_invariants(client, a.stores["redis"])
    finally:
        for cache in (a, b, other):
            cache.close()


# -- failures ---------------------------------------------------------------------------------------------


def test_redis_killed_mid_workload_then_restarted(redis_server):
    """No call raises or waits past the timeouts; loads stay exact (fewer hits); the breaker opens and shows
    in the metrics; Redis back on the same port (empty): the breaker closes and hits from it resume."""
    a, b = engines(redis_server.url, host_blocks=16)
    errors: list[BaseException] = []
    wrong, worst = [0], [0.0]
    phase = ["before"]
    hits: dict[str, int] = {"before": 0, "down": 0, "after": 0}
    states: set[int] = set()
    stop = threading.Event()

    def workload() -> None:
        i = 0
        while not stop.is_set():
            keys, blocks = keys_for(3, salt=i), random_blocks(3, DTYPE, seed=i)
            now = phase[0]
            try:
                start = time.monotonic()
                a.store(keys, blocks)
                a.flush()
                got = b.load(keys)
                b.lookup(keys_for(2, salt=10_000 + i))
                worst[0] = max(worst[0], time.monotonic() - start)
            except BaseException as e:  # the test is that there are none
                errors.append(e)
                return
            wrong[0] += sum(not same_bytes(x, y) for x, y in zip(got, blocks))
            hits[now] += len(got)
            text = b.metrics.exposition().decode()
            states.add(int(float(re.search(r"^kvtier_redis_breaker_state (\S+)$", text, re.MULTILINE).group(1))))
            i += 1

    worker = threading.Thread(target=workload)
    worker.start()
    try:
        time.sleep(0.6)
        phase[0] = "down"
        redis_server.kill()
        time.sleep(1.0)
        assert b.stores["redis"].breaker.state is not BreakerState.CLOSED
        redis_server.start()  # the same port, empty
        time.sleep(0.5)
        phase[0] = "after"
        time.sleep(0.8)
    finally:
        stop.set()
        worker.join()
    try:
        assert not errors and wrong[0] == 0
        assert worst[0] < 2 * (0.3 + 0.3) + 1.0, f"one iteration took {worst[0]:.2f} s"
        assert hits["before"] > 0 and hits["after"] > 0, hits
        assert 2 in states and 0 in states, "the breaker opened (2) and closed (0), as the metric shows"
        for cache in (a, b):
            snap = cache.snapshot()
            assert snap["shared"]["redis"]["breaker_opens"] >= 1 and snap["shared"]["redis"]["breaker_closes"] >= 1
            assert cache.stores["redis"].breaker.state is BreakerState.CLOSED
            assert snap["orphan_blocks"] == 0
        assert a.snapshot()["stores_dropped"].get("breaker_open", 0) > 0
        text = a.metrics.exposition().decode()
        assert 'kvtier_stores_dropped_total{reason="breaker_open"}' in text
        assert "kvtier_redis_breaker_state 0.0" in text and "kvtier_redis_breaker_opens_total 0.0" not in text
        check_invariants(redis_server.client(), a.stores["redis"])
    finally:
        a.close()
        b.close()


def test_breaker_open_lookups_miss_and_local_tiers_keep_serving(redis_server):
    a, b = engines(redis_server.url, breaker_cooldown_s=1.0)
    try:
        keys, blocks = keys_for(4), random_blocks(4, DTYPE, seed=5)
        a.store(keys, blocks)
        a.flush()
        redis_server.pause()  # hung: the sockets stay open, nothing answers
        try:
            start = time.monotonic()
            for _ in range(2):
                assert b.lookup(keys) == 0
            assert b.stores["redis"].breaker.state is BreakerState.OPEN
            assert time.monotonic() - start < 2 * (0.3 + 0.3) + 0.3
            start = time.monotonic()
            assert b.load(keys) == [] and b.lookup(keys) == 0
            got = a.load(keys)  # a's host tier still has them
            assert len(got) == 4 and all(same_bytes(x, y) for x, y in zip(got, blocks))
            assert time.monotonic() - start < 0.1, "with the breaker open, Redis is not even tried"
            assert b.store(keys_for(2, salt=1), random_blocks(2, DTYPE)) == 2
            b.flush()
            assert b.snapshot()["stores_dropped"] == {"breaker_open": 2}
        finally:
            redis_server.resume()
        time.sleep(1.05)  # the cooldown: the next call probes
        assert b.lookup(keys) == 4 and b.stores["redis"].breaker.state is BreakerState.CLOSED
    finally:
        a.close()
        b.close()


# -- the bound --------------------------------------------------------------------------------------------


def test_shared_tier_never_exceeds_max_bytes_with_two_engines_writing(redis_server):
    """Two engines store far more than the shared tier holds, concurrently; a watcher sums the values in Redis
    all along: never above max_bytes. Each engine reads the other's latest chain from Redis, bit for bit."""
    redis_blocks, rounds = 12, 30
    a, b = engines(redis_server.url, host_blocks=8, redis_blocks=redis_blocks)
    limit = redis_blocks * VALUE
    client = redis_server.client()
    samples: list[int] = []
    done = threading.Event()
    errors: list[BaseException] = []
    wrong = [0]
    step = threading.Barrier(2, timeout=10)

    def watch() -> None:
        while not done.is_set():
            samples.append(stored_bytes(client))
            time.sleep(0.002)

    def engine(me: TieredCache, peer_salt: int, first: int) -> None:
        try:
            for r in range(first, first + rounds):
                keys, blocks = keys_for(4, salt=r), random_blocks(4, DTYPE, seed=r)
                me.store(keys, blocks)
                me.flush()
                step.wait()  # both stored this round's chain: each loads the other's (Redis holds both)
                theirs = keys_for(4, salt=r - first + peer_salt)
                got = me.load(theirs)
                want = random_blocks(4, DTYPE, seed=r - first + peer_salt)
                wrong[0] += sum(not same_bytes(x, y) for x, y in zip(got, want))
                step.wait()
        except BaseException as e:
            errors.append(e)
            step.abort()

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=engine, args=(a, 100, 0)), threading.Thread(target=engine, args=(b, 0, 100))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    try:
        assert not errors and wrong[0] == 0
        written = sum(c.snapshot()["moves"].get("host->redis", 0) for c in (a, b))
        assert written * VALUE > 3 * limit, "the workload must be larger than the tier"
        assert len(samples) > 10 and max(samples) <= limit, (len(samples), max(samples), limit)
        snap = a.snapshot()
        assert snap["tiers"]["redis"]["used_bytes"] <= snap["tiers"]["redis"]["capacity_bytes"] == limit
        assert sum(c.snapshot()["evictions"].get("redis/capacity", 0) for c in (a, b)) > 0
        assert all(c.snapshot()["lookup_tokens"].get("redis", 0) > 0 for c in (a, b)), "each read the other's"
        check_invariants(client, a.stores["redis"])
    finally:
        a.close()
        b.close()


# -- the directory's shared-tier plans under random traffic ------------------------------------------------


class SharedDirectoryMachine(DirectoryMachine):
    """test_directory's machine with a shared tier: loads fetch what a modelled Redis holds after the local
    prefix, stores write through to it. Other engines add and remove chains in it at random. All of the base
    machine's invariants still hold (slots, pins, no orphans, exact accounting), and a write-through step
    always finds its block's bytes in the host slot it reads."""

    @initialize(specs=tier_specs(), sightings=st.integers(1, 2), stage_loads=st.booleans())
    def setup(self, specs: list[TierSpec], sightings: int, stage_loads: bool) -> None:
        super().setup(specs, stage_loads)
        self.shared = SharedSpec("redis", BLOCK, AdmissionRule(min_sightings=sightings))
        self.d = self._listened(Directory(specs, clock=lambda: 0.0, shared=self.shared, stage_loads=stage_loads))
        self.redis: dict[bytes, bytes | None] = {}  # key -> parent, with the chain invariant

    def _redis_drop(self, key: bytes) -> None:
        for k in [k for k in self.redis if k.startswith(key)]:  # a key's descendants extend it (see `key`)
            del self.redis[k]

    @rule(path=st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple))
    def other_engine_stores(self, path: tuple[int, ...]) -> None:
        keys = chain(path)
        for i, k in enumerate(keys):
            self.redis[k] = keys[i - 1] if i else None

    @rule(pick=st.integers(0, 1 << 16))
    def other_engine_evicts(self, pick: int) -> None:
        if self.redis:
            self._redis_drop(sorted(self.redis)[pick % len(self.redis)])

    @rule(path=st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple))
    def load(self, path: tuple[int, ...]) -> None:
        self.seen.add(path)
        keys = chain(path)
        readable = self.d.lookup(keys)
        n = len(readable)
        while n < len(keys) and keys[n] in self.redis:
            n += 1
        plan = self.d.plan_load(keys, shared_end=n)
        assert plan.keys == keys[: len(plan.keys)]
        local = [s for s in plan.sources if s != "redis"]
        assert local == readable[: len(local)] and all(s == "redis" for s in plan.sources[len(local) :])
        assert len(local) == len(readable) or len(plan.sources) == len(local), "fetches only follow a whole prefix"
        gets = sorted(s.index for c in plan.chains for s in c if s.op is Op.GET)
        assert gets == list(range(len(plan.keys))), "one GET per loaded block"
        load = Load(plan)
        self.loads.append(load)
        self._submit(plan, load)

    def fresh_directory(self) -> Directory:
        """As the base machine's, with the shared tier (which a restart does not touch)."""
        return self._listened(Directory([t.spec for t in self.d.tiers], clock=lambda: 0.0, shared=self.shared,
                                        stage_loads=self.d.stage_loads))

    def _execute(self, step: Step, roll: int) -> Status:
        if step.dst == "redis":
            assert step.src == "host" and self.bytes.slots["host"][step.src_slot] == step.key, \
                f"{step} reads a slot that does not hold its block"
            if roll >= ROLLS - 3 or (step.parent is not None and step.parent not in self.redis):
                return Status.FAILED  # Redis refused it (an orphan) or failed
            self.redis[step.key] = step.parent
            return Status.OK
        if step.src == "redis":
            assert (step.op, step.dst) == self.fetch, step
            if step.key not in self.redis or roll >= ROLLS - 3:  # gone, corrupt or unavailable: all the same
                if roll == ROLLS - 1:
                    self._redis_drop(step.key)  # corrupt: the store removes it and its descendants
                return self._failed(step, Status.SOURCE_LOST)
            if step.dst == "host":
                self.bytes.slots["host"][step.dst_slot] = step.key
            return Status.OK
        return super()._execute(step, roll)

    @property
    def fetch(self) -> tuple[Op, str]:
        """A fetch's step: staged in host, then a GET from there; or straight into the caller."""
        return (Op.COPY, "host") if self.d.stage_loads else (Op.GET, CALLER)

    def held_in(self, source: str) -> str | None:
        if source != "redis":
            return source
        return "host" if self.d.stage_loads else None  # a fetched block is staged in host, or not ours at all

    @invariant()
    def shared_steps_are_well_formed(self) -> None:
        for c in self.chains.values():
            for step in c.steps:
                if step.dst == "redis":
                    assert (step.op, step.src) == (Op.COPY, "host"), step
                elif step.src == "redis":
                    assert (step.op, step.dst) == self.fetch, step


SharedDirectoryMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
TestSharedDirectory = SharedDirectoryMachine.TestCase


def test_fetch_that_fails_drops_the_block_and_its_fetched_descendants() -> None:
    specs = [TierSpec("host", 8 * BLOCK, BLOCK, kind=TierKind.HOST)]
    d = Directory(specs, shared=SharedSpec("redis", BLOCK))
    keys = chain((0, 1, 2, 0))
    plan = d.plan_load(keys, shared_end=4)
    assert plan.sources == ["redis"] * 4 and d.lookup(keys) == []
    fetches = {s.key: s for c in plan.chains for s in c if s.src == "redis"}
    d.complete(fetches[keys[0]], Status.OK)
    d.complete(fetches[keys[1]], Status.SOURCE_LOST)  # corrupt in Redis
    d.complete(fetches[keys[2]], Status.OK)
    d.complete(fetches[keys[3]], Status.OK)
    for c in plan.chains:
        for s in c:
            if s.op is Op.GET:
                d.complete(s, Status.OK if s.key == keys[0] else Status.FAILED)
    d.finish_load(plan)
    assert d.lookup(keys) == ["host"] and len(d) == 1 and d.tier["host"].used_blocks == 1
    assert not d.pinned() and d.orphans() == 0


def test_a_staged_fetch_after_the_callers_own_prefix_is_served_and_then_retires() -> None:
    """The caller holds the chain's first block itself (vLLM's own hit), we do not: the blocks fetched after it
    are staged and served, but not kept (kept, they would be orphans)."""
    specs = [TierSpec("host", 8 * BLOCK, BLOCK, kind=TierKind.HOST)]
    d = Directory(specs, shared=SharedSpec("redis", BLOCK))
    keys = chain((0, 1, 2))
    plan = d.plan_load(keys[1:], shared_end=2, parent=keys[0])
    assert plan.sources == ["redis"] * 2 and d.orphans() == 0
    assert d.retiring()[keys[1]].parent == keys[0], "in the drop cascade, under its real parent"
    for c in plan.chains:
        for s in c:
            d.complete(s, Status.OK)
    d.finish_load(plan)
    assert len(d) == 0 and not d.retiring() and d.tier["host"].used_blocks == 0 and d.orphans() == 0


def test_store_writes_through_parents_first_and_holds_the_slots() -> None:
    specs = [TierSpec("host", 8 * BLOCK, BLOCK, kind=TierKind.HOST)]
    d = Directory(specs, shared=SharedSpec("redis", BLOCK))
    keys = chain((1, 1, 1))
    first = d.plan_store(keys[:2])
    shared = [s for c in first.chains for s in c if s.dst == "redis"]
    assert [s.key for s in shared] == keys[:2] and all(s.needs_prev for s in shared)
    for c in first.chains:
        for s in c:
            d.complete(s, Status.OK)
    plan = d.plan_store(keys)  # two blocks there (offered again: Redis may have lost them), one new
    shared = [s for c in plan.chains for s in c if s.dst == "redis"]
    assert [s.key for s in shared] == keys and [s.needs_prev for s in shared] == [False, False, True]
    assert [s.parent for s in shared] == [None, keys[0], keys[1]]
    assert sorted(d.pinned()) == sorted(keys), "the blocks (and their slots) stay until Redis has the bytes"
    for c in plan.chains:
        for s in c:
            d.complete(s, Status.FAILED if s.dst == "redis" else Status.OK)
    assert not d.pinned() and d.lookup(keys) == ["host"] * 3


def test_a_failed_put_keeps_its_dropped_block_until_the_write_through_step_is_done() -> None:
    """The bug the machine found: a PUT fails, its block is dropped; the write-through step, skipped, completes
    later, after a new store of the same key. It must not touch the new block."""
    specs = [TierSpec("host", 8 * BLOCK, BLOCK, kind=TierKind.HOST)]
    d = Directory(specs, shared=SharedSpec("redis", BLOCK))
    k = chain((1,))
    (put, through), = d.plan_store(k).chains
    d.complete(put, Status.FAILED)
    assert k[0] not in d and d.plan_store(k).chains == [], "still retiring: not stored again meanwhile"
    d.complete(through, Status.FAILED)
    again = d.plan_store(k)
    assert [s.op for s in again.chains[0]] == [Op.PUT, Op.COPY]
    for s in again.chains[0]:
        d.complete(s, Status.OK)
    assert not d.pinned() and d.lookup(k) == ["host"]


def test_shared_admission_stops_the_write_through_at_the_first_refusal() -> None:
    specs = [TierSpec("host", 8 * BLOCK, BLOCK, kind=TierKind.HOST)]
    d = Directory(specs, shared=SharedSpec("redis", BLOCK, AdmissionRule(min_priority=50)))
    plan = d.plan_store(chain((2, 2)), priority=10)
    assert not [s for c in plan.chains for s in c if s.dst == "redis"]
    assert d.stats.admission_rejects[("redis", "priority")] == 1


def test_a_write_through_copy_abandoned_after_making_room_keeps_the_victims_file_counted() -> None:
    """The bug the shared machine found (the shared tier only made it likelier): making room on disk for k's
    write-through copy evicts a, whose only copy is there, and drops a's descendants, k with them. The copy is
    abandoned, but a's DELETE stays in k's chain, after its PUT: a's file exists until that DELETE runs, so it
    must stay counted, or another chain's write takes its room first and disk holds more files than it may."""
    specs = [TierSpec("host", 2 * BLOCK, BLOCK, kind=TierKind.HOST),
             TierSpec("disk", 2 * BLOCK, BLOCK, write_through=True)]
    d = Directory(specs, shared=SharedSpec("redis", BLOCK))
    a, p, k = chain((1, 1, 1))
    complete_instantly(d, d.plan_store([a]))
    complete_instantly(d, d.plan_store([p], parent=a))  # host {a, p}, disk {a, p}
    (late,) = d.plan_store([k], parent=p).chains  # a leaves host, then disk: a, p and k are dropped
    assert [(s.op, s.key) for s in late] == [(Op.PUT, k), (Op.DELETE, a)]
    garbage = d.take_garbage()  # p's file
    files = {a, p}  # on disk until their DELETEs run
    assert d.used_bytes("disk") == len(files) * BLOCK
    for steps in d.plan_store(chain((2,))).chains:  # no room on disk: its write-through copy waits for none
        for s in steps:
            if s.dst == "disk":
                files.add(s.key)
            d.complete(s, Status.OK)
        assert len(files) <= 2, "disk holds more files than it may"
    for s in late + garbage:
        d.complete(s, Status.OK)
    assert d.used_bytes("disk") == len(d.keys_in("disk")) * BLOCK


@pytest.mark.parametrize("dtype", [torch.float32])
def test_other_dtype_is_another_namespace(redis_server, dtype):
    a = TieredCache(config(redis_server.url), SHAPE, DTYPE, model="test")
    c = TieredCache(config(redis_server.url, host_blocks=16), SHAPE, dtype, model="test")
    try:
        keys = keys_for(3)
        a.store(keys, random_blocks(3, DTYPE))
        a.flush()
        assert c.lookup(keys) == 0 and c.load(keys) == []
    finally:
        a.close()
        c.close()
