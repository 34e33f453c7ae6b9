"""The rollout's steps in order, each in a server of its own, and what is concluded from them at the end."""

from __future__ import annotations

import math
from pathlib import Path

from kvtier.integrations.vllm.tiny_model import ENGINE_BLOCK_TOKENS, ENGINE_BLOCKS
from kvtier.rollout import drills, exactness, faults
from kvtier.rollout.harness import KV_BYTES_PER_TOKEN, Rollout, budget_from, drill_budget_from, quantiles
from kvtier.rollout.server import ENGINE_ENV


def run_all(ro: Rollout) -> None:
    if ro.opts.model is not None:
        ro.model = str(ro.opts.model)
    elif not ro.opts.command:
        from kvtier.integrations.vllm.tiny_model import build_tiny_llama

        ro.model = build_tiny_llama(ro.root / "tiny-llama", tokenizer=True)
    for step in ro.opts.steps:
        entry = headroom(ro) if step == "headroom" else serve(ro, step)
        ro.report["steps"].append(entry)
    conclude(ro.report, [p.tokens for p in ro.workload(1)])


def serve(ro: Rollout, step: str) -> dict:
    kvtier = None if step in ("reference", "baseline") else ro.kvtier(step)
    blocks, env = ENGINE_BLOCKS, {}
    if step == "reference":  # an engine cache that holds every level's workload: a bigger GPU
        tokens = sum(len(p.tokens) for i in range(len(ro.opts.levels)) for p in ro.workload(i + 1))
        blocks = tokens // ENGINE_BLOCK_TOKENS + 64
        env = {"VLLM_CPU_KVCACHE_SPACE": str(max(int(ENGINE_ENV["VLLM_CPU_KVCACHE_SPACE"]),
                                                 math.ceil(tokens * KV_BYTES_PER_TOKEN / 2**30) + 1))}
    if step in ("host+disk", "rollback"):
        env = faults.server_env(ro.root)
    server = ro.start(step, kvtier, blocks, env)
    entry: dict = {"name": step, "config": kvtier, "engine_blocks": None if ro.opts.command else blocks}
    try:
        if step == "rollback":
            budget = ro.report["drill_budget_ms"]
            entry["drills"] = [drills.rollback(ro, server, budget)] if budget else []
            return entry
        entry["levels"] = ro.levels(server, step)
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
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        info[name] = int(value.split()[0]) * 1024
    served = [s.get("server_rss_bytes", 0) for s in ro.report["steps"] if s.get("server_rss_bytes")]
    rss = max(served, default=0)
    reserve = info["MemTotal"] // 10  # the OS, other services and the page cache a disk tier needs: an assumption
    left = info["MemAvailable"] - rss - reserve
    return {"name": "headroom", "mem_total_bytes": info["MemTotal"], "mem_available_bytes": info["MemAvailable"],
            "server_rss_bytes": rss, "reserve_bytes": reserve, "headroom_bytes": left,
            "host_tier_bytes": ro.opts.host_bytes, "fits": ro.opts.host_bytes <= left}


def conclude(report: dict, prompts: list[list[int]]) -> None:
    """Exactness against the reference (`prompts`: level 1's), the rollback rule on every level and drill, the
    headline comparisons."""
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
        s["rolled_back"] = None if budget is None or not levels else not all(lv["within_budget"] for lv in levels)
        s["guard_transitions"] = transitions(s)
    report["findings"] = findings(steps)


def transitions(step: dict) -> dict[str, float]:
    total: dict[str, float] = {}
    for run in step.get("levels", []) + step.get("drills", []):
        source = run.get("guard_transitions") if "timeline" in run else run.get("kvtier", {})
        for key, value in (source or {}).items():
            if key.startswith("kvtier_guard_transitions"):
                total[key] = total.get(key, 0) + value
    return total


def by_kind(step: dict, reused: bool) -> list[float]:
    return [r["ttft"] for level in step.get("levels", [])[:1] for r in level["results"]
            if r["error"] is None and (r["kind"] != "unique") == reused]


def findings(steps: dict[str, dict]) -> dict:
    """TTFT p50 of reused prompts and p99 of unique ones at concurrency 1, each step against the baseline."""
    base = steps.get("baseline")
    out = {}
    for name, s in steps.items():
        if base is None or s is base or not s.get("levels"):
            continue
        reused, unique = quantiles(by_kind(s, True)), quantiles(by_kind(s, False))
        base_reused, base_unique = quantiles(by_kind(base, True)), quantiles(by_kind(base, False))
        out[name] = {"reused_ttft_p50_vs_baseline": reused["p50"] / base_reused["p50"] if base_reused["p50"] else None,
                     "unique_ttft_p99_vs_baseline": unique["p99"] / base_unique["p99"] if base_unique["p99"] else None}
    return out
