"""A simulation as a report: every configuration side by side, then the one to deploy as vLLM takes it."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from kvtier.report import (
    Heading,
    Plot,
    Report,
    Table,
    Text,
    fmt_bytes,
    fmt_seconds,
    fmt_share,
)
from kvtier.sim.simulate import ENGINE, ServingSetup, SimResult, recommend

SOURCES = (ENGINE, "host", "disk")


def simulation_report(source: str, results: Sequence[SimResult], setup: ServingSetup,
                      notes: Sequence[str] = (), warnings: Sequence[str] = ()) -> Report:
    """`warnings`: e.g. a profile measured on another machine, shown above the figures that rest on it."""
    choice, reasons = recommend(results)
    c = setup.cost
    transfer = choice.config.kv_transfer_config()
    assumptions = {
        "model": c.layout.name, "block_tokens": setup.block_tokens, "block_bytes": setup.block_bytes,
        "engine_kv_bytes": setup.engine_kv_bytes, "instances": setup.instances,
        "prefill_flops_per_s": None if c.prefill_fit is not None else c.flops_per_s, "itl_s": c.itl_s,
        "links": {link.name: {"bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s} for link in c.links},
        "profile": c.profile_file or None, "cost_source": c.sources(),
    }
    report = Report(f"kvtier simulate — {source}", data={
        "trace": source, "deployment": assumptions, "warnings": list(warnings),
        "results": [r.as_dict() for r in results],
        "recommended": {"name": choice.name, "reasons": reasons, "kv_transfer_config": transfer},
    })
    report.add(*[Text(f"warning: {w}", "bold yellow") for w in warnings], Text(
        f"{results[0].requests:,} requests, model {c.layout.name} ({fmt_bytes(setup.block_bytes)} per "
        f"{setup.block_tokens}-token block), engine KV {fmt_bytes(setup.engine_kv_bytes)} "
        f"({setup.engine_blocks:,} blocks), {setup.instances} prefill server(s)."),
        Text(f"cost model: {c.sources_text()}"), *[Text(f"note: {n}", "yellow") for n in notes])
    report.add(
        Heading("Configurations side by side"),
        Table("prompt tokens by source, bytes moved, estimated TTFT",
              ["configuration", *SOURCES, "recomputed", "hit", "loaded", "stored", "demoted",
               "TTFT p50", "p95", "p99"], [_row(r) for r in results],
              note="loaded = tiers -> engine; stored = engine -> host; demoted = host -> disk. TTFT = queueing + "
                   "load + prefill, from the cost model."),
        Table("evictions, admission rejects, dropped stores (blocks)", ["configuration", "evictions",
              "admission rejects", "stores dropped"], [_drops(r) for r in results if r.config.extra is not None]),
        Table("load or recompute, and the guard", ["configuration", "load decisions", "guard: tier off (s)"],
              [_guard(r) for r in results if r.config.extra is not None],
              note="decisions per request that found blocks: load all, partial (a prefix), recompute. Off: from "
                   "the guard's turning the tier off to its return (a probe is off for most requests)."),
        Plot("TTFT distribution", lambda ax: _ttft_cdf(ax, results), "TTFT (s)", "share of requests"),
        Plot("prompt tokens by source", lambda ax: _sources(ax, results), "", "share of prompt tokens"),
        Heading("Recommendation"),
        Text(f"deploy: {choice.name}", "bold green"),
        *[Text(f"- {r}") for r in reasons],
    )
    if transfer is None:
        report.add(Text("run vLLM without kvtier (no --kv-transfer-config)"))
    else:
        report.add(Text("vllm serve MODEL --kv-transfer-config '" + json.dumps(transfer) + "'"))
        if any(t.get("root_dir") == "/mnt/kv_cache" for t in transfer["kv_connector_extra_config"].get(
                "secondary_tiers", [])):
            report.add(Text("(set root_dir to a local NVMe directory of yours)"))
    return report


def _row(r: SimResult) -> list[str]:
    total = r.total_tokens or 1
    moved = r.moved_bytes
    loaded = sum(n for k, n in moved.items() if k.endswith(f"->{ENGINE}"))
    return [r.name, *(fmt_share(r.hit_tokens[s] / total) if r.hit_tokens[s] else "-" for s in SOURCES),
            fmt_share(r.hit_tokens["miss"] / total), fmt_share(r.hit_ratio), fmt_bytes(loaded),
            fmt_bytes(moved[f"{ENGINE}->host"]), fmt_bytes(moved["host->disk"]),
            *(fmt_seconds(r.ttft(q)) for q in (50, 95, 99))]


def _drops(r: SimResult) -> list[str]:
    def fmt(counter) -> str:
        return ", ".join(f"{'/'.join(k) if isinstance(k, tuple) else k} {n:,}"
                         for k, n in sorted(counter.items())) or "-"

    return [r.name, fmt(r.evictions), fmt(r.admission_rejects), fmt(r.stores_dropped)]


def _guard(r: SimResult) -> list[str]:
    decisions = ", ".join(f"{t} {d} {n:,}" for (t, d), n in sorted(r.load_decisions.items())) or "-"
    off = ", ".join(f"{t} {a:,.0f}–{'end' if b is None else f'{b:,.0f}'}" for t, a, b in r.guard_off()) or "-"
    return [r.name, decisions, off]


def _ttft_cdf(ax, results: Sequence[SimResult]) -> None:
    for r in results:
        x = np.sort(r.ttft_s)
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=r.name)
    ax.set_xscale("log")


def _sources(ax, results: Sequence[SimResult]) -> None:
    names = [r.name for r in results]
    bottom = np.zeros(len(results))
    for source in (*SOURCES, "miss"):
        share = np.array([r.hit_tokens[source] / (r.total_tokens or 1) for r in results])
        ax.barh(names, share, left=bottom, label="recomputed" if source == "miss" else source)
        bottom += share
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
