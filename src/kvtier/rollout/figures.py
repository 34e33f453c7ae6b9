"""The rollout's figures: a level's latency percentiles (each with the count it rests on), its load (how busy
the server was, how long requests queued), prompt tokens by source from the server's /metrics, the rollback
rule's budget."""

from __future__ import annotations

import math

from kvtier.rollout import client
from kvtier.timing import percentile

SOURCES = {"device": "engine", "host": "host", "disk": "disk", "external_unspecified": "remote", "p2p": "remote"}
KVTIER_FIGURES = ("kvtier_lookup_tokens_total", "kvtier_guard_transitions_total", "kvtier_stores_dropped_total",
                  "kvtier_load_decisions_total", "kvtier_evictions_total")
QUEUE = "vllm:request_queue_time_seconds"
SATURATED = 0.9  # a level busier than this measures its queue more than the change under test


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def quantiles(values: list[float]) -> dict[str, float]:
    """p50/p95/p99 in ms (nearest rank), and `n`, the samples they rest on: with fewer than 100, p99 is the max."""
    return {**{q: 1e3 * percentile(values, p) for q, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))},
            "n": len(values)}


def tokens_by_source(d: dict[str, float]) -> dict[str, int]:
    """Prompt tokens by where their KV came from, as vLLM counted them (its by-source counter)."""
    out = {"prompt": int(d.get("vllm:prompt_tokens_total{}", 0)), "engine": 0, "host": 0, "disk": 0, "remote": 0}
    for source, name in SOURCES.items():
        out[name] += int(d.get(f'vllm:prompt_tokens_cached_by_source_total{{source="{source}"}}', 0))
    out["recomputed"] = out["prompt"] - sum(out[s] for s in ("engine", "host", "disk", "remote"))
    return out


def load_figures(results: list[client.Result], load: client.Load, d: dict[str, float]) -> dict:
    """How loaded the server was: the busy share (`client.busy_share`) and the server's own queue time per
    request (vLLM's `request_queue_time_seconds`, when it exports it)."""
    count, total = d.get(f"{QUEUE}_count{{}}", 0.0), d.get(f"{QUEUE}_sum{{}}", 0.0)
    busy = client.busy_share(results)
    return {"clients": load.clients if load.closed else None, "think_s": load.think_s if load.closed else None,
            "rate_per_s": load.rate, "busy_share": busy, "saturated": busy > SATURATED,
            "queue_ms_mean": 1e3 * total / count if count else None}


def summarize(label: str, results: list[client.Result], load: client.Load, d: dict[str, float]) -> dict:
    ok = [r for r in results if r.error is None]
    return {
        "label": label, "load": load_figures(results, load, d), "rate_per_s": load.rate,
        "requests": len(results), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "ttft_ms": quantiles([r.ttft for r in ok]), "itl_ms": quantiles([t for r in ok for t in r.itl]),
        "e2e_ms": quantiles([r.e2e for r in ok]), "tokens": tokens_by_source(d),
        "client_cached_tokens": sum(r.cached for r in ok), "client_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "kvtier": {k: v for k, v in d.items() if k.startswith(KVTIER_FIGURES)},
        "results": [r.as_dict() for r in results],
    }


def ttfts(level: dict, reused: bool) -> list[float]:
    """The TTFTs (seconds) of a level's reused prompts, or of its others."""
    return [r["ttft"] for r in level["results"] if r["error"] is None and r["reused"] == reused]


def budget_from(baseline: list[dict]) -> float:
    """The rollback rule's TTFT budget when none is given: 1.5 x the baseline's worst p99 over the levels it could
    carry (not saturated; the first level if none), up to 10 ms."""
    carried = [level for level in baseline if not level["load"]["saturated"]] or baseline[:1]
    return 10 * math.ceil(1.5 * max(level["ttft_ms"]["p99"] for level in carried) / 10)


def drill_budget_from(baseline: list[dict]) -> float:
    """The rollback drill's budget when none is given: the rule applied to the baseline at the drill's own load,
    one client and no think time: its first level."""
    return budget_from(baseline[:1])
