"""TieredCache end to end on real files: exact round trips, demotion, restart, faults, back-pressure, metrics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.guard import TierState
from kvtier.keys import chain_keys
from tests.conftest import (
    DEMOTE_ALL,
    SHAPE,
    make_config,
    native_threads_beyond_python,
    random_blocks,
    same_bytes,
    torch_kernel_in_a_thread,
)


def keys_for(n: int, salt: int = 0) -> list[bytes]:
    return chain_keys([salt * 100_000 + i for i in range(16 * n)], 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_round_trip_is_bit_identical(tmp_path, dtype):
    with TieredCache(make_config(tmp_path, 16, dtype=dtype), SHAPE, dtype, model="test") as cache:
        keys, blocks = keys_for(8), random_blocks(8, dtype)
        assert cache.store(keys, blocks) == 8
        cache.flush()
        got = cache.load(keys)
        assert len(got) == 8 and all(same_bytes(a, b) for a, b in zip(got, blocks))
        assert cache.snapshot()["lookup_tokens"] == {"host": 8 * 16, "miss": 0}


@pytest.mark.parametrize("stage_loads", [True, False], ids=["staged", "direct"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_disk_round_trip_through_demotion_is_bit_identical(tmp_path, dtype, stage_loads):
    config = make_config(tmp_path, 4, 32, dtype=dtype)
    with TieredCache(config, SHAPE, dtype, model="test", stage_loads=stage_loads) as cache:
        keys, blocks = keys_for(12), random_blocks(12, dtype, seed=1)
        for i in range(0, 12, 3):  # the host holds 4: older blocks are demoted to disk as we go
            cache.store(keys[i : i + 3], blocks[i : i + 3], parent=keys[i - 1] if i else None)
            cache.flush()
        snap = cache.snapshot()
        assert snap["moves"]["host->disk"] >= 8
        assert cache.lookup(keys) == 12
        got = cache.load(keys[:3])  # comes from disk: staged through host, or read straight into the result
        assert len(got) == 3 and all(same_bytes(a, b) for a, b in zip(got, blocks))
        moves = cache.snapshot()["moves"]
        assert moves.get("disk->host" if stage_loads else "disk->caller", 0) == 3
        assert "host" not in cache.directory.residency(keys[0]) or stage_loads
        if not stage_loads:  # storing what it used promotes it
            cache.store(keys[:3], got)
            cache.flush()
            assert cache.lookup(keys[:3]) == 3 and "host" in cache.directory.residency(keys[0])
            assert all(same_bytes(a, b) for a, b in zip(cache.load(keys[:3]), blocks))


def test_restart_recovers_every_valid_block(tmp_path):
    config = make_config(tmp_path, 16, 32, write_policy="write_through")
    keys, blocks = keys_for(10), random_blocks(10, seed=2)
    with TieredCache(config, SHAPE, torch.bfloat16, model="test") as cache:
        cache.store(keys, blocks)
        cache.flush()
    with TieredCache(config, SHAPE, torch.bfloat16, model="test") as cache:
        assert cache.lookup(keys) == 10
        assert cache.directory.residency(keys[0]) == {"disk": cache.directory.residency(keys[0])["disk"]}
        got = cache.load(keys)
        assert len(got) == 10 and all(same_bytes(a, b) for a, b in zip(got, blocks))


def _block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kv") if p.is_file())


def _file_of(cache: TieredCache, key: bytes) -> Path:
    from kvtier.stores.disk import file_name

    name = file_name(key)
    return next(p for p in _block_files(cache.stores["disk"].root) if p.name == name)


def test_flipped_payload_byte_is_a_miss_and_counted(tmp_path):
    config = make_config(tmp_path, 16, 32, write_policy="write_through")
    keys, blocks = keys_for(6), random_blocks(6, seed=3)
    with TieredCache(config, SHAPE, torch.bfloat16, model="test") as cache:
        cache.store(keys, blocks)
        cache.flush()
    with TieredCache(config, SHAPE, torch.bfloat16, model="test") as cache:  # host empty: every hit comes from disk
        path = _file_of(cache, keys[3])
        with open(path, "r+b") as f:
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        got = cache.load(keys)
        assert len(got) == 3  # the prefix stops at the corrupt block: never served
        assert all(same_bytes(a, b) for a, b in zip(got, blocks))
        cache.flush()
        snap = cache.snapshot()
        assert snap["integrity_failures"] == {"disk": 1}
        assert cache.lookup(keys) == 3 and snap["orphan_blocks"] == 0
        assert cache.lookup(keys[:3]) == 3  # the rest of the cache is unharmed


def test_restart_scan_removes_torn_foreign_temp_and_symlinks(tmp_path):
    config = make_config(tmp_path, 16, 32, write_policy="write_through")
    keys, blocks = keys_for(4), random_blocks(4, seed=4)
    other_keys = keys_for(2, salt=7)
    with TieredCache(config, SHAPE, torch.bfloat16, model="test") as cache:
        cache.store(keys, blocks)
        cache.store(other_keys, random_blocks(2, seed=5))
        cache.flush()
        root = cache.stores["disk"].root
        leaf = _file_of(cache, other_keys[1])
        torn = _file_of(cache, other_keys[0])
    os.truncate(torn, 5000)  # a torn write
    (leaf.parent / "stray.0123.tmp").write_bytes(b"half a block")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    os.symlink(outside, leaf.parent / "ffff.kv")
    with TieredCache(config, SHAPE, torch.bfloat16, model="test") as cache:
        assert cache.lookup(keys) == 4  # every valid block is back
        assert cache.lookup(other_keys) == 0  # torn root: it and its child are gone
        assert cache.snapshot()["orphan_blocks"] == 0
        assert not list(root.rglob("*.tmp")) and not (leaf.parent / "ffff.kv").is_symlink()
        assert outside.read_bytes() == b"not yours"  # the link's target is never touched
        assert cache.snapshot()["integrity_failures"]["disk"] >= 2
        got = cache.load(keys)
        assert all(same_bytes(a, b) for a, b in zip(got, blocks))


def test_other_namespace_never_hits(tmp_path):
    config = make_config(tmp_path, 16, 32, write_policy="write_through")
    keys = keys_for(3)
    with TieredCache(config, SHAPE, torch.bfloat16, model="test") as cache:
        cache.store(keys, random_blocks(3))
        cache.flush()
    with TieredCache(config, SHAPE, torch.float32, model="test") as other:  # another dtype = another namespace
        assert other.lookup(keys) == 0


def test_full_store_queue_drops_and_counts_without_blocking(tmp_path):
    config = make_config(tmp_path, 64, 64).model_copy(update={"queue_depth": 1})
    with TieredCache(config, SHAPE, torch.bfloat16, model="test") as cache:
        assert cache.mover.reserve_store()  # another store holds the only place in the queue
        accepted = cache.store(keys_for(3), random_blocks(3))
        assert accepted == 0
        assert cache.snapshot()["stores_dropped"] == {"queue_full": 3}
        cache.mover.release_store()
        assert cache.store(keys_for(3), random_blocks(3)) == 3


def test_tiers_stay_within_bytes_under_pressure(tmp_path):
    config = make_config(tmp_path, 6, 10)
    with TieredCache(config, SHAPE, torch.bfloat16, model="test") as cache:
        disk = cache.stores["disk"]
        stored = {}
        for r in range(12):
            keys, blocks = keys_for(4, salt=r), random_blocks(4, seed=r)
            stored.update(zip(keys, blocks))
            cache.store(keys, blocks)
            cache.flush()
            snap = cache.snapshot()["tiers"]
            assert snap["host"]["used_bytes"] <= snap["host"]["capacity_bytes"]
            assert snap["disk"]["used_bytes"] <= snap["disk"]["capacity_bytes"]
            assert disk.used_bytes() <= config.secondary_tiers[0].max_bytes
        assert cache.snapshot()["orphan_blocks"] == 0
        assert disk.files_reused > 0, "the full disk tier wrote over the files of the blocks it evicted"
        assert disk.used_bytes() == disk.footprint * cache.directory.tier["disk"].used_blocks, "no spare is left"
        served = 0
        for key in [key for key in cache.directory.keys_in("disk") if "host" not in cache.directory.residency(key)]:
            if cache.directory.residency(key):  # an earlier load's promotion may have evicted it since
                got = cache.load([key])
                assert len(got) == 1 and same_bytes(got[0], stored[key])
                served += 1
        assert served, "blocks written over reused files are served as they were stored"


def test_prometheus_families(tmp_path):
    with TieredCache(make_config(tmp_path, 8, 8), SHAPE, torch.bfloat16, model="test") as cache:
        keys = keys_for(2)
        cache.store(keys, random_blocks(2))
        cache.flush()
        cache.load(keys)
        text = cache.metrics.exposition().decode()
    for family in ("kvtier_lookup_tokens_total", "kvtier_moves_total", "kvtier_move_bytes_total",
                   "kvtier_move_seconds_bucket", "kvtier_tier_used_bytes", "kvtier_tier_capacity_bytes",
                   "kvtier_evictions_total", "kvtier_admission_rejects_total", "kvtier_stores_dropped_total",
                   "kvtier_integrity_failures_total", "kvtier_orphan_blocks", "kvtier_tier_enabled"):
        assert family in text, family
    assert 'kvtier_lookup_tokens_total{source="host"} 32.0' in text
    assert 'kvtier_moves_total{dst="host",src="caller"} 2.0' in text
    assert 'kvtier_move_seconds_count{dst="host",src="caller"} 2.0' in text  # a batch of 2: each move counted
    assert 'kvtier_move_seconds_bucket{dst="host",le="+Inf",src="caller"} 2.0' in text
    assert 'kvtier_admission_sightings_needed{tier="disk"} 1.0' in text  # min_sightings 1, as configured


def test_wrong_block_shape_is_refused(tmp_path):
    with TieredCache(make_config(tmp_path, 8), SHAPE, torch.bfloat16, model="test") as cache:
        with pytest.raises(ValueError, match="shape"):
            cache.store(keys_for(1), [torch.zeros(3, 3, dtype=torch.bfloat16)])


def test_the_guard_in_process_turns_off_the_tier_whose_requests_break_the_budget_and_probes_it_back(tmp_path):
    from kvtier.config import parse_config

    now = [0.0]
    guard = {"ttft_p99_ms": 100, "window_s": 1, "breach_windows": 1, "of_windows": 1, "min_requests": 2,
             "hold_s": 5, "probe_share": 1.0}
    config = parse_config({**make_config(tmp_path, 4, 32).model_dump(mode="json"), "guard": guard})
    with TieredCache(config, SHAPE, torch.bfloat16, model="test", clock=lambda: now[0]) as cache:
        keys, blocks = keys_for(9), random_blocks(9, seed=3)
        for i in range(0, 9, 3):  # the host holds 4: the first blocks end up on disk only
            cache.store(keys[i : i + 3], blocks[i : i + 3], parent=keys[i - 1] if i else None)
            cache.flush()
        assert cache.directory.lookup(keys[:2]) == ["disk", "disk"]

        def serve(rid: str, ttft_s: float) -> int:
            got = cache.load(keys[:2], request=rid)
            cache.report(rid, ttft_s=ttft_s)
            return len(got)

        def push_out_of_host(salt: int) -> None:  # other traffic fills the host tier
            cache.store(keys_for(6, salt=salt), random_blocks(6, seed=salt))
            cache.flush()

        assert serve("slow-1", 0.5) == 2  # from disk (staged in host), over budget
        serve("hot", 0.01)  # a host hit within budget
        push_out_of_host(1)
        assert serve("slow-2", 0.5) == 2
        now[0] = 1.0
        cache.report("late", ttft_s=0.01)  # the window closes: the disk's requests broke the budget
        assert not cache.guard.enabled("disk") and cache.guard.enabled("host")
        text = cache.metrics.exposition().decode()
        assert 'kvtier_tier_enabled{tier="disk"} 0.0' in text and 'kvtier_tier_enabled{tier="host"} 1.0' in text
        assert 'kvtier_guard_transitions_total{tier="disk",to="off"} 1.0' in text
        assert 'kvtier_guard_window_p99_seconds{signal="ttft",tier="disk"} 0.5' in text
        on_disk = cache.directory.keys_in("disk")
        push_out_of_host(2)  # evicts host blocks: none is demoted to the disk
        kept = set(cache.directory.keys_in("disk"))
        assert kept <= set(on_disk) and set(keys) <= kept  # nothing written, nothing wiped (but what the chain
        # invariant drops: blocks whose parent, in host only, had nowhere to go)
        assert cache.lookup(keys[:2]) == 0 and cache.load(keys[:2]) == []
        now[0] = 6.0  # held 5 s: on probe, and every request is the probe's (probe_share 1)
        got = cache.load(keys[:2], request="probe")
        assert len(got) == 2 and all(same_bytes(a, b) for a, b in zip(got, blocks[:2]))
        cache.report("probe", ttft_s=0.02)
        push_out_of_host(3)
        assert serve("probe-2", 0.02) == 2  # a probe window needs two of its requests (probe_share x 2)
        now[0] = 7.0
        cache.report("after", ttft_s=0.02)
        assert cache.guard.enabled("disk")
        assert cache.metrics.snapshot()["guard_transitions"] == {"disk/off": 1, "disk/probe": 1, "disk/on": 1}


def test_disk_moves_start_no_openmp_team(tmp_path):
    """A torch kernel in a mover thread would start an OpenMP team there (one more thread per team member),
    which stalls the engine's own team on a machine with few cores: promotions, demotions and the caller
    copies behind them must start none. Blocks of 1 MiB, large enough that torch would copy them in parallel."""
    shape, threads = (2, 2, 8, 64, 128), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 22).add_(1)  # this thread's own team, as the engine's thread has one
        block = 2 * 2 * 8 * 64 * 128 * 2
        config = parse_config({"cpu_bytes_to_use": 8 * block, "block_size": 16, "secondary_tiers": [
            {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "kv"), "max_bytes": 200 * (block + 4096)}]})
        gen = torch.Generator().manual_seed(7)
        with TieredCache(config, shape, torch.bfloat16, model="test") as cache:
            before = native_threads_beyond_python()
            for round_ in range(4):
                keys = chain_keys([round_ * 100_000 + i for i in range(16 * 12)], 16)
                blocks = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(12)]
                for i in range(0, 12, 3):  # the host holds 8: each store demotes, some make room first
                    cache.store(keys[i : i + 3], blocks[i : i + 3], parent=keys[i - 1] if i else None)
                    cache.flush()
                got = cache.load(keys[:6])  # promoted from disk, then copied out in a read thread
                assert len(got) == 6 and all(same_bytes(a, b) for a, b in zip(got, blocks))
            moves = cache.snapshot()["moves"]
            assert moves["host->disk"] >= 30 and moves["disk->host"] >= 12
            after = native_threads_beyond_python()
            assert after <= before  # fewer: another test's thread that was still exiting
            with torch_kernel_in_a_thread():  # the count sees the team such a thread starts
                assert native_threads_beyond_python() > after
    finally:
        torch.set_num_threads(threads)


def test_a_tier_on_probe_comes_back_once_the_traffic_moved_on_from_what_it_holds(tmp_path):
    """r_guard_probe_stuck: nothing is written to a tier on probe, so once the traffic had moved on to new
    prompts no request ever read it again: healthy, it stayed on probe for good. With no probe for of_windows
    windows it comes back on, takes writes again, and serves."""
    now = [0.0]
    block_tokens, shape = 16, (2, 16, 64)  # 4 KiB blocks
    config = parse_config({"cpu_bytes_to_use": 4 * 4096, "block_size": block_tokens, "secondary_tiers": [
        {"type": "fs", "root_dir": str(tmp_path / "kv"), "max_bytes": 1 << 24, "write_policy": "write_through",
         "admission": {"min_sightings": 1}}],
        "guard": {"ttft_p99_ms": 100, "window_s": 10, "breach_windows": 2, "of_windows": 3, "min_requests": 5,
                  "hold_s": 30, "probe_share": 0.5}})
    with TieredCache(config, shape, torch.float16, model="probe", clock=lambda: now[0]) as cache:
        served = []

        def request(prompt: int, disk_slow: bool) -> None:
            """A 2-block prefix loaded (what was stored), its latency reported, the prefix stored."""
            keys = chain_keys([prompt * 1000 + i for i in range(2 * block_tokens)], block_tokens)
            rid = f"r{len(served)}"
            cache.load(keys, request=rid)
            served.append(cache._requests.get(rid))
            cache.report(rid, ttft_s=2.0 if served[-1] == "disk" and disk_slow else 0.02)
            cache.store(keys, [torch.full(shape, float(prompt % 100), dtype=torch.float16) for _ in keys])
            cache.flush()
            now[0] += 0.25

        while now[0] < 60:  # 40 prompts in turn, the host holds 4 blocks: each comes back from the slow disk
            request(len(served) % 40, disk_slow=True)
        assert [(t.tier, t.to) for t in cache.guard.history] == [("disk", TierState.OFF)]
        first = len(served)
        while now[0] < 200:  # the disk is healthy; the traffic moved on to 40 new prompts
            request(1000 + len(served) % 40, disk_slow=False)
        assert cache.guard.enabled("disk")
        assert cache.guard.history[-1].reason.startswith("no probe in 3 windows of 10 s read it")
        assert served[-40:].count("disk") >= 30  # written again, and serving
        assert served[first:].count("disk") < len(served) - first  # not all along: on probe, nothing was there
