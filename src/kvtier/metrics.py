"""What we measure, under the Prometheus names DESIGN.md fixes (one family per fact).

The directory and the mover keep plain counters (cheap on the hot path); a collector turns them into
Prometheus families at scrape time. Only move latencies are observed live, into a histogram.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvtier.directory import Directory

MOVE_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


@dataclass
class MoveStats:
    """The data plane's counters; written from mover threads, hence the lock."""

    moves: Counter = field(default_factory=Counter)  # (src, dst)
    bytes: Counter = field(default_factory=Counter)  # (src, dst)
    seconds: Counter = field(default_factory=Counter)  # (src, dst), total
    integrity_failures: Counter = field(default_factory=Counter)  # tier
    stores_dropped: Counter = field(default_factory=Counter)  # reason
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Metrics:
    """One registry per cache, so that two caches in one process never mix their numbers."""

    def __init__(
        self, directory: Directory | None, block_tokens: int, tier_enabled: Callable[[str], bool] = lambda _: True
    ) -> None:
        """`directory` is None where only bytes move (a vLLM worker): then only the data plane's figures exist."""
        self.directory = directory
        self.block_tokens = block_tokens
        self.tier_enabled = tier_enabled
        self.moves = MoveStats()
        self.registry = CollectorRegistry()
        self.move_seconds = Histogram(
            "kvtier_move_seconds", "Duration of one block move", ["src", "dst"],
            buckets=MOVE_BUCKETS, registry=self.registry,
        )
        self.registry.register(_Collector(self))

    def observe_move(self, src: str, dst: str, nbytes: int, seconds: float, count: int = 1) -> None:
        """`count` moves of `nbytes` each that took `seconds` each (a batch is observed in one call)."""
        with self.moves.lock:
            self.moves.moves[(src, dst)] += count
            self.moves.bytes[(src, dst)] += nbytes * count
            self.moves.seconds[(src, dst)] += seconds * count
        histogram = self.move_seconds.labels(src, dst)
        for _ in range(count):
            histogram.observe(seconds)

    def count(self, family: str, label: str, n: int = 1) -> None:
        with self.moves.lock:
            getattr(self.moves, family)[label] += n

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        """Every figure as plain data, for reports and `--json`."""
        d = self.directory
        with self.moves.lock:
            moves = {f"{s}->{t}": n for (s, t), n in self.moves.moves.items()}
            move_bytes = {f"{s}->{t}": n for (s, t), n in self.moves.bytes.items()}
            move_seconds = {f"{s}->{t}": n for (s, t), n in self.moves.seconds.items()}
            integrity = dict(self.moves.integrity_failures)
            dropped = Counter(self.moves.stores_dropped)
        data_plane = {"moves": moves, "move_bytes": move_bytes, "move_seconds": move_seconds,
                      "integrity_failures": integrity, "stores_dropped": dict(dropped)}
        if d is None:
            return data_plane
        dropped.update(d.stats.stores_dropped)
        return {
            "lookup_tokens": {k: v * self.block_tokens for k, v in d.stats.lookup_blocks.items()},
            "moves": moves,
            "move_bytes": move_bytes,
            "move_seconds": move_seconds,
            "tiers": {
                t.name: {"used_bytes": t.used_bytes, "capacity_bytes": t.capacity_blocks * t.spec.block_bytes,
                         "enabled": self.tier_enabled(t.name)}
                for t in d.tiers
            },
            "evictions": {f"{t}/{r}": n for (t, r), n in d.stats.evictions.items()},
            "admission_rejects": {f"{t}/{r}": n for (t, r), n in d.stats.admission_rejects.items()},
            "stores_dropped": dict(dropped),
            "integrity_failures": integrity,
            "orphan_blocks": d.orphans(),
        }


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m, d = self.metrics, self.metrics.directory
        snap = m.snapshot()

        def counter(name: str, doc: str, labels: list[str], items: dict) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=labels)
            for key, value in items.items():
                fam.add_metric(list(key) if isinstance(key, tuple) else [key], value)
            return fam

        def gauge(name: str, doc: str, values: dict[str, float]) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, value in values.items():
                fam.add_metric([tier], value)
            return fam

        with m.moves.lock:
            moves, nbytes = dict(m.moves.moves), dict(m.moves.bytes)
        yield counter("kvtier_moves", "Blocks moved", ["src", "dst"], moves)
        yield counter("kvtier_move_bytes", "Bytes moved", ["src", "dst"], nbytes)
        yield counter("kvtier_stores_dropped", "Block stores dropped", ["reason"], snap["stores_dropped"])
        yield counter("kvtier_integrity_failures", "Corrupt, torn or foreign blocks detected", ["tier"],
                      snap["integrity_failures"])
        if d is None:
            return
        tokens = {k: v * m.block_tokens for k, v in d.stats.lookup_blocks.items()}
        yield counter("kvtier_lookup_tokens", "Tokens looked up, by where they were found", ["source"], tokens)
        yield counter("kvtier_evictions", "Blocks evicted", ["tier", "reason"], dict(d.stats.evictions))
        yield counter("kvtier_admission_rejects", "Blocks refused by a tier's admission rule", ["tier", "reason"],
                      dict(d.stats.admission_rejects))
        tiers = snap["tiers"]
        yield gauge("kvtier_tier_used_bytes", "Bytes held by a tier", {t: v["used_bytes"] for t, v in tiers.items()})
        yield gauge("kvtier_tier_capacity_bytes", "Configured bytes of a tier",
                    {t: v["capacity_bytes"] for t, v in tiers.items()})
        yield gauge("kvtier_tier_enabled", "1 while a tier serves, 0 once the guard turned it off",
                    {t: float(v["enabled"]) for t, v in tiers.items()})
        yield gauge("kvtier_orphan_blocks", "Blocks whose parent is in no tier (a bug if not 0)",
                    d.orphans_by_tier())
