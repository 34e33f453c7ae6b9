"""The directory's counters: plain Counters, cheap on the hot path, exported to Prometheus at scrape time
by `kvtier.metrics` (and by the vLLM connector's stats path)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class DirectoryStats:
    lookup_blocks: Counter = field(default_factory=Counter)  # source tier or "miss"
    evictions: Counter = field(default_factory=Counter)  # (tier, reason)
    admission_rejects: Counter = field(default_factory=Counter)  # (tier, reason)
    stores_dropped: Counter = field(default_factory=Counter)  # reason
    planned_moves: Counter = field(default_factory=Counter)  # (src, dst)
    failed_deletes: Counter = field(default_factory=Counter)  # tier: files that may be left, still counted
