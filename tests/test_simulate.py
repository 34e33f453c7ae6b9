"""`kvtier simulate`: what is simulated is what runs (the same hits as TieredCache), the virtual clock charges
what the cost model says, and the recommendation follows the numbers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvtier.cache import TieredCache
from kvtier.cli import main
from kvtier.config import parse_config
from kvtier.layout import KVLayout
from kvtier.sim.configs import SimConfig
from kvtier.sim.cost import CostModel, ModelCompute, cost_model
from kvtier.sim.engine import EngineCache
from kvtier.sim.simulate import ServingSetup, held_blocks, recommend, simulate
from kvtier.traces.request import TraceRequest
from kvtier.traces.workloads import GENERATORS, generate_trace
from kvtier.traces.write import write_kvtier_jsonl

SHAPE = (2, 2, 4, 16, 64)  # layers, K/V, KV heads, tokens, head dim: one 16-token block, bf16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="bfloat16", name="tiny")
TINY = CostModel(LAYOUT, ModelCompute(params=1e6, attn_pair_flops=1.0), flops_per_s=1e12, itl_s=0.001)
PAYLOAD = 2 * 2 * 4 * 16 * 64 * 2


def sequential(requests: list[TraceRequest]) -> list[TraceRequest]:
    """Far apart in time: each request finishes (and is stored) before the next starts, as in a plain loop."""
    return [replace(r, timestamp=1000.0 * i) for i, r in enumerate(requests)]


def tiered_cache_hits(requests, extra: dict, engine_blocks: int, tmp_path) -> tuple[dict, dict]:
    """The in-process runtime driven as the vLLM connector drives the directory: engine prefix first, kvtier
    for the rest (disk hits read straight into the result), then every full block stored when the request
    finishes."""
    data = json.loads(json.dumps(extra))
    for tier in data.get("secondary_tiers", []):
        tier["root_dir"] = str(tmp_path / "kv")
        tier["o_direct"] = False
    block = torch.zeros(SHAPE, dtype=torch.bfloat16)
    engine = EngineCache(engine_blocks)
    hits = {"engine": 0}
    with TieredCache(parse_config(data), SHAPE, torch.bfloat16, model="test", stage_loads=False) as cache:
        assert cache.payload_nbytes == PAYLOAD == LAYOUT.bytes_per_block(16)
        for r in requests:
            keys = [b.to_bytes(8, "little") for b in r.blocks]
            in_engine = engine.hit_prefix(r.blocks)
            hits["engine"] += in_engine
            if in_engine < len(keys):
                cache.load(keys[in_engine:])
            engine.insert(r.blocks, held=held_blocks(r))
            cache.store(keys, [block] * len(keys), priority=r.priority)
            cache.flush()
        stats = cache.directory.stats
        hits.update(stats.lookup_blocks)
        return hits, dict(stats.evictions)


@pytest.mark.parametrize("extra", [
    {"cpu_bytes_to_use": 24 * PAYLOAD, "block_size": 16,
     "secondary_tiers": [{"type": "fs", "root_dir": "x", "max_bytes": 80 * (PAYLOAD + 4096)}]},
    {"cpu_bytes_to_use": 20 * PAYLOAD, "block_size": 16, "eviction_policy": "s3fifo", "admit_after_sightings": 2,
     "secondary_tiers": [{"type": "fs", "root_dir": "x", "max_bytes": 60 * (PAYLOAD + 4096),
                          "eviction_policy": "arc", "admission": {"min_priority": 40}}]},
], ids=["lru+disk", "s3fifo+arc-disk+admission"])
def test_simulator_and_tiered_cache_report_identical_hits(tmp_path, extra):
    workload = replace(GENERATORS["shared"], requests=160, block_tokens=16, system_blocks=4, document_blocks=6,
                       documents=12, unique_blocks=6, seed=5)
    requests = sequential(generate_trace(workload))
    dep = ServingSetup(TINY, block_tokens=16, engine_kv_bytes=16 * PAYLOAD, instances=1)  # holds a request
    [result] = simulate(requests, [SimConfig("under test", extra)], dep)
    expected, evictions = tiered_cache_hits(requests, extra, dep.engine_blocks, tmp_path)
    assert {k: v for k, v in result.hit_blocks.items() if v} == {k: v for k, v in expected.items() if v}
    assert dict(result.evictions) == evictions
    assert min(expected["engine"], expected["host"], expected["disk"], expected["miss"]) > 0  # every tier served


def test_configurations_replayed_in_processes_give_what_one_process_gives():
    """`simulate` replays configurations in processes of their own: the same results, in the same order, and
    one progress call per request of each configuration."""
    workload = replace(GENERATORS["shared"], requests=120, block_tokens=16, system_blocks=4, document_blocks=6,
                       documents=12, unique_blocks=6, seed=9)
    requests = generate_trace(workload)
    dep = ServingSetup(TINY, block_tokens=16, engine_kv_bytes=8 * PAYLOAD, instances=1)
    disk = {"type": "fs", "root_dir": "x", "max_bytes": 60 * (PAYLOAD + 4096)}
    configs = [SimConfig("engine only", None),
               SimConfig("+ host", {"cpu_bytes_to_use": 12 * PAYLOAD, "block_size": 16}),
               SimConfig("+ host + disk", {"cpu_bytes_to_use": 12 * PAYLOAD, "block_size": 16,
                                           "secondary_tiers": [disk]})]
    calls = [0]

    def count() -> None:
        calls[0] += 1

    alone = simulate(requests, configs, dep, workers=1)
    side_by_side = simulate(requests, configs, dep, on_request=count, workers=3)
    assert [r.as_dict() for r in side_by_side] == [r.as_dict() for r in alone]
    assert all((a.ttft_s == b.ttft_s).all() for a, b in zip(alone, side_by_side))
    assert calls[0] == len(requests) * len(configs)
    assert alone[2].hit_blocks["disk"] > 0  # the configurations differ: a mix-up would show


# ---------------------------------------------------------------- the virtual clock and the cost model


def request(t: float, blocks: tuple[int, ...], tokens: int = 512) -> TraceRequest:
    return TraceRequest(t, blocks, input_tokens=tokens * len(blocks), output_tokens=10, block_tokens=tokens)


def test_requests_queue_for_the_prefill_servers():
    cost = cost_model()
    dep = ServingSetup(cost, 512, engine_kv_bytes=cost.block_bytes(512), instances=1)
    trace = [request(0.0, (0, 1, 2, 3)), request(0.0, (4, 5, 6, 7))]
    [r] = simulate(trace, [SimConfig("engine only", None)], dep)
    alone = cost.prefill_seconds(2048)
    assert r.ttft_s[0] == pytest.approx(alone)
    assert r.ttft_s[1] == pytest.approx(2 * alone)  # waited for the only server
    [r2] = simulate(trace, [SimConfig("engine only", None)], replace(dep, instances=2))
    assert r2.ttft_s[1] == pytest.approx(alone)


def test_a_host_hit_costs_its_transfer_instead_of_its_prefill():
    cost = cost_model()
    dep = ServingSetup(cost, 512, engine_kv_bytes=cost.block_bytes(512), instances=1)  # engine: one block
    host = SimConfig("+ host", {"cpu_bytes_to_use": 16 * cost.block_bytes(512), "block_size": 512})
    trace = [request(0.0, (0, 1, 2, 3)), request(100.0, (9,)), request(200.0, (0, 1, 2, 3))]
    [r] = simulate(trace, [host], dep)
    assert dict(r.hit_blocks) == {"miss": 5, "host": 4}  # the engine's one block is block 9 by then
    load = cost.pcie.seconds(4 * cost.block_bytes(512))
    assert r.ttft_s[2] == pytest.approx(load + cost.prefill_seconds(1, 2047))
    assert r.moved_bytes["host->engine"] == 4 * cost.block_bytes(512)


def test_unique_prompts_get_engine_only_recommended():
    requests = generate_trace(replace(GENERATORS["unique"], requests=300))
    cost = cost_model()
    dep = ServingSetup(cost, 256, 4 << 30, instances=1)
    host = SimConfig("+ host", {"cpu_bytes_to_use": 64 << 30, "block_size": 256})
    results = simulate(requests, [SimConfig("engine only", None), host], dep)
    assert results[1].hit_tokens["host"] == 0
    choice, reasons = recommend(results)
    assert choice.config.extra is None
    assert any("not worth a tier" in r for r in reasons)


# ---------------------------------------------------------------- the command


def test_simulate_command_compares_configs_and_prints_the_vllm_config(tmp_path, capsys):
    path = tmp_path / "shared.jsonl"
    write_kvtier_jsonl(generate_trace(replace(GENERATORS["shared"], requests=600)), path)
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"kv_connector": "KVTierConnector", "kv_connector_extra_config": {
        "cpu_bytes_to_use": 64 << 30, "block_size": 256, "eviction_policy": "arc"}}))
    out_json, out_html = tmp_path / "s.json", tmp_path / "s.html"
    assert main(["simulate", str(path), "--config", str(mine), "--engine-kv-gib", "8",
                 "--json", str(out_json), "--html", str(out_html)]) == 0
    data = json.loads(out_json.read_text())
    names = [r["name"] for r in data["results"]]
    assert names == ["engine only", "mine.json"]
    base, tiered = data["results"]
    assert tiered["hit_blocks"]["host"] > 0 and tiered["ttft_s"]["p99"] < base["ttft_s"]["p99"]
    assert base["hit_blocks"]["engine"] == tiered["hit_blocks"]["engine"]
    recommended = data["recommended"]["kv_transfer_config"]
    assert recommended["kv_connector"] == "KVTierConnector"
    assert recommended["kv_connector_module_path"] == "kvtier.integrations.vllm"
    parse_config(recommended["kv_connector_extra_config"])  # what it prints, the runtime accepts
    out = capsys.readouterr().out
    assert "--kv-transfer-config" in out and "KVTierConnector" in out
    assert out_html.read_text().count("data:image/png;base64,") == 2


def test_bad_config_exits_2_naming_file_and_field(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_kvtier_jsonl(generate_trace(replace(GENERATORS["shared"], requests=20)), path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cpu_bytes_to_use": 1 << 30, "eviction_policy": "fifo"}))
    assert main(["simulate", str(path), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "eviction_policy" in err


# ---------------------------------------------------------------- the guard and the decision on the virtual clock

SLOW_DISK = {"type": "fs", "root_dir": "x", "max_bytes": 2 << 40}
GUARD = {"ttft_p99_ms": 3000, "window_s": 30, "breach_windows": 2, "of_windows": 3, "min_requests": 5, "hold_s": 120}


def test_the_guard_turns_a_slow_disk_off_and_the_decision_recomputes_instead():
    """A disk at 0.5 GB/s: loading a prefix from it takes seconds, recomputing it a fraction of one."""
    from kvtier.config import parse_guard

    requests = generate_trace(replace(GENERATORS["shared"], requests=1500, rate_per_s=4))
    dep = ServingSetup(cost_model(disk_gbs=0.5), 256, 4 << 30, instances=2)
    configs = [SimConfig(policy, {"cpu_bytes_to_use": 8 << 30, "block_size": 256, "load_policy": policy,
                                  "secondary_tiers": [SLOW_DISK]}) for policy in ("always", "auto")]
    always, auto = simulate(requests, configs, dep, guard=parse_guard(GUARD))
    tier, since, _ = always.guard_off()[0]
    assert tier == "disk" and since < always.end_s / 4  # off early on
    assert [t.to.value for t in always.guard[:2]] == ["off", "probe"]
    assert always.hit_blocks["disk"] > 0 and always.hit_blocks["host"] > 0  # the host tier stayed on
    assert not any(t.tier == "host" for t in always.guard)
    assert auto.load_decisions[("disk", "recompute")] > 0 and auto.load_decisions[("disk", "partial")] > 0
    assert auto.load_decisions[("host", "load")] > 0 and ("host", "recompute") not in auto.load_decisions
    assert auto.ttft(99) < always.ttft(99) and not auto.guard_off()  # the decision kept the budget on its own


def test_simulate_guard_flag_reports_when_the_tier_was_off(tmp_path, capsys):
    path = tmp_path / "shared.jsonl"
    write_kvtier_jsonl(generate_trace(replace(GENERATORS["shared"], requests=1500, rate_per_s=4)), path)
    mine = tmp_path / "always.json"
    mine.write_text(json.dumps({"cpu_bytes_to_use": 8 << 30, "load_policy": "always",
                                "secondary_tiers": [SLOW_DISK]}))
    out_json = tmp_path / "s.json"
    assert main(["simulate", str(path), "--config", str(mine), "--engine-kv-gib", "4", "--instances", "2",
                 "--disk-gbs", "0.5", "--guard", json.dumps(GUARD), "--json", str(out_json)]) == 0
    off = json.loads(out_json.read_text())["results"][1]["guard_off"]
    assert off[0]["tier"] == "disk" and off[0]["from_s"] < 200
    assert "load or recompute, and the guard" in capsys.readouterr().out
    assert main(["simulate", str(path), "--guard", '{"ttft_p99_ms": 1, "probe_share": 2}']) == 2
    assert "probe_share" in capsys.readouterr().err
