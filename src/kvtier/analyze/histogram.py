"""A log-binned histogram: percentiles of reuse times over any trace length in constant memory.

Reuse times span milliseconds to days, so bins are equal in log scale (20 per decade: a percentile is off by
at most 12 %); the mean is exact. Zeros (two requests in one timestamp bucket) are counted on their own.
"""

from __future__ import annotations

import math
from array import array

import numpy as np

PER_DECADE = 20


class LogHistogram:
    def __init__(self, low: float = 1e-4, high: float = 1e8) -> None:
        self.low_exp = math.floor(math.log10(low))
        self.bins = (math.ceil(math.log10(high)) - self.low_exp) * PER_DECADE
        self.counts = np.zeros(self.bins, dtype=np.int64)
        self.zeros = 0
        self.total = 0.0
        self.n = 0
        self._pending = array("d")

    def add(self, value: float) -> None:
        self._pending.append(value)
        if len(self._pending) >= 1 << 16:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        values = np.frombuffer(self._pending, dtype=np.float64)
        self.n += len(values)
        self.total += float(values.sum())
        positive = values[values > 0]
        self.zeros += len(values) - len(positive)
        index = np.floor((np.log10(positive) - self.low_exp) * PER_DECADE).astype(np.int64)
        np.add.at(self.counts, np.clip(index, 0, self.bins - 1), 1)
        self._pending = array("d")

    @property
    def count(self) -> int:
        self._flush()
        return self.n

    @property
    def mean(self) -> float:
        self._flush()
        return self.total / self.n if self.n else 0.0

    def edges(self) -> np.ndarray:
        return 10.0 ** (self.low_exp + np.arange(self.bins + 1) / PER_DECADE)

    def quantile(self, q: float) -> float:
        """The value below which a share `q` of the samples lie (the geometric middle of its bin)."""
        self._flush()
        if not self.n:
            return 0.0
        rank = q * self.n
        if rank <= self.zeros:
            return 0.0
        cumulative = self.zeros + np.cumsum(self.counts)
        i = int(np.searchsorted(cumulative, rank))
        edges = self.edges()
        return float(math.sqrt(edges[i] * edges[i + 1]))

    def share_below(self, value: float) -> float:
        """Share of the samples at most `value` (to within a bin)."""
        self._flush()
        if not self.n:
            return 0.0
        if value <= 0:
            return self.zeros / self.n
        i = int(np.clip(math.floor((math.log10(value) - self.low_exp) * PER_DECADE), -1, self.bins - 1))
        return (self.zeros + int(self.counts[: i + 1].sum())) / self.n

    def summary(self, unit: str) -> dict:
        return {
            "unit": unit, "count": self.count, "mean": self.mean,
            **{f"p{q}": self.quantile(q / 100) for q in (10, 50, 90, 99)},
        }

    def as_dict(self, unit: str) -> dict:
        """Every figure: the summary and the non-empty bins (lower edge, count)."""
        edges = self.edges()
        nonzero = np.nonzero(self.counts)[0]
        return {**self.summary(unit), "zeros": self.zeros,
                "bins": [[float(edges[i]), int(self.counts[i])] for i in nonzero]}
