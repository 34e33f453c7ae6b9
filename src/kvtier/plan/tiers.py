"""With a trace: how much host and disk the traffic needs, what each buys, and whether to offload at all.

The sizes sit at the knee of the LRU hit-ratio curve `kvtier analyze` draws, taken as the smallest cache that
reaches KNEE_SHARE of the hit ratio an unbounded cache would: the host tier takes what the host can give up to it,
the disk tier the rest. `kvtier simulate` then replays the trace through the runtime's directory at those sizes,
so the hits reported are the real policies', not only the curve's. The verdict is `analyze`'s four checks (reuse,
memory pressure, reach, the tail-latency budget) and one of the plan's own: host DRAM already scarce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.analyze.questions import Analysis, Deployment, analyze
from kvtier.analyze.verdict import Check, verdict
from kvtier.plan.budget import GiB
from kvtier.sim.cost import CostModel
from kvtier.traces.request import TraceRequest

KNEE_SHARE = 0.95


@dataclass
class TierSizes:
    """Sizes in bytes of the whole model's KV (every rank's shards together), as the trace's blocks count them."""

    engine: int
    host: int
    disk: int
    knee: int | None = None  # None without a trace
    curve_hits: dict[str, float] = field(default_factory=dict)  # token hit ratio per step, from the LRU curve
    replay_hits: dict[str, float] = field(default_factory=dict)  # the same from `simulate`'s replay
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def offload(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    def as_dict(self) -> dict:
        return {"engine_kv_bytes": self.engine, "host_bytes": self.host, "disk_bytes": self.disk,
                "knee_bytes": self.knee, "knee_share": KNEE_SHARE, "curve_hit_ratio": self.curve_hits,
                "replay_hit_ratio": self.replay_hits, "offload": self.offload,
                "checks": [c.__dict__ for c in self.checks], "notes": self.notes}


def host_check(engine: int, host: int) -> Check:
    """A host tier holds what the engine computed, the engine's own blocks too: no larger than the engine's KV, it
    holds nothing the engine does not."""
    if host <= engine:
        return Check("host", False, f"host DRAM is already scarce: the slab it can give ({host / GiB:,.1f} GiB of KV) "
                     f"is no larger than the engine's own KV ({engine / GiB:,.1f} GiB), so it would hold nothing the "
                     "engine does not")
    return Check("host", True, f"the host gives the slab {host / GiB:,.1f} GiB of KV, {host / engine:,.1f}x the "
                 f"engine's {engine / GiB:,.1f} GiB")


def sizes_without_trace(engine: int, host: int, disk: int) -> TierSizes:
    return TierSizes(engine, host, disk, checks=[host_check(engine, host)])


def sizes_from_trace(requests: Sequence[TraceRequest], cost: CostModel, engine: int, host_available: int,
                     disk_available: int, ttft_budget_s: float, host_fixed: int | None = None, source: str = "",
                     on_request: Callable[[], None] | None = None) -> TierSizes:
    """Sizes at the knee, capped by what the host and the disk can give (`host_fixed`: the slab is set)."""
    analysis = analyze(requests, Deployment(cost, engine, host_available, disk_available, ttft_budget_s), source)
    knee = analysis.bytes_for(KNEE_SHARE)
    host = host_fixed if host_fixed is not None else min(knee, host_available)
    disk = min(knee - host, disk_available) if knee > max(engine, host) else 0
    analysis.deployment = Deployment(cost, engine, host, disk, ttft_budget_s)
    sizes = TierSizes(engine, host, disk, knee, curve_hits=analysis.tier_hit_ratios())
    found = verdict(analysis)
    pressure = next(c for c in found.checks if c.name == "pressure")
    host_judged = host_check(engine, host) if pressure.ok else Check("host", None, "not judged: without memory "
                                                                     "pressure no host tier is needed")
    sizes.checks = [*found.checks, host_judged]
    sizes.notes = list(found.notes)
    if host_fixed is None and knee > host_available:
        sizes.notes.append(f"the knee needs {knee / GiB:,.1f} GiB; the host can give {host_available / GiB:,.1f} GiB, "
                           f"so disk takes {disk / GiB:,.1f} GiB of the rest")
    if sizes.offload:
        sizes.replay_hits = _replay(list(requests), analysis, sizes, on_request)
    return sizes


def _replay(requests: list[TraceRequest], analysis: Analysis, sizes: TierSizes,
            on_request: Callable[[], None] | None) -> dict[str, float]:
    from kvtier.sim.configs import DISK_ROOT, SimConfig, host_config
    from kvtier.sim.simulate import ServingSetup, auto_instances, simulate

    block_tokens = analysis.block_tokens
    host = host_config(block_tokens, sizes.host)
    configs = [SimConfig("engine", None), SimConfig("engine + host", host)]
    if sizes.disk:
        disk = {"type": "fs", "root_dir": DISK_ROOT, "max_bytes": sizes.disk}
        configs.append(SimConfig("engine + host + disk", {**host, "secondary_tiers": [disk]}))
    cost = analysis.deployment.cost
    setup = ServingSetup(cost, block_tokens, sizes.engine, auto_instances(requests, cost))
    return {r.name: r.hit_ratio for r in simulate(requests, configs, setup, on_request=on_request)}
