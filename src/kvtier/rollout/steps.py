"""The rollout's steps in order, each in a server of its own, and what is concluded from them at the end."""

from __future__ import annotations

import math

from kvtier.integrations.vllm.tiny_model import ENGINE_BLOCK_TOKENS, ENGINE_BLOCKS
from kvtier.rollout import drills, exactness, faults
from kvtier.rollout.figures import budget_from, drill_budget_from, quantiles, ttfts
from kvtier.rollout.harness import Rollout
from kvtier.rollout.options import KVTIER_STEPS
from kvtier.rollout.server import ENGINE_ENV
from kvtier.rollout.sizes import bytes_per_token, headroom_now, memory, size_tiers


def run_all(ro: Rollout) -> None:
    if ro.opts.model is not None and not ro.opts.command:
        ro.model = ro.opts.model
    elif not ro.opts.command:
        from kvtier.integrations.vllm.tiny_model import build_tiny_llama

        ro.model = build_tiny_llama(ro.root / "tiny-llama", tokenizer=True)
    if any(s in KVTIER_STEPS for s in ro.opts.steps):
        size(ro)
    for step in ro.opts.steps:
        entry = headroom(ro) if step == "headroom" else serve(ro, step)
        ro.report["steps"].append(entry)
    conclude(ro.report, [p.tokens for p in ro.workload(1)])


def size(ro: Rollout) -> None:
    """The tiers of the kvtier steps, before any server starts: a size the host cannot give is refused here."""
    model = ro.opts.model if ro.opts.command else ro.model
    token_bytes = bytes_per_token(model) if model is not None else 1  # unused: both sizes given (Options.check)
    engine = None if ro.opts.command else ENGINE_BLOCKS * ENGINE_BLOCK_TOKENS * token_bytes  # the embedded server's
    ro.sizes = size_tiers(ro.sent_workloads(), token_bytes, ro.opts.host_bytes, ro.opts.disk_bytes, headroom_now(),
                          engine)
    ro.report["tiers"] = ro.sizes.as_dict()


def serve(ro: Rollout, step: str) -> dict:
    kvtier = None if step in ("reference", "baseline") else ro.kvtier(step)
    blocks, env = ENGINE_BLOCKS, {}
    if step == "reference":  # an engine cache that holds the first level's workload: a bigger GPU
        tokens = sum(len(p.tokens) for p in ro.workload(1))
        blocks = tokens // ENGINE_BLOCK_TOKENS + 64
        kv_bytes = tokens * bytes_per_token(ro.model or "")
        env = {"VLLM_CPU_KVCACHE_SPACE": str(max(int(ENGINE_ENV["VLLM_CPU_KVCACHE_SPACE"]),
                                                 math.ceil(kv_bytes / 2**30) + 1))}
    if step in ("host+disk", "rollback"):
        env = faults.server_env(ro.root)
    server = ro.start(step, kvtier, blocks, env)
    entry: dict = {"name": step, "config": kvtier, "engine_blocks": None if ro.opts.command else blocks}
    try:
        if step == "rollback":
            budget = ro.report["drill_budget_ms"]
            entry["drills"] = [drills.rollback(ro, server, budget)] if budget else []
            return entry
        entry["levels"] = ro.levels(server, step, kvtier, count=1 if step == "reference" else None)
        entry["server_rss_bytes"] = server.rss_bytes()
        if step == "baseline" and ro.report["budget_ms"] is None:
            ro.report["budget_ms"] = budget_from(entry["levels"])
            ro.report["drill_budget_ms"] = drill_budget_from(entry["levels"])
        if step == "host+disk":
            entry["drills"] = drills.secondary(ro, server, step)
        entry["startup_line"] = next((line.split("kvtier: ", 1)[1] for line in server.log_tail(200_000).splitlines()
                                      if "kvtier: tiers" in line), None)
    finally:
        server.stop()
    return entry


def headroom(ro: Rollout) -> dict:
    """Step 2: what the host has beside the server, read now (the servers of earlier steps have stopped)."""
    info = memory()
    served = [s.get("server_rss_bytes", 0) for s in ro.report["steps"] if s.get("server_rss_bytes")]
    rss = max(served, default=0)
    host = ro.sizes.host_bytes if ro.sizes is not None else 0
    left = headroom_now(rss)
    return {"name": "headroom", "mem_total_bytes": info["MemTotal"], "mem_available_bytes": info["MemAvailable"],
            "server_rss_bytes": rss, "reserve_bytes": info["MemAvailable"] - rss - left, "headroom_bytes": left,
            "host_tier_bytes": host, "fits": host <= left,
            "sizes": ro.sizes.as_dict() if ro.sizes is not None else None}


def conclude(report: dict, prompts: list[list[int]]) -> None:
    """Exactness against the reference (`prompts`: the first level's), the rollback rule on every level and
    drill, and the findings."""
    steps = {s["name"]: s for s in report["steps"]}
    reference = steps.get("reference")
    checks = []
    for s in report["steps"]:
        if reference is None or s is reference or not s.get("levels"):
            continue
        s["exactness"] = exactness.check(reference["levels"][0]["results"], s["levels"][0]["results"], prompts,
                                         ENGINE_BLOCK_TOKENS)
        checks.append(s["exactness"]["exact"])
    report["exact"] = all(checks) if checks else None
    budget = report.get("budget_ms")
    for s in report["steps"]:  # drills break things on purpose: they are judged, but roll nothing back
        for run in s.get("levels", []) + [d for d in s.get("drills", []) if "ttft_ms" in d]:
            run["within_budget"] = None if budget is None else run["ttft_ms"]["p99"] <= budget
        levels = s.get("levels", [])
        s["rolled_back"] = None if budget is None or not levels or s["name"] not in KVTIER_STEPS else \
            not all(lv["within_budget"] for lv in levels if not lv["load"]["saturated"])
        s["guard_transitions"] = transitions(s)
    report["findings"] = findings(steps, budget)
    report["prediction_findings"] = prediction_findings(report["steps"])


def prediction_findings(steps: list[dict]) -> list[str]:
    """Each level whose prediction missed its tolerance, with what missed most (judged ones at one client; the
    others reported as errors to explain)."""
    out = []
    for s in steps:
        for level in s.get("levels", []):
            p = level.get("predicted")
            if p is None or p["within_tolerance"]:
                continue
            e = p["errors"]
            out.append(f"{s['name']} at level {level['level']}: the prediction "
                       f"{'missed its tolerance' if p['judged'] else 'is off'} (TTFT p50 {e['ttft_p50']:+.0%}, p99 "
                       f"{e['ttft_p99']:+.0%}); largest contributor: {p['largest_contributor']}")
    return out


def transitions(step: dict) -> dict[str, float]:
    total: dict[str, float] = {}
    for run in step.get("levels", []) + step.get("drills", []):
        source = run.get("guard_transitions") if "timeline" in run else run.get("kvtier", {})
        for key, value in (source or {}).items():
            if key.startswith("kvtier_guard_transitions"):
                total[key] = total.get(key, 0) + value
    return total


def findings(steps: dict[str, dict], budget: float | None) -> dict:
    """Per step with tiers, at the first level: how much of the gap between the baseline and the reference (a
    bigger GPU) it closed for reused prompts' TTFT p50, and its unique prompts' p99 against the baseline's; at
    every level, the unique prompts' p99 against the baseline's at that level."""
    base, ref = steps.get("baseline"), steps.get("reference")
    out = {}
    for name, s in steps.items():
        if base is None or s is base or not s.get("levels"):
            continue
        reused, base_reused = quantiles(ttfts(s["levels"][0], True)), quantiles(ttfts(base["levels"][0], True))
        ref_reused = quantiles(ttfts(ref["levels"][0], True)) if ref is not None else None
        gap = base_reused["p50"] - ref_reused["p50"] if ref_reused and ref_reused["n"] else None
        unique_by_level = []
        for level, base_level in zip(s["levels"], base["levels"]):
            mine, theirs = quantiles(ttfts(level, False)), quantiles(ttfts(base_level, False))
            unique_by_level.append({"level": level["level"], "unique_p99_ms": mine["p99"], "n": mine["n"],
                                    "baseline_unique_p99_ms": theirs["p99"], "baseline_n": theirs["n"],
                                    "vs_baseline": mine["p99"] / theirs["p99"] if theirs["n"] else None})
        out[name] = {
            "reused_ttft_p50_ms": reused["p50"], "reused_n": reused["n"],
            "baseline_reused_ttft_p50_ms": base_reused["p50"], "baseline_reused_n": base_reused["n"],
            "reference_reused_ttft_p50_ms": ref_reused["p50"] if ref_reused else None,
            "reused_ttft_p50_vs_baseline": reused["p50"] / base_reused["p50"] if base_reused["n"] else None,
            "gap_closed": (base_reused["p50"] - reused["p50"]) / gap if gap else None,
            "unique": unique_by_level,
            "rolled_back": s.get("rolled_back"), "budget_ms": budget,
        }
    return out
