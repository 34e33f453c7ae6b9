"""One regression test per confirmed defect of the audit (`../shared/repro/expN_*.py`, written against f9cb4a7).

Each drives kvtier's own code in the order vLLM or a user would, as its script does, and asserts the right
outcome where the script printed the wrong one. The connector's halves run in-process on real stores.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from kvtier.admission import AdmissionRule
from kvtier.cache import TieredCache
from kvtier.config import ConfigError, parse_config
from kvtier.directory import CopyState, Directory, Op, Status, TierSpec
from kvtier.guard import TierState
from kvtier.integrations.vllm.control import SchedulerControl
from kvtier.integrations.vllm.messages import KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.scheduler_stats import SHARED_USAGE_S
from kvtier.integrations.vllm.setup import Geometry
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.keys import chain_keys
from kvtier.sim.instant_mover import complete_instantly
from kvtier.stores import blockformat
from kvtier.stores.base import TierKind
from kvtier.stores.disk import DiskStore
from kvtier.stores.redis import RedisStore
from tests.conftest import DEMOTE_ALL, SIGNED
from tests.connector_harness import STEP, loading_all
from tests.connector_harness import Engine as HarnessEngine
from tests.connector_harness import Request as HarnessRequest

SHAPE, DT, P = (4, 1024), torch.uint8, 4096  # one block: 4 KiB of uint8


def geometry(world_size: int = 1) -> Geometry:
    return Geometry(engine_block_size=16, block_tokens=16, engine_block_nbytes=P, world_size=world_size,
                    model="m", dtype="bf16", kv_layout="x", hash_algo="sha256", tenant_salt="")


def request(rid: str, hashes: list[bytes], computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed, num_tokens=16 * len(hashes) + 1,
                           num_prompt_tokens=16 * len(hashes) + 1, block_hashes=hashes, num_output_tokens=0,
                           arrival_time=0.0, num_preemptions=0)


def engine_blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


class Engine:
    """The connector's two halves wired in-process (world size 1), stepped in vLLM's order."""

    def __init__(self, config, num_blocks: int = 32) -> None:
        geo = geometry()  # one engine: its halves know one engine id
        self.worker = WorkerSide(config, geo, 0)
        self.kv = torch.zeros(num_blocks, P, dtype=torch.uint8)
        self.worker.register_kv_caches({"layer0": self.kv}, num_blocks)  # before the scheduler half, as in vLLM
        self.scheduler = SchedulerSide(loading_all(config), geo)

    def step(self) -> tuple[set[str] | None, set[str] | None]:
        meta = self.scheduler.build_connector_meta(STEP)
        self.worker.start(meta)
        self.worker.mover.flush()
        finished = self.worker.get_finished(set())
        self.scheduler.update_connector_output(self.worker.worker_meta())
        return finished

    def drain(self, steps: int = 20) -> None:
        for _ in range(steps):
            self.step()
            if not self.scheduler.has_pending_work():
                return
            time.sleep(0.01)

    def close(self) -> None:
        self.worker.shutdown()


# ---------------------------------------------------------------- keys and config


def test_extra_keys_are_delimited_so_different_lists_never_share_a_key():
    """exp12: extra keys were concatenated without a separator."""
    tokens = list(range(16))
    assert chain_keys(tokens, 16, extra_keys=["tenant-a", "lora:x"]) != chain_keys(
        tokens, 16, extra_keys=["tenant-al", "ora:x"])
    assert chain_keys(tokens, 16, extra_keys=["salt1"]) != chain_keys(tokens, 16, extra_keys=["salt", "1"])
    assert chain_keys(tokens, 16, extra_keys=["salt"]) == chain_keys(tokens, 16, extra_keys=[b"salt"])


@pytest.mark.parametrize("url, secret", [
    ("redis://user:s3cr/et@redis.example:6379/0", "s3cr"),
    ("redis://user:p@ss@redis.example:bad/0", "p@ss"),
    ("redis://:hunter2@/0", "hunter2"),
])
def test_a_bad_redis_url_never_shows_its_password(url, secret):
    """exp6: the scrub missed passwords containing / or @."""
    with pytest.raises(ConfigError) as err:
        parse_config({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "redis", "url": url,
                                                                         "max_bytes": 1 << 20}]})
    assert "secondary_tiers[0].url" in str(err.value)
    assert secret not in str(err.value) and "***" in str(err.value)


# ---------------------------------------------------------------- the directory


def test_a_promoted_block_dropped_while_making_room_never_enters_a_policy():
    """exp11: plan_load inserted a block into the host policy although making room had dropped it; the next
    plan_store raised KeyError (in vLLM, the scheduler died)."""
    d = Directory([TierSpec("host", 2, 1, kind=TierKind.HOST),
                   TierSpec("disk", 100, 1, admission=AdmissionRule(max_bytes_per_s=1))], clock=lambda: 0.0)
    complete_instantly(d, d.plan_store([b"A", b"B"]))
    complete_instantly(d, d.plan_store([b"X"]))  # B (the LRU leaf) is demoted: the budget allows one write
    assert d.residency(b"B") == {"disk": d.residency(b"B")["disk"]}
    d.plan_load([b"X"])  # a load of X in flight: X is pinned
    load_b = d.plan_load([b"B"])  # its parent A is the engine's own hit; making room evicts A, dropping B
    assert b"B" not in d.tier["host"].policy
    complete_instantly(d, load_b)
    d.finish_load(load_b)
    complete_instantly(d, d.plan_store([b"Y"]))  # raised KeyError
    assert d.orphans() == 0


# ---------------------------------------------------------------- the mover


def two_disk_config(tmp_path, disk_blocks: int = 2, disk1_blocks: int = 8):
    return parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, "secondary_tiers": [
        {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "d0"), "max_bytes": disk_blocks * (P + 4096)},
        {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "d1"), "max_bytes": disk1_blocks * (P + 4096)}]})


def test_a_second_fs_tier_takes_demotions_and_serves_them_exactly(tmp_path):
    """exp8: two fs tiers were accepted, but the first disk->disk1 demotion crashed (no path)."""
    blocks = [torch.full(SHAPE, i, dtype=DT) for i in range(6)]
    with TieredCache(two_disk_config(tmp_path), SHAPE, DT, model="test") as cache:
        for i, block in enumerate(blocks):
            assert cache.store([b"k%d" % i], [block]) == 1
            cache.flush()
        assert "disk1" in cache.directory.residency(b"k0")
        assert cache.snapshot()["moves"]["disk->disk1"] >= 1
        got = cache.load([b"k0"])
        assert len(got) == 1 and torch.equal(got[0], blocks[0])


def test_an_exception_in_a_mover_thread_fails_its_step_and_leaks_nothing(tmp_path):
    """exp2: a non-OSError in a mover chain abandoned the chain unreported: a copy stayed WRITING forever."""
    config = parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, "secondary_tiers": [
        {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "kv"), "max_bytes": 8 * (P + 4096)}]})
    with TieredCache(config, SHAPE, DT, model="test") as cache:
        real_write = DiskStore.write

        def failing_write(store, key, parent, src):
            if key == b"k0":
                raise RuntimeError("injected: not an OSError")
            return real_write(store, key, parent, src)

        cache.stores["disk"].write = failing_write.__get__(cache.stores["disk"])
        blocks = [torch.full(SHAPE, i, dtype=DT) for i in range(8)]
        for i, block in enumerate(blocks):
            cache.store([b"k%d" % i], [block])
            cache.flush()
        d = cache.directory
        assert not d.retiring() and not d.pinned()
        for key in list(d.blocks()):  # every copy is READY: nothing is stuck WRITING, no slot held for it
            assert set(d.residency(key).values()) == {CopyState.READY}, key
        assert d.tier["host"].used_blocks == len(d.keys_in("host")) == 2
        assert b"k0" not in d  # its demotion failed: the block is gone, not half-written
        got = cache.load([b"k7"])
        assert len(got) == 1 and torch.equal(got[0], blocks[7])


def test_a_failed_demotion_never_sends_other_bytes_through_to_the_shared_tier(tmp_path, redis_server):
    """exp3, exp3b: the chain abandoned by an exception still ran its write-through, which sent whatever the
    host slot held (another block's bytes) with a valid checksum: engine B loaded wrong KV."""
    def config(disk: bool, host_blocks: int):
        tiers = [{"type": "fs", **DEMOTE_ALL,
                  "root_dir": str(tmp_path / "kv"), "max_bytes": 8 * (P + 4096)}] if disk else []
        tiers.append({"type": "redis", "url": redis_server.url, "max_bytes": 64 * (P + 600)})
        return parse_config({"cpu_bytes_to_use": host_blocks * P, "block_size": 16, **SIGNED, "secondary_tiers": tiers})

    with (TieredCache(config(True, 1), SHAPE, DT, model="test") as a,
          TieredCache(config(False, 4), SHAPE, DT, model="test") as b):
        def failing_write(key, parent, src):
            raise RuntimeError("injected: not an OSError")

        a.stores["disk"].write = failing_write
        for i in range(3):  # each store evicts the one before: its demotion raises
            a.store([b"k%d" % i], [torch.full(SHAPE, i + 1, dtype=DT)])
            a.flush()
        for i in range(3):
            got = b.load([b"k%d" % i])
            assert not got or torch.equal(got[0], torch.full(SHAPE, i + 1, dtype=DT)), f"k{i}: wrong bytes served"
        assert any(b.load([b"k%d" % i]) for i in range(3)), "the write-throughs that could run did"


def test_two_fs_tiers_through_the_connector_release_every_held_request(tmp_path):
    """exp10: with two fs tiers, vLLM's blocks stayed held forever and has_pending_work stayed True."""
    engine = Engine(two_disk_config(tmp_path, disk_blocks=1))
    held: set[str] = set()
    try:
        for i in range(4):
            engine.kv[i].fill_(i + 1)
            holds, _ = engine.scheduler.request_finished(request(f"r{i}", [bytes([i + 1]) * 32], computed=16), [i])
            if holds:
                held.add(f"r{i}")
            sending, _ = engine.step()
            held -= sending or set()
        for _ in range(20):
            sending, _ = engine.step()
            held -= sending or set()
            if not held and not engine.scheduler.has_pending_work():
                break
            time.sleep(0.01)
        assert not held and not engine.scheduler.has_pending_work()
        assert "disk1" in engine.scheduler.directory.residency(bytes([1]) * 32 + b"\0\0")
    finally:
        engine.close()


def test_keys_a_store_cannot_hold_are_refused_at_the_door(tmp_path):
    """exp2's trigger: a key longer than the block header allows reached the disk store on demotion."""
    with TieredCache(parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16}), SHAPE, DT, model="test") as cache:
        with pytest.raises(ValueError, match="key"):
            cache.store([b"L" * 200], [torch.zeros(SHAPE, dtype=DT)])


# ---------------------------------------------------------------- the connector


def test_a_rank_that_failed_a_step_is_never_outvoted_by_a_later_ok():
    """exp1: with tensor parallelism a step took the latest rank's status: FAILED on rank 0, then OK on rank 1,
    completed READY, and a host copy rank 0 never wrote was served."""
    config = parse_config({"cpu_bytes_to_use": 2 * 4 * P, "block_size": 16, "engine_block_size": 16})
    s = SchedulerSide(loading_all(config), geometry(world_size=2))
    held, _ = s.request_finished(request("r1", [b"\x01" * 32, b"\x02" * 32], computed=32), [7, 8])
    assert held
    meta = s.build_connector_meta(STEP)
    puts = [st for c in meta.stores[0].chains for st in c if st.op is Op.PUT]
    s.update_connector_output(KVTierWorkerMetadata([puts[0].id, puts[1].id], {puts[0].id: Status.FAILED}))
    s.update_connector_output(KVTierWorkerMetadata([puts[0].id, puts[1].id]))
    assert s.directory.lookup([puts[0].key]) == []
    assert puts[0].key not in s.directory


def test_ranks_reports_merged_as_vllm_merges_them_complete_each_step_with_its_worst_status():
    """Each rank's completions, pickled and merged one pair at a time as vLLM does: a step both ranks reported in
    one message completes at once with the worst status either saw; one a rank has not reported yet waits for it."""
    import pickle

    config = parse_config({"cpu_bytes_to_use": 4 * 4 * P, "block_size": 16, "engine_block_size": 16})
    s = SchedulerSide(loading_all(config), geometry(world_size=2))
    for rid, first in (("r1", 1), ("r2", 3)):
        s.request_finished(request(rid, [bytes([first]) * 32, bytes([first + 1]) * 32], computed=32), [7, 8])
    meta = s.build_connector_meta(STEP)
    (a, b), (c, d) = ([st for ch in job.chains for st in ch if st.op is Op.PUT] for job in meta.stores)
    ranks = [KVTierWorkerMetadata([a.id, b.id, c.id, d.id]),
             KVTierWorkerMetadata([c.id, d.id, a.id], {a.id: Status.FAILED})]
    merged = pickle.loads(pickle.dumps(ranks[0])).aggregate(pickle.loads(pickle.dumps(ranks[1])))
    assert sorted(merged.reported) == sorted([a.id, a.id, b.id, c.id, c.id, d.id, d.id]) and merged.statuses == {
        a.id: Status.FAILED}
    s.update_connector_output(merged)
    assert s.directory.lookup([c.key, d.key]) == ["host", "host"]  # both ranks: OK at once
    assert s.directory.lookup([a.key]) == [] and a.key not in s.directory  # one rank failed it
    assert s.inflight.stores == 1  # r1's plan waits for rank 1's report of b
    s.update_connector_output(KVTierWorkerMetadata([b.id]))
    assert s.inflight.stores == 0 and not s.inflight.busy()


def test_a_restart_with_tensor_parallelism_recovers_and_bounds_every_rank(tmp_path):
    """exp4: the restart scan and trim ran for rank 0 only: rank 1's files exceeded max_bytes, its temp files
    stayed."""
    geo = geometry(world_size=2)
    config = parse_config({"cpu_bytes_to_use": 2 * 4 * P, "block_size": 16, "engine_block_size": 16,
                           "secondary_tiers": [{"type": "fs", **DEMOTE_ALL,
                                                "root_dir": str(tmp_path), "max_bytes": 2 * (P + 4096)}]})
    keys = [bytes([i]) * 34 for i in range(1, 7)]
    for rank in (0, 1):
        store = DiskStore(tmp_path, geo.namespace(rank), rank, P)
        for i, key in enumerate(keys):  # one chain of 6 blocks per rank: 3x the tier's capacity
            store.write(key, keys[i - 1] if i else None, torch.zeros(P, dtype=torch.uint8))
        store.close()
    stray = tmp_path / geo.namespace(1) / "1" / "aa"
    stray.mkdir(parents=True, exist_ok=True)
    (stray / "aabb.0123456789abcdef.tmp").write_bytes(b"x" * 8192)

    def files(rank: int) -> set[str]:
        return {p.name for p in (tmp_path / geo.namespace(rank)).rglob("*") if p.is_file() and p.name != ".lock"}

    workers = [DiskStore(tmp_path, geo.namespace(rank), rank, P, owner=geo.owner) for rank in (0, 1)]  # as vLLM's
    try:
        s = SchedulerSide(loading_all(config), geo)
    finally:
        for store in workers:
            store.close()
    assert s.directory.tier["disk"].used_blocks == 2 == len(files(0)) == len(files(1))
    assert files(0) == files(1), "the ranks hold the same blocks"
    assert not any(name.endswith(".tmp") for name in files(1))


def test_a_restart_never_plans_copies_it_does_not_run(tmp_path):
    """exp9: a restart with a smaller first fs tier planned COPY disk->disk1 for the excess; the caller took it
    for a delete and completed it OK: disk1 entries with no file."""
    def config(tiers):
        return parse_config({"cpu_bytes_to_use": P, "block_size": 16, "secondary_tiers": tiers})

    d0 = {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "d0"), "max_bytes": 4 * (P + 4096)}
    with TieredCache(config([d0]), SHAPE, DT, model="test") as cache:
        for i in range(5):
            cache.store([b"k%d" % i], [torch.full(SHAPE, i, dtype=DT)])
            cache.flush()
    d1 = {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "d1"), "max_bytes": 4 * (P + 4096)}
    with TieredCache(config([{**d0, "max_bytes": 2 * (P + 4096)}, d1]), SHAPE, DT, model="test") as cache:
        files = sum(1 for p in (tmp_path / "d1").rglob("*.kv"))
        assert cache.directory.tier["disk1"].used_blocks == files
        for key in cache.directory.keys_in("disk1"):
            got = cache.load([key])
            assert len(got) == 1 and torch.equal(got[0], torch.full(SHAPE, int(key[1:]), dtype=DT))


def test_two_engines_on_one_root_dir_cannot_exceed_its_bound(tmp_path):
    """exp5: two engines on one root_dir each bounded only their own files: bytes on disk were 2 x max_bytes."""
    config = parse_config({"cpu_bytes_to_use": P, "block_size": 16, "secondary_tiers": [
        {"type": "fs", **DEMOTE_ALL,
         "root_dir": str(tmp_path), "max_bytes": 4 * (P + 4096), "write_policy": "write_through"}]})
    with TieredCache(config, SHAPE, DT, model="test") as first:
        with pytest.raises(ValueError, match="root_dir"):
            TieredCache(config, SHAPE, DT, model="test")
        first.store([b"a"], [torch.zeros(SHAPE, dtype=DT)])
    with TieredCache(config, SHAPE, DT, model="test") as again:  # the first one closed: its lock went with it
        assert again.lookup([b"a"]) == 1


def test_an_overridden_hit_leaves_no_promise_behind(tmp_path):
    """exp13 (b): when vLLM overrode a hit (num_external_tokens 0), the promise stayed behind forever."""
    engine = Engine(parse_config({"cpu_bytes_to_use": 4 * P, "block_size": 16, "engine_block_size": 16}))
    try:
        engine.scheduler.request_finished(request("r0", [b"\x02" * 32], computed=16), [0])
        engine.drain()
        q = request("q2", [b"\x02" * 32, b"\x09" * 32])
        assert engine.scheduler.get_num_new_matched_tokens(q, 0)[0] == 16
        engine.scheduler.update_state_after_alloc(q, engine_blocks([]), 0)
        assert not engine.scheduler.promised(q.request_id)
        engine.scheduler.request_finished(q, [])
        assert not engine.scheduler.requests_known()
    finally:
        engine.close()


def test_an_asynchronous_load_never_runs_on_the_engine_thread(tmp_path):
    """exp13 (a): a disk hit is declared asynchronous to vLLM, but the worker ran it inside start_load_kv."""
    config = parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, "engine_block_size": 16, "secondary_tiers": [
        {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "kv"), "max_bytes": 8 * (P + 4096)}]})
    engine = Engine(config)
    try:
        for i in range(3):  # three one-block requests: host holds 2, the first is demoted to disk
            engine.kv[i].fill_(i + 1)
            engine.scheduler.request_finished(request(f"r{i}", [bytes([i + 1]) * 32], computed=16), [i])
            engine.drain()
        key = bytes([1]) * 32 + b"\0\0"
        assert "disk" in engine.scheduler.directory.residency(key)
        disk = engine.worker.stores.local["disk"]
        real_read = disk.read
        disk.read = lambda k, into: (time.sleep(0.5), real_read(k, into))[1]  # a slow disk
        q = request("q", [bytes([1]) * 32, bytes([9]) * 32])
        promised, is_async = engine.scheduler.get_num_new_matched_tokens(q, 0)
        assert promised == 16 and is_async
        engine.scheduler.update_state_after_alloc(q, engine_blocks([30, 31]), promised)
        meta = engine.scheduler.build_connector_meta(STEP)
        start = time.perf_counter()
        engine.worker.start(meta)
        assert time.perf_counter() - start < 0.25, "start_load_kv waited for the disk"
        for _ in range(100):  # vLLM polls get_finished every step until the load is reported
            _, recving = engine.worker.get_finished(set())
            if recving:
                break
            time.sleep(0.02)
        assert recving == {"q"}
        assert torch.equal(engine.kv[30], torch.full((P,), 1, dtype=torch.uint8))
        engine.scheduler.update_connector_output(engine.worker.worker_meta())
    finally:
        engine.close()


def scheduler_with_a_seeded_redis(redis_server, n: int) -> tuple[SchedulerSide, list[bytes], list[bytes]]:
    """A scheduler half with a Redis tier that already holds one chain of `n` blocks (another engine's)."""
    geo = geometry()
    config = parse_config({"cpu_bytes_to_use": 16 * P, "block_size": 16, "engine_block_size": 16, **SIGNED,
                           "secondary_tiers": [{"type": "redis", "url": redis_server.url,
                                                "max_bytes": 64 * (P + 600)}]})
    hashes = [bytes([i]) * 32 for i in range(1, n + 1)]
    keys = [h + b"\x00\x00" for h in hashes]
    other = RedisStore(redis_server.url, geo.namespace(0), P, 64 * (P + 600), auth_key=config.auth_key())
    other.put_many([(k, keys[i - 1] if i else None, torch.zeros(P, dtype=torch.uint8)) for i, k in enumerate(keys)])
    other.close()
    return SchedulerSide(loading_all(config), geo), hashes, keys


def test_an_aborted_request_stores_only_blocks_that_were_filled(redis_server):
    """exp7: a request aborted while its shared-tier fetch was cut short planned PUTs (and write-through) of
    engine blocks its own load job had declared unavailable. (Cut short here: Redis answered R's lookup, then Q's
    store of the first block began, and a load cannot take a block a transfer is on.)"""
    s, hashes, keys = scheduler_with_a_seeded_redis(redis_server, 4)
    r = request("R", hashes)
    s.get_num_new_matched_tokens(r, 0)
    time.sleep(0.3)  # the shared tier answers the lookup
    nr, _ = s.get_num_new_matched_tokens(r, 0)
    assert nr == 64
    s.request_finished(request("Q", hashes[:1], computed=16), [10])  # Q computed the first block: stored now
    r_ids = [20, 21, 22, 23, 24]
    s.update_state_after_alloc(r, engine_blocks(r_ids), nr)
    r.num_computed_tokens = nr  # vLLM: WAITING_FOR_REMOTE_KVS, num_computed_tokens set to the promise
    meta = s.build_connector_meta(STEP)
    load = next(j for j in meta.loads if j.request_id == "R")
    assert load.unavailable, "Q's store of the first block cut R's load short"
    s.request_finished(r, r_ids[:4])  # the abort, processed before update_from_output
    meta = s.build_connector_meta(STEP)
    read = {b for job in meta.stores for c in job.chains for st in c if st.op is Op.PUT
            for b in job.sources[st.index] if b is not None}
    assert not read & set(load.unavailable), "a PUT reads engine blocks that were never filled"
    assert not read & {b for t in load.targets for b in t if b is not None}, "a PUT reads blocks still loading"


def test_blocks_fetched_after_a_local_hit_are_served_and_never_kept_as_orphans(redis_server):
    """Found by reading: the first block fetched from Redis after vLLM's own prefix hit got parent=None, outside
    the drop cascade and the orphan audit. Fetched blocks are now read straight into the engine and never enter
    the directory: the request's store adds them, with their parents."""
    s, hashes, keys = scheduler_with_a_seeded_redis(redis_server, 3)
    r = request("R", hashes)
    s.get_num_new_matched_tokens(r, 16)  # vLLM holds the first block itself; kvtier does not
    time.sleep(0.3)
    n, _ = s.get_num_new_matched_tokens(r, 16)
    assert n == 32
    s.update_state_after_alloc(r, engine_blocks([5, 6, 7]), n)
    d = s.directory
    load = s.build_connector_meta(STEP).loads[0]
    assert [(st.src, st.dst) for c in load.chains for st in c] == [("redis", "caller")] * 2
    assert keys[1] not in d and keys[2] not in d and not d.retiring() and d.orphans() == 0
    s.update_connector_output(KVTierWorkerMetadata([st.id for c in load.chains for st in c]), {"R"})
    assert not d.pinned() and d.tier["host"].used_blocks == 0


def test_failed_disk_deletes_keep_their_bytes_counted(tmp_path):
    """Found by reading: a delete that failed still freed its bytes in the directory, so the files on disk
    exceeded max_bytes."""
    config = parse_config({"cpu_bytes_to_use": P, "block_size": 16, "secondary_tiers": [
        {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path), "max_bytes": 2 * (P + 4096)}]})
    with TieredCache(config, SHAPE, DT, model="test") as cache:
        disk = cache.stores["disk"]
        real_delete = disk.delete

        def failing_delete(key):
            if key == b"k0":
                raise OSError(5, "injected I/O error")
            return real_delete(key)

        disk.delete = failing_delete
        for i in range(8):
            cache.store([b"k%d" % i], [torch.full(SHAPE, i, dtype=DT)])
            cache.flush()
            files = sum(1 for _ in tmp_path.rglob("*.kv"))
            assert files * (P + 4096) <= 2 * (P + 4096), f"{files} files on a disk tier of 2 blocks"
        assert any(p.name == b"k0".hex() + ".kv" for p in tmp_path.rglob("*.kv")), "the injected failure kept k0"
        assert cache.snapshot()["failed_deletes"] == {"disk": 1}


def test_a_cache_reset_leaves_no_tier_serving_the_old_kv(tmp_path):
    """Found by reading: the connector did not implement reset_cache, so vLLM's reset_prefix_cache after a
    weight update left every tier serving KV of the old weights."""
    config = parse_config({"cpu_bytes_to_use": 4 * P, "block_size": 16, "engine_block_size": 16, "secondary_tiers": [
        {"type": "fs", **DEMOTE_ALL,
         "root_dir": str(tmp_path), "max_bytes": 8 * (P + 4096), "write_policy": "write_through"}]})
    engine = Engine(config)
    try:
        hashes = [bytes([i]) * 32 for i in range(1, 4)]
        engine.scheduler.request_finished(request("r", hashes, computed=48), [0, 1, 2])
        engine.drain()
        assert engine.scheduler.get_num_new_matched_tokens(request("again", hashes), 0) == (48, False)
        assert len(list(tmp_path.rglob("*.kv"))) == 3
        assert engine.scheduler.reset_cache()
        assert engine.scheduler.get_num_new_matched_tokens(request("after", hashes), 0) == (0, False)
        engine.drain()
        assert not list(tmp_path.rglob("*.kv")), "the old blocks' files are deleted"
        assert all(u.used_bytes == 0 for u in engine.scheduler.directory.usage().values())
        engine.scheduler.request_finished(request("new", hashes, computed=48), [0, 1, 2])  # the new weights' KV
        engine.drain()
        assert engine.scheduler.get_num_new_matched_tokens(request("hit", hashes), 0) == (48, False)
    finally:
        engine.close()


def test_a_cache_with_a_persistent_tier_must_name_its_model(tmp_path):
    """Found by reading: TieredCache named every model "in-process", so a disk tier served blocks of another
    model with the same block shape after a restart."""
    config = parse_config({"cpu_bytes_to_use": 2 * P, "block_size": 16, "secondary_tiers": [
        {"type": "fs", **DEMOTE_ALL,
         "root_dir": str(tmp_path), "max_bytes": 8 * (P + 4096), "write_policy": "write_through"}]})
    with pytest.raises(ValueError, match="model"):
        TieredCache(config, SHAPE, DT)
    with TieredCache(config, SHAPE, DT, model="weights A") as a:
        a.store([b"k"], [torch.ones(SHAPE, dtype=DT)])
    with TieredCache(config, SHAPE, DT, model="weights A") as a:
        assert a.lookup([b"k"]) == 1  # a restart of the same model finds it
    with TieredCache(config, SHAPE, DT, model="weights B") as b:
        assert b.lookup([b"k"]) == 0
    with TieredCache(config, SHAPE, DT, model="weights A") as a:  # B removed A's namespace (tests/test_bounds.py)
        assert a.lookup([b"k"]) == 0


def test_the_vllm_stats_path_carries_the_shared_tiers_bytes_and_its_lowered_bound(redis_server):
    """Found by reading (r_metrics_redis_vllm.py): in vLLM, kvtier_tier_used_bytes and kvtier_tier_capacity_bytes had
    no redis series, so the bound a Redis refusing puts for memory set (its oom cap) was invisible in /metrics."""
    config = parse_config({"cpu_bytes_to_use": 8 * P, "block_size": 16, "engine_block_size": 16, **SIGNED,
                           "secondary_tiers": [{"type": "redis", "url": redis_server.url,
                                                "max_bytes": 64 * (P + 600)}]})
    engine = Engine(config)

    def gauges(expected: tuple[int, int]) -> tuple[int | None, int | None]:
        """The stats path reads Redis on a thread of its own, at most once per SHARED_USAGE_S: the steps of a few
        such periods, until the reading that follows the change (or what the last one said)."""
        for _ in range(10):
            g = engine.scheduler.stats_payload()["gauges"]
            now = (g["tier_used_bytes"].get("redis"), g["tier_capacity_bytes"].get("redis"))
            if now == expected:
                break
            time.sleep(SHARED_USAGE_S / 2)
        return now

    value = P + blockformat.HEADER_NBYTES
    try:
        assert gauges((0, 64 * (P + 600))) == (0, 64 * (P + 600))
        engine.scheduler.request_finished(request("r", [bytes([i]) * 32 for i in range(1, 4)], computed=48), [0, 1, 2])
        engine.drain()
        assert int(redis_server.client().get(b"kvtier:!used")) == 3 * value
        assert gauges((3 * value, 64 * (P + 600))) == (3 * value, 64 * (P + 600))
        redis_server.client().set(b"kvtier:!cap", 5 * value, px=60_000)  # what a put refused for memory leaves
        assert gauges((3 * value, 5 * value)) == (3 * value, 5 * value)
    finally:
        engine.close()


class UpdatedInPlace(HarnessEngine):
    """An engine whose weights are updated in place once `updated` is set: it computes other KV for the same
    tokens (the namespace, taken at startup, stays the same)."""

    updated = False

    def compute(self, request: HarnessRequest, invalid: set[int]) -> None:
        super().compute(request, invalid)
        if self.updated:
            for i, block in enumerate(request.blocks):
                if i >= request.promised // 16 or block in invalid:
                    for kv in self.kv:
                        kv[block] ^= 0x55


def test_engines_sharing_redis_that_each_reset_once_never_share_a_generation(redis_server):
    """r_generation_shared.py: reset_cache appended a per-engine counter to every key, so engine B, after a reset of
    its own, hit the blocks engine A wrote after its weight update and reset: KV of other weights, served as exact."""
    config = parse_config({"cpu_bytes_to_use": 64 * P, "block_size": 16, "engine_block_size": 16, **SIGNED,
                           "secondary_tiers": [{"type": "redis", "url": redis_server.url, "max_bytes": 1 << 26}]})
    prompt = [bytes([7, i]) * 16 for i in range(4)]
    a = UpdatedInPlace(config)
    b = HarnessEngine(config)  # another replica of the same checkpoint, weights not updated
    try:
        a.run(a.admit_when_answered(HarnessRequest("a1", prompt)))
        a.drain()
        a.updated = True  # a weight update in place, then vLLM's reset_prefix_cache(reset_connector=True)
        a.scheduler.reset_cache()
        a.run(a.admit_when_answered(HarnessRequest("a2", prompt)))
        a.drain()
        values = [k for k in redis_server.client().scan_iter(b"kvtier:*") if b"!" not in k]
        assert len(values) == 8, "Redis holds the prompt's blocks of both weights"
        b.scheduler.reset_cache()  # B resets once too, for a reason of its own
        request = b.admit_when_answered(HarnessRequest("b1", prompt))
        assert request.promised == 0, "B was promised blocks that A computed with other weights"
        b.run(request)
        assert b.wrong == 0
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- the guard on vLLM's requests (../shared/repro2)


def guard_control(guard: dict, mono: list[float], wall: list[float]) -> SchedulerControl:
    """The scheduler half's guard over a host and a disk tier, on clocks the test moves."""
    config = parse_config({"cpu_bytes_to_use": 1 << 20, "guard": guard})
    directory = Directory([TierSpec("host", 1 << 20, 4096, kind=TierKind.HOST), TierSpec("disk", 1 << 24, 8192)])
    return SchedulerControl(config, directory, 4096, clock=lambda: mono[0], wall=lambda: wall[0])


def test_the_connectors_guard_holds_on_a_monotonic_clock_whatever_the_wall_clock_does():
    """r_guard_wallclock: the connector's guard ran on wall time: the wall clock stepped back an hour right after
    the disk went off kept it off an hour longer (and closed no window meanwhile). Holds, windows and probes run on
    a monotonic clock; TTFT is still taken from vLLM's arrival_time, wall time."""
    mono, wall = [1000.0], [1_700_000_000.0]
    control = guard_control({"ttft_p99_ms": 100, "window_s": 10, "breach_windows": 2, "of_windows": 3,
                             "min_requests": 5, "hold_s": 60}, mono, wall)
    i = 0
    while control.guard.enabled("disk"):  # every disk request has its first token 0.5 s after it arrived
        r = SimpleNamespace(request_id=f"r{i}", num_output_tokens=0, arrival_time=wall[0], num_prompt_tokens=64)
        control.route(r, engine_hit=False)
        control.served(r, ["disk"], engine_hit=False)
        mono[0] += 0.5
        wall[0] += 0.5
        r.num_output_tokens = 1
        control.step(STEP)
        control.finished(r)
        i += 1
    assert "ttft p99 500 ms" in control.guard.history[-1].reason  # TTFT: wall time, from arrival_time
    wall[0] -= 3600  # NTP steps the wall clock back an hour
    for _ in range(61):  # a minute of steps
        mono[0] += 1
        wall[0] += 1
        control.step(STEP)
    assert control.guard.state("disk") is TierState.PROBE


def test_requests_stuck_on_a_hung_tier_count_against_it_though_they_never_had_a_first_token():
    """r_guard_blind_to_hangs: the guard learnt only from first tokens and token gaps: requests stuck behind a
    hung disk, then aborted by their clients, gave it no sample, and the disk was never turned off. A request that
    ends without a first token counts its wait as its TTFT: it took at least that."""
    now = [1000.0]
    control = guard_control({"ttft_p99_ms": 500, "window_s": 10, "breach_windows": 1, "of_windows": 1,
                             "min_requests": 1, "hold_s": 600}, now, now)
    for i in range(200):  # 200 requests in 100 s; each got a disk hit, its load hangs, its client gives up after 30 s
        r = SimpleNamespace(request_id=f"r{i}", num_output_tokens=0, arrival_time=now[0], num_prompt_tokens=4096)
        control.route(r, engine_hit=False)
        control.served(r, ["disk"], engine_hit=False)
        control.step(STEP)
        now[0] += 0.5
        if i >= 60:
            control.finished(SimpleNamespace(request_id=f"r{i - 60}", num_output_tokens=0))
    assert control.guard.state("disk") is TierState.OFF
    assert control.guard.history[0].reason.startswith("ttft p99 30,500 ms > 500 ms")  # they waited 30 s and more


def charged(redis_server, tmp_path, slow: str) -> list[tuple[str, str]]:
    """One request whose prefix is read from disk (its first two blocks) and from Redis (its last two), with one
    of the two tiers slow (its reads sleep): the guard's transitions once its window closes (a budget of 1 ms:
    whichever tier the request is charged to goes off)."""
    from tests.connector_harness import Engine as Harness
    from tests.connector_harness import Request
    from tests.test_faults import h

    redis_tier = {"type": "redis", "url": redis_server.url, "max_bytes": 1 << 26}
    guard = {"ttft_p99_ms": 1, "window_s": 3600, "breach_windows": 1, "of_windows": 1, "min_requests": 1}
    writer = Harness(parse_config({"cpu_bytes_to_use": 64 * P, "block_size": 16, "engine_block_size": 16, **SIGNED,
                                   "secondary_tiers": [redis_tier]}))
    engine = Harness(parse_config({"cpu_bytes_to_use": 4 * P, "block_size": 16, "engine_block_size": 16, **SIGNED,
                                   "guard": guard, "secondary_tiers": [
                                       {"type": "fs", "root_dir": str(tmp_path / slow), "max_bytes": 1 << 24,
                                        "write_policy": "write_through", **DEMOTE_ALL}, redis_tier]}))
    try:
        prompt = [h(slow, i) for i in range(4)]
        engine.admit_when_answered(head := Request("head", prompt[:2], arrival_time=time.time()), step=False)
        engine.run(head)  # the first two blocks on disk (and in Redis)
        engine.drain()
        writer.admit_when_answered(stored := Request("w", prompt), step=False)
        writer.run(stored)
        writer.drain()  # all four in Redis
        for name in ("x", "y"):  # the head out of the 4-block host
            filled = Request(name, [h(slow, name, i) for i in range(2)], arrival_time=time.time())
            engine.admit_when_answered(filled, step=False)
            engine.run(filled)
        engine.drain()
        worker = engine.workers[0]
        if slow == "disk":
            store, name = worker.stores.local["disk"], "read"
        else:
            store, name = worker.stores.shared["redis"], "get_many"
        real = getattr(store, name)
        setattr(store, name, lambda *args: (time.sleep(0.3), real(*args))[1])
        engine.admit_when_answered(both := Request("both", prompt, arrival_time=time.time()), step=False)
        assert engine.scheduler.served_by_kind("both") == {TierKind.DISK: 32, TierKind.SHARED: 32}
        engine.run(both)
        assert engine.wrong == 0
        control = engine.scheduler.control
        control.control.tick(time.monotonic() + 3600)
        return [(t.tier, t.to.value) for t in control.guard.history]
    finally:
        writer.close()
        engine.close()


def test_a_request_is_charged_to_the_tier_whose_part_of_its_load_took_longest(redis_server, tmp_path):
    """r_guard_wrong_tier: a request read from disk, then Redis, was charged to Redis (the later tier by
    configuration) whatever was slow: a slow disk turned a healthy Redis off. The worker times each tier's part
    of a load, and the request goes to the tier that took longest."""
    assert charged(redis_server, tmp_path, slow="disk") == [("disk", "off")]
    assert charged(redis_server, tmp_path, slow="redis") == [("redis", "off")]


@pytest.mark.parametrize("per", [1, 4])
def test_a_requests_blocks_and_tokens_worked_out_in_bulk_are_what_each_block_gives(per: int):
    """The scheduler half works out a long request's engine blocks per kvtier block, the tokens each tier serves it,
    and the tokens per block its lookup weighs, from slices and counts rather than block by block: the same as the
    per-block rules, on random requests (a load starting inside a kvtier block vLLM partly holds, ending inside
    one)."""
    import random
    from collections import Counter

    from kvtier.integrations.vllm.tokens import tokens_by_block, tokens_served

    geo = Geometry(engine_block_size=16, block_tokens=16 * per, engine_block_nbytes=P, world_size=1, model="m",
                   dtype="bf16", kv_layout="x", hash_algo="sha256", tenant_salt="")
    config = parse_config({"cpu_bytes_to_use": 4 * 4 * P * per, "block_size": 16 * per, "engine_block_size": 16})
    half, bt, rng = SchedulerSide(config, geo), 16 * per, random.Random(per)
    for _ in range(2000):
        first, n = rng.randrange(0, 8), rng.randrange(0, 12)
        local, end = rng.randrange(0, (first + 2) * bt), rng.randrange(0, (first + n + 2) * bt)
        sources = [rng.choice(["host", "disk", "redis"]) for _ in range(n)]
        expected: Counter = Counter()
        for i, source in enumerate(sources):
            expected[source] += max(0, min((first + i + 1) * bt, end) - max((first + i) * bt, local))
        assert tokens_served(sources, first, bt, local, end) == expected
        lookup_first = local // bt  # the lookup weighs blocks from the one that holds the first token it lacks
        weighed = [min((lookup_first + i + 1) * bt, end) - max((lookup_first + i) * bt, local) for i in range(n)]
        while weighed and weighed[-1] <= 0:
            weighed.pop()
        assert tokens_by_block(lookup_first, n, bt, local, end) == weighed
        engine_ids = rng.sample(range(10_000), (first + n) * per + 1)
        held, stop = local // 16, end // 16
        assert half._engine_blocks(engine_ids, first, n, held, end) == [
            [engine_ids[j] if held <= j < stop else None for j in range(b * per, b * per + per)]
            for b in range(first, first + n)]


def test_a_requests_keys_are_kept_as_its_hashes_grow_and_never_reused_for_other_hashes():
    """The scheduler half makes a request's keys once and extends them as vLLM adds block hashes; keys kept for
    other hashes under the same request id (an id used again), or made before a cache reset, are made afresh."""
    from kvtier.integrations.vllm.requests import RequestState

    s = SchedulerSide(parse_config({"cpu_bytes_to_use": 4 * P, "block_size": 16, "engine_block_size": 16}),
                      geometry())
    fresh = SchedulerSide(parse_config({"cpu_bytes_to_use": 4 * P, "block_size": 16, "engine_block_size": 16}),
                          geometry())
    state, hashes = RequestState(), [bytes([i]) * 32 for i in range(1, 6)]
    first = s._keys(request("r", hashes[:3]), state)
    assert first == fresh._keys(request("r", hashes[:3])) and state.keys is first
    assert s._keys(request("r", hashes), state) == fresh._keys(request("r", hashes))  # grown by two
    other = [bytes([i]) * 32 for i in range(9, 15)]  # vLLM's hashes are chained: another prompt's all differ
    assert s._keys(request("r", other), state) == fresh._keys(request("r", other))  # under the same id
    assert s._keys(request("r", hashes[:2]), state) == fresh._keys(request("r", hashes[:2]))  # fewer hashes
    s.reset_cache()
    after_reset = s._keys(request("r", hashes), state)
    assert after_reset != fresh._keys(request("r", hashes)) and len(after_reset) == 5
    assert after_reset == s._keys(request("r", hashes))  # the new generation's keys, made afresh
