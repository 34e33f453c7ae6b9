"""The guard and the load-or-recompute decision, as the connector's scheduler half runs them on vLLM's requests.

Per request, once: the guard's route (the tiers it must not read). Per lookup: the decision, fed with the
workers' timings of each tier's part of each load, the loads shipped and not done, and the engine's prefill spans
(`latency.RequestClock`). A request is charged to the tier whose part of its load took longest, as the workers
timed it. Per step: the requests' first tokens and, at their end, their token gaps go to the guard. The wiring
into the directory is `kvtier.control.Control`'s. The guard's windows, holds and probes and the decision's ages
run on a monotonic clock; only TTFT is wall time, as vLLM's `arrival_time` (a wall clock stepped back an hour
must not hold a tier off an hour longer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.config import KVTierConfig
from kvtier.control import Control
from kvtier.directory import Directory
from kvtier.integrations.vllm.latency import FirstToken, RequestClock
from kvtier.integrations.vllm.messages import LoadTiming
from kvtier.integrations.vllm.stats import Deltas, label

if TYPE_CHECKING:
    from vllm.v1.request import Request

SAMPLED = ("ok", "expired")  # a part that passed its deadline is a sample too: the tier took at least that


@dataclass
class _Served:
    """What a request's load reads, and what each tier's part of it took (the longest any rank saw)."""

    sources: list[str]
    engine_hit: bool
    seconds: dict[str, float] = field(default_factory=dict)


class SchedulerControl:
    def __init__(self, config: KVTierConfig, directory: Directory, block_nbytes: int,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        """`clock`: monotonic, for the guard and the decision; `wall`: what vLLM stamps `arrival_time` with."""
        self.clock = clock
        self.control = Control(directory, config, block_nbytes, start=clock())
        self.guard = self.control.guard
        self.decider = self.control.decider
        self.requests = RequestClock(clock, wall)
        self._routes: dict[str, frozenset[str]] = {}  # request id -> the tiers it must not read
        self._decided: set[str] = set()  # requests whose decision was counted
        self._served: dict[str, _Served] = {}  # request id -> its load, until the request ends

    def route(self, request: Request, engine_hit: bool) -> frozenset[str]:
        """The tiers this request must not read; decided once, at its first lookup."""
        skip = self._routes.get(request.request_id)
        if skip is None:
            skip = self._routes[request.request_id] = self.control.route(self.clock())
            self.requests.track(request, self.control.source_of((), engine_hit))
        return skip

    def blocks_to_load(self, request_id: str, sources: Sequence[str], tokens: Sequence[int]) -> int:
        """How many of the blocks found to offer vLLM (counted once per request)."""
        count_as = None
        if request_id not in self._decided and sources:
            self._decided.add(request_id)
            count_as = self.control.source_of(sources, engine_hit=False)
        return self.decider.blocks_to_load(sources, tokens, self.clock(), count_as)

    def served(self, request: Request, sources: Sequence[str], engine_hit: bool) -> None:
        """What a request's load will read: where its latency is attributed until the workers' timings come."""
        self._served[request.request_id] = _Served(list(sources), engine_hit)
        self.requests.track(request, self.control.source_of(sources, engine_hit))

    def shipped(self, load: object, queued: Mapping[str, float]) -> None:
        """A load left for the workers: its bytes per tier are queued on those tiers until it `landed`."""
        self.decider.shipped(id(load), queued, self.clock())

    def landed(self, load: object) -> None:
        self.decider.landed(id(load))

    def transferred(self, timings: Sequence[LoadTiming]) -> None:
        """The workers' timings of each tier's part of each load: the decision's samples, and where each request's
        latency is charged (the tier whose part took longest)."""
        now = self.clock()
        for timing in timings:
            if timing.outcome in SAMPLED:
                self.decider.transferred(timing.tier, timing.blocks * self.decider.block_bytes, timing.seconds, now)
            served = self._served.get(timing.request_id)
            if served is not None:
                seconds = served.seconds
                seconds[timing.tier] = max(seconds.get(timing.tier, 0.0), timing.seconds)
                self.requests.charge(timing.request_id,
                                     self.control.source_of(served.sources, served.engine_hit, seconds))

    def step(self, scheduler_output: Any) -> None:
        now = self.clock()
        for first in self.requests.step(scheduler_output):
            self._first_token(first, now)
        self.control.tick(now)

    def finished(self, request: Request) -> None:
        self._routes.pop(request.request_id, None)
        self._decided.discard(request.request_id)
        self._served.pop(request.request_id, None)
        done = self.requests.finish(request)
        if done is None:
            return
        source, first, gaps = done
        now = self.clock()
        if first is not None:
            self._first_token(first, now)
        if gaps:
            self.control.observe(source, now, itl_s=gaps)
        self.control.tick(now)

    def _first_token(self, first: FirstToken, now: float) -> None:
        if first.prefill_tokens > 0:
            self.decider.prefill.add(first.prefill_tokens, first.prefill_s)
        self.control.observe(first.source, now, ttft_s=first.ttft_s, served_s=first.served_s)

    def payload(self, deltas: Deltas) -> tuple[dict, dict]:
        """Counters (deltas) and gauges for the stats path."""
        counters = {"load_decisions": deltas.take("load_decisions", self.decider.decisions)}
        enabled = {name: 1.0 if self.guard is None or self.guard.enabled(name) else 0.0
                   for name in self.control.tiers}
        gauges: dict[str, dict] = {"tier_enabled": enabled}
        if self.guard is not None:
            counters["guard_transitions"] = deltas.take("guard_transitions", self.guard.transitions)
            gauges["guard_window_p99_seconds"] = {label(key): v for key, v in self.guard.window_p99.items()}
        return counters, gauges
