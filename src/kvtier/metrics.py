"""What we measure, under the Prometheus names DESIGN.md fixes: one table of families (`FAMILIES`), exported
in-process by `Metrics` and in vLLM through its stats path (`kvtier.integrations.vllm.stats`).

The directory and the mover keep plain counters (cheap on the hot path); a collector turns them into
Prometheus families at scrape time. Only move latencies are observed live, into a histogram.

A shared tier (Redis) appears under its name in the same families (`source="redis"`, moves host<->redis,
`integrity_failures{tier="redis"}`, `tier_used_bytes{tier="redis"}`: all engines' bytes under its prefix, as
the store counts them), plus its circuit breaker: `kvtier_redis_breaker_state` (0 closed, 1 half-open,
2 open) and `kvtier_redis_breaker_opens_total`. Stores it refused or never tried are
`kvtier_stores_dropped_total{reason="breaker_open"|"redis_orphan"|"redis_no_room"|"redis_queue_full"|...}`.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from kvtier.directory import Directory
    from kvtier.guard import Guard


@dataclass(frozen=True)
class Family:
    name: str  # the metric is kvtier_<name> (counters get Prometheus' _total)
    kind: str  # "counter", "gauge" or "histogram"
    doc: str
    labels: tuple[str, ...]
    per_client: bool = False  # one series per client of a shared store: in vLLM, labelled (tier, side)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("lookup_tokens", "counter", "Prompt tokens looked up, by the tier that served them (or miss)", ("source",)),
    Family("moves", "counter", "Blocks moved", ("src", "dst")),
    Family("move_bytes", "counter", "Bytes moved", ("src", "dst")),
    Family("move_seconds", "histogram", "Duration of one block move", ("src", "dst")),
    Family("evictions", "counter", "Blocks evicted (reason lost: found gone or damaged when read)", ("tier", "reason")),
    Family("admission_rejects", "counter", "Blocks refused by a tier's admission rule", ("tier", "reason")),
    Family("stores_dropped", "counter", "Block stores dropped", ("reason",)),
    Family("integrity_failures", "counter", "Corrupt, torn or foreign blocks detected (served as misses)", ("tier",)),
    Family("failed_deletes", "counter", "Deletes that failed: their files may be left, and stay counted", ("tier",)),
    Family("tier_used_bytes", "gauge", "Bytes held by a tier", ("tier",)),
    Family("tier_capacity_bytes", "gauge", "Configured bytes of a tier", ("tier",)),
    Family("admission_sightings_needed", "gauge", "Sightings a block needs to enter a tier now (`min_sightings: "
           "auto` moves it between 1 and 2 as blocks offered to the tier come back or not)", ("tier",)),
    Family("tier_enabled", "gauge", "1 while a tier serves, 0 while the guard has it off or on probe", ("tier",)),
    Family("orphan_blocks", "gauge", "Blocks whose parent is in no tier (a bug if not 0)", ("tier",)),
    Family("guard_transitions", "counter", "The guard turned a tier off, on probe, or back on", ("tier", "to")),
    Family("guard_window_p99_seconds", "gauge", "p99 of the guard's last window, by the source of requests' "
           "prefixes (a tier, engine or recompute)", ("tier", "signal")),
    Family("load_shortfall_tokens", "counter", "Prompt tokens promised to vLLM as a shared tier's hit that the load "
           "could not take (a transfer of this engine's own was on the block): vLLM recomputes them", ("tier",)),
    Family("shared_lookups_skipped", "counter", "Requests that went on without the shared tier's answer to their "
           "lookup: it passed lookup_deadline_s, or lookup_queue_depth lookups were in flight", ("reason",)),
    Family("load_decisions", "counter", "Requests whose blocks found were all loaded, partly, or recomputed, by "
           "their slowest tier", ("tier", "decision")),
    Family("shared_tier_authenticated", "gauge", "1 when a shared tier serves only blocks signed with the secret of "
           "auth_key_env, 0 when its config trusts the network (trusted_network): whoever can write to it then "
           "decides what is served", ("tier",)),
    Family("redis_breaker_state", "gauge", "Circuit breaker of a shared tier: 0 closed, 1 half-open, 2 open", (),
           per_client=True),
    Family("redis_breaker_opens", "counter", "Times a shared tier's circuit breaker opened", (), per_client=True),
)}
BREAKER_GAUGE = {"closed": 0, "half_open": 1, "open": 2}
MOVE_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
MAX_OBSERVED = 4096  # move durations kept per pair between two `take_observed` (one engine step)


class MeteredStore(Protocol):
    """What metrics read from a shared tier's store (RedisStore): local counters, its byte count and its bound."""

    def stats(self) -> dict[str, Any]: ...

    def used_bytes(self) -> int | None: ...

    def capacity_bytes(self) -> int: ...

    @property
    def authenticated(self) -> bool: ...


@dataclass
class MoveStats:
    """The data plane's counters; written from mover threads, hence the lock."""

    moves: Counter = field(default_factory=Counter)  # (src, dst)
    bytes: Counter = field(default_factory=Counter)  # (src, dst)
    seconds: defaultdict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))  # total
    buckets: dict = field(default_factory=dict)  # (src, dst) -> moves per MOVE_BUCKETS bucket (+Inf last)
    integrity_failures: Counter = field(default_factory=Counter)  # tier
    stores_dropped: Counter = field(default_factory=Counter)  # reason
    observed: dict = field(default_factory=dict)  # (src, dst) -> [(seconds, count)], kept only for `take_observed`
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Metrics:
    """One registry per cache, so that two caches in one process never mix their numbers."""

    def __init__(
        self, directory: Directory | None, block_tokens: int, guard: Guard | None = None,
        shared: Mapping[str, MeteredStore] | None = None, lock: AbstractContextManager | None = None,
        keep_observed: bool = False,
    ) -> None:
        """`directory` is None where only bytes move (a vLLM worker): then only the data plane's figures exist.
        `shared`: the shared tiers' stores by name, where this process has them. `lock`: held while the
        directory is read (the caller's lock around it); never while a shared store is asked for its bytes.
        `keep_observed`: keep each move's duration until `take_observed` (a vLLM worker ships them to the
        engine's own histogram)."""
        self.directory = directory
        self.block_tokens = block_tokens
        self.guard = guard
        self.keep_observed = keep_observed
        self.shared = dict(shared or {})
        self.lock = lock if lock is not None else nullcontext()
        self.moves = MoveStats()
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))

    def observe_move(self, src: str, dst: str, nbytes: int, seconds: float, count: int = 1) -> None:
        """`count` moves of `nbytes` each that took `seconds` each (a batch is observed in one call)."""
        with self.moves.lock:
            self.moves.moves[(src, dst)] += count
            self.moves.bytes[(src, dst)] += nbytes * count
            self.moves.seconds[(src, dst)] += seconds * count
            buckets = self.moves.buckets.get((src, dst))
            if buckets is None:
                buckets = self.moves.buckets[(src, dst)] = [0] * (len(MOVE_BUCKETS) + 1)
            buckets[bisect_left(MOVE_BUCKETS, seconds)] += count  # a bucket counts the moves of at most its bound
            if self.keep_observed:
                kept = self.moves.observed.setdefault((src, dst), [])
                if len(kept) < MAX_OBSERVED:
                    kept.append((seconds, count))

    def move_histogram(self) -> HistogramMetricFamily:
        """The move durations as Prometheus buckets, counted here: a batch of moves is one increment."""
        f = FAMILIES["move_seconds"]
        fam = HistogramMetricFamily(f"kvtier_{f.name}", f.doc, labels=list(f.labels))
        with self.moves.lock:
            for (src, dst), counts in self.moves.buckets.items():
                cumulative, total = [], 0
                for bound, n in zip([*map(str, MOVE_BUCKETS), "+Inf"], counts):
                    total += n
                    cumulative.append((bound, total))
                fam.add_metric([src, dst], cumulative, sum_value=self.moves.seconds[(src, dst)])
        return fam

    def take_observed(self) -> dict:
        """Move durations since the last call: (src, dst) -> [(seconds, count)]."""
        with self.moves.lock:
            observed, self.moves.observed = self.moves.observed, {}
        return observed

    def count(self, family: str, label: str, n: int = 1) -> None:
        with self.moves.lock:
            getattr(self.moves, family)[label] += n

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        """Every figure as plain data, for reports and `--json`."""
        with self.lock:
            snap = self._snapshot()
        if self.shared:  # asks the shared store for its byte count: outside the lock, bounded by its timeouts
            self._add_shared(snap)
        return snap

    def _snapshot(self) -> dict:
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
            **data_plane,
            "lookup_tokens": {k: v * self.block_tokens for k, v in d.stats.lookup_blocks.items()},
            "tiers": {name: {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                             "sightings_needed": u.sightings_needed, "enabled": self.tier_enabled(name)}
                      for name, u in d.usage().items()},
            "evictions": {f"{t}/{r}": n for (t, r), n in d.stats.evictions.items()},
            "admission_rejects": {f"{t}/{r}": n for (t, r), n in d.stats.admission_rejects.items()},
            "stores_dropped": dict(dropped),
            "failed_deletes": dict(d.stats.failed_deletes),
            "orphan_blocks": d.orphans(),
            "orphan_blocks_by_tier": d.orphans_by_tier(),
            **self._guard_figures(),
        }

    def tier_enabled(self, tier: str) -> bool:
        return self.guard is None or self.guard.enabled(tier)

    def _guard_figures(self) -> dict:
        g = self.guard
        if g is None:
            return {}
        return {"guard_transitions": {f"{t}/{to}": n for (t, to), n in g.transitions.items()},
                "guard_window_p99_seconds": {f"{s}/{signal}": v for (s, signal), v in g.window_p99.items()}}

    def _add_shared(self, snap: dict) -> None:
        """The shared tiers' figures: their stores' counters and breakers, and the bytes all engines use."""
        snap["shared"] = {}
        for name, store in self.shared.items():
            stats = store.stats()
            snap["shared"][name] = stats
            snap.setdefault("tiers", {})[name] = {"used_bytes": store.used_bytes(),
                                                  "capacity_bytes": store.capacity_bytes(),
                                                  "enabled": self.tier_enabled(name),
                                                  "authenticated": store.authenticated}
            if stats.get("evictions") and "evictions" in snap:  # what this engine's puts evicted
                snap["evictions"][f"{name}/capacity"] = stats["evictions"]


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m, d = self.metrics, self.metrics.directory
        snap = m.snapshot()

        def counter(name: str, items: dict) -> CounterMetricFamily:
            f = FAMILIES[name]
            fam = CounterMetricFamily(f"kvtier_{name}", f.doc, labels=list(f.labels))
            for key, value in items.items():
                fam.add_metric(list(key) if isinstance(key, tuple) else [key], value)
            return fam

        def gauge(name: str, values: dict[str, float]) -> GaugeMetricFamily:
            f = FAMILIES[name]
            fam = GaugeMetricFamily(f"kvtier_{name}", f.doc, labels=list(f.labels))
            for tier, value in values.items():
                if value is not None:  # a shared tier that did not answer has no figure, rather than a wrong one
                    fam.add_metric([tier], value)
            return fam

        def pairs(items: dict) -> dict:
            return {tuple(k.split("->" if "->" in k else "/", 1)): v for k, v in items.items()}

        yield counter("moves", pairs(snap["moves"]))
        yield m.move_histogram()
        yield counter("move_bytes", pairs(snap["move_bytes"]))
        yield counter("stores_dropped", snap["stores_dropped"])
        yield counter("integrity_failures", snap["integrity_failures"])
        shared = snap.get("shared", {})
        if shared:  # in-process, one client per shared store: one series of each, no labels
            state = FAMILIES["redis_breaker_state"]
            fam = GaugeMetricFamily(f"kvtier_{state.name}", state.doc)
            fam.add_metric([], max(BREAKER_GAUGE[s["breaker_state"]] for s in shared.values()))
            yield fam
            opens = FAMILIES["redis_breaker_opens"]
            yield CounterMetricFamily(f"kvtier_{opens.name}", opens.doc,
                                      value=sum(s["breaker_opens"] for s in shared.values()))
        if d is None:
            return
        yield counter("lookup_tokens", snap["lookup_tokens"])
        yield counter("evictions", pairs(snap["evictions"]))
        yield counter("admission_rejects", pairs(snap["admission_rejects"]))
        yield counter("failed_deletes", snap["failed_deletes"])
        tiers = snap["tiers"]
        yield gauge("tier_used_bytes", {t: v["used_bytes"] for t, v in tiers.items()})
        yield gauge("tier_capacity_bytes", {t: v["capacity_bytes"] for t, v in tiers.items()})
        yield gauge("tier_enabled", {t: float(v["enabled"]) for t, v in tiers.items()})
        yield gauge("admission_sightings_needed", {t: v.get("sightings_needed") for t, v in tiers.items()})
        yield gauge("orphan_blocks", snap["orphan_blocks_by_tier"])
        yield gauge("shared_tier_authenticated", {t: float(v["authenticated"]) for t, v in tiers.items()
                                                  if "authenticated" in v})
        if m.guard is not None:
            yield counter("guard_transitions", pairs(snap["guard_transitions"]))
            p99 = FAMILIES["guard_window_p99_seconds"]
            fam = GaugeMetricFamily(f"kvtier_{p99.name}", p99.doc, labels=list(p99.labels))
            for (source, signal), value in pairs(snap["guard_window_p99_seconds"]).items():
                fam.add_metric([source, signal], value)
            yield fam
