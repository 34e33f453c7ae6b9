"""Faults injected into real parts; what matters in each is how many wrong blocks were served: 0.

- a writer process killed (SIGKILL) at random moments while it stores blocks to disk, then restarted;
- a disk tier on a file system that fills up (a tmpfs mounted with `size=`);
- tensor parallelism: two worker halves (ranks) in one process, one of them failing writes and reads;
- a randomized state machine at the connector level: requests, aborts before their output, failing stores and
  reads, restarts, on real host and disk stores;
- a disk whose reads hang (never return until released), beside a healthy Redis.
The real vLLM engine's aborts and preemptions are in tests/test_vllm.py.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import subprocess
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.directory import CopyState
from tests.conftest import DEMOTE_ALL, SIGNED, missing
from tests.connector_harness import Engine, P, Request
from tests.connector_harness import content as engine_content

SHAPE, DT = (4, 1024), torch.uint8  # a block: 4 KiB
KILLS = 50


def content(key: bytes) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    return torch.randint(0, 256, SHAPE, dtype=DT, generator=torch.Generator().manual_seed(seed))


def disk_config(root, host_blocks: int, disk_blocks: int, **extra):
    return parse_config({"cpu_bytes_to_use": host_blocks * P, "block_size": 16, "secondary_tiers": [
        {"type": "fs", **DEMOTE_ALL, "root_dir": str(root), "max_bytes": disk_blocks * (P + 4096), **extra}]})


# ---------------------------------------------------------------- kill -9 while writing


def _writer(root: str, cycle: int) -> None:
    """The victim: stores chains of 4 blocks to a write-through disk tier until it is killed."""
    torch.set_num_threads(1)
    cache = TieredCache(disk_config(root, 8, 24, write_policy="write_through"), SHAPE, DT, model="killed")
    for i in range(1 << 30):
        keys = [b"c%d-%d-%d" % (cycle, i, j) for j in range(4)]
        cache.store(keys, [content(k) for k in keys])


def test_a_writer_killed_at_random_moments_never_leaves_a_block_that_is_served_wrong(tmp_path):
    root = tmp_path / "kv"
    rng = random.Random(0)
    fork = multiprocessing.get_context("fork")
    verified = recovered = 0
    for cycle in range(KILLS):
        victim = fork.Process(target=_writer, args=(str(root), cycle))
        victim.start()
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        assert victim.exitcode == -signal.SIGKILL, "killed mid-write, not finished"
        with TieredCache(disk_config(root, 8, 24, write_policy="write_through"), SHAPE, DT, model="killed") as cache:
            adopted = cache.directory.keys_in("disk")
            files = list(root.rglob("*.kv"))
            assert not list(root.rglob("*.tmp")), "the restart scan removes temp files"
            assert len(files) == len(adopted) <= 24, "every complete block is taken back; the bound holds"
            recovered += len(adopted)
            for key in adopted:
                got = cache.load([key])
                assert len(got) == 1 and torch.equal(got[0], content(key)), f"cycle {cycle}: {key!r} served wrong"
                verified += 1
    assert verified >= KILLS, "the kills left blocks to check"
    print(f"\n{KILLS} kills, {recovered} blocks recovered, {verified} loaded and verified, 0 wrong")


# ---------------------------------------------------------------- a full file system


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of 40 blocks' worth, mounted for the test (root only; in CI a failure to mount is a failure)."""
    where = tmp_path / "fs"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={40 * (P + 4096)}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        missing(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_file_system_fails_stores_counts_them_and_serves_on(small_fs):
    junk = small_fs / "junk.bin"
    junk.write_bytes(b"\0" * (28 * (P + 4096)))  # another user of the file system leaves room for ~12 blocks
    config = disk_config(small_fs / "kv", 4, 64, write_policy="write_through")
    with TieredCache(config, SHAPE, DT, model="enospc") as cache:
        keys = [b"e%d" % i for i in range(40)]
        for key in keys:
            cache.store([key], [content(key)])
            cache.flush()
        snap = cache.snapshot()
        assert snap["stores_dropped"].get("disk_failed", 0) > 0, "ENOSPC: stores failed, and were counted"
        on_disk = len(list((small_fs / "kv").rglob("*.kv")))
        assert cache.directory.tier["disk"].used_blocks == on_disk < 40
        assert not list(small_fs.rglob("*.tmp"))
        for key in cache.directory.keys_in("disk"):  # what the full disk holds is whole, and served as it was
            got = cache.load([key])
            assert len(got) == 1 and torch.equal(got[0], content(key))
        junk.unlink()  # the operator cleans up: stores succeed again
        more = [b"m%d" % i for i in range(10)]
        for key in more:
            cache.store([key], [content(key)])
            cache.flush()
        assert len(list((small_fs / "kv").rglob("*.kv"))) > on_disk, "usage recovers"
        assert all(torch.equal(cache.load([k])[0], content(k)) for k in more)


# ---------------------------------------------------------------- tensor parallelism: one rank fails


def failing(store, method: str, rng: random.Random, p: float, exc: type[Exception]):
    """Make `store.method` raise `exc` with probability p (the store itself stays real)."""
    real = getattr(store, method)

    def maybe(*args, **kwargs):
        if rng.random() < p:
            raise exc(5, f"injected: {method} failed")
        return real(*args, **kwargs)

    setattr(store, method, maybe)


def test_a_rank_that_fails_never_lets_another_serve_a_hit_it_cannot(tmp_path):
    config = disk_config(tmp_path / "kv", 16, 40)  # 8 host slots per rank
    config = parse_config({**config.model_dump(mode="json"), "engine_block_size": 16})
    engine = Engine(config, world_size=2, lagging=0.5)  # rank 1 often reports a step's work a step later
    rng = random.Random(1)
    failing(engine.workers[0].stores.local["disk"], "write", rng, 0.15, OSError)  # it reports first: rank 1 lags
    failing(engine.workers[0].stores.local["disk"], "read", rng, 0.15, OSError)
    for method in ("run", "run_many"):  # a copy into its host slab: no checksum would catch its bytes
        failing(engine.workers[0].mover._put, method, rng, 0.15, RuntimeError)
    try:
        chains = [[bytes([c, j]) * 16 for j in range(3)] for c in range(48)]
        for round_ in range(6):  # 8 new chains a round (stores into a full host), and 8 seen before (loads)
            for i, c in enumerate([*range(8 * round_, 8 * round_ + 8), *rng.sample(range(8 * round_ + 8), 8)]):
                request = Request(f"r{round_}-{i}", chains[c])
                while not engine.admit(request):
                    engine.drain()
                engine.run(request)
            engine.drain()
        assert engine.wrong == 0
        assert engine.loaded > 20, "the tiers served hits"
    finally:
        engine.close()


def busy_host(engine: Engine, first: int) -> None:
    """Two stores planned, not yet run: both slots of a 2-slot host are being written."""
    for i in (first, first + 1):
        engine.admit_when_answered(busy := Request(f"busy{i}", [bytes([i]) * 32]), step=False)
        engine.compute(busy, set())
        busy.num_computed_tokens = 16
        engine.finish(busy)


def served_with_every_host_slot_busy(engine: Engine, hit: Request, tier: str) -> None:
    """`hit`'s first block, found in `tier`, is served exactly while every host slot is being written: read
    straight into the engine's block, no shortfall. Then the request is stored."""
    busy_host(engine, 10)
    engine.admit_when_answered(hit, step=False)
    assert hit.promised == 16 and hit.is_async
    engine.run(hit)
    assert engine.loaded == 1 and engine.wrong == 0
    assert engine.scheduler.stats_payload()["counters"]["load_shortfall_tokens"] == {}
    assert engine.workers[0].metrics.moves.moves[(tier, "caller")] == 1
    engine.drain()


def test_a_disk_hit_needs_no_host_slot_and_is_promoted_by_its_store(tmp_path):
    """A disk hit is read straight into the engine's block: with every host slot held by a store in flight it is
    still served, exactly, and the request's own store then gives it a host copy."""
    config = parse_config({**disk_config(tmp_path / "kv", 2, 16).model_dump(mode="json"), "engine_block_size": 16})
    engine = Engine(config)
    try:
        for i in range(3):  # host holds 2 slots: the first request's block goes down to disk
            engine.admit(stored := Request(f"r{i}", [bytes([i + 1]) * 32]))
            engine.run(stored)
            engine.drain()
            if i == 0:
                key = engine.scheduler._keys(stored)[0]
        directory = engine.scheduler.directory
        assert set(directory.residency(key)) == {"disk"}
        served_with_every_host_slot_busy(engine, Request("q", [bytes([1]) * 32, bytes([9]) * 32]), "disk")
        assert set(directory.residency(key)) == {"host", "disk"}  # promoted when the request was stored
    finally:
        engine.close()


def shared_engine(redis_server) -> Engine:
    """A 2-slot host and a Redis tier."""
    config = parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, "engine_block_size": 16, **SIGNED,
                           "secondary_tiers": [{"type": "redis", "url": redis_server.url,
                                                "max_bytes": 64 * (P + 600)}]})
    return Engine(config)


def stored_by_another_engine(redis_server, engine: Engine, request: Request) -> None:
    """The request's first block, as another engine of the same model writes it to Redis."""
    from kvtier.stores.redis import RedisStore

    other = RedisStore(redis_server.url, engine.scheduler.geo.namespace(0), P, 64 * (P + 600),
                       auth_key=engine.scheduler.config.auth_key())
    other.put_many([(engine.scheduler._keys(request)[0], None, engine_content(request.block_hashes[0], 0))])
    other.close()


def test_a_shared_tier_hit_needs_no_host_slot_and_is_given_one_by_its_store(redis_server):
    """A Redis hit is read straight into the engine's block, as a disk hit is: with every host slot held by a store
    in flight it is still served, exactly, and the request's own store then gives it a host copy."""
    hit = Request("q", [bytes([1]) * 32, bytes([9]) * 32])
    engine = shared_engine(redis_server)
    try:
        stored_by_another_engine(redis_server, engine, hit)
        served_with_every_host_slot_busy(engine, hit, "redis")
        assert set(engine.scheduler.directory.residency(engine.scheduler._keys(hit)[0])) == {"host"}
    finally:
        engine.close()


def test_a_shared_tier_hit_on_a_block_being_stored_here_is_recomputed_and_counted(redis_server):
    """Redis holds a block this engine is storing right now (its host copy not yet written): vLLM was promised the
    hit, but the load cannot take a block a transfer is on. It is reported failed (vLLM recomputes it), never
    served, and counted as the load's shortfall."""
    hit = Request("q", [bytes([1]) * 32, bytes([9]) * 32])
    engine = shared_engine(redis_server)
    try:
        engine.admit_when_answered(writing := Request("w", hit.block_hashes[:1]), step=False)
        engine.compute(writing, set())
        writing.num_computed_tokens = 16
        engine.finish(writing)  # its store is planned, not yet run
        stored_by_another_engine(redis_server, engine, hit)
        engine.admit_when_answered(hit, step=False)
        assert hit.promised == 16 and hit.is_async  # the hit was promised ...
        counters = engine.scheduler.stats_payload()["counters"]
        assert counters["load_shortfall_tokens"] == {"redis": 16}  # ... and could not be taken
        engine.run(hit)
        assert engine.loaded == 0 and engine.wrong == 0  # reported failed: recomputed, not served
    finally:
        engine.close()


# ---------------------------------------------------------------- the connector under random traffic and faults


class ConnectorMachine(RuleBasedStateMachine):
    """Invariant: every block a load delivers (not reported failed) holds exactly its key's bytes."""

    @initialize(seed=st.integers(0, 1 << 30), ranks=st.sampled_from([1, 2]))
    def setup(self, seed: int, ranks: int) -> None:
        import tempfile

        self.root = tempfile.mkdtemp(prefix="kvtier-machine-")
        self.rng = random.Random(seed)
        self.ranks = ranks
        self.engine = self._engine()
        self.n = 0

    def _engine(self) -> Engine:
        config = parse_config({"cpu_bytes_to_use": 4 * P * self.ranks, "block_size": 16, "engine_block_size": 16,
                               "secondary_tiers": [{"type": "fs", **DEMOTE_ALL,
                                                    "root_dir": self.root, "max_bytes": 10 * (P + 4096)}]})
        engine = Engine(config, world_size=self.ranks, num_blocks=32)
        for worker in engine.workers:
            disk = worker.stores.local["disk"]
            failing(disk, "write", self.rng, 0.1, OSError)
            failing(disk, "write", self.rng, 0.05, RuntimeError)  # not an I/O error: a bug, still only a failure
            failing(disk, "read", self.rng, 0.1, OSError)
            failing(disk, "delete", self.rng, 0.05, OSError)
            for method in ("run", "run_many"):
                failing(worker.mover._put, method, self.rng, 0.05, RuntimeError)
        return engine

    @rule(path=st.lists(st.integers(0, 2), min_size=1, max_size=5), abort=st.booleans())
    def request(self, path: list[int], abort: bool) -> None:
        hashes = [bytes(path[: i + 1]) + b"\x00" * (32 - i - 1) for i in range(len(path))]
        self.n += 1
        request = Request(f"q{self.n}", hashes)
        if not self.engine.admit(request):
            self.engine.drain()
            return
        self.engine.run(request, abort_before_output=abort and request.promised > 0)

    @rule(burst=st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=5), st.booleans()),
                         min_size=1, max_size=12))
    def traffic(self, burst: list[tuple[list[int], bool]]) -> None:
        for path, abort in burst:
            self.request(path, abort)

    @rule()
    def drain(self) -> None:
        """Once every transfer is done: no pin, no held engine block, every host slot free or holding a copy."""
        self.engine.drain()
        d = self.engine.scheduler.directory
        assert not d.pinned() and not d.retiring()
        host = d.tier["host"]
        assert host.used_blocks == len(d.keys_in("host")) == host.capacity_blocks - len(host.free_slots)
        assert sorted(self.engine.free) == list(range(32)) and not self.engine.held, "an engine block leaked"

    @rule()
    def restart(self) -> None:
        self.engine.drain()
        self.engine.close()
        wrong = self.engine.wrong
        self.engine = self._engine()
        self.engine.wrong = wrong

    @invariant()
    def no_wrong_block_served(self) -> None:
        if hasattr(self, "engine"):
            assert self.engine.wrong == 0

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.engine.drain()
            self.engine.close()



ConnectorMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestConnectorMachine = ConnectorMachine.TestCase


# ---------------------------------------------------------------- a hung tier


class Hung:
    """Every read of `store` hangs until `release` (a bad sector's retries, an NFS server gone)."""

    def __init__(self, store) -> None:
        self.gate, self.started, self.ended = threading.Event(), 0, 0
        read = store.read

        def hung_read(key, into):
            self.started += 1
            self.gate.wait()
            try:
                return read(key, into)
            finally:
                self.ended += 1

        store.read = hung_read

    def release(self) -> None:
        """Let the hung reads finish; wait until they have."""
        self.gate.set()
        for _ in range(1000):
            if self.ended == self.started:
                return
            time.sleep(0.01)
        raise AssertionError("the hung reads never ended")


def h(*path) -> bytes:
    return hashlib.blake2b(repr(path).encode(), digest_size=16).digest()


def test_a_hung_disk_fails_its_loads_at_their_deadline_and_never_holds_up_another_tiers(redis_server, tmp_path):
    """r_hung_disk_blocks_all_loads, r_guard_blind_to_hangs: loads had no deadline, and every tier's ran on the same
    two threads: two disk reads that hung held both, and a healthy Redis's load waited as long as the disk hung;
    the guard heard nothing of requests stuck on it. Each tier's part of a load now has a deadline (the disk's
    `load_timeout_s`) and threads of its own: the Redis load is served while the disk hangs; the disk loads fail at
    their deadline (vLLM recomputes their blocks), their late bytes never land in the engine's blocks, nothing
    stays pinned or queued, and the hang counts against the disk, in the decision and the guard."""
    redis_tier = {"type": "redis", "url": redis_server.url, "max_bytes": 1 << 26}
    guard = {"ttft_p99_ms": 100, "window_s": 1, "breach_windows": 1, "of_windows": 1, "min_requests": 1}
    writer = Engine(parse_config({"cpu_bytes_to_use": 64 * P, "block_size": 16, "engine_block_size": 16, **SIGNED,
                                  "secondary_tiers": [redis_tier]}))
    engine = Engine(parse_config({"cpu_bytes_to_use": 4 * P, "block_size": 16, "engine_block_size": 16, **SIGNED,
                                  "guard": guard,
                                  "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv"),
                                                       "max_bytes": 1 << 24, "write_policy": "write_through",
                                                       **DEMOTE_ALL, "load_timeout_s": 0.5}, redis_tier]}))
    try:
        q = [h("q", i) for i in range(2)]
        writer.admit_when_answered(stored := Request("w", q), step=False)
        writer.run(stored)
        writer.drain()  # q is in Redis
        prompts = {n: [h("p", n, i) for i in range(2)] for n in range(6)}
        for n, prompt in prompts.items():  # on disk; the host keeps the last two
            engine.admit_when_answered(filled := Request(f"fill{n}", prompt, arrival_time=time.time()), step=False)
            engine.run(filled)
        engine.drain()
        hung = Hung(engine.workers[0].stores.local["disk"])
        a, b = (Request(name, prompts[n], arrival_time=time.time()) for name, n in (("a", 0), ("b", 1)))
        engine.admit_when_answered(a, step=False)
        engine.admit_when_answered(b, step=False)
        c = Request("c", q)
        engine.admit_when_answered(c, step=False)
        sources = {r: dict(engine.scheduler._requests[r].served) for r in "abc"}
        assert [set(map(str, s)) for s in sources.values()] == [{"TierKind.DISK"}] * 2 + [{"TierKind.SHARED"}]
        invalid: set[int] = set()
        for _ in range(5000):  # the engine steps on; vLLM polls each step for the loads that came in
            invalid |= engine.step()
            if all(engine.recving.get(r.request_id) for r in (a, b, c)):
                break
            time.sleep(0.002)
        assert not hung.gate.is_set() and hung.started  # all three reported while the disk still hangs
        assert set(a.blocks + b.blocks) <= invalid and not set(c.blocks) & invalid  # disk's failed, Redis's served
        engine.check_loaded(c, invalid)
        assert engine.wrong == 0
        for block in a.blocks + b.blocks:  # vLLM recomputes them, or gives them to another request
            engine.kv[0][block].fill_(0xAB)
        for request in (a, b):
            engine.finish(request)  # aborted by its client before its first token: its wait counts
        hung.release()
        engine.workers[0].mover.flush()
        assert all(bool((engine.kv[0][block] == 0xAB).all()) for block in a.blocks + b.blocks)  # no late bytes
        engine.step()
        control = engine.scheduler.control
        assert not engine.scheduler.directory.pinned() and control.decider.queued["disk"] == 0
        assert control.decider.links["disk"].seconds(2 * P, time.monotonic(), busy=True) >= 0.5  # the hang, measured
        control.control.tick(time.monotonic() + 1)  # the window closes
        assert [(t.tier, t.to.value) for t in control.guard.history] == [("disk", "off")]
        assert "ttft p99" in control.guard.history[0].reason
    finally:
        for e in (writer, engine):
            e.close()


def test_a_hung_disk_costs_an_in_process_load_its_deadline_and_no_slot_is_reused_under_it(tmp_path):
    """TieredCache stages a disk hit through a host slot: past the deadline the load returns without it, while the
    hung read keeps its slot (a slot is never reused while a transfer may still write it); once the read ends,
    the block is in host, nothing is pinned, and every block stored meanwhile reads back exactly."""
    config = disk_config(tmp_path / "kv", 2, 16, load_timeout_s=0.3)
    with TieredCache(config, SHAPE, DT, model="hung") as cache:
        keys = [b"k%d" % i for i in range(6)]
        for key in keys[:4]:  # the host holds 2: k0 and k1 go down to disk
            cache.store([key], [content(key)])
            cache.flush()
        directory = cache.directory
        assert set(directory.residency(b"k0")) == {"disk"}
        hung = Hung(cache.stores.local["disk"])
        assert cache.load([b"k0"]) == []  # its deadline passed: a miss, never a hang
        assert directory.residency(b"k0")["host"] is CopyState.WRITING  # the read may still write its slot
        for key in keys[4:]:  # the other slot turns over under it
            cache.store([key], [content(key)])
            cache.flush()
        hung.release()
        cache.flush()
        assert not directory.pinned()
        assert all(set(directory.residency(k).values()) == {CopyState.READY} for k in directory.blocks())
        for key in [*keys, b"k0"]:
            got = cache.load([key])
            assert not got or torch.equal(got[0], content(key)), key
        assert len(cache.load([b"k0"])) == 1
