"""`--profile FILE` on analyze, simulate and plan: the fits are recovered from noisy points, a profile that cannot be
used is refused naming its file, the commands' figures follow the profile's, every report says which numbers
were measured and which are defaults, and a profile of another model (refused) or machine (warned) is named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli import main
from kvtier.layout import preset
from kvtier.sim.profile import Profile, ProfileError, fit_line, fit_prefill_curve, load_profile, machine_identity

TRACE = str(Path(__file__).parent / "data" / "traces" / "mooncake_small.jsonl")
LLAMA_8B = {"model": "meta-llama/Llama-3.1-8B-Instruct", "block_size": 16,
            "kv_bytes_per_token": preset("llama-3.1-8b").bytes_per_token}
SIZES = [(n, c) for n in (16, 64, 256, 1024, 4096) for c in (0, 1024, 8192)]


def prefill_points(fixed: float, per_token: float, per_pair: float, noise: float = 0.0,
                   seed: int = 0) -> list[tuple[int, int, float]]:
    rng = np.random.default_rng(seed)
    return [(n, c, (fixed + per_token * n + per_pair * (n * c + n * (n + 1) / 2)) * (1 + noise * rng.standard_normal()))
            for n, c in SIZES for _ in range(2)]


def write_profile(path: Path, fixed: float = 0.02, per_token: float = 1e-4, per_pair: float = 1e-9,
                  machine: dict | None = None, server: dict | None = None, host_gbs: float | None = 10.0) -> Path:
    """A profile fitted to exact synthetic points: the figures a command prints must be these."""
    decode = fit_line([(b, 0.012 + 3e-4 * b) for b in (1, 2, 4, 8, 16)], "decode")
    tiers = {}
    if host_gbs is not None:
        tiers["host"] = fit_line([(k * 2**21, 30e-6 + k * 2**21 / (host_gbs * 1e9)) for k in (1, 4, 16, 64)], "host")
    prefill = fit_prefill_curve(prefill_points(fixed, per_token, per_pair))
    Profile(machine or machine_identity(), server or LLAMA_8B, prefill, decode, tiers).write(path)
    return path


def flat(text: str) -> str:
    """The terminal text with rich's line wrapping undone."""
    return " ".join(text.split())


# ---------------------------------------------------------------- fitting and reading


def test_fit_prefill_recovers_its_coefficients_from_noisy_points():
    fit = fit_prefill_curve(prefill_points(0.03, 1.5e-4, 2e-8, noise=0.03, seed=1))
    assert fit.fixed_s == pytest.approx(0.03, rel=0.1)
    assert fit.per_token_s == pytest.approx(1.5e-4, rel=0.1)
    assert fit.per_pair_s == pytest.approx(2e-8, rel=0.1)
    assert 0.01 < fit.relative_rms < 0.06  # the 3% noise, not a perfect fit and not a miss


def test_fit_line_recovers_intercept_and_slope_from_noisy_points():
    rng = np.random.default_rng(2)
    fit = fit_line([(b, (0.01 + 5e-4 * b) * (1 + 0.03 * rng.standard_normal())) for b in (1, 2, 4, 8, 16, 32, 64)
                    for _ in range(2)], "decode")
    assert fit.intercept == pytest.approx(0.01, rel=0.1) and fit.slope == pytest.approx(5e-4, rel=0.1)
    assert fit.bytes_per_s == pytest.approx(1 / fit.slope)
    assert 0.01 < fit.relative_rms < 0.06


def test_a_fit_that_misses_its_points_is_refused_naming_the_fit_and_the_file(tmp_path, capsys):
    path = write_profile(tmp_path / "p.json")
    data = json.loads(path.read_text())
    wild = [(n, c, t * (4.0 if i % 2 else 0.25)) for i, (n, c, t) in enumerate(prefill_points(0.02, 1e-4, 1e-9))]
    refit = fit_prefill_curve(wild)  # the form cannot follow times that jump 16x between neighbours
    assert refit.relative_rms > 0.25
    data["prefill"] = {**data["prefill"], "points": wild, "relative_rms": refit.relative_rms}
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"p\.json: prefill: the fit misses its own points"):
        load_profile(path)
    assert main(["simulate", TRACE, "--profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert "p.json" in err and "prefill" in err


@pytest.mark.parametrize(("content", "words"), [
    (None, "cannot read profile"),
    ("{not json", "not valid JSON"),
    (json.dumps({"kvtier_profile": 99}), "kvtier_profile 99"),
    (json.dumps({"kvtier_profile": 1, "machine": {}}), "malformed profile"),
])
@pytest.mark.parametrize("command", ["analyze", "simulate", "plan"])
def test_a_bad_profile_file_exits_2_naming_the_file(tmp_path, capsys, command, content, words):
    path = tmp_path / "bad-profile.json"
    if content is not None:
        path.write_text(content)
    args = [command, TRACE] if command != "plan" else ["plan"]
    assert main([*args, "--profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and words in err


# ---------------------------------------------------------------- simulate


def simulate(tmp_path, capsys, profile: Path, *options: str) -> tuple[dict, str]:
    out = tmp_path / f"sim-{profile.stem}.json"
    assert main(["simulate", TRACE, "--profile", str(profile), "--instances", "8", "--json", str(out),
                 *options]) == 0
    return json.loads(out.read_text()), flat(capsys.readouterr().out)


def test_simulate_ttft_follows_the_profile_and_says_what_was_measured(tmp_path, capsys):
    slow, text = simulate(tmp_path, capsys, write_profile(tmp_path / "slow.json", fixed=2.0))
    assert slow["results"][0]["ttft_s"]["p50"] >= 2.0  # every recompute pays the engine's fixed cost
    sources = slow["deployment"]["cost_source"]
    assert sources["prefill"].startswith(f"measured (profile {tmp_path / 'slow.json'}, 30 points, rms 0.0%)")
    assert sources["decode"].startswith("measured") and sources["pcie"].startswith("measured")
    assert "10 GB/s" in sources["pcie"] and "load from host" in sources["pcie"]
    assert sources["disk"] == "default 6 GB/s" and sources["network"] == "default 12.5 GB/s"
    assert slow["deployment"]["profile"] == str(tmp_path / "slow.json") and slow["warnings"] == []
    assert f"cost model: measured (profile {tmp_path / 'slow.json'}): prefill" in text
    assert "default: disk 6 GB/s, network 12.5 GB/s" in text and "another machine" not in text

    # fixed and attention costs 0: TTFT is per_token x new tokens, so doubling per_token doubles every TTFT (each
    # prefill ends before the next request arrives, so the engine's hits are the same in both)
    one, _ = simulate(tmp_path, capsys, write_profile(tmp_path / "one.json", fixed=0, per_token=1e-4, per_pair=0))
    two, _ = simulate(tmp_path, capsys, write_profile(tmp_path / "two.json", fixed=0, per_token=2e-4, per_pair=0))
    for q in ("p50", "p99"):
        assert two["results"][0]["ttft_s"][q] == pytest.approx(2 * one["results"][0]["ttft_s"][q], rel=0.02)
    assert one["results"][0]["ttft_s"]["p50"] < slow["results"][0]["ttft_s"]["p50"]


def test_without_a_profile_every_figure_is_a_default_or_the_flag_given(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", TRACE, "--pcie-gbs", "10", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["deployment"]["cost_source"] == {
        "prefill": "default 400 TFLOP/s effective", "decode": "default 20 ms per token", "pcie": "stated 10 GB/s",
        "disk": "default 6 GB/s", "network": "default 12.5 GB/s"}
    assert data["deployment"]["profile"] is None
    assert "cost model: stated: pcie 10 GB/s; default: prefill 400 TFLOP/s" in flat(capsys.readouterr().out)


def test_a_flag_for_a_figure_the_profile_measured_exits_2_naming_it_and_others_apply(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json")  # prefill, decode and host measured; disk and redis not
    for flag, value in (("--tflops", "300"), ("--pcie-gbs", "5"), ("--itl-ms", "10")):
        assert main(["simulate", TRACE, "--profile", str(profile), flag, value]) == 2
        err = capsys.readouterr().err
        assert flag in err and "p.json" in err
    data, text = simulate(tmp_path, capsys, profile, "--network-gbs", "3", "--disk-gbs", "6")
    sources = data["deployment"]["cost_source"]
    assert sources["network"] == "stated 3 GB/s" and sources["disk"] == "default 6 GB/s"
    assert data["deployment"]["links"]["network"]["bytes_per_s"] == 3e9
    assert "stated: network 3 GB/s" in text


def test_a_model_whose_kv_bytes_differ_from_the_profiles_exits_2_naming_both(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json")
    for command in ("simulate", "analyze"):
        assert main([command, TRACE, "--profile", str(profile), "--model", "qwen2.5-7b"]) == 2
        err = flat(capsys.readouterr().err)
        assert "qwen2.5-7b" in err and "meta-llama/Llama-3.1-8B-Instruct" in err
        assert f"{preset('qwen2.5-7b').bytes_per_token:,} B" in err and f"{LLAMA_8B['kv_bytes_per_token']:,} B" in err
    data, _ = simulate(tmp_path, capsys, profile, "--model", "mistral-7b")  # the same KV layout: accepted
    assert data["deployment"]["model"] == "mistral-7b"


def test_without_model_the_profiles_model_and_its_block_bytes_are_used(tmp_path, capsys):
    tiny = {"model": "/models/tiny", "block_size": 16, "kv_bytes_per_token": 4096}
    data, text = simulate(tmp_path, capsys, write_profile(tmp_path / "tiny.json", server=tiny))
    assert data["deployment"]["model"] == "/models/tiny"
    assert data["deployment"]["block_bytes"] == 4096 * data["deployment"]["block_tokens"]
    assert "model /models/tiny" in text


def test_a_profile_from_another_machine_is_warned_about_naming_the_cpu(tmp_path, capsys):
    elsewhere = {**machine_identity(), "cpu": "Imaginary CPU 9000"}
    profile = write_profile(tmp_path / "p.json", machine=elsewhere)
    data, text = simulate(tmp_path, capsys, profile)
    assert "warning: the profile" in text and "Imaginary CPU 9000" in text and machine_identity()["cpu"] in text
    [warning] = data["warnings"]
    assert "machine cpu" in warning and "Imaginary CPU 9000" in warning


# ---------------------------------------------------------------- analyze and plan


def test_analyze_prices_recompute_with_the_profile_and_says_so(tmp_path, capsys):
    path = write_profile(tmp_path / "p.json", fixed=0.5, machine={**machine_identity(), "cores": 4097})
    out = tmp_path / "a.json"
    assert main(["analyze", TRACE, "--profile", str(path), "--json", str(out)]) == 0
    data, text = json.loads(out.read_text()), flat(capsys.readouterr().out)
    fit = load_profile(path).prefill
    for row in data["q3_block_size"]:
        assert row["recompute_first_s"] == pytest.approx(fit.seconds(row["block_tokens"], 0))
        assert row["recompute_first_s"] > 0.5
    d = data["deployment"]
    assert d["cost_source"]["prefill"].startswith("measured") and d["cost_source"]["network"] == "default 12.5 GB/s"
    assert d["prefill_flops_per_s"] is None and d["links"]["pcie"]["bytes_per_s"] == pytest.approx(10e9)
    assert f"cost model: measured (profile {path}): prefill" in text and "default: disk 6 GB/s" in text
    assert "machine cores: 4097 in the profile" in text and data["warnings"]


def test_plan_uses_the_profiles_model_and_figures_and_says_so(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json", host_gbs=5.0)
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(profile), "--max-model-len", "8192", "--cpu-offload-gib", "5",
                 "--disk-gbs", "3", "--json", str(out)]) == 0
    data, text = json.loads(out.read_text()), flat(capsys.readouterr().out)
    assert data["model"] == "llama-3.1-8b"  # the profile's hub id, as its preset
    sources = data["cost_source"]
    assert sources["prefill"].startswith("measured") and sources["decode"].startswith("measured")
    assert "5 GB/s" in sources["pcie"] and sources["disk"] == "stated 3 GB/s"
    assert sources["network"] == "default 12.5 GB/s"
    assert any("at 5 GB/s" in w and "12.3 ms decode step" in w for w in data["warnings"])  # the weight-offload price
    assert f"measured (profile {profile}): prefill" in text and "stated: disk 3 GB/s" in text


def test_plan_with_a_trace_sizes_with_the_profile(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json")
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(profile), "--model", "llama-3.1-8b", "--trace", TRACE, "--kv-cache-gib", "4",
                 "--max-model-len", "8192", "--host-gib", "64", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cost_source"]["prefill"].startswith(f"measured (profile {profile}")


@pytest.mark.parametrize(("options", "words"), [
    (["--model", "qwen2.5-7b"], ["qwen2.5-7b", "meta-llama/Llama-3.1-8B-Instruct", "B of KV per token"]),
    (["--tflops", "300"], ["--tflops", "p.json"]),
    (["--itl-ms", "10"], ["--itl-ms", "p.json"]),
    (["--measure"], ["--profile", "--measure"]),
])
def test_plan_refuses_what_contradicts_the_profile(tmp_path, capsys, options, words):
    profile = write_profile(tmp_path / "p.json")
    assert main(["plan", "--profile", str(profile), *options]) == 2
    err = flat(capsys.readouterr().err)
    assert all(w in err for w in words), err


def test_plan_without_model_needs_a_profile_model_it_can_plan_for(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json", server={"model": "someone/unknown-model", "kv_bytes_per_token": 8})
    assert main(["plan", "--profile", str(profile)]) == 2
    err = flat(capsys.readouterr().err)
    assert "someone/unknown-model" in err and "--model" in err
