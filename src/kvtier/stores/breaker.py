"""A circuit breaker for a remote tier: when the server is down or slow, stop waiting on it.

closed --N consecutive failures--> open --cooldown--> half-open (one probe call) --ok--> closed
                                    ^                                           |
                                    +-------------------- probe fails ----------+

While open, callers skip the remote call at once (lookups become misses, stores are dropped) instead of
paying a timeout per request; serving goes on from the local tiers. Thread-safe; the counters are plain
ints so that metrics can export them at scrape time.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def gauge(self) -> int:
        """0 closed, 1 half-open, 2 open: one number for a Prometheus gauge."""
        return {"closed": 0, "half_open": 1, "open": 2}[self.value]


@dataclass(frozen=True)
class BreakerStats:
    state: BreakerState
    opens: int  # transitions into OPEN (a failed probe re-opens and counts again)
    closes: int  # recoveries: a probe succeeded
    failures: int  # calls that failed or timed out, in any state
    rejected: int  # calls refused without trying (open, or half-open with a probe in flight)


class CircuitBreaker:
    def __init__(
        self, failure_threshold: int = 3, cooldown_s: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failure_threshold < 1 or cooldown_s <= 0:
            raise ValueError(f"need failure_threshold >= 1 and cooldown_s > 0, got {failure_threshold}, {cooldown_s}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._since = 0.0  # when the breaker opened, or when the current probe started
        self._opens = self._closes = self._failures = self._rejected = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May the caller try the remote call now? Every True must be followed by `success()` or `failure()`.

        After the cooldown, exactly one caller gets True (the probe). A probe that never reports (its thread
        died) is replaced by another after one more cooldown, so the breaker cannot stay stuck half-open.
        """
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._clock() - self._since >= self.cooldown_s:
                self._state = BreakerState.HALF_OPEN
                self._since = self._clock()
                return True
            self._rejected += 1
            return False

    def success(self) -> None:
        with self._lock:
            self._consecutive = 0
            if self._state is not BreakerState.CLOSED:
                self._state = BreakerState.CLOSED
                self._closes += 1

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._consecutive += 1
            reopen = self._state is BreakerState.HALF_OPEN
            if reopen or (self._state is BreakerState.CLOSED and self._consecutive >= self.failure_threshold):
                self._state = BreakerState.OPEN
                self._since = self._clock()
                self._opens += 1

    def stats(self) -> BreakerStats:
        with self._lock:
            return BreakerStats(self._state, self._opens, self._closes, self._failures, self._rejected)
