"""An analysis as a report: the verdict first, then the four questions, each with its numbers and plots."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.analyze.questions import Analysis
from kvtier.analyze.verdict import verdict
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

GiB = 1 << 30


def analysis_report(a: Analysis, warnings: Sequence[str] = ()) -> Report:
    """`warnings`: e.g. a profile measured on another machine, shown above the verdict that rests on it."""
    v = verdict(a)
    s, d = a.stats, a.deployment
    data = {**a.as_dict(), "verdict": v.as_dict(), "warnings": list(warnings)}
    report = Report(f"kvtier analyze — {a.source}", data=data)
    rate = s.requests / s.span_s if s.span_s > 0 else 0.0
    report.add(
        *[Text(f"warning: {w}", "bold yellow") for w in warnings],
        Text(f"{s.requests:,} requests over {fmt_seconds(s.span_s)} ({rate:,.2f}/s), {s.total_tokens:,} prompt "
             f"tokens in {s.accesses:,} blocks of {a.block_tokens} tokens ({s.distinct_blocks:,} distinct). "
             f"Model {d.cost.layout.name}: {fmt_bytes(a.block_bytes)} per block."),
        Text(f"cost model: {d.cost.sources_text()}"),
        Heading("Verdict"),
        Text(v.headline, "bold green" if v.fits else "bold red"),
        Table("checks", ["check", "ok", "why"],
              [[c.name, {True: "yes", False: "NO", None: "-"}[c.ok], c.reason] for c in v.checks], text_columns=3),
        *[Text(f"note: {n}", "yellow") for n in v.notes],
    )
    _shared(report, a)
    _reuse(report, a)
    _block_size(report, a)
    _one_shot(report, a)
    _curve(report, a)
    return report


def _shared(report: Report, a: Analysis) -> None:
    s = a.stats
    rows = [[f"{p.tokens:,}", f"{p.blocks:,}", f"{p.requests:,}", f"{p.saved_tokens:,}",
             fmt_seconds(p.first_seen_s), fmt_seconds(p.last_seen_s - p.first_seen_s)] for p in s.top_prefixes()]
    report.add(
        Heading("1. Which prefixes are shared?"),
        Text(f"{fmt_share(s.reused_token_share)} of prompt tokens ({s.reused_tokens:,}) are in a prefix an earlier "
             f"request already had: the hit ratio of an unbounded cache."),
        Table("top shared prefixes (shared by more requests than any longer extension)",
              ["prefix tokens", "blocks", "requests", "tokens saved", "first seen", "reused for"], rows),
    )


def _reuse(report: Report, a: Analysis) -> None:
    s = a.stats
    dist = a.reuse_distance()

    def row(name: str, h: dict, fmt) -> list[str]:
        return [name, f"{h['count']:,}", fmt(h["mean"]), *(fmt(h[f"p{q}"]) for q in (10, 50, 90, 99))]

    report.add(
        Heading("2. How long after creation are they reused?"),
        Table("per reused block access", ["distribution", "reuses", "mean", "p10", "p50", "p90", "p99"], [
            row("reuse time (since previous use)", s.reuse_time.summary("s"), fmt_seconds),
            row("age at reuse (since first use)", s.age_at_reuse.summary("s"), fmt_seconds),
            row(f"reuse distance (LRU bytes, {a.deployment.cost.layout.name})", dist, fmt_bytes),
        ], note="reuse distance = the LRU capacity a reuse needs to hit; times are binned (±12%), means exact"),
        Plot("reuse time: share of reuses within t", lambda ax: _cdf_time(ax, a), "seconds since previous use",
             "share of reuses"),
        Plot("reuse distance: share of reuses an LRU of this size catches", lambda ax: _cdf_distance(ax, a),
             "LRU capacity (bytes of KV)", "share of reuses"),
    )


def _block_size(report: Report, a: Analysis) -> None:
    rows = []
    for r in a.block_table():
        mark = " (trace)" if r["trace_block"] else ""
        rows.append([f"{r['block_tokens']:,}{mark}", fmt_bytes(r["bytes"]), fmt_seconds(r["pcie_s"]),
                     fmt_seconds(r["disk_s"]), fmt_seconds(r["network_s"]), fmt_seconds(r["recompute_first_s"]),
                     fmt_seconds(r["recompute_at_median_context_s"]), f"{r['break_even_bytes_per_s'] / 1e9:,.1f}"])
    c = a.deployment.cost
    links = ", ".join(f"{link.name} {link.bytes_per_s / 1e9:g} GB/s + {fmt_seconds(link.latency_s)}"
                      for link in c.links)
    context = a.block_table()[0]["median_context_tokens"]
    report.add(
        Heading("3. How big is a useful block against the transfer budget?"),
        Table(f"one block of {c.layout.name} ({fmt_bytes(c.layout.bytes_per_token)} per token)",
              ["tokens", "bytes", "PCIe", "disk", "network", "recompute (first)",
               f"recompute (after {context:,})", "break-even GB/s"], rows,
              note=f"links: {links}; prefill {c.sources()['prefill']}. A link slower than the break-even bandwidth "
              "loads a block more slowly than the GPU recomputes it."),
    )


def _one_shot(report: Report, a: Analysis) -> None:
    o = a.stats.one_shot()
    report.add(
        Heading("4. Which blocks should be dropped at once?"),
        Table("blocks used by one request only", ["figure", "value"], [
            ["distinct blocks", f"{o['distinct_blocks']:,}"],
            ["one-shot blocks", f"{o['one_shot_blocks']:,} ({fmt_share(o['one_shot_fraction'])})"],
            ["one-shot bytes", fmt_bytes(o["one_shot_blocks"] * a.block_bytes)],
            ["most uses of one block", f"{o['max_uses']:,}"],
            ["store on 2nd sighting: stores saved", fmt_share(o["second_sighting_stores_saved"])],
            ["store on 2nd sighting: reuses lost", fmt_share(o["second_sighting_hits_lost"])],
        ], note="with an unbounded cache; 'store on the 2nd sighting' is admit_after_sightings: 2"),
    )


def _curve(report: Report, a: Analysis) -> None:
    d = a.deployment
    marks = [("engine KV", d.engine_kv_bytes), ("engine + host", max(d.engine_kv_bytes, d.host_bytes)),
             ("+ disk", max(d.engine_kv_bytes, d.host_bytes + d.disk_bytes))]
    sizes = [(f"{fmt_bytes(n)}", n) for n in (GiB, 10 * GiB, 100 * GiB, 1024 * GiB, 10240 * GiB)]
    sizes += [(f"{name} ({fmt_bytes(n)})", n) for name, n in marks]
    sizes += [("95% of max", a.bytes_for(0.95)), ("every distinct block", a.mrc.distinct_blocks * a.block_bytes)]
    rows = []
    for name, nbytes in sorted(sizes, key=lambda x: x[1]):
        blocks = a.capacity_blocks(nbytes)
        rows.append([name, f"{blocks * a.block_tokens:,}", f"{blocks:,}", fmt_share(a.mrc.hit_ratio(blocks, "tokens")),
                     fmt_share(a.mrc.hit_ratio(blocks, "blocks"))])
    report.add(
        Heading("Miss-ratio curve (LRU)"),
        Table("hit ratio by cache capacity", ["capacity", "tokens", "blocks", "hit (tokens)", "hit (blocks)"], rows),
        Plot("LRU hit ratio vs capacity", lambda ax: _mrc(ax, a, marks), "capacity (bytes of KV)", "hit ratio"),
    )


# ---------------------------------------------------------------- plots

def _cdf_time(ax, a: Analysis) -> None:
    h = a.stats.reuse_time
    edges = h.edges()
    if h.count:
        ax.step(edges[1:], (h.zeros + np.cumsum(h.counts)) / h.count, where="post")
        used = np.nonzero(h.counts)[0]
        if len(used):
            ax.set_xlim(edges[used[0]] / 2, edges[used[-1] + 1] * 2)
    ax.set_xscale("log")
    ax.set_ylim(0, 1)


def _cdf_distance(ax, a: Analysis) -> None:
    hits = a.mrc.hit_blocks
    if hits[-1]:
        ax.plot(a.mrc.capacities[1:] * a.block_bytes, hits[1:] / hits[-1])
    ax.set_xscale("log")
    ax.set_ylim(0, 1)


def _mrc(ax, a: Analysis, marks) -> None:
    x = a.mrc.capacities[1:] * a.block_bytes
    ax.plot(x, a.mrc.hit_ratio_tokens[1:], label="tokens")
    ax.plot(x, a.mrc.hit_ratio_blocks[1:], label="blocks", alpha=0.7)
    for name, nbytes in marks:
        ax.axvline(nbytes, color="grey", linestyle=":")
        ax.annotate(name, (nbytes, 0.02), rotation=90, fontsize=7, color="grey")
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
