"""`kvtier plan`: the presets' published figures, vLLM's published memory profile, the host's budget, the verdicts
with a trace, the flags, bad input, and `--measure` on the vLLM CPU engine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from kvtier.cli import main
from kvtier.config import parse_config
from kvtier.layout import PRESETS
from kvtier.plan.budget import GiB
from kvtier.plan.make import PlanInputs, make_plan
from kvtier.plan.model import load_model
from kvtier.plan.presets import MODEL_CONFIGS
from kvtier.traces.workloads import GENERATORS, generate_trace
from kvtier.traces.write import write_kvtier_jsonl

# Published parameter counts (model cards) and KV bytes per token from the published configs:
# layers x 2 x KV heads x head size x 2 bytes (bf16), or layers x (kv_lora_rank + rope dim) x 2 for MLA.
PUBLISHED = {
    "llama-3.1-8b": (8.03e9, 32 * 2 * 8 * 128 * 2),
    "llama-3-8b": (8.03e9, 32 * 2 * 8 * 128 * 2),
    "llama-3.1-70b": (70.6e9, 80 * 2 * 8 * 128 * 2),
    "qwen2.5-7b": (7.61e9, 28 * 2 * 4 * 128 * 2),
    "qwen2.5-72b": (72.7e9, 80 * 2 * 8 * 128 * 2),
    "mistral-7b": (7.24e9, 32 * 2 * 8 * 128 * 2),
    "deepseek-v3": (671e9, 61 * (512 + 64) * 2),
}


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_each_preset_counts_its_published_parameters_and_kv_per_token(name):
    model = load_model(name)
    params, kv_per_token = PUBLISHED[name]
    assert model.params.total == pytest.approx(params, rel=0.005)
    assert model.layout.bytes_per_token == kv_per_token
    if name in PRESETS:  # the analyzer's layout presets hold the same shapes
        assert model.layout == PRESETS[name]


def test_llama_3_1_8b_weighs_14_96_gib_and_128_kib_of_kv_per_token():
    model = load_model("llama-3.1-8b")
    assert model.params.total == 8_030_261_248  # 16.06e9 bytes in bf16 (the "16.06e9 parameters" is bytes)
    assert model.weight_bytes == 2 * model.params.total
    assert model.weight_bytes / GiB == pytest.approx(14.96, abs=0.005)
    assert model.layout.bytes_per_token == 128 << 10


def test_deepseek_v3_weighs_its_fp8_checkpoint_and_activates_37b():
    model = load_model("deepseek-v3")
    assert model.params.active == pytest.approx(37e9, rel=0.02)
    embeddings_bf16 = 2 * model.params.embeddings
    assert model.weight_bytes == model.params.layers + embeddings_bf16 + 2 * model.params.norms
    assert load_model("deepseek-v3", weight_dtype="bf16").weight_bytes > 1.9 * model.weight_bytes


@pytest.mark.parametrize(("tp", "weights", "non_torch", "kv"), [
    (1, 14.96, 1.79, 53.29),  # vLLM's published profile of Llama-3-8B on an H100 at 0.90
    (2, 7.48, 3.58, 71.29 - 7.48 - 3.58 - 1.26),  # the same at TP 2 (activation peak 1.26 GiB again)
])
def test_the_published_llama_3_8b_h100_profile_is_reproduced(tp, weights, non_torch, kv):
    plan = make_plan(PlanInputs(model="llama-3-8b", tp=tp, gpu_gib=79.22, gpu_util=0.9, max_model_len=8192,
                                max_num_seqs=256, max_batched_tokens=8192, host_gib=512, slab_gib=64))
    g = plan.gpu
    assert g.usable_bytes / GiB == pytest.approx(71.29, abs=0.01)
    assert g.weights_bytes / GiB == pytest.approx(weights, abs=0.1)
    assert g.non_torch_bytes / GiB == pytest.approx(non_torch, abs=0.01)
    assert g.activation_bytes / GiB == pytest.approx(1.26, abs=0.05)  # the stated assumption's error
    assert g.kv_bytes / GiB == pytest.approx(kv, abs=0.1)
    assert g.kv_blocks == g.kv_bytes // (16 * 128 * 1024 // tp)
    assert g.max_model_len_sequences == g.kv_tokens / 8192


def test_kv_cache_memory_bytes_skips_the_profile_and_is_in_the_flags():
    plan = make_plan(PlanInputs(model="llama-3.1-8b", kv_cache_gib=20, max_model_len=32768, slab_gib=100))
    assert plan.gpu.kv_bytes == 20 * GiB and plan.gpu.kv_blocks == 20 * GiB // (16 * 128 * 1024)
    assert f"--kv-cache-memory-bytes {20 * GiB}" in plan.vllm_flags
    assert "--gpu-memory-utilization" not in plan.vllm_flags


def test_a_config_json_gives_what_its_preset_gives(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIGS["qwen2.5-7b"]))
    preset = make_plan(PlanInputs(model="qwen2.5-7b", max_model_len=32768, slab_gib=50))
    folder = make_plan(PlanInputs(model=str(tmp_path), max_model_len=32768, slab_gib=50))
    assert folder.gpu == preset.gpu and folder.host == preset.host
    assert folder.model.weight_bytes == preset.model.weight_bytes


def test_the_slab_is_whole_slots_with_no_power_of_two_rounding():
    plan = make_plan(PlanInputs(model="llama-3.1-70b", tp=4, max_model_len=32768, slab_gib=200, host_gib=1024))
    h = plan.host
    slot = 256 * 80 * 2 * 2 * 128 * 2  # one kvtier block of one rank's shard: 2 of 8 KV heads
    assert h.slot_bytes == slot
    assert h.slab_bytes == 4 * h.slab_slots_per_rank * slot
    assert 200 * GiB - 4 * slot < h.slab_bytes <= 200 * GiB
    assert h.pinned_pow2_bytes == 4 * 64 * GiB > h.slab_bytes  # torch's pinned allocator: 50 GiB per rank -> 64
    extra = plan.transfer_config["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == h.slab_bytes
    assert h.free_bytes == h.total_bytes - h.reserved_bytes - h.process_bytes - h.slab_bytes


def test_with_tensor_parallelism_the_disk_tier_bounds_each_ranks_files():
    plan = make_plan(PlanInputs(model="llama-3.1-70b", tp=4, max_model_len=32768, slab_gib=200, host_gib=1024,
                                disk_gib=400))
    [disk] = plan.transfer_config["kv_connector_extra_config"]["secondary_tiers"]
    assert disk["max_bytes"] == 100 * GiB  # each of the 4 ranks writes its shard of every block to its own folder
    assert plan.sizes.disk == 400 * GiB  # the whole model's KV: 8 KV heads split 4 ways, none replicated


def test_weight_offload_is_counted_on_the_host_and_warned_with_its_per_forward_cost():
    base = PlanInputs(model="llama-3.1-8b", max_model_len=8192, slab_gib=64, host_gib=256, tp=2)
    plain, offloaded = make_plan(base), make_plan(replace(base, cpu_offload_gib=5))
    assert plain.warnings == []
    assert offloaded.gpu.weights_bytes == plain.gpu.weights_bytes - 5 * GiB
    assert offloaded.host.offloaded_weights_bytes == 2 * 5 * GiB
    assert offloaded.gpu.kv_bytes == plain.gpu.kv_bytes + 5 * GiB
    [warning] = offloaded.warnings
    assert f"{5 * GiB / 25e9 * 1e3:,.0f} ms each at 25 GB/s" in warning and "every forward pass" in warning
    assert "--cpu-offload-gb 5" in offloaded.vllm_flags


def trace(tmp_path, kind: str, requests: int) -> str:
    path = tmp_path / f"{kind}.jsonl"
    write_kvtier_jsonl(generate_trace(replace(GENERATORS[kind], requests=requests)), path)
    return str(path)


def run_plan(tmp_path, *options: str) -> dict:
    out = tmp_path / "plan.json"
    assert main(["plan", "--json", str(out), *options]) == 0
    return json.loads(out.read_text())


def test_unique_prompts_get_a_do_not_offload_verdict_and_no_kvtier_flags(tmp_path, capsys):
    data = run_plan(tmp_path, "--trace", trace(tmp_path, "unique", 400), "--kv-cache-gib", "4",
                    "--max-model-len", "8192", "--host-gib", "64")
    checks = {c["name"]: c["ok"] for c in data["tiers"]["checks"]}
    assert data["offload"] is False and checks["reuse"] is False
    assert data["kv_transfer_config"] is None and "--kv-transfer-config" not in data["vllm_serve"]
    assert data["host"]["slab_bytes"] == 0 and "host_cache_size" not in data["trtllm_kv_cache_config"]
    assert "do not offload: prompts are (nearly) unique" in capsys.readouterr().out


def test_memory_pressure_sizes_host_then_disk_at_the_knee_and_the_replay_confirms_the_hits(tmp_path):
    path = trace(tmp_path, "shared", 1500)
    roomy = run_plan(tmp_path, "--trace", path, "--kv-cache-gib", "4", "--max-model-len", "8192", "--host-gib", "128")
    tiers = roomy["tiers"]
    assert roomy["offload"] and all(c["ok"] is not False for c in tiers["checks"])
    assert tiers["engine_kv_bytes"] < tiers["knee_bytes"]
    assert tiers["host_bytes"] == roomy["host"]["slab_bytes"]  # one kvtier block per slot, tp 1
    assert tiers["knee_bytes"] - 256 * 128 * 1024 < tiers["host_bytes"] <= tiers["knee_bytes"]
    assert tiers["disk_bytes"] == 0  # the host holds the knee
    replay = tiers["replay_hit_ratio"]
    assert replay["engine + host"] > replay["engine"] + 0.2
    assert replay["engine + host"] == pytest.approx(tiers["curve_hit_ratio"]["engine + host"], abs=0.05)
    extra = roomy["kv_transfer_config"]["kv_connector_extra_config"]
    assert parse_config(extra).cpu_bytes_to_use == roomy["host"]["slab_bytes"]

    tight = run_plan(tmp_path, "--trace", path, "--kv-cache-gib", "4", "--max-model-len", "8192", "--host-gib", "24",
                     "--disk-gib", "100")
    t = tight["tiers"]
    assert t["host_bytes"] <= tight["host"]["available_bytes"] < tiers["host_bytes"]
    assert t["disk_bytes"] == pytest.approx(t["knee_bytes"] - t["host_bytes"], abs=1)
    assert t["replay_hit_ratio"]["engine + host + disk"] > t["replay_hit_ratio"]["engine + host"]
    [disk] = tight["kv_transfer_config"]["kv_connector_extra_config"]["secondary_tiers"]
    assert disk["max_bytes"] == t["disk_bytes"]


@pytest.mark.parametrize(("options", "failing", "words"), [
    (["--kv-cache-gib", "400", "--gpu-gib", "512"], "pressure", "no memory pressure"),
    (["--kv-cache-gib", "4", "--ttft-budget-ms", "5"], "latency", "cannot meet the 5 ms TTFT budget"),
])
def test_a_trace_without_pressure_or_within_no_budget_gets_do_not_offload(tmp_path, options, failing, words):
    data = run_plan(tmp_path, "--trace", trace(tmp_path, "shared", 600), "--max-model-len", "8192",
                    "--host-gib", "128", *options)
    checks = {c["name"]: c for c in data["tiers"]["checks"]}
    assert data["offload"] is False and checks[failing]["ok"] is False and words in checks[failing]["reason"]
    assert data["kv_transfer_config"] is None and data["tiers"]["replay_hit_ratio"] == {}


def test_a_host_too_small_for_more_than_the_engine_holds_is_scarce(tmp_path):
    data = run_plan(tmp_path, "--kv-cache-gib", "40", "--max-model-len", "8192", "--host-gib", "48")
    assert data["offload"] is False
    [check] = data["tiers"]["checks"]
    assert check["name"] == "host" and check["ok"] is False and "host DRAM is already scarce" in check["reason"]


def test_json_and_html_hold_the_per_gpu_and_host_figures(tmp_path):
    page = tmp_path / "plan.html"
    data = run_plan(tmp_path, "--model", "llama-3.1-70b", "--tp", "4", "--max-model-len", "32768", "--html", str(page))
    gpu = data["gpu"]
    for key in ("weights_bytes", "workspace_bytes", "kv_bytes", "kv_tokens"):
        assert gpu[key] > 0, key
    assert gpu["weights_bytes"] + gpu["workspace_bytes"] + gpu["kv_bytes"] <= gpu["usable_bytes"]
    assert data["host"]["slab_bytes"] > 0
    html = page.read_text()
    assert html.count("<img") == 1 and "data:image/png;base64," in html and "memory per device" in html


@pytest.mark.parametrize(("options", "names"), [
    (["--model", "llama-9"], "--model 'llama-9'"),
    (["--model", "llama-3.1-70b", "--gpu-gib", "80"], "does not fit the GPU"),
    (["--slab-gib", "600", "--host-gib", "512"], "--slab-gib 600"),
    (["--host-gib", "8", "--host-reserved-gib", "6"], "--host-gib 8"),
    (["--tp", "3"], "num_kv_heads=8 and tp_size=3"),
    (["--max-model-len", "1000000"], "--max-model-len 1000000"),
    (["--gpu-util", "1.5"], "--gpu-util"),
    (["--kv-dtype", "fp7"], "'fp7'"),
])
def test_bad_input_exits_2_naming_the_value(options, names, capsys):
    assert main(["plan", *options]) == 2
    assert names in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--gpu-gib", "--host-gib", "--disk-gib", "--cpu-offload-gib", "--kv-cache-gib"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_size_that_is_not_finite_exits_2_naming_the_flag(option, value, capsys):
    """argparse's float took 'inf' and 'nan': the plan then died with an OverflowError and exit code 1
    (r_plan_inputs.sh)."""
    with pytest.raises(SystemExit) as exited:
        main(["plan", f"{option}={value}"])
    assert exited.value.code == 2
    assert f"argument {option}: must be a finite number, got '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "names"), [
    ("{not json", "not valid JSON"),
    (json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}), "'num_attention_heads'"),
    (json.dumps({**MODEL_CONFIGS["llama-3.1-8b"], "num_hidden_layers": "32"}), "'num_hidden_layers'"),
])
def test_a_malformed_config_exits_2_naming_file_and_key(tmp_path, content, names, capsys):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert main(["plan", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and names in err


vllm_needed = pytest.mark.skipif(os.environ.get("CI") != "true" and not importlib.util.find_spec("vllm"),
                                 reason="needs vLLM (CI=true makes a missing vLLM a failure)")


@vllm_needed
def test_measure_predicts_the_blocks_the_vllm_cpu_engine_allocates(tmp_path):
    out = tmp_path / "measure.json"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    result = subprocess.run([sys.executable, "-m", "kvtier.cli", "plan", "--measure", "--kv-cache-gib", "0.7",
                             "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    per_block = 128 * 4 * 2 * 2 * 64 * 2  # the tiny model: 4 layers, 2 KV heads of 64, bf16; CPU blocks of 128
    assert data["kv_bytes_per_block"] == per_block
    assert data["engine_kv_blocks"] == int(0.7 * GiB) // per_block  # the engine's own figure, not the plan's
    assert abs(data["predicted_kv_blocks"] / data["engine_kv_blocks"] - 1) <= 0.02
    assert abs(data["predicted_weight_bytes"] / data["checkpoint_weight_bytes"] - 1) <= 0.02
    assert data["ok"] is True
