"""`kvtier rollout` against real `vllm serve` processes over HTTP: every step, the drills, the guard, and the
exactness check that must catch a wrong restore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
vllm = pytest.importorskip("vllm") if os.environ.get("CI") != "true" else __import__("vllm")


def same_as_the_clients(run: dict) -> None:
    """The tokens by source the rollout read from /metrics are what the clients were told request by request,
    one request at a time. Under contention they are not: vLLM counts a preempted request's engine hits again
    when it is admitted again, and a block found at lookup can be evicted before its load."""
    tokens = run["tokens"]
    cached = tokens["engine"] + tokens["host"] + tokens["disk"] + tokens["remote"]
    assert tokens["prompt"] == run["client_prompt_tokens"], run["label"]
    if run["load"]["clients"] == 1:
        assert cached == run["client_cached_tokens"], run["label"]
    lookups = run["kvtier"]  # kvtier's own families: whole blocks found, vLLM's the tokens loaded (up to a block less)
    for source in ("host", "disk"):
        found = lookups.get(f'kvtier_lookup_tokens_total{{source="{source}"}}', 0)
        assert found - 256 * run["requests"] <= tokens[source] <= found, (run["label"], source)


def in_temp_folder() -> set[Path]:
    return set(Path(tempfile.gettempdir()).iterdir())


def test_the_rollout_on_the_embedded_default(tmp_path, served_model):
    from rich.console import Console

    from kvtier.rollout.harness import Options
    from kvtier.rollout.present import write_html
    from kvtier.rollout.run import run

    before = in_temp_folder()
    report = run(Options(requests=12, levels=(1, 2), think_s=0.2, model=served_model),
                 Console(file=open(os.devnull, "w")))
    left = in_temp_folder() - before  # the servers' sockets and files, the restart drill's kill -9 included
    assert not left, f"the rollout left {sorted(p.name for p in left)} in the temp folder"
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["reference", "baseline", "headroom", "host", "host+disk", "rollback"]
    assert report["exact"] is True
    capacity, tiers = report["capacity"], report["tiers"]
    assert capacity["service_s"] > 0 and capacity["think_s"] == 0.2
    # the host tier at the elbow of the workload's reuse curve (1.5x the engine's 12 MiB of KV at least), the disk
    # tier for the rest, in the tiny model's 512 KiB blocks; and what the servers were started with
    assert tiers["block_bytes"] == 256 * 2048 and tiers["elbow_bytes"] > 0
    assert tiers["host_bytes"] == max(tiers["elbow_bytes"], 3 * 48 * 128 * 2048 // 2)
    assert tiers["disk_bytes"] >= tiers["reused_bytes"] - tiers["host_bytes"] and tiers["disk_bytes"] > 0
    assert steps["host"]["config"]["cpu_bytes_to_use"] == tiers["host_bytes"]
    assert steps["host+disk"]["config"]["secondary_tiers"][0]["max_bytes"] == tiers["disk_bytes"]
    assert len(steps["reference"]["levels"]) == 1
    for name in ("baseline", "host", "host+disk"):
        e = steps[name]["exactness"]
        assert e["compared"] >= 4 and e["identical"] == e["compared"], (name, e)
        for level, clients in zip(steps[name]["levels"], (1, 2), strict=True):
            assert level["errors"] == 0 and level["requests"] == 12
            assert level["ttft_ms"]["n"] == 12 and set(level["itl_ms"]) == {"p50", "p95", "p99", "n"}
            assert level["load"]["clients"] == clients and 0 < level["load"]["busy_share"] <= 1
            same_as_the_clients(level)
        if name != "baseline":
            finding = report["findings"][name]
            assert finding["reused_n"] + finding["unique"][0]["n"] == 12 and finding["gap_closed"] is not None
    host_levels = steps["host"]["levels"]
    # lookup_tokens counts what a tier served; a hit the load-or-recompute decision declined (it judged recomputing
    # faster: timing, contention) is counted as a decision of that tier instead
    served = sum(lv["kvtier"].get('kvtier_lookup_tokens_total{source="host"}', 0) for lv in host_levels)
    declined = sum(lv["kvtier"].get(f'kvtier_load_decisions_total{{decision="{d}",tier="host"}}', 0)
                   for lv in host_levels for d in ("recompute", "partial"))
    assert served > 0 or declined > 0, "the host tier held reused prefixes the engine had dropped"
    assert sum(lv["tokens"]["host"] for lv in host_levels) > 0 or declined > 0, "the host tier served prompt tokens"
    assert steps["headroom"]["mem_total_bytes"] > steps["headroom"]["server_rss_bytes"] > 0
    assert "tiers host" in steps["host"]["startup_line"] and "disk" in steps["host+disk"]["startup_line"]

    drills = {d["drill"]: d for d in steps["host+disk"]["drills"]}
    assert list(drills) == ["promotion burst", "storage pressure", "restart", "cache loss"]
    assert all(d["passed"] and d["errors"] == 0 for d in drills.values()), {k: d["outcome"] for k, d in drills.items()}
    assert drills["storage pressure"]["kvtier"]['kvtier_stores_dropped_total{reason="disk_failed"}'] > 0  # injected
    assert drills["restart"]["tokens"]["disk"] > 0
    assert drills["cache loss"]["kvtier"]['kvtier_evictions_total{reason="lost",tier="disk"}'] > 0
    for name in ("promotion burst", "storage pressure", "restart"):
        same_as_the_clients(drills[name])
    lost = drills["cache loss"]  # vLLM counts a hit at admission; the lost blocks were recomputed after
    assert lost["client_cached_tokens"] < sum(lost["tokens"][s] for s in ("engine", "host", "disk", "remote"))

    slow = steps["rollback"]["drills"][0]
    assert slow["passed"], slow["outcome"]
    assert slow["guard_transitions"]['kvtier_guard_transitions_total{tier="disk",to="off"}'] >= 1
    assert slow["guard_transitions"]['kvtier_guard_transitions_total{tier="disk",to="on"}'] >= 1
    assert slow["budget_ms"] == report["drill_budget_ms"] <= report["budget_ms"]
    assert max(e["ttft_ms"] for e in slow["timeline"]) > slow["budget_ms"], "the injected delay broke the budget"
    assert steps["rollback"]["guard_transitions"] == slow["guard_transitions"]

    # each level was predicted before it was sent, with costs measured on the first server (each fit reproduces
    # its points) and each server's prefill speed against them
    assert report["profile"]["from"] == "measured on the first server" and report["profile"]["differs"] == []
    assert all(rms < 0.25 for rms in report["profile"]["residuals"].values()), report["profile"]["residuals"]
    assert set(report["server_speed"]) == {"reference", "baseline", "host", "host+disk"}
    assert all(0.5 < f < 2 for f in report["server_speed"].values()), report["server_speed"]
    for name in ("reference", "baseline", "host", "host+disk"):
        for level in steps[name]["levels"]:
            p = level["predicted"]
            assert p["judged"] == (level["load"]["clients"] == 1) and p["ttft_ms"]["n"] == 12
            assert p["tokens"]["prompt"] == level["tokens"]["prompt"]  # the same prompts, simulated
            assert p["within_tolerance"] or p["largest_contributor"], (name, p)
            if level["load"]["clients"] == 1:  # one request at a time: the simulator's engine cache is vLLM's
                assert all(abs(v) <= 5 for v in p["errors"]["tokens_points"].values()), (name, p["errors"])
    judged = [lv["predicted"] for s in steps.values() for lv in s.get("levels", []) if lv["predicted"]["judged"]]
    missed = [f for f in report["prediction_findings"] if "missed its tolerance" in f]
    assert len(missed) == sum(1 for p in judged if not p["within_tolerance"])  # each miss is a finding

    write_html(report, tmp_path / "rollout.html")
    assert (tmp_path / "rollout.html").read_text().count("data:image/png;base64,") == 5  # predicted vs measured too


def test_a_kv_cache_tester_trace_through_the_cli_and_a_corrupted_restore_caught(tmp_path, served_model):
    """A test build whose host restores flip one bit of every KV element after the checksum: the rollout's
    exactness check must fail for the step with kvtier, exit 1, and still report every request."""
    corrupt = ROOT / "tests" / "data" / "corrupt_restores"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(corrupt), os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "rollout.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "rollout", "--trace", str(ROOT / "tests" / "data" /
                           "traces" / "agentic"), "--steps", "reference,host", "--levels", "1", "--think-s", "0",
                           "--no-predict", "--model", served_model, "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    reference, host = report["steps"]
    level = host["levels"][0]
    assert level["requests"] == 11 and level["errors"] == 0  # every request of the trace, sub-agents included
    same_as_the_clients(level)
    assert level["tokens"]["host"] > 0
    assert not host["exactness"]["exact"] and report["exact"] is False
    assert "FAILED" in proc.stdout


def test_your_own_server_gets_the_sizes_and_the_disk_root_you_give(tmp_path, served_model):
    """`--command` starts the server from a template (here `vllm serve` with the tiny model, as a user would write
    it); `--model` gives its geometry, `--host-bytes` and `--disk-root` the host tier and where the disk tier's
    files go: the server's startup line says what it was given, and the files are under the root."""
    from kvtier.rollout.server import ENGINE_FLAGS

    root = tmp_path / "nvme"
    root.mkdir()
    template = " ".join([str(Path(sys.executable).parent / "vllm"), "serve", served_model, "--port", "{port}",
                         *ENGINE_FLAGS, "--num-gpu-blocks-override", "48", "{kv_transfer_config}"])
    out = tmp_path / "rollout.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "rollout", "--command", template, "--model",
                           str(Path(served_model) / "config.json"), "--host-bytes", "24MiB", "--disk-root", str(root),
                           "--steps", "host+disk", "--levels", "1", "--requests", "6", "--think-s", "0",
                           "--no-predict", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    step = report["steps"][0]
    assert "profile" not in report and "predicted" not in step["levels"][0]  # --no-predict: nothing calibrated
    assert step["startup_line"].startswith("tiers host 24 MiB ("), step["startup_line"]
    disk = step["config"]["secondary_tiers"][0]
    assert Path(disk["root_dir"]).parent == root
    assert f"disk {disk['max_bytes'] / 2**20:,.0f} MiB" in step["startup_line"]
    lost = {d["drill"]: d for d in step["drills"]}["cache loss"]  # the drill deleted the tier's files: they were here
    assert Path(lost["root_dir"]).is_relative_to(root) and lost["files_deleted"] > 0
    assert all(d["passed"] for d in step["drills"]), [d["outcome"] for d in step["drills"]]


@pytest.mark.parametrize("args, named", [
    (["--steps", "baseline,foo"], "'foo'"), (["--levels", "1,x"], "'1,x'"), (["--trace", "/no/such/trace"], "/no/such"),
    (["--model", "/no/such/model"], "/no/such/model"), (["--requests", "0"], "--requests"),
    (["--command", "vllm serve m"], "{port}"), (["--command", "x {port}", "--steps", "reference"], "reference"),
    (["--host-bytes", "1000TiB"], "--host-bytes"), (["--host-bytes", "12XB"], "--host-bytes"),
    (["--disk-root", "/no/such/root"], "--disk-root"), (["--disk-root", "/sys"], "/sys: not writable"),
    (["--rates", "0.5,2"], "--rates"), (["--profile", "/no/such/profile.json"], "/no/such/profile.json"),
    (["--kv-config", "/no/such/config.json"], "--kv-config"), (["--think-s", "inf"], "--think-s"),
    (["--command", "x {port}", "--steps", "baseline,host"], "--model"),
    (["--command", "x {port}", "--steps", "baseline,host", "--model", "/no/such/config.json"], "/no/such/config.json"),
])
def test_bad_input_exits_2_naming_it_before_any_server_starts(args: list[str], named: str):
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "rollout", *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_a_server_leaves_nothing_in_the_temp_folder(tmp_path, end: str):
    """What a server writes to its temp folder (vLLM's sockets, its process group's file store, which a stopped
    or killed `vllm serve` leaves behind) goes with the server; torch's compiled kernels are kept outside it."""
    import time

    from kvtier.rollout.server import Server

    before = in_temp_folder()
    seen = tmp_path / "seen"
    script = ('touch "$TMPDIR/vllm_dist_0" "${VLLM_RPC_BASE_PATH:-$TMPDIR}/socket"'  # vLLM's defaults
              f' && echo "$TORCHINDUCTOR_CACHE_DIR" > {seen} && exec sleep 60')
    server = Server(["/bin/sh", "-c", script], 0, tmp_path / "server.log")
    deadline = time.monotonic() + 30
    while not (seen.exists() and seen.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.05)
    written = [p for p in in_temp_folder() - before for p in p.rglob("*")]
    assert sorted(p.name for p in written) == ["socket", "vllm_dist_0"]  # in a folder of its own, for now
    cache = seen.read_text().strip()
    assert cache and not Path(cache).is_relative_to(written[0].parent)
    getattr(server, end)()
    assert in_temp_folder() == before


def test_a_server_that_cannot_start_leaves_nothing_in_the_temp_folder(tmp_path):
    from kvtier.rollout.server import Server

    before = in_temp_folder()
    with pytest.raises(FileNotFoundError):
        Server([str(tmp_path / "no-such-server")], 0, tmp_path / "server.log")
    assert in_temp_folder() == before
