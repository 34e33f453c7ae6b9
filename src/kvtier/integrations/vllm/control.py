"""The guard and the load-or-recompute decision, as the connector's scheduler half runs them.

Per request, once: the guard's route (the tiers it must not read). Per lookup: the decision, fed with the
workers' timings of completed loads, the bytes of loads shipped and not done, and the engine's prefill spans
(`latency.RequestClock`). Per step: the requests' first tokens and, at their end, their token gaps go to the
guard, and the tiers it turned off stop taking writes (`Directory.disabled`). The clock is wall time, as
vLLM's `arrival_time`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.config import KVTierConfig
from kvtier.decide import Decider
from kvtier.directory import Directory
from kvtier.guard import Guard, request_source
from kvtier.integrations.vllm.latency import RequestClock
from kvtier.integrations.vllm.stats import Deltas, label

if TYPE_CHECKING:
    from vllm.v1.request import Request


class Control:
    def __init__(self, config: KVTierConfig, directory: Directory, block_nbytes: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.tiers = directory.names
        self.clock = clock
        self.guard = Guard(config.guard, self.tiers, start=clock()) if config.guard is not None else None
        self.decider = Decider(config.load_policy, config.max_load_tokens, config.prefill_tokens_per_s, block_nbytes)
        self.requests = RequestClock(clock)
        self._routes: dict[str, frozenset[str]] = {}  # request id -> the tiers it must not read
        self._decided: set[str] = set()  # requests whose decision was counted

    def route(self, request: Request, engine_hit: bool) -> frozenset[str]:
        """The tiers this request must not read; decided once, at its first lookup."""
        skip = self._routes.get(request.request_id)
        if skip is None:
            skip = self.guard.route(self.clock()) if self.guard is not None else frozenset()
            self._routes[request.request_id] = skip
            self.requests.track(request, request_source((), self.tiers, engine_hit))
        return skip

    def blocks_to_load(self, request_id: str, sources: Sequence[str], tokens: Sequence[int]) -> int:
        """How many of the blocks found to offer vLLM (counted once per request)."""
        count_as = None
        if request_id not in self._decided and sources:
            self._decided.add(request_id)
            count_as = request_source(sources, self.tiers, False)
        return self.decider.blocks_to_load(sources, tokens, self.clock(), count_as)

    def served(self, request: Request, sources: Sequence[str], engine_hit: bool) -> None:
        """What a request's load will read: where its latency is attributed."""
        self.requests.track(request, request_source(sources, self.tiers, engine_hit))

    def shipped(self, queued: Counter, sign: int) -> None:
        """A load's bytes per tier joined (+1) or left (-1) the tiers' queues."""
        for tier, nbytes in queued.items():
            self.decider.queued[tier] += sign * nbytes

    def transferred(self, samples: Sequence[tuple[dict[str, int], float]]) -> None:
        """The workers' timings of completed loads: (blocks per tier, seconds), charged to the slowest tier."""
        now = self.clock()
        for blocks, seconds in samples:
            slowest = request_source(blocks, self.tiers, False)
            if slowest in blocks:
                self.decider.transferred(slowest, blocks[slowest] * self.decider.block_bytes, seconds, now)

    def step(self, scheduler_output: Any) -> None:
        now = self.clock()
        for first in self.requests.step(scheduler_output):
            self._first_token(first, now)
        self._tick(now)

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
        if self.guard is not None and gaps:
            self.guard.observe(source, now, itl_s=gaps)
        self._tick(now)

    def _first_token(self, first: Any, now: float) -> None:
        if first.prefill_tokens > 0:
            self.decider.prefill.add(first.prefill_tokens, first.prefill_s)
        if self.guard is not None:
            self.guard.observe(first.source, now, ttft_s=first.ttft_s)

    def _tick(self, now: float) -> None:
        if self.guard is not None:
            self.guard.tick(now)
            self.directory.disabled = self.guard.off()

    def payload(self, deltas: Deltas) -> tuple[dict, dict]:
        """Counters (deltas) and gauges for the stats path."""
        counters = {"load_decisions": deltas.take("load_decisions", self.decider.decisions)}
        enabled = {name: 1.0 if self.guard is None or self.guard.enabled(name) else 0.0 for name in self.tiers}
        gauges: dict[str, dict] = {"tier_enabled": enabled}
        if self.guard is not None:
            counters["guard_transitions"] = deltas.take("guard_transitions", self.guard.transitions)
            gauges["guard_window_p99_seconds"] = {label(key): v for key, v in self.guard.window_p99.items()}
        return counters, gauges
