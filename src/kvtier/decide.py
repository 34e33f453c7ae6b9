"""The decision: per request, how many of the blocks kvtier found to load, and how many to let the engine
recompute. Plain Python and numpy, fed with measurements by its driver (the vLLM scheduler half, the simulator).

A load of the first k blocks is expected to take, per tier, its latency + (bytes queued on it + the bytes of its
blocks among the k) / its bandwidth, summed over tiers, and no less than the oldest load still in flight on that
tier has waited once that is longer than the fit says its queue takes (the tier is behind: stalled, or hung);
recomputing them takes their tokens x the engine's cost per token. Both sides are measured online: a tier's
latency and bandwidth are fitted (EWMA) to each tier's part of the loads that completed (or passed their
deadline), the engine's fixed cost per prefill and cost per token apart, to the last requests' prefill spans (a
configured prior until there are some). Only the cost per token counts against a load: the fixed one is paid
either way, since the request computes its last tokens whatever it loads. The longest prefix whose load wins is
offered. An idle tier without a recent transfer is assumed fast: its next load measures it again, so a tier that
recovers is used again; a tier with loads in flight keeps its fit until one completes.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict, deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

ALPHA = 0.2  # weight of the newest sample in the moving averages
ESTIMATE_TTL_S = 10.0  # an idle tier's fit is forgotten this long after its last transfer
PREFILL_SAMPLES = 32  # prefill spans the engine's costs are fitted to
REFIT_EVERY = 8  # new spans before the fit is redone, once PREFILL_SAMPLES are there
SPREAD = 2.0  # two spans tell the cost per token from the fixed one if one computed this many times the tokens
MIN_PAIRS = 8  # such pairs needed to fit the two costs apart
WEIGHED_AT_ONCE = 32  # found blocks from which the decision weighs every prefix at once (numpy)
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

    def current(self, now: float, busy: bool = False) -> tuple[float, float]:
        """The fit, or (0, 0) without a recent sample (the next load will tell). `busy`: loads are in flight on the
        tier, not completing: its last fit holds (a hung tier is not assumed fast because it stopped answering)."""
        if self.samples == 0 or (not busy and now - self.updated_at > ESTIMATE_TTL_S):
            return 0.0, 0.0
        return self.fit()

    def seconds(self, nbytes: float, now: float, busy: bool = False) -> float:
        latency, per_byte = self.current(now, busy)
        return latency + nbytes * per_byte


class PrefillEstimate:
    """The engine's prefill: seconds = fixed + tokens x per_token, fitted to the last requests' prefill spans. A
    request that loaded its prefix computes a few tokens in one step, which costs the step's fixed part: its span
    over its tokens says nothing of a token's cost. So the cost per token is the median slope between pairs of
    spans whose token counts differ enough (Theil-Sen: a warm-up or a stalled step does not move it); while the
    spans are too alike in size to tell, the median of span / tokens (which counts the fixed part in: the
    most a token can cost); the prior until the first span."""

    def __init__(self, prior_tokens_per_s: float) -> None:
        self.prior = 1 / prior_tokens_per_s
        self._recent: deque[tuple[int, float]] = deque(maxlen=PREFILL_SAMPLES)
        self._fit: tuple[float, float] | None = None
        self._new = 0  # spans added since the last fit

    @property
    def per_token(self) -> float:
        """Seconds one more recomputed token costs."""
        return self.fit()[1]

    @property
    def fixed(self) -> float:
        """Seconds a prefill costs whatever its tokens (a step's own cost)."""
        return self.fit()[0]

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token)."""
        if not self._recent:
            return 0.0, self.prior
        if self._fit is None or self._new >= REFIT_EVERY or (self._new and len(self._recent) < PREFILL_SAMPLES):
            self._fit, self._new = fit_prefill(self._recent), 0
        return self._fit

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._recent.append((tokens, seconds))
            self._new += 1

    def seconds(self, tokens: int) -> float:
        """What recomputing `tokens` more adds to a prefill."""
        return tokens * self.per_token


def fit_prefill(spans: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per token) of prefill spans (tokens, seconds): `PrefillEstimate`'s fit."""
    slopes = [(s2 - s1) / (t2 - t1) for (t1, s1), (t2, s2) in combinations(sorted(spans), 2) if t2 >= SPREAD * t1]
    if len(slopes) >= MIN_PAIRS:
        per_token = statistics.median(slopes)
        if per_token > 0:
            return max(0.0, statistics.median(s - per_token * t for t, s in spans)), per_token
    return 0.0, statistics.median(s / t for t, s in spans)


class Decider:
    def __init__(self, policy: str, max_load_tokens: int | None, prior_tokens_per_s: float, block_bytes: int) -> None:
        self.policy = policy  # "auto" | "always"
        self.max_load_tokens = max_load_tokens
        self.block_bytes = block_bytes
        self.links: dict[str, LinkEstimate] = {}
        self.prefill = PrefillEstimate(prior_tokens_per_s)
        self.queued: defaultdict[str, float] = defaultdict(float)  # tier -> bytes of loads shipped, not done
        self.decisions: Counter = Counter()  # (tier, load | partial | recompute) -> requests
        self._in_flight: dict[Hashable, tuple[float, dict[str, float]]] = {}  # load -> (shipped at, bytes per tier)

    def transferred(self, tier: str, nbytes: int, seconds: float, now: float) -> None:
        """`tier`'s part of a load completed (or passed its deadline): `nbytes` in `seconds`, from its start."""
        self.links.setdefault(tier, LinkEstimate()).add(nbytes, seconds, now)

    def shipped(self, load: Hashable, nbytes: Mapping[str, float], now: float) -> None:
        """A load left for the tiers (`nbytes` per tier); it is queued on them until `landed`."""
        self._in_flight[load] = (now, dict(nbytes))
        for tier, n in nbytes.items():
            self.queued[tier] += n

    def landed(self, load: Hashable) -> None:
        """A load `shipped` is done, whatever its outcome."""
        shipped = self._in_flight.pop(load, None)
        for tier, n in (shipped[1] if shipped else {}).items():
            self.queued[tier] = max(0.0, self.queued[tier] - n)

    def waited(self, tier: str, now: float) -> float:
        """How long the oldest load in flight on `tier` has waited (0: none): no load there takes less."""
        return max((now - at for at, nbytes in self._in_flight.values() if nbytes.get(tier)), default=0.0)

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
        """The longest prefix whose load wins. A long prompt is thousands of blocks, weighed on the scheduler's
        thread: all its prefixes at once (`_weigh_all`); a short one, one by one (`_weigh_each`), where numpy's
        own cost per call would be more. Both give the same answer to the bit (`tests/test_guard.py`)."""
        per_token = self.prefill.per_token  # read even for no block: a read is what refits it
        n = min(len(sources), len(tokens))
        loads = {tier: self._load_seconds(tier, now) for tier in dict.fromkeys(sources[:n])}
        weigh = self._weigh_each if n < WEIGHED_AT_ONCE else self._weigh_all
        return weigh(sources[:n], tokens[:n], loads, per_token)

    def _weigh_each(self, sources: Sequence[str], tokens: Sequence[int], loads: Mapping[str, LoadSeconds],
                    per_token: float) -> int:
        """`_winning_prefix`, a prefix at a time: the tiers' parts summed in the order the tiers first come."""
        best, recompute_tokens = 0, 0
        blocks: Counter[str] = Counter()
        for k, (tier, n) in enumerate(zip(sources, tokens), start=1):
            blocks[tier] += 1
            recompute_tokens += n
            load_s = sum(loads[t].seconds(b * self.block_bytes) for t, b in blocks.items())
            if load_s <= recompute_tokens * per_token:
                best = k
        return best

    def _weigh_all(self, sources: Sequence[str], tokens: Sequence[int], loads: Mapping[str, LoadSeconds],
                   per_token: float) -> int:
        """`_winning_prefix`, every prefix at once (numpy), in the order and the arithmetic of `_weigh_each`."""
        recompute = np.cumsum(np.asarray(tokens, dtype=np.int64)) * per_token
        load_s = np.zeros(len(sources))
        for tier, blocks in _blocks_by_tier(sources).items():
            seconds = loads[tier].each(blocks * self.block_bytes)
            load_s += np.where(blocks > 0, seconds, 0.0)  # a tier none of the prefix's blocks is on adds nothing
        wins = np.flatnonzero(load_s <= recompute)
        return int(wins[-1]) + 1 if len(wins) else 0

    def _load_seconds(self, tier: str, now: float) -> LoadSeconds:
        """What a load from `tier` is expected to take now (`LoadSeconds`)."""
        queued = self.queued[tier]
        latency, per_byte = self.links[tier].current(now, busy=queued > 0) if tier in self.links else (0.0, 0.0)
        waited = self.waited(tier, now)
        return LoadSeconds(latency, per_byte, queued, waited, behind=waited > latency + queued * per_byte)


@dataclass(frozen=True, slots=True)
class LoadSeconds:
    """Seconds a load of n more bytes from a tier is expected to take: its fit, over the bytes queued there and its
    own; and, once the oldest load in flight there has waited longer than the fit says the queue takes (the tier is
    behind: stalled, or hung), no less than that wait."""

    latency: float
    per_byte: float
    queued: float
    waited: float
    behind: bool

    def seconds(self, nbytes: float) -> float:
        expected = self.latency + (self.queued + nbytes) * self.per_byte
        return max(expected, self.waited) if self.behind else expected

    def each(self, nbytes: np.ndarray) -> np.ndarray:
        """`seconds` of every element of `nbytes`."""
        expected = self.latency + (self.queued + nbytes) * self.per_byte
        return np.maximum(expected, self.waited) if self.behind else expected


def _blocks_by_tier(sources: Sequence[str]) -> dict[str, np.ndarray]:
    """Each tier's blocks among the first k, for every k, in the order the tiers first come (the order a loop's sum
    would add them in)."""
    if sources.count(sources[0]) == len(sources):  # most prompts: one tier
        return {sources[0]: np.arange(1, len(sources) + 1)}
    names = np.asarray(sources)
    return {tier: np.cumsum(names == tier) for tier in dict.fromkeys(sources)}
