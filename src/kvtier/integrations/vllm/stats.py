"""kvtier's figures through vLLM's stats path: workers and scheduler report deltas each step, vLLM aggregates
them, logs them, and hands them to Prometheus as the families of `kvtier.metrics.FAMILIES` (with vLLM's engine
labels)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvtier.config import parse_config
from kvtier.metrics import BREAKER_GAUGE, FAMILIES, MOVE_BUCKETS, Family

SEP = "|"  # joins label values in the serializable payload
PER_CLIENT = ["tier", "side"]  # a shared tier's breaker: one per client (the scheduler's lookups, each rank)


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
        histograms = {k: {lab: list(obs) for lab, obs in v.items()} for k, v in self.data.get("histograms", {}).items()}
        for name, values in other.data.get("histograms", {}).items():
            for lab, obs in values.items():
                histograms.setdefault(name, {}).setdefault(lab, []).extend(obs)
        return KVTierStats({"counters": counters, "gauges": gauges, "histograms": histograms})

    def reduce(self) -> dict[str, int | float]:
        flat: dict[str, int | float] = {}
        for kind in ("counters", "gauges"):
            for name, values in self.data.get(kind, {}).items():
                for lab, n in values.items():
                    flat[f"{name}[{lab}]"] = n
        return flat

    def is_empty(self) -> bool:
        return not any(any(self.data.get(kind, {}).values()) for kind in ("counters", "gauges", "histograms"))


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def labels(family: Family) -> list[str]:
            return labelnames + list(family.labels) + (PER_CLIENT if family.per_client else [])

        # vLLM's prometheus_client classes (or its multiprocess wrappers): typed loosely there, so here
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        histogram: Any = self._histogram_cls
        self._counters = {f.name: counter(name=f"kvtier_{f.name}", documentation=f.doc, labelnames=labels(f))
                          for f in FAMILIES.values() if f.kind == "counter"}
        self._gauges = {f.name: gauge(name=f"kvtier_{f.name}", documentation=f.doc, labelnames=labels(f),
                                      multiprocess_mode="mostrecent")
                        for f in FAMILIES.values() if f.kind == "gauge"}
        self._histograms = {f.name: histogram(name=f"kvtier_{f.name}", documentation=f.doc, labelnames=labels(f),
                                              buckets=list(MOVE_BUCKETS))
                            for f in FAMILIES.values() if f.kind == "histogram"}
        self._from_startup(vllm_config, per_engine_labelvalues)

    def _from_startup(self, vllm_config: Any, per_engine_labelvalues: dict[int, list[object]]) -> None:
        """Series with values before the first request: every tier on, no token looked up yet (misses included),
        whether the shared tier is signed, so that a dashboard's hit ratio, the guard's state and the trust the
        config placed in the network exist from the start."""
        extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None)
        try:
            config = parse_config(extra or {})
        except ValueError:
            return  # the engine itself reports the bad config, naming the field
        names = config.tier_names()
        shared = [n for n, t in zip(names[1:], config.secondary_tiers) if t.type == "redis"]
        signed = int(config.auth_key_env is not None)
        for values in per_engine_labelvalues.values():
            engine = [str(v) for v in values]
            for tier in names:
                self._gauges["tier_enabled"].labels(*engine, tier).set(1)
            for tier in shared:
                self._gauges["shared_tier_authenticated"].labels(*engine, tier).set(signed)
            for source in ("engine", *names, "miss"):
                self._counters["lookup_tokens"].labels(*engine, source).inc(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for name, values in transfer_stats_data.get("counters", {}).items():
            for lab, n in values.items():
                self._counters[name].labels(*engine, *lab.split(SEP)).inc(n)
        for name, values in transfer_stats_data.get("gauges", {}).items():
            for lab, v in values.items():
                self._gauges[name].labels(*engine, *lab.split(SEP)).set(v)
        for name, values in transfer_stats_data.get("histograms", {}).items():
            for lab, observed in values.items():
                histogram = self._histograms[name].labels(*engine, *lab.split(SEP))
                for seconds, count in observed:
                    for _ in range(count):
                        histogram.observe(seconds)
