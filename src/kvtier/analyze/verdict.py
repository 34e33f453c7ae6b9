"""The verdict: does tiering fit this traffic, in plain words, with the numbers that decide it.

Tiering fits only if all four hold; each failure is a reason not to deploy it:
- reuse: enough prompt tokens sit in prefixes an earlier request already had (a tier cannot create reuse);
- pressure: the engine's own KV memory does not already hold what is reused (else a tier adds nothing);
- reach: the tiers of the stated sizes add hits the engine misses (the reuse is not farther apart than they hold);
- latency: loading beats recomputing, and the reused prefix loads within the TTFT budget at p99.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.analyze.questions import Analysis
from kvtier.stores.base import TierKind

MIN_REUSED_SHARE = 0.10  # below this share of reused prompt tokens the traffic is "unique prompts"
NO_PRESSURE = 0.95  # the engine alone reaching this share of the achievable hit ratio = no memory pressure
MIN_GAIN = 0.02  # tiers must add at least this much token hit ratio to be worth their cost


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: not judged, because an earlier check already decided it
    reason: str  # a sentence with the numbers, true whichever way the check went


@dataclass(frozen=True)
class Verdict:
    checks: list[Check]
    notes: list[str]  # advice that does not change the verdict

    @property
    def fits(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    @property
    def headline(self) -> str:
        if self.fits:
            return "tiering fits: " + "; ".join(c.reason for c in self.checks)
        return "tiering does not fit because " + "; and ".join(c.reason for c in self.checks if c.ok is False)

    def as_dict(self) -> dict:
        return {"fits": self.fits, "headline": self.headline,
                "checks": [c.__dict__ for c in self.checks], "notes": self.notes}


def verdict(a: Analysis) -> Verdict:
    notes: list[str] = []
    pressure = _pressure(a)
    reach = _reach(a, notes) if pressure.ok else Check("reach", None, "not judged: without memory pressure no tier "
                                                       "size adds hits")
    checks = [_reuse(a), pressure, reach, _transfer(a, notes), _tail(a, notes)]
    return Verdict(checks, notes)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def _reuse(a: Analysis) -> Check:
    share = a.stats.reused_token_share
    if share < MIN_REUSED_SHARE:
        return Check("reuse", False, f"prompts are (nearly) unique: only {share:.1%} of prompt tokens are in prefixes "
                     f"an earlier request had (needs {MIN_REUSED_SHARE:.0%}); a tier keeps warm state, it cannot "
                     "create reuse")
    return Check("reuse", True, f"{share:.0%} of prompt tokens are in prefixes an earlier request already had")


def _pressure(a: Analysis) -> Check:
    engine, best = a.hit_ratio_at(a.deployment.engine_kv_bytes), a.max_hit_ratio
    kv = _gib(a.deployment.engine_kv_bytes)
    if best <= 0 or engine >= NO_PRESSURE * best:
        return Check("pressure", False, f"there is no memory pressure: the working set fits the engine's KV memory "
                     f"({kv} already serves {engine:.0%} of prompt tokens, of {best:.0%} any cache could; "
                     f"95% of that needs {_gib(a.bytes_for(0.95))})")
    return Check("pressure", True, f"the engine's {kv} of KV serves only {engine:.0%} of prompt tokens of the "
                 f"{best:.0%} reachable (95% of that needs {_gib(a.bytes_for(0.95))})")


def _reach(a: Analysis, notes: list[str]) -> Check:
    ratios = a.tier_hit_ratios()
    engine, host, disk = ratios["engine"], ratios["engine + host"], ratios["engine + host + disk"]
    d = a.deployment
    sizes = f"host {_gib(d.host_bytes)}, disk {_gib(d.disk_bytes)}"
    if disk - engine < MIN_GAIN:
        return Check("reach", False, f"reuse is too far apart for the tiers ({sizes}): they raise the hit ratio "
                     f"only from {engine:.0%} to {disk:.0%}; 95% of the reachable needs {_gib(a.bytes_for(0.95))}")
    if host - engine < MIN_GAIN:
        notes.append(f"the host tier alone adds little ({engine:.0%} -> {host:.0%}): the gain needs the disk tier")
    return Check("reach", True, f"tiers ({sizes}) raise the hit ratio from {engine:.0%} to {host:.0%} with host "
                 f"and {disk:.0%} with disk (LRU estimate)")


def _transfer(a: Analysis, notes: list[str]) -> Check:
    row = next(r for r in a.block_table() if r["trace_block"])
    pcie, disk, recompute = row["pcie_s"], row["disk_s"], row["recompute_first_s"]
    block = f"a {a.block_tokens}-token block ({a.block_bytes / 2**20:,.0f} MiB)"
    if disk + pcie >= recompute:
        notes.append(f"disk is slower than recomputing {block}: {1e3 * (disk + pcie):.1f} ms vs "
                     f"{1e3 * recompute:.1f} ms; a disk tier would not pay off")
    if pcie >= recompute:
        return Check("transfer", False, f"loading {block} over PCIe ({1e3 * pcie:.1f} ms) is slower than "
                     f"recomputing it ({1e3 * recompute:.1f} ms)")
    return Check("transfer", True, f"loading {block} over PCIe takes {1e3 * pcie:.1f} ms against "
                 f"{1e3 * recompute:.1f} ms to recompute it")


def _tail(a: Analysis, notes: list[str]) -> Check:
    budget = a.deployment.ttft_budget_s
    host = a.prefix_load_seconds(TierKind.HOST)
    if not len(host):
        return Check("latency", True, "no request has a prefix to load")
    p99, tokens = float(np.percentile(host, 99)), a.reused_prefix_tokens(99)
    disk = float(np.percentile(a.prefix_load_seconds(TierKind.DISK), 99))
    if disk > budget:
        notes.append(f"from disk, the p99 reused prefix takes {1e3 * disk:,.0f} ms to load, over the "
                     f"{1e3 * budget:,.0f} ms TTFT budget: keep the tail on host, or cap what disk serves")
    what = f"the p99 reused prefix ({tokens:,.0f} tokens, {_gib(np.ceil(tokens / a.block_tokens) * a.block_bytes)})"
    if p99 > budget:
        return Check("latency", False, f"the transfer path cannot meet the {1e3 * budget:,.0f} ms TTFT budget: "
                     f"loading {what} from host takes {1e3 * p99:,.0f} ms")
    return Check("latency", True, f"{what} loads from host in {1e3 * p99:,.0f} ms, within the "
                 f"{1e3 * budget:,.0f} ms TTFT budget")
