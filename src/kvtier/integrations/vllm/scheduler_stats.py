"""The scheduler half's figures for vLLM's stats path (deltas of counters, gauges now) and its startup line."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.directory import Directory
from kvtier.integrations.vllm.control import SchedulerControl
from kvtier.integrations.vllm.setup import Geometry
from kvtier.integrations.vllm.stats import Deltas, add_breaker
from kvtier.stores.base import SharedStore

ORPHAN_AUDIT_S = 1.0  # the orphan count walks every block: at most once a second, not on every engine step


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
        self._deltas = Deltas()
        self._orphans: dict[str, int] = {}
        self._audited_at = float("-inf")

    def payload(self) -> dict:
        """What changed in the directory since the last call, and the tiers' usage now."""
        d = self.directory
        tokens = {k: v * self.geo.block_tokens for k, v in d.stats.lookup_blocks.items()}
        usage = d.usage()
        payload: dict[str, dict[str, Any]] = {
            "counters": {
                "lookup_tokens": self._deltas.take("lookup_tokens", tokens),
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
        return payload

    def describe(self, config: KVTierConfig) -> str:
        """One line for the engine's log: what kvtier configured and took back."""
        d = self.directory
        tiers = ", ".join(f"{t.name} {t.capacity_bytes / 2**20:,.0f} MiB ({t.capacity_blocks:,} blocks, "
                          f"{t.spec.policy}, {t.used_blocks:,} recovered)" for t in d.tiers)
        if d.shared is not None:
            tiers += f", {d.shared.name} (shared)"
        guard = "off" if config.guard is None else config.guard.model_dump_json(exclude_defaults=True)
        return (f"tiers {tiers}; block {self.geo.block_tokens} tokens, {self.geo.block_nbytes:,} B per rank; "
                f"load_policy {config.load_policy}; guard {guard}; namespace {self.geo.namespace(0)[:16]}")

    def _audit_orphans(self) -> dict[str, int]:
        now = time.monotonic()
        if now - self._audited_at >= ORPHAN_AUDIT_S:
            self._orphans, self._audited_at = self.directory.orphans_by_tier(), now
        return self._orphans
