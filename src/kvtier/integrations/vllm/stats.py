"""kvtier's figures through vLLM's stats path: workers and scheduler report deltas each step, vLLM aggregates
them, logs them, and hands them to Prometheus under the DESIGN.md family names (with vLLM's engine labels)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvtier.metrics import BREAKER_GAUGE

SEP = "|"  # joins label values in the serializable payload

COUNTERS: dict[str, tuple[str, list[str]]] = {  # payload key -> (documentation, labels); the metric is kvtier_<key>
    "lookup_tokens": ("Prompt tokens looked up, by the tier that served them (or miss)", ["source"]),
    "moves": ("Blocks moved", ["src", "dst"]),
    "move_bytes": ("Bytes moved", ["src", "dst"]),
    "evictions": ("Blocks evicted", ["tier", "reason"]),
    "admission_rejects": ("Blocks refused by a tier's admission rule", ["tier", "reason"]),
    "stores_dropped": ("Block stores dropped", ["reason"]),
    "integrity_failures": ("Corrupt, torn or foreign blocks detected (served as misses)", ["tier"]),
    "redis_breaker_opens": ("Times a shared tier's circuit breaker opened", ["tier", "side"]),
}
GAUGES: dict[str, tuple[str, list[str]]] = {
    "tier_used_bytes": ("Bytes held by a tier", ["tier"]),
    "tier_capacity_bytes": ("Configured bytes of a tier", ["tier"]),
    "orphan_blocks": ("Blocks whose parent is in no tier (a bug if not 0)", ["tier"]),
    "redis_breaker_state": ("Circuit breaker of a shared tier: 0 closed, 1 half-open, 2 open", ["tier", "side"]),
}


def label(key: Any) -> str:
    return SEP.join(map(str, key)) if isinstance(key, tuple) else str(key)


def add_breaker(payload: dict, store: Any, tier: str, side: str, deltas: Deltas) -> dict:
    """A shared tier's breaker in a stats payload: its state now and how often it opened. `side`: which client
    (the scheduler's lookups, or a rank's transfers) - each has a breaker of its own."""
    figures = store.stats()
    key = (tier, side)
    payload["counters"]["redis_breaker_opens"] = deltas.take("redis_breaker_opens", {key: figures["breaker_opens"]})
    payload["gauges"]["redis_breaker_state"] = {label(key): BREAKER_GAUGE[figures["breaker_state"]]}
    return payload


class Deltas:
    """Turns cumulative counters into what changed since the last call (vLLM sums what it is sent)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}

    def take(self, name: str, cumulative: Mapping[Any, float]) -> dict[str, float]:
        out = {}
        for key, value in cumulative.items():
            lab = label(key)
            delta = value - self._last.get((name, lab), 0)
            if delta:
                out[lab] = delta
                self._last[(name, lab)] = value
        return out


@dataclass
class KVTierStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=lambda: {"counters": {}, "gauges": {}})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        counters = {k: dict(v) for k, v in self.data.get("counters", {}).items()}
        for name, values in other.data.get("counters", {}).items():
            mine = counters.setdefault(name, {})
            for lab, n in values.items():
                mine[lab] = mine.get(lab, 0) + n
        gauges = {k: dict(v) for k, v in self.data.get("gauges", {}).items()}
        for name, values in other.data.get("gauges", {}).items():
            gauges.setdefault(name, {}).update(values)  # the latest reading wins
        return KVTierStats({"counters": counters, "gauges": gauges})

    def reduce(self) -> dict[str, int | float]:
        flat: dict[str, int | float] = {}
        for kind in ("counters", "gauges"):
            for name, values in self.data.get(kind, {}).items():
                for lab, n in values.items():
                    flat[f"{name}[{lab}]"] = n
        return flat

    def is_empty(self) -> bool:
        return not any(self.data.get("counters", {}).values()) and not any(self.data.get("gauges", {}).values())


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._counter_cls(name=f"kvtier_{name}", documentation=doc,
                                                  labelnames=labelnames + extra)
                          for name, (doc, extra) in COUNTERS.items()}
        self._gauges = {name: self._gauge_cls(name=f"kvtier_{name}", documentation=doc,
                                              labelnames=labelnames + extra, multiprocess_mode="mostrecent")
                        for name, (doc, extra) in GAUGES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for name, values in transfer_stats_data.get("counters", {}).items():
            for lab, n in values.items():
                self._counters[name].labels(*engine, *lab.split(SEP)).inc(n)
        for name, values in transfer_stats_data.get("gauges", {}).items():
            for lab, v in values.items():
                self._gauges[name].labels(*engine, *lab.split(SEP)).set(v)
