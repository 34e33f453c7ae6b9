"""`kvtier bench --quick` runs end to end and writes every named figure (speed itself is never asserted here)."""

from __future__ import annotations

import json
import statistics

from kvtier.cli import main


def test_bench_quick_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out), "--root", str(tmp_path / "disk")]) == 0
    result = json.loads(out.read_text())
    for name in ("host_vs_copy", "disk_write_vs_raw", "disk_write_full_vs_raw", "disk_read_vs_raw",
                 "lookup_keys_per_s", "scheduler_vs_vllm_hashing", "large_blocks_vs_vllm_hashing"):
        assert isinstance(result[name], (int, float)) and result[name] > 0, name
    disk = result["disk"]  # every full write took the files of the blocks it deleted (the warm-up's too)
    assert disk["files_reused"] == disk["blocks"] * (len(disk["write_full"]["ours_gbps_runs"]) + 1)
    assert len(result["host_vs_copy_by_size"]) == 3  # 256 KiB, 1 MiB, 4 MiB blocks
    assert set(result["disk_by_size"]) == {"2MiB", "8MiB"}  # the quick run's other disk block sizes
    assert all(case[side]["ratio"] > 0 for case in result["disk_by_size"].values()
               for side in ("write", "write_full", "read"))
    pages = result["engine_pages"]  # the tiny model's pages and Llama-3.1-8B's, each also as per-part copies
    assert [case["parts_per_block"] for case in pages] == [16, 1024]
    assert result["engine_pages_vs_copy"] == min(case["ratio"] for case in pages) > 0
    assert all(case["parts"]["ratio"] > 0 and case["parts"]["bytes"] == case["bytes"] for case in pages)
    assert set(result["targets"]) == {"host_vs_copy", "disk_write_vs_raw", "disk_write_full_vs_raw", "disk_read_vs_raw",
                                      "lookup_keys_per_s", "redis_vs_raw", "redis_cluster_vs_raw"}
    assert result["redis_vs_raw"] == result["redis"]["min_ratio"] == min(
        min(statistics.median(c["put_ratio_runs"]), statistics.median(c["get_ratio_runs"]))
        for c in result["redis"]["redis_vs_raw"].values())
    assert result["sim"]["mrc_equals_libcachesim"]  # the timed curve is the right one
    assert result["sim"]["replay_lru_hit_ratio"] == result["sim"]["libcachesim_lru_hit_ratio"]
    assert set(result["redis"]["redis_vs_raw"]) == {"256KiB", "1MiB", "4MiB"}
    assert all(case["tier_get_GBps"] > 0 and case["tier_put_GBps"] > 0
               for case in result["redis"]["redis_vs_raw"].values())


def test_the_simulator_table_shows_every_replay_target_and_its_verdict():
    from rich.console import Console

    from kvtier.bench.simulator import TARGETS
    from kvtier.bench.tables import print_simulator

    sim = {"accesses": 10, "targets": TARGETS, "replay_lru_accesses_per_s": 4e6, "replay_arc_accesses_per_s": 2e6,
           "replay_s3fifo_accesses_per_s": 5e6,
           "targets_met": {"replay_lru_accesses_per_s": True, "replay_arc_accesses_per_s": False,
                           "replay_s3fifo_accesses_per_s": True}}
    console = Console(record=True, width=200)
    print_simulator(console, sim)
    rows = {line.split()[1]: line for line in console.export_text().splitlines() if "replay_" in line}
    for policy, verdict in (("lru", "ok"), ("arc", "MISSED"), ("s3fifo", "ok")):
        name = f"replay_{policy}_accesses_per_s"
        assert f"≥ {TARGETS[name] / 1e6:.2f} M/s" in rows[name] and rows[name].rstrip(" │").endswith(verdict)


def test_the_weights_bench_measures_each_start_and_leaves_nothing(tmp_path):
    """`python -m kvtier.bench.weights`, small: every figure there, a restart reads no byte, the file is gone."""
    from kvtier.bench.weights import run

    result = run(gib=1 / 16, root=tmp_path, threads=(1, 2), reps=1)
    assert set(result["cold"]) == {"raw_read", "threads_1", "threads_2"}
    assert set(result["page_cache"]) == {"threads_1", "threads_2"}
    assert all(f["gbps"] > 0 for phase in ("cold", "page_cache") for f in result[phase].values())
    assert result["cached_start"]["first_start_bytes_read"] == result["bytes"] == 64 << 20
    assert result["cached_start"]["bytes_read"] == 0
    assert not list(tmp_path.iterdir())


def test_scheduler_cost_is_measured_beside_vllms_hashing():
    """`kvtier.bench.scheduler` on a short prompt: both sides timed, stores and loads of the whole chain, with
    and without eviction, in kvtier blocks of vLLM's 16 tokens and of 256 (the same prompt for vLLM's hashing)."""
    from kvtier.bench.scheduler import WarmDirectory, _case

    for evict in (False, True):
        case = _case(64 * 16, evict, rounds=1)
        assert case["blocks"] == 64 and case["evict"] is evict
        assert all(case[k] > 0 for k in ("store_ms", "load_ms", "store_vllm_hashing_ms", "store_ratio", "load_ratio"))
    case = _case(64 * 16, True, rounds=1, demote=True)  # host + disk: the store, both tiers full
    assert case["demote"] and case["store_ms"] > 0 and case["store_ratio"] > 0 and "load_ms" not in case
    large = _case(64 * 16, True, rounds=1, block_tokens=256)
    assert large["blocks"] == 4 and large["block_tokens"] == 256 and large["tokens"] == 64 * 16
    assert large["load_ms"] > 0 and large["store_vllm_hashing_ms"] > 0
    d = WarmDirectory(64, True, rounds=1, demote=True)
    stats = d.directory.stats
    before = (stats.evictions[("host", "capacity")], stats.evictions[("disk", "capacity")],
              stats.planned_moves[("host", "disk")])
    d.store()  # each of its 64 blocks evicts one from host, demoted to disk, which evicts one
    assert (stats.evictions[("host", "capacity")], stats.evictions[("disk", "capacity")],
            stats.planned_moves[("host", "disk")]) == tuple(n + 64 for n in before)


def test_a_request_through_the_connectors_hooks_is_timed_beside_vllms_hashing():
    """`hooks`: a miss stores the prompt through the connector's scheduler half, a hit of it loads it back (the
    bench raises if the hit is not promised every token), each round beside vLLM's hashing of the prompt."""
    from kvtier.bench.connector import hooks

    figures = hooks(64 * 16, rounds=3)
    assert figures["blocks"] == 64
    for part in ("hit", "miss"):
        assert figures[f"{part}_ms"] > 0 and figures[f"{part}_vllm_hashing_ms"] > 0
        assert len(figures[f"{part}_ratio_runs"]) == 3


def test_a_requests_jobs_are_timed_as_sent_to_the_ranks():
    """`sent`: a request's load and store jobs pickled as vLLM's multiprocess executor sends them (beside vLLM's
    hashing of the prompt) and unpickled as a rank gets them, with a step per block in them."""
    from kvtier.bench.connector import sent

    figures = sent(64 * 16, rounds=2)
    assert figures["blocks"] == 64
    for part in ("load", "store"):
        assert figures[f"{part}_sent_ms"] > 0 and figures[f"{part}_received_ms"] > 0
        assert figures[f"{part}_sent_ratio"] > 0 and len(figures[f"{part}_sent_ratio_runs"]) == 2
        assert figures[f"{part}_sent_bytes"] > 64 * 16  # every block's key travels


def test_the_collectors_cost_counts_the_directorys_objects_alone():
    """`collector`: a full directory, three objects the collector tracks per block (the block, its copies' dict,
    its copy: a single child is held as its key, no set); stores timed with the collector off and on; the rest of
    the heap frozen while it is measured, thawed after, and the collector left as it was."""
    import gc

    from kvtier.bench.scheduler import collector

    frozen, enabled = gc.get_freeze_count(), gc.isenabled()
    figures = collector(20_000, rounds=2, stores=2)
    assert figures["blocks"] == 20_000 and figures["tracked_objects_per_block"] == 3
    assert len(figures["full_collection_ms_runs"]) == 2 and figures["full_collection_ms"] > 0
    assert figures["store_ms_collector_on"] > 0 and figures["store_ms_collector_off"] > 0
    assert figures["full_collections_while_storing"] >= 1  # 2 x 8,192 new blocks on 20,000: a full one came due
    assert gc.get_freeze_count() == frozen and gc.isenabled() == enabled
