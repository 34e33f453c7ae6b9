"""`kvtier analyze` and `kvtier generate`: verdicts with reasons, figures that match what was generated, errors
that name the file, line and field, and reports that hold every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from kvtier.analyze.questions import Deployment, analyze
from kvtier.cli import main
from kvtier.sim.cost import cost_model
from kvtier.traces.kvtier_jsonl import read_kvtier_jsonl
from kvtier.traces.workloads import GENERATORS, generate_trace
from kvtier.traces.write import write_kvtier_jsonl


def trace_file(tmp_path, kind: str, **changes) -> str:
    path = tmp_path / f"{kind}.jsonl"
    write_kvtier_jsonl(generate_trace(replace(GENERATORS[kind], **changes)), path)
    return str(path)


def run_analyze(path: str, tmp_path, *options: str) -> dict:
    out = tmp_path / "analysis.json"
    assert main(["analyze", path, "--json", str(out), *options]) == 0
    return json.loads(out.read_text())


def failed(verdict: dict) -> set[str]:
    return {c["name"] for c in verdict["checks"] if c["ok"] is False}


# ---------------------------------------------------------------- verdicts, each with its reasons


def test_unique_prompts_do_not_fit_because_there_is_no_reuse(tmp_path, capsys):
    data = run_analyze(trace_file(tmp_path, "unique", requests=400), tmp_path)
    verdict = data["verdict"]
    assert not verdict["fits"]
    assert "reuse" in failed(verdict)
    assert verdict["headline"].startswith("tiering does not fit because prompts are (nearly) unique")
    assert data["q1_shared_prefixes"]["reused_token_share"] == 0.0
    assert data["q4_one_shot"]["one_shot_fraction"] == 1.0
    assert "tiering does not fit because" in capsys.readouterr().out


def test_shared_prefixes_fit_with_every_reason_given(tmp_path, capsys):
    data = run_analyze(trace_file(tmp_path, "shared", requests=1500), tmp_path, "--engine-kv-gib", "8")
    verdict = data["verdict"]
    assert verdict["fits"], verdict["headline"]
    assert [c["name"] for c in verdict["checks"]] == ["reuse", "pressure", "reach", "transfer", "latency"]
    assert verdict["headline"].startswith("tiering fits: ")
    for check in verdict["checks"]:  # every reason carries its number
        assert any(ch.isdigit() for ch in check["reason"]), check
    assert data["q1_shared_prefixes"]["reused_token_share"] > 0.5
    assert data["tier_hit_ratios"]["engine + host"] > data["tier_hit_ratios"]["engine"] + 0.02
    assert "tiering fits:" in capsys.readouterr().out


def test_no_memory_pressure_does_not_fit(tmp_path):
    verdict = run_analyze(trace_file(tmp_path, "shared", requests=600), tmp_path, "--engine-kv-gib", "4096")["verdict"]
    assert not verdict["fits"]
    assert failed(verdict) == {"pressure"}  # and nothing else: the tiers' reach is moot then
    assert "no memory pressure: the working set fits the engine's KV memory" in verdict["headline"]


def test_a_ttft_budget_the_transfer_path_cannot_meet_does_not_fit(tmp_path):
    path = trace_file(tmp_path, "shared", requests=600)
    verdict = run_analyze(path, tmp_path, "--engine-kv-gib", "8", "--ttft-budget-ms", "5",
                          "--model", "llama-3.1-70b")["verdict"]
    assert failed(verdict) == {"latency"}
    assert "the transfer path cannot meet the 5 ms TTFT budget" in verdict["headline"]


def test_a_slow_link_loses_to_recompute(tmp_path):
    path = trace_file(tmp_path, "shared", requests=300)
    verdict = run_analyze(path, tmp_path, "--engine-kv-gib", "1", "--pcie-gbs", "0.5")["verdict"]
    assert "transfer" in failed(verdict)
    assert "is slower than recomputing it" in verdict["headline"]


# ---------------------------------------------------------------- figures match the generator's parameters


@pytest.mark.parametrize("think_time_s", [5.0, 40.0])
def test_reuse_time_is_the_sessions_think_time(think_time_s):
    """Sessions alone (no shared system prompt): every reuse is a turn coming back after one think time."""
    workload = replace(GENERATORS["sessions"], requests=3000, think_time_s=think_time_s, seed=3)
    a = analyze(generate_trace(workload), Deployment(cost_model()))
    reuse = a.stats.reuse_time
    assert reuse.mean == pytest.approx(think_time_s, rel=0.08)
    assert reuse.quantile(0.5) == pytest.approx(think_time_s * 0.693, rel=0.15)  # exponential median: ln 2 x mean
    assert a.stats.one_shot()["one_shot_fraction"] > 0  # the last turn of every session is never reused


def test_shared_prefix_figures_match_the_workload():
    workload = replace(GENERATORS["system"], requests=800, tenants=2, system_prompts=3, system_blocks=8)
    a = analyze(generate_trace(workload), Deployment(cost_model()))
    top = a.stats.top_prefixes()
    assert len(top) == 6  # 3 system prompts per tenant, tenants never share
    assert {p.blocks for p in top} == {8}
    assert sum(p.requests for p in top) == 800
    # every request after the first of its prompt reuses 8 of its 9 blocks
    assert a.stats.reused_token_share == pytest.approx((800 - 6) * 8 / (800 * 9))
    assert a.max_hit_ratio == pytest.approx(a.stats.reused_token_share)  # the curve agrees at infinity


def test_written_traces_read_back_unchanged(tmp_path):
    requests = generate_trace(replace(GENERATORS["shared"], requests=200))
    write_kvtier_jsonl(requests, tmp_path / "t.jsonl")
    assert list(read_kvtier_jsonl(tmp_path / "t.jsonl")) == requests


def test_generate_command_writes_a_seeded_trace(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["generate", "sessions", str(a), "--requests", "50", "--seed", "7", "--think-time", "12"]) == 0
    assert main(["generate", "sessions", str(b), "--requests", "50", "--seed", "7", "--think-time", "12"]) == 0
    assert a.read_text() == b.read_text() and len(a.read_text().splitlines()) == 50


# ---------------------------------------------------------------- bad input: exit 2, naming file, line, field


def test_malformed_trace_exits_2_naming_file_line_and_field(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]}
    path.write_text("\n".join([json.dumps(good), json.dumps(good),
                               json.dumps({**good, "hash_ids": [0, "x"]})]) + "\n")
    for command in ("analyze", "simulate"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{path}:3: field 'hash_ids'" in err, err


def test_missing_trace_exits_2(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl: no such trace file" in capsys.readouterr().err


# ---------------------------------------------------------------- reports


def test_json_and_html_hold_the_figures(tmp_path):
    path = trace_file(tmp_path, "shared", requests=400)
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    assert main(["analyze", path, "--json", str(out_json), "--html", str(out_html), "--engine-kv-gib", "4"]) == 0
    data = json.loads(out_json.read_text())
    for key in ("q1_shared_prefixes", "q2_reuse", "q3_block_size", "q4_one_shot", "mrc", "verdict", "deployment"):
        assert key in data
    assert data["q2_reuse"]["reuse_time_s"]["count"] == data["q2_reuse"]["reuse_distance_bytes"]["count"] > 0
    assert {row["block_tokens"] for row in data["q3_block_size"]} >= {16, 256, 2048}
    mrc = data["mrc"]
    assert mrc["hit_ratio_tokens"] == sorted(mrc["hit_ratio_tokens"])  # a curve never falls with capacity
    assert mrc["hit_ratio_tokens"][-1] == pytest.approx(data["q1_shared_prefixes"]["reused_token_share"])
    page = out_html.read_text()
    assert page.count("<img") == 3 and "data:image/png;base64," in page
    assert data["verdict"]["headline"].split(":")[0] in page
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")  # self-contained


def test_analyzer_and_simulator_import_neither_torch_nor_vllm(tmp_path):
    path = trace_file(tmp_path, "shared", requests=100)
    code = ("import sys; from kvtier.cli import main; "
            f"assert main(['analyze', {path!r}]) == 0; "
            f"assert main(['simulate', {path!r}, '--engine-kv-gib', '1', '--host-gib', '2', '--disk-gib', '4']) == 0; "
            "import kvtier.sim.simulate, kvtier.report, kvtier.sim.present; "
            "print('torch' in sys.modules, 'vllm' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stderr.split()[-2:] == ["False", "False"]
