"""The guard and the load-or-recompute decision, as the connector's scheduler half runs them on vLLM's requests.

Per request, once: the guard's route (the tiers it must not read). Per lookup: the decision, fed with the
workers' timings of completed loads, the bytes of loads shipped and not done, and the engine's prefill spans
(`latency.RequestClock`). Per step: the requests' first tokens and, at their end, their token gaps go to the
guard. The wiring into the directory is `kvtier.control.Control`'s. The clock is wall time, as vLLM's
`arrival_time`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.config import KVTierConfig
from kvtier.control import Control
from kvtier.directory import Directory
from kvtier.integrations.vllm.latency import FirstToken, RequestClock
from kvtier.integrations.vllm.stats import Deltas, label

if TYPE_CHECKING:
    from vllm.v1.request import Request


class SchedulerControl:
    def __init__(self, config: KVTierConfig, directory: Directory, block_nbytes: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.control = Control(directory, config, block_nbytes, start=clock())
        self.guard = self.control.guard
        self.decider = self.control.decider
        self.requests = RequestClock(clock)
        self._routes: dict[str, frozenset[str]] = {}  # request id -> the tiers it must not read
        self._decided: set[str] = set()  # requests whose decision was counted

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
        """What a request's load will read: where its latency is attributed."""
        self.requests.track(request, self.control.source_of(sources, engine_hit))

    def shipped(self, queued: Counter, sign: int) -> None:
        """A load's bytes per tier joined (+1) or left (-1) the tiers' queues."""
        for tier, nbytes in queued.items():
            self.decider.queued[tier] += sign * nbytes

    def transferred(self, samples: Sequence[tuple[dict[str, int], float]]) -> None:
        """The workers' timings of completed loads: (blocks per tier, seconds), charged to the slowest tier."""
        now = self.clock()
        for blocks, seconds in samples:
            slowest = self.control.source_of(blocks, engine_hit=False)
            if slowest in blocks:
                self.decider.transferred(slowest, blocks[slowest] * self.decider.block_bytes, seconds, now)

    def step(self, scheduler_output: Any) -> None:
        now = self.clock()
        for first in self.requests.step(scheduler_output):
            self._first_token(first, now)
        self.control.tick(now)

    def finished(self, request: Request) -> None:
        self._routes.pop(request.request_id, None)
        self._decided.discard(request.request_id)
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
        self.control.observe(first.source, now, ttft_s=first.ttft_s)

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
