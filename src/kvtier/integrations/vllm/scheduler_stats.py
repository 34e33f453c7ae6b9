"""The scheduler half's figures for vLLM's stats path (deltas of counters, gauges now) and its startup line.

The shared tier's bytes (all engines' blocks, and the bound a Redis refusing puts for memory lowered) live in Redis:
they are read by the scheduler's own client on a thread of its own, at most once per SHARED_USAGE_S, so the stats
path never waits on the network; a reading Redis did not answer leaves the last one."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvtier.config import KVTierConfig, redact_url
from kvtier.directory import Directory
from kvtier.integrations.vllm.control import SchedulerControl
from kvtier.integrations.vllm.setup import Geometry
from kvtier.integrations.vllm.stats import Deltas, add_breaker
from kvtier.stores.base import SharedStore

ORPHAN_AUDIT_S = 1.0  # the orphan count walks every block: at most once a second, not on every engine step
SHARED_USAGE_S = 1.0  # the shared tier's bytes are asked of Redis at most this often


class SchedulerStats:
    def __init__(self, directory: Directory, geometry: Geometry, control: SchedulerControl,
                 shared_store: SharedStore | None, lookups_skipped: Counter | None = None) -> None:
        self.directory = directory
        self.lookups_skipped = lookups_skipped if lookups_skipped is not None else Counter()  # reason -> requests
        self.geo = geometry
        self.control = control
        self.shared_store = shared_store
        self.dropped: Counter = Counter()  # reason -> blocks the scheduler half refused to store
        self.shortfall: Counter = Counter()  # tier -> tokens promised to vLLM that no load could take
        self.lookup_tokens: Counter = Counter()  # "engine", a tier or "miss" -> prompt tokens (`_count_lookup`)
        self._deltas = Deltas()
        self._orphans: dict[str, int] = {}
        self._audited_at = float("-inf")
        self._usage = SharedUsage(shared_store) if shared_store is not None else None

    def payload(self) -> dict:
        """What changed in the directory since the last call, and the tiers' usage now."""
        d = self.directory
        usage = d.usage()
        payload: dict[str, dict[str, Any]] = {
            "counters": {
                "lookup_tokens": self._deltas.take("lookup_tokens", self.lookup_tokens),
                "evictions": self._deltas.take("evictions", d.stats.evictions),
                "admission_rejects": self._deltas.take("admission_rejects", d.stats.admission_rejects),
                "stores_dropped": self._deltas.take("stores_dropped", d.stats.stores_dropped + self.dropped),
                "failed_deletes": self._deltas.take("failed_deletes", d.stats.failed_deletes),
                "load_shortfall_tokens": self._deltas.take("load_shortfall_tokens", self.shortfall),
                "shared_lookups_skipped": self._deltas.take("shared_lookups_skipped", self.lookups_skipped),
            },
            "gauges": {
                "tier_used_bytes": {name: u.used_bytes for name, u in usage.items()},
                "tier_capacity_bytes": {name: u.capacity_bytes for name, u in usage.items()},
                "admission_sightings_needed": {name: u.sightings_needed for name, u in usage.items()},
                "orphan_blocks": self._audit_orphans(),
            },
        }
        counters, gauges = self.control.payload(self._deltas)
        payload["counters"].update(counters)
        payload["gauges"].update(gauges)
        if self.shared_store is not None and d.shared is not None:
            add_breaker(payload, self.shared_store, d.shared.name, "scheduler", self._deltas)
            self._add_shared_usage(payload["gauges"], d.shared.name)
        return payload

    def _add_shared_usage(self, gauges: dict[str, dict[str, Any]], name: str) -> None:
        assert self.shared_store is not None and self._usage is not None
        gauges["shared_tier_authenticated"] = {name: int(self.shared_store.authenticated)}
        used, capacity = self._usage.reading()
        if used is not None:
            gauges["tier_used_bytes"][name] = used
        if capacity is not None:
            gauges["tier_capacity_bytes"][name] = capacity

    def describe(self, config: KVTierConfig) -> str:
        """One line for the engine's log: what kvtier configured and took back."""
        d = self.directory
        tiers = ", ".join(f"{t.name} {t.capacity_bytes / 2**20:,.0f} MiB ({t.capacity_blocks:,} blocks, "
                          f"{t.spec.policy}, {t.used_blocks:,} recovered)" for t in d.tiers)
        if d.shared is not None:
            tier = next(t for t in config.secondary_tiers if t.type == "redis")
            trust = ("blocks signed with auth_key_env's secret" if config.auth_key_env is not None else
                     "trusted_network: blocks unsigned, whoever can write to it decides what is served")
            tiers += f", {d.shared.name} (shared, {redact_url(tier.url)} {tier.key_prefix}, {trust})"
        guard = "off" if config.guard is None else config.guard.model_dump_json(exclude_defaults=True)
        return (f"tiers {tiers}; block {self.geo.block_tokens} tokens, {self.geo.block_nbytes:,} B per rank; "
                f"load_policy {config.load_policy}; guard {guard}; namespace {self.geo.namespace(0)[:16]}")

    def _audit_orphans(self) -> dict[str, int]:
        now = time.monotonic()
        if now - self._audited_at >= ORPHAN_AUDIT_S:
            self._orphans, self._audited_at = self.directory.orphans_by_tier(), now
        return self._orphans


class SharedUsage:
    """The shared tier's (used, capacity) bytes, read by a thread of its own: `reading()` returns the last
    reading at once, and asks for a new one when it is older than SHARED_USAGE_S."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-shared-usage")
        self._asked: Future | None = None
        self._asked_at = float("-inf")
        self._last: tuple[int | None, int | None] = (None, None)

    def reading(self) -> tuple[int | None, int | None]:
        asked = self._asked
        if asked is not None and asked.done():
            self._asked = None
            try:
                used, capacity = asked.result()
                self._last = (used if used is not None else self._last[0], capacity)
            except Exception:  # a reading that failed keeps the last one; the breaker counted it
                pass
        now = time.monotonic()
        if self._asked is None and now - self._asked_at >= SHARED_USAGE_S:
            self._asked, self._asked_at = self._pool.submit(self._read), now
        return self._last

    def _read(self) -> tuple[int | None, int]:
        return self.store.used_bytes(), self.store.capacity_bytes()
