"""`kvtier analyze`: the four questions asked of a trace before tiering is turned on, answered with numbers.

1. Which prefixes are shared across requests?         (reused token share, top shared prefixes)
2. How long after creation are they reused?           (reuse time in seconds, reuse distance in bytes)
3. How big is a useful block against the transfer budget? (block-size table: bytes, link times, recompute)
4. Which blocks should be dropped at once?             (one-shot blocks; what second-sighting admission trades)

One pass over the trace feeds both the reuse statistics and the LRU miss-ratio curve, so a trace is read
once and never held in memory. The verdict that follows from the answers is in `kvtier.analyze.verdict`, which
reads an `Analysis`; `kvtier.analyze.present` puts both in the report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvtier.analyze.reuse import ReuseStats
from kvtier.sim.cost import CostModel
from kvtier.sim.mrc import MissRatioCurve, lru_mrc
from kvtier.stores.base import TierKind
from kvtier.traces.request import TraceRequest

GiB = 1 << 30
TABLE_BLOCK_TOKENS = (16, 64, 256, 512, 1024, 2048)
MRC_POINTS = 400


@dataclass(frozen=True)
class Deployment:
    """What the traffic is judged against: the model's costs, the engine's KV memory, tier sizes, budget."""

    cost: CostModel
    engine_kv_bytes: int = 40 * GiB
    host_bytes: int = 256 * GiB
    disk_bytes: int = 2048 * GiB
    ttft_budget_s: float = 2.0

    def as_dict(self) -> dict:
        c = self.cost
        return {
            "model": c.layout.name, "bytes_per_token": c.layout.bytes_per_token,
            "prefill_flops_per_s": None if c.prefill_fit is not None else c.flops_per_s, "itl_s": c.itl_s,
            "links": {link.name: {"bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s} for link in c.links},
            "profile": c.profile_file or None, "cost_source": c.sources(),
            "engine_kv_bytes": self.engine_kv_bytes, "host_bytes": self.host_bytes, "disk_bytes": self.disk_bytes,
            "ttft_budget_s": self.ttft_budget_s,
        }


@dataclass
class Analysis:
    source: str
    deployment: Deployment
    stats: ReuseStats
    mrc: MissRatioCurve

    @property
    def block_tokens(self) -> int:
        return self.stats.block_tokens

    @property
    def block_bytes(self) -> int:
        return self.deployment.cost.block_bytes(self.block_tokens)

    # ---------------------------------------------------------------- question 2: reuse distance

    def reuse_distance_blocks(self, q: float) -> int:
        """The LRU capacity (blocks) at which a share `q` of all reuses hit: the q-quantile of reuse distance."""
        hits = self.mrc.hit_blocks
        if hits[-1] == 0:
            return 0
        return int(np.searchsorted(hits, q * hits[-1]))

    def reuse_distance(self) -> dict:
        hits = self.mrc.hit_blocks
        per_capacity = np.diff(hits)  # reuses whose distance needs exactly this capacity
        mean = float((per_capacity * np.arange(1, len(hits))).sum() / hits[-1]) if hits[-1] else 0.0
        return {"unit": "bytes", "count": int(hits[-1]), "mean": mean * self.block_bytes,
                **{f"p{q}": self.reuse_distance_blocks(q / 100) * self.block_bytes for q in (10, 50, 90, 99)}}

    # ---------------------------------------------------------------- memory pressure (from the curve)

    def capacity_blocks(self, nbytes: int) -> int:
        return nbytes // self.block_bytes

    def hit_ratio_at(self, nbytes: int) -> float:
        """Token hit ratio of an LRU cache of `nbytes` of KV."""
        return self.mrc.hit_ratio(self.capacity_blocks(nbytes), "tokens")

    @property
    def max_hit_ratio(self) -> float:
        return self.mrc.hit_ratio(self.mrc.distinct_blocks, "tokens")

    def bytes_for(self, share_of_max: float) -> int:
        """KV bytes an LRU cache needs to reach `share_of_max` of the achievable token hit ratio."""
        return self.blocks_for(share_of_max) * self.block_bytes

    def blocks_for(self, share_of_max: float) -> int:
        hits = self.mrc.hit_tokens
        return int(np.searchsorted(hits, share_of_max * hits[-1])) if hits[-1] else 0

    def elbow_blocks(self) -> int:
        """The capacity (blocks) at the elbow of the token hit curve: where it departs most from the straight line
        from no cache to a cache that hits every reuse, past which more capacity buys the least per block (the
        "kneedle" point of a concave curve); where the curve never rises above that line, all of it. 0 without
        reuse."""
        top = self.blocks_for(1.0)
        hits = self.mrc.hit_tokens[: top + 1]
        if top == 0 or hits[-1] == 0:
            return 0
        gain = hits / hits[-1] - np.arange(top + 1) / top
        best = int(np.argmax(gain))
        return best if gain[best] > 0 else top  # no returns diminish before the end: every reuse is the hot set

    def tier_hit_ratios(self) -> dict[str, float]:
        """Approximate hit ratios per deployment step, as an LRU of the capacity the step adds up to.

        The host tier stores what the engine computed (it includes the engine's blocks), the disk tier takes
        the host's evictions (it excludes them): so max(engine, host) and max(engine, host + disk).
        `kvtier simulate` replays the real policies instead.
        """
        d = self.deployment
        return {
            "engine": self.hit_ratio_at(d.engine_kv_bytes),
            "engine + host": self.hit_ratio_at(max(d.engine_kv_bytes, d.host_bytes)),
            "engine + host + disk": self.hit_ratio_at(max(d.engine_kv_bytes, d.host_bytes + d.disk_bytes)),
            "unbounded": self.max_hit_ratio,
        }

    # ---------------------------------------------------------------- question 3: block size

    def block_table(self) -> list[dict]:
        """Per block size: bytes, transfer time on each link, recompute time, and the break-even bandwidth."""
        cost = self.deployment.cost
        context = int(np.median(np.frombuffer(self.stats.request_input, dtype=np.uint32))) if self.stats.requests else 0
        rows = []
        for tokens in sorted({*TABLE_BLOCK_TOKENS, self.block_tokens}):
            nbytes = cost.block_bytes(tokens)
            first = cost.prefill_seconds(tokens, 0)
            rows.append({
                "block_tokens": tokens, "bytes": nbytes, "trace_block": tokens == self.block_tokens,
                **{f"{link.name}_s": link.seconds(nbytes) for link in cost.links},
                "recompute_first_s": first,
                "recompute_at_median_context_s": cost.prefill_seconds(tokens, context),
                "median_context_tokens": context,
                "break_even_bytes_per_s": nbytes / first,
            })
        return rows

    # ---------------------------------------------------------------- the transfer path per request

    def prefix_load_seconds(self, kind: TierKind = TierKind.HOST) -> np.ndarray:
        """Per request with a reused prefix: the time to load all of it from a tier of this kind (its whole
        path)."""
        cost = self.deployment.cost
        reused = np.frombuffer(self.stats.request_reused, dtype=np.uint32)
        reused = reused[reused > 0].astype(np.float64)
        nbytes = np.ceil(reused / self.block_tokens) * self.block_bytes
        links = cost.tier_path(kind)
        return sum((link.latency_s + nbytes / link.bytes_per_s for link in links), np.zeros_like(nbytes))

    def reused_prefix_tokens(self, q: float) -> float:
        reused = np.frombuffer(self.stats.request_reused, dtype=np.uint32)
        reused = reused[reused > 0]
        return float(np.percentile(reused, q)) if len(reused) else 0.0

    def mrc_points(self, n: int = MRC_POINTS) -> np.ndarray:
        """Capacities (blocks) at which to report the curve: log-spaced, ends included."""
        top = self.mrc.distinct_blocks
        return np.unique(np.concatenate(([0], np.geomspace(1, max(top, 1), n).astype(np.int64), [top])))

    def as_dict(self) -> dict:
        s = self.stats
        points = self.mrc_points()
        return {
            "trace": self.source,
            "deployment": self.deployment.as_dict(),
            "requests": s.requests, "span_s": s.span_s, "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes, "prompt_tokens": s.total_tokens, "block_accesses": s.accesses,
            "q1_shared_prefixes": {
                "reused_token_share": s.reused_token_share, "reused_tokens": s.reused_tokens,
                "top": [{**p.__dict__, "saved_tokens": p.saved_tokens} for p in s.top_prefixes()],
            },
            "q2_reuse": {
                "reuse_time_s": s.reuse_time.as_dict("s"), "age_at_reuse_s": s.age_at_reuse.as_dict("s"),
                "reuse_distance_bytes": self.reuse_distance(),
            },
            "q3_block_size": self.block_table(),
            "q4_one_shot": s.one_shot(),
            "mrc": {
                "note": f"LRU, sampled at {len(points)} log-spaced capacities from 0 to every distinct block",
                "capacity_blocks": points.tolist(),
                "capacity_bytes": (points * self.block_bytes).tolist(),
                "capacity_tokens": (points * self.block_tokens).tolist(),
                "hit_ratio_blocks": self.mrc.hit_ratio_blocks[points].tolist(),
                "hit_ratio_tokens": self.mrc.hit_ratio_tokens[points].tolist(),
            },
            "tier_hit_ratios": self.tier_hit_ratios(),
            "bytes_for_95pct_of_max": self.bytes_for(0.95),
        }


def analyze(requests: Iterable[TraceRequest], deployment: Deployment, source: str = "") -> Analysis:
    """Answer the four questions for a request stream (read once)."""
    stats = ReuseStats()
    mrc = lru_mrc(stats.observe_all(requests))
    if not stats.requests:
        raise ValueError(f"{source or 'trace'}: no requests")
    if mrc.block_tokens is None:
        raise ValueError(f"{source or 'trace'}: requests use different block sizes; analyze one size at a time")
    return Analysis(source, deployment, stats, mrc)
