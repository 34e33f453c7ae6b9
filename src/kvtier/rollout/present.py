"""The rollout's report: terminal tables, and an HTML page with the plots (TTFT distributions per step, p99
against concurrency, prompt tokens by source, the rollback drill's timeline)."""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Any

SOURCES = ("engine", "host", "disk", "remote", "recomputed")
PREDICTED = ("engine", "host", "disk", "recomputed")  # the simulator has no remote tier


def tables(report: dict) -> list[Any]:
    from rich.table import Table

    budget = report.get("budget_ms")
    levels = Table(title=f"kvtier rollout: every step at rising load; prompt tokens by source from /metrics; "
                   f"TTFT budget {_ms(budget)}; exact: requests whose cached KV has the reference's lineage, identical "
                   "bit for bit", title_justify="left")
    for col in ("step", "load", "busy", "queue ms", "TTFT ms p50/p95/p99 (n)", "ITL ms p50/p99", "e2e p99",
                *SOURCES, "errors", "in budget", "exact"):
        levels.add_column(col, justify="left" if col == "step" else "right", overflow="fold")
    for s in report["steps"]:
        for i, level in enumerate(s.get("levels", [])):
            t, itl, tok, load = level["ttft_ms"], level["itl_ms"], level["tokens"], level["load"]
            e = s.get("exactness") if i == 0 else None
            queue = load.get("queue_ms_mean")
            levels.add_row(s["name"] if i == 0 else "", _load(load),
                           f"{load['busy_share']:.2f}" + (" SATURATED" if load["saturated"] else ""),
                           "—" if queue is None else f"{queue:.0f}",
                           f"{t['p50']:.0f} / {t['p95']:.0f} / {t['p99']:.0f} ({t['n']})",
                           f"{itl['p50']:.1f} / {itl['p99']:.1f}", f"{level['e2e_ms']['p99']:.0f}",
                           *(f"{tok[k]:,}" for k in SOURCES), str(level["errors"]), _yes(level.get("within_budget")),
                           "" if e is None else f"{e['identical']}/{e['compared']}" + ("" if e["exact"] else " FAILED"))
    drills = Table(title="drills (step 6: the secondary tier; step 7: the rollback rule)", title_justify="left")
    for col in ("step", "drill", "what", "TTFT p99 ms (n)", "errors", "outcome"):
        drills.add_column(col)
    for s in report["steps"]:
        for d in s.get("drills", []):
            p99 = f"{d['ttft_ms']['p99']:.0f} ({d['ttft_ms']['n']})" if "ttft_ms" in d else "—"
            errors = str(d.get("errors", sum(1 for e in d.get("timeline", []) if e["error"])))
            drills.add_row(s["name"], d["drill"], d["what"], p99, errors, d["outcome"])
    out: list[Any] = [levels, drills]
    if any("predicted" in lv for s in report["steps"] for lv in s.get("levels", [])):
        out.append(predictions(report))
    return out + _notes(report)


def predictions(report: dict) -> Any:
    """Each level's prediction (`kvtier.rollout.predict`) beside its measurement."""
    from rich.table import Table

    table = Table(title="predicted (simulate, before the level was sent) / measured; tokens by source as % of the "
                  "prompt tokens; judged at one client: TTFT p50 within 15%, p99 within 25%, each source within 5 "
                  "points", title_justify="left")
    for col in ("step", "load", "TTFT p50 ms", "TTFT p95 ms", "TTFT p99 ms", *(f"{s} %" for s in PREDICTED),
                "verdict"):
        table.add_column(col, justify="left" if col in ("step", "verdict") else "right", overflow="fold")
    for s in report["steps"]:
        for i, level in enumerate(s.get("levels", [])):
            p = level.get("predicted")
            if p is None:
                continue
            mine, seen = p["tokens"], level["tokens"]
            cells = [f"{p['ttft_ms'][q]:,.0f} / {level['ttft_ms'][q]:,.0f} ({p['errors']['ttft_' + q]:+.0%})"
                     for q in ("p50", "p95", "p99")]
            shares = [f"{100 * mine[k] / max(1, mine['prompt']):.0f} / {100 * seen[k] / max(1, seen['prompt']):.0f}"
                      for k in PREDICTED]
            verdict = ("within tolerance" if p["within_tolerance"] else
                       ("MISSED: " if p["judged"] else "off: ") + (p["largest_contributor"] or ""))
            table.add_row(s["name"] if i == 0 else "", _load(level["load"]), *cells, *shares, verdict)
    return table


def _notes(report: dict) -> list[str]:
    """The capacity measured, the tiers' sizes and why, the headroom, and the findings in plain words."""
    out = []
    capacity, tiers = report.get("capacity"), report.get("tiers")
    if capacity:
        out.append(f"capacity: {capacity['service_s'] * 1e3:,.0f} ms a recomputed prompt, one at a time (mean of "
                   f"{capacity['probe_requests']}); clients think {capacity['think_s']:.1f} s on average between "
                   "their requests")
    if tiers:
        elbow = "" if tiers["elbow_bytes"] is None else f"; the workload's elbow {_mib(tiers['elbow_bytes'])}, " \
            f"every reuse {_mib(tiers['reused_bytes'])}"
        out.append(f"tiers: host {_mib(tiers['host_bytes'])}, disk {_mib(tiers['disk_bytes'])} "
                   f"({tiers['reason']}{elbow})")
    for s in report["steps"]:
        if s["name"] == "headroom":
            out.append(f"host headroom: {_gib(s['mem_available_bytes'])} available of {_gib(s['mem_total_bytes'])}, "
                       f"server {_gib(s['server_rss_bytes'])}, reserve {_gib(s['reserve_bytes'])} (a tenth of the "
                       f"host) -> {_gib(s['headroom_bytes'])} left; host tier {_gib(s['host_tier_bytes'])}: "
                       + ("fits" if s["fits"] else "DOES NOT FIT"))
    profile = report.get("profile")
    if profile:
        fits = ", ".join(f"{name} {rms:.0%}" for name, rms in profile["residuals"].items())
        out.append(f"costs for the predictions: {profile['from']}; each fit's rms miss of its own points: {fits}")
        out += [f"profile differs: {d}" for d in profile.get("differs", [])]
    speed = report.get("server_speed")
    if speed:
        out.append("each server's prefill time against the profile's (fresh prompts before its levels; its "
                   "predictions scaled by it): " + ", ".join(f"{step} {f:.2f}x" for step, f in speed.items()))
    for name, f in report.get("findings", {}).items():
        out.append(finding(name, f))
    return out + report.get("prediction_findings", [])


def finding(name: str, f: dict) -> str:
    """One step's conclusion in plain words."""
    ref = f["reference_reused_ttft_p50_ms"]
    words = (f"{name}: reused prompts' TTFT p50 went from {f['baseline_reused_ttft_p50_ms']:,.0f} ms to "
             f"{f['reused_ttft_p50_ms']:,.0f} ms (n={f['reused_n']})")
    if ref is not None and f["gap_closed"] is not None:
        words += f" (a bigger GPU gives {ref:,.0f} ms): this step closed {100 * f['gap_closed']:.0f}% of the gap"
    unique = "; ".join(f"{u['unique_p99_ms']:,.0f} ms vs {u['baseline_unique_p99_ms']:,.0f} ms at {u['level']} "
                       f"(n={u['n']}, {_ratio(u['vs_baseline'])})" for u in f["unique"])
    words += f". Unique prompts' p99 TTFT against the baseline's: {unique}."
    if f["rolled_back"] is not None:
        budget = _ms(f["budget_ms"])
        words += (f" The rollback rule fired: a level it carried broke the {budget} budget: roll it back."
                  if f["rolled_back"] else f" The rollback rule held: every level it carried within {budget}.")
    return words


def write_html(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    served = [s for s in report["steps"] if s.get("levels")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in served:
        values = sorted(1e3 * r["ttft"] for r in s["levels"][0]["results"] if r["error"] is None)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=s["name"])
    _finish(ax, "TTFT (ms)", "fraction of requests", "TTFT by step (first level)", log=True)
    figures.append(_png(fig))
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in served:
        ax.plot([lv["level"] for lv in s["levels"]], [lv["ttft_ms"]["p99"] for lv in s["levels"]], "o-",
                label=s["name"])
    if report.get("budget_ms"):
        ax.axhline(report["budget_ms"], color="red", linestyle="--", label="budget")
    _finish(ax, "level (closed-loop clients)", "TTFT p99 (ms)", "p99 TTFT against load")
    figures.append(_png(fig))
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(served)
    for source in SOURCES:
        values = [sum(lv["tokens"][source] for lv in s["levels"]) for s in served]
        ax.bar([s["name"] for s in served], values, bottom=bottom, label=source)
        bottom = [b + v for b, v in zip(bottom, values)]
    _finish(ax, "step", "prompt tokens", "prompt tokens by source (all levels)")
    figures.append(_png(fig))
    predicted = [(s["name"], lv) for s in served for lv in s["levels"] if "predicted" in lv]
    if predicted:
        fig, ax = plt.subplots(figsize=(7, 4))
        for q, marker in (("p50", "o"), ("p99", "^")):
            measured = [lv["ttft_ms"][q] for _, lv in predicted]
            ax.scatter(measured, [lv["predicted"]["ttft_ms"][q] for _, lv in predicted], marker=marker,
                       label=f"TTFT {q}")
        for name, lv in predicted:
            ax.annotate(f"{name}/{lv['level']}", (lv["ttft_ms"]["p99"], lv["predicted"]["ttft_ms"]["p99"]), fontsize=7)
        top = max(max(lv["ttft_ms"]["p99"], lv["predicted"]["ttft_ms"]["p99"]) for _, lv in predicted)
        ax.plot([0, top], [0, top], color="grey", linestyle="--", label="predicted = measured")
        _finish(ax, "measured TTFT (ms)", "predicted TTFT (ms)", "prediction against measurement, per step/level")
        figures.append(_png(fig))
    drill = next((d for s in report["steps"] for d in s.get("drills", []) if "timeline" in d), None)
    if drill:
        timeline = drill["timeline"]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.scatter([e["t"] for e in timeline], [e["ttft_ms"] for e in timeline],
                   c=["tab:green" if e["disk_enabled"] else "tab:red" for e in timeline], s=12)
        ax.axhline(drill["budget_ms"], color="red", linestyle="--")
        _finish(ax, "seconds", "TTFT (ms)", "rollback drill: slow disk (red: the guard has the disk off; dashed: "
                "its budget)", legend=False)
        figures.append(_png(fig))
    texts = "".join(f"<pre>{html.escape(_text(t))}</pre>" for t in tables(report))
    images = "".join(f'<img src="data:image/png;base64,{f}">' for f in figures)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<!doctype html><meta charset=utf-8><title>kvtier rollout</title><h1>kvtier rollout</h1>"
                    f"{images}{texts}")


def _finish(ax: Any, xlabel: str, ylabel: str, title: str, log: bool = False, legend: bool = True) -> None:
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend()


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    from kvtier.report import png_base64

    try:
        return png_base64(fig, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)


def _text(renderable: Any) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _ms(value: float | None) -> str:
    return "none" if value is None else f"{value:,.0f} ms"


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _load(load: dict) -> str:
    if load["clients"] is not None:
        return f"{load['clients']} client{'s' if load['clients'] > 1 else ''}"
    return f"{load['rate_per_s']:.2f} req/s"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _yes(value: bool | None) -> str:
    return "—" if value is None else "yes" if value else "NO"
