"""The guard: the rollback rule of a tiered rollout, built in. Pure Python on an explicit clock (`now`), so the
vLLM scheduler half, the in-process cache and the simulator run the same rule. Its clock must be monotonic: a wall
clock stepped back an hour would hold a tier off an hour longer.

Each finished request's latency is attributed to the source of its prefix: the kvtier tier whose part of its
load took longest, as measured (`request_source`), else "engine" (vLLM's own cache) or "recompute". Per window of
`window_s` and per source, the p99 of TTFT and of ITL are compared with the budgets. A tier's window breaks a
budget if its requests' p99 is above it and the tier is to blame: where the requests no tier served (engine hits
and recomputes: the reference) are `min_requests` or more, its p99 is above theirs by `reference_margin` (an
engine overloaded on its own is slow for every source alike: no tier's fault); where they are fewer, it is still
above the budget without the engine's queue. For TTFT both compare the time from when the engine took each
request up (its first lookup) to its first token, where the driver measures it: the queue before that is the
engine's, while a tier's slow loads (which may well make everyone queue) are its own requests' alone.
A tier is turned off once its own requests broke a budget in `breach_windows` of the last `of_windows` windows
(each with at least `min_requests` of them); when several tiers qualify at once, only the first in `order` goes
(one change at a time: every tier's history starts over). Off, it is read by no request and written by nothing;
its contents are kept. After its hold it is probed: a `probe_share` of requests read it again, and it is back on
after `breach_windows` probe windows within budget (a probe window needs `probe_share` of
`min_requests`, at least one); a breached one turns it off again. The hold is `hold_s`, times `hold_backoff` for
each return in a row that broke the budget again (a load-dependent tier passes a probe's share and fails under
all requests), at most `max_hold_s`. A tier on probe that too few requests read in `of_windows` of its windows
(nothing is written to it, and the traffic moved on from what it holds) comes back on and is judged on all
requests. So a tier always comes back, a probe lasts fewer than `of_windows + breach_windows` windows, and every
transition's reason says why and for how long.
The engine's own cache is never a tier here: nothing can turn it off.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvtier.config import GuardConfig

log = logging.getLogger(__name__)
ENGINE = "engine"  # the request's prefix came from vLLM's own cache only
RECOMPUTE = "recompute"  # nothing was cached
REFERENCE = (ENGINE, RECOMPUTE)  # the requests no tier served: what the engine does without kvtier
SIGNALS = ("ttft", "itl")
KEEP_TRANSITIONS = 10_000  # a server's guard keeps its last transitions, not all of them


class TierState(Enum):
    ON = "on"
    OFF = "off"
    PROBE = "probe"


def request_source(served: Iterable[str], tier_order: Sequence[str], engine_hit: bool,
                   seconds: Mapping[str, float] | None = None) -> str:
    """Where a request's prefix came from, for attribution: of the kvtier tiers that served it, the one whose part
    of the load took longest (`seconds`: measured per tier, from the load's start to the end of that tier's part);
    without measurements (or on a tie), the slowest by configuration (latest in `tier_order`)."""
    tiers = set(served) & set(tier_order)
    if tiers:
        took = seconds or {}
        return max(tiers, key=lambda t: (took.get(t, 0.0), tier_order.index(t)))
    return ENGINE if engine_hit else RECOMPUTE


def p99(values: Sequence[float]) -> float:
    """Nearest rank: with fewer than 100 samples, the largest is the p99."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Transition:
    tier: str
    to: TierState
    at: float
    reason: str


@dataclass
class _Window:
    """One window's samples, by source: TTFTs (one per request), ITL gaps and the requests they came from."""

    ttft: dict[str, list[float]] = field(default_factory=dict)
    itl: dict[str, list[float]] = field(default_factory=dict)
    itl_requests: Counter = field(default_factory=Counter)
    served: dict[str, list[float]] = field(default_factory=dict)  # the part of each TTFT after the engine took it

    def requests(self, source: str, signal: str) -> int:
        return len(self.ttft.get(source, ())) if signal == "ttft" else self.itl_requests[source]

    def samples(self, source: str, signal: str) -> list[float]:
        return getattr(self, signal).get(source, [])

    def compared(self, source: str, signal: str) -> list[float]:
        """What a source is compared with the reference on: for TTFT, the part after the engine took it."""
        return self.served.get(source, []) if signal == "ttft" else self.samples(source, signal)


@dataclass
class _Tier:
    state: TierState = TierState.ON
    since: float = 0.0  # when it entered its state
    breaches: deque = field(default_factory=deque)  # ON: the verdicts of its last windows (True: breached)
    clean: int = 0  # PROBE: probe windows within budget (a breached one ends the probe)
    starved: int = 0  # PROBE: probe windows with too few probe requests to judge
    credit: float = 0.0  # PROBE: the share of requests owed to the probe
    hold: float = 0.0  # OFF: how long this hold lasts
    failed_returns: int = 0  # returns in a row after which it broke the budget again
    returned_at: float | None = None  # when it last came back on


class Guard:
    def __init__(self, config: GuardConfig, tiers: Sequence[str], start: float = 0.0,
                 keep: int | None = KEEP_TRANSITIONS) -> None:
        """`tiers`: kvtier's tiers, fastest first (host, disk, ..., redis); by default the newest, the last one,
        goes first when several break the budget. `keep`: the last transitions kept in `history` (None: all)."""
        self.config = config
        self.budget = {"ttft": config.ttft_p99_ms, "itl": config.itl_p99_ms}
        self.order = list(config.order or []) + [t for t in reversed(tiers) if t not in (config.order or [])]
        self._tiers = {name: _Tier(since=start, breaches=deque(maxlen=config.of_windows), hold=config.hold_s)
                       for name in tiers}
        self._probe_min = max(1, math.ceil(config.min_requests * config.probe_share))
        self._window = _Window()
        self._window_end = start + config.window_s
        self.transitions: Counter = Counter()  # (tier, state value) -> times
        self.window_p99: dict[tuple[str, str], float] = {}  # (source, signal) -> p99 of the last window, seconds
        self.history: deque[Transition] = deque(maxlen=keep)

    # ---------------------------------------------------------------- what drivers ask

    def state(self, tier: str) -> TierState:
        return self._tiers[tier].state

    def enabled(self, tier: str) -> bool:
        return self._tiers[tier].state is TierState.ON

    def off(self) -> frozenset[str]:
        """Tiers nothing is written to: off or on probe."""
        return frozenset(name for name, t in self._tiers.items() if t.state is not TierState.ON)

    def route(self, now: float) -> frozenset[str]:
        """The tiers one new request must not read: those off, and those on probe unless it is a probe's share."""
        self.tick(now)
        skip = set()
        for name, tier in self._tiers.items():
            if tier.state is TierState.OFF:
                skip.add(name)
            elif tier.state is TierState.PROBE:
                tier.credit += self.config.probe_share
                if tier.credit >= 1:
                    tier.credit -= 1
                else:
                    skip.add(name)
        return frozenset(skip)

    def observe(self, source: str, now: float, ttft_s: float | None = None, itl_s: Sequence[float] = (),
                served_s: float | None = None) -> None:
        """One request's latency: its TTFT (when it had its first token) and/or its gaps between tokens. `served_s`:
        the part of its TTFT after the engine took it up (unknown: all of it)."""
        self.tick(now)
        if ttft_s is not None:
            self._window.ttft.setdefault(source, []).append(ttft_s)
            self._window.served.setdefault(source, []).append(ttft_s if served_s is None else served_s)
        if itl_s:
            self._window.itl.setdefault(source, []).extend(itl_s)
            self._window.itl_requests[source] += 1

    def tick(self, now: float) -> None:
        """Close the windows that ended by `now`; end the holds that are over."""
        if now >= self._window_end:
            self._close(self._window_end)
            self._window = _Window()
            idle = min(int((now - self._window_end) // self.config.window_s), self.config.of_windows)
            for k in range(1, idle + 1):  # empty windows: nothing breached
                self._close(self._window_end + k * self.config.window_s)
            self._window_end += (int((now - self._window_end) // self.config.window_s) + 1) * self.config.window_s
        for name, tier in self._tiers.items():
            if tier.state is TierState.OFF and now - tier.since >= tier.hold:
                tier.clean, tier.starved, tier.credit = 0, 0, 1 - self.config.probe_share  # the next request probes
                self._move(name, TierState.PROBE, now, f"held {tier.hold:g} s")

    # ---------------------------------------------------------------- windows

    def _close(self, end: float) -> None:
        window = self._window
        self.window_p99 = {(source, signal): p99(samples) for signal in SIGNALS
                           for source, samples in getattr(window, signal).items() if samples}
        start = end - self.config.window_s
        candidates = []
        for name, tier in self._tiers.items():
            if tier.state is TierState.ON:
                tier.breaches.append(self._breach(window, name, self.config.min_requests) is not None)
                if sum(tier.breaches) >= self.config.breach_windows:
                    candidates.append(name)
            elif tier.state is TierState.PROBE and tier.since <= start:
                self._judge_probe(name, tier, window, end)
        if candidates:
            name = min(candidates, key=self.order.index)
            breached = sum(self._tiers[name].breaches)
            last = self._breach(window, name, self.config.min_requests)
            figures = self._figures(name, last, window) + "; " if last else ""
            hold = self._hold_after_breach(self._tiers[name], end)
            self._move(name, TierState.OFF, end, f"{figures}budget broken in {breached} of the last "
                       f"{self.config.of_windows} windows of {self.config.window_s:g} s; {hold}")
            for tier in self._tiers.values():
                tier.breaches.clear()  # one change at a time: judge the others on what follows it

    def _hold_after_breach(self, tier: _Tier, at: float) -> str:
        """Set the hold of a tier that broke the budget while on: longer after each return that failed (a
        load-dependent tier passes its probes and breaks again under all requests), reset once it held."""
        longest = self.config.longest_hold()
        returned = tier.returned_at
        if returned is not None and at - returned < longest:
            tier.failed_returns += 1
            tier.hold = min(self.config.hold_s * self.config.hold_backoff ** tier.failed_returns, longest)
            return (f"off for {tier.hold:g} s: it broke the budget again {at - returned:g} s after coming back "
                    f"({tier.failed_returns} such returns in a row)")
        tier.failed_returns, tier.hold = 0, self.config.hold_s
        return f"off for {tier.hold:g} s"

    def _judge_probe(self, name: str, tier: _Tier, window: _Window, end: float) -> None:
        breached = self._breach(window, name, self._probe_min)
        if breached is not None:
            self._move(name, TierState.OFF, end, f"probe: {self._figures(name, breached, window)}; off for "
                       f"{tier.hold:g} s")
        elif any(window.requests(name, s) >= self._probe_min for s in SIGNALS if self.budget[s] is not None):
            tier.clean += 1
            if tier.clean >= self.config.breach_windows:
                self._return(name, tier, end, f"{tier.clean} probe windows within budget")
        else:
            tier.starved += 1
            if tier.starved >= self.config.of_windows:
                self._return(name, tier, end, f"no probe in {tier.starved} windows of {self.config.window_s:g} s "
                             "read it (nothing is written to a tier on probe, and the traffic moved on from what it "
                             "holds): back on, judged on all requests")

    def _return(self, name: str, tier: _Tier, at: float, reason: str) -> None:
        tier.returned_at = at
        self._move(name, TierState.ON, at, reason)

    def _breach(self, window: _Window, source: str, min_requests: int) -> str | None:
        """The first signal whose budget `source`'s requests broke in `window`, if they were enough to judge and
        did worse than the requests no tier served (module docstring)."""
        for signal in SIGNALS:
            budget = self.budget[signal]
            if budget is None or window.requests(source, signal) < min_requests:
                continue
            if p99(window.samples(source, signal)) * 1e3 <= budget:
                continue
            reference = self._reference(window, signal, window.compared)
            bar = budget / 1e3 if reference is None else reference * (1 + self.config.reference_margin)
            if p99(window.compared(source, signal)) <= bar:
                continue  # the engine is as slow without any tier, or its queue broke the budget: not this tier
            return signal
        return None

    def _reference(self, window: _Window, signal: str,
                   samples: Callable[[str, str], list[float]]) -> float | None:
        """The p99 of the window's requests no tier served (`samples` of them), if they are enough to judge by."""
        if sum(window.requests(source, signal) for source in REFERENCE) < self.config.min_requests:
            return None
        return p99([v for source in REFERENCE for v in samples(source, signal)])

    def _figures(self, name: str, signal: str, window: _Window) -> str:
        reference = self._reference(window, signal, window.samples)
        without = "" if reference is None else f" (without a tier: {reference * 1e3:,.0f} ms)"
        return (f"{signal} p99 {p99(window.samples(name, signal)) * 1e3:,.0f} ms > {self.budget[signal]:g} ms "
                f"over {window.requests(name, signal)} requests in the last window{without}")

    def _move(self, name: str, to: TierState, at: float, reason: str) -> None:
        tier = self._tiers[name]
        tier.state, tier.since = to, at
        tier.breaches.clear()
        transition = Transition(name, to, at, reason)
        self.transitions[(name, to.value)] += 1
        self.history.append(transition)
        (log.warning if to is TierState.OFF else log.info)("kvtier guard: tier %s %s: %s", name, to.value, reason)
