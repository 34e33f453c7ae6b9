"""The decision: per request, how many of the blocks kvtier found to load, and how many to let the engine
recompute. Pure Python, fed with measurements by its driver (the vLLM scheduler half, the simulator).

A load of the first k blocks is expected to take, per tier, its latency + (bytes queued on it + the bytes of its
blocks among the k) / its bandwidth, summed over tiers; recomputing them takes their tokens / the engine's
prefill throughput. Both sides are measured online: a tier's latency and bandwidth are fitted (EWMA) to the
transfers that completed on it, the engine's throughput is the median of the last requests' prefill spans (a
configured prior until there is one). The longest prefix whose load wins is offered. A tier without a recent
transfer is assumed fast: its next load measures it again, so a tier that recovers is used again.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict, deque
from collections.abc import Sequence

ALPHA = 0.2  # weight of the newest sample in the moving averages
ESTIMATE_TTL_S = 10.0  # a tier's fit is forgotten this long after its last transfer
PREFILL_SAMPLES = 32  # prefill spans the engine's throughput is the median of
LOAD, PARTIAL, RECOMPUTE = "load", "partial", "recompute"


class LinkEstimate:
    """seconds(bytes) = latency + bytes / bandwidth, fitted to exponentially weighted moments of the samples.
    While the samples' sizes hardly vary, latency and bandwidth cannot be told apart: the fit is proportional.
    A tier's first transfer is not a sample: it pays one-time costs (threads started, first page faults)."""

    def __init__(self) -> None:
        self.samples = 0
        self.updated_at = float("-inf")
        self.warm = False
        self._x = self._y = self._xx = self._xy = 0.0

    def add(self, nbytes: int, seconds: float, now: float) -> None:
        if not self.warm:
            self.warm = True
            return
        if self.samples == 0 or now - self.updated_at > ESTIMATE_TTL_S:
            self.samples = 0
            self._x, self._y, self._xx, self._xy = float(nbytes), seconds, float(nbytes) ** 2, nbytes * seconds
        else:
            a = ALPHA
            self._x += a * (nbytes - self._x)
            self._y += a * (seconds - self._y)
            self._xx += a * (nbytes * nbytes - self._xx)
            self._xy += a * (nbytes * seconds - self._xy)
        self.samples += 1
        self.updated_at = now

    def fit(self) -> tuple[float, float]:
        """(latency in seconds, seconds per byte)."""
        var = self._xx - self._x**2
        if var > (0.05 * self._x) ** 2:
            per_byte = (self._xy - self._x * self._y) / var
            latency = self._y - per_byte * self._x
            if per_byte > 0 and latency >= 0:
                return latency, per_byte
        return 0.0, self._y / self._x if self._x else 0.0

    def current(self, now: float) -> tuple[float, float]:
        """The fit, or (0, 0) without a recent sample (the next load will tell)."""
        if self.samples == 0 or now - self.updated_at > ESTIMATE_TTL_S:
            return 0.0, 0.0
        return self.fit()

    def seconds(self, nbytes: float, now: float) -> float:
        latency, per_byte = self.current(now)
        return latency + nbytes * per_byte


class PrefillEstimate:
    """Seconds per recomputed token: the median over the last requests' prefill spans (a warm-up or a stalled
    step does not move it), the prior until the first."""

    def __init__(self, prior_tokens_per_s: float) -> None:
        self.prior = 1 / prior_tokens_per_s
        self._recent: deque[float] = deque(maxlen=PREFILL_SAMPLES)

    @property
    def per_token(self) -> float:
        return statistics.median(self._recent) if self._recent else self.prior

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._recent.append(seconds / tokens)

    def seconds(self, tokens: int) -> float:
        return tokens * self.per_token


class Decider:
    def __init__(self, policy: str, max_load_tokens: int | None, prior_tokens_per_s: float, block_bytes: int) -> None:
        self.policy = policy  # "auto" | "always"
        self.max_load_tokens = max_load_tokens
        self.block_bytes = block_bytes
        self.links: dict[str, LinkEstimate] = {}
        self.prefill = PrefillEstimate(prior_tokens_per_s)
        self.queued: defaultdict[str, float] = defaultdict(float)  # tier -> bytes of loads shipped, not done
        self.decisions: Counter = Counter()  # (tier, load | partial | recompute) -> requests

    def transferred(self, tier: str, nbytes: int, seconds: float, now: float) -> None:
        """A load from `tier` completed: `nbytes` in `seconds`, from its start."""
        self.links.setdefault(tier, LinkEstimate()).add(nbytes, seconds, now)

    def blocks_to_load(self, sources: Sequence[str], tokens: Sequence[int], now: float,
                       count_as: str | None = None) -> int:
        """How many leading blocks of those found (`sources[i]`: the tier of block i, bringing `tokens[i]`
        tokens) to load. The decision is counted under `count_as` (the request's slowest tier), if given."""
        found = len(sources)
        if self.max_load_tokens is not None:
            total, capped = 0, 0
            while capped < found and total + tokens[capped] <= self.max_load_tokens:
                total += tokens[capped]
                capped += 1
            found = capped
        best = found if self.policy == "always" else self._winning_prefix(sources[:found], tokens, now)
        if count_as is not None and sources:
            decision = LOAD if best == len(sources) else PARTIAL if best else RECOMPUTE
            self.decisions[(count_as, decision)] += 1
        return best

    def _winning_prefix(self, sources: Sequence[str], tokens: Sequence[int], now: float) -> int:
        fits = {t: self.links[t].current(now) if t in self.links else (0.0, 0.0) for t in set(sources)}
        per_token = self.prefill.per_token
        best, recompute_tokens = 0, 0
        blocks: Counter[str] = Counter()
        for k, (tier, n) in enumerate(zip(sources, tokens), start=1):
            blocks[tier] += 1
            recompute_tokens += n
            load_s = sum(fits[t][0] + (self.queued[t] + b * self.block_bytes) * fits[t][1] for t, b in blocks.items())
            if load_s <= recompute_tokens * per_token:
                best = k
        return best
