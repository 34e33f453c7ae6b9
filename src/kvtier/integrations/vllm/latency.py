"""Each request's TTFT, ITL and prefill span, as the connector's scheduler half sees them.

The source: vLLM's own `Request` objects, which the scheduler hands the connector (`get_num_new_matched_tokens`,
`request_finished`) and keeps updating. At every step's `build_connector_meta` the new tokens of the requests we
track are read off `num_output_tokens`: vLLM appended them at the end of the step before, so a token is seen at
most one scheduling pass after it was sampled. TTFT runs from `arrival_time` (stamped by vLLM's front end when
the request came in, wall time) to its first token; the part of it after the engine took the request up runs
from its first lookup (vLLM asks for a request's external hit when it is about to schedule it); ITL is the gap
between steps that gave it tokens; the prefill span runs from the step that first scheduled it
(`scheduled_new_reqs`) to its first token, over the tokens it had to compute. The last tokens are read in
`request_finished`; a request that ends without a first token (aborted while it waited, e.g. on a hung load)
counts its wait as its TTFT: it took at least that. Everything but TTFT runs on a monotonic clock. No timers of
our own, nothing in the engine's loop beyond one pass over the requests in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from vllm.v1.request import Request


class FirstToken(NamedTuple):
    source: str
    ttft_s: float
    prefill_tokens: int  # tokens computed from its first scheduling to its first token (0: unknown)
    prefill_s: float
    served_s: float  # the part of its TTFT from its first lookup on


@dataclass
class _Tracked:
    request: Request
    source: str
    looked_up_at: float
    scheduled_at: float | None = None
    computed_at_schedule: int = 0
    outputs: int = 0
    last_token_at: float = 0.0
    gaps: list[float] = field(default_factory=list)


class RequestClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall = wall  # vLLM stamps arrival_time with time.time()
        self._tracked: dict[str, _Tracked] = {}

    def track(self, request: Request, source: str) -> None:
        """From its first lookup on; `source` (where its prefix comes from) may be updated until it runs."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            self._tracked[request.request_id] = _Tracked(request, source, self.clock())
        else:
            tracked.source = source

    def charge(self, request_id: str, source: str) -> None:
        """Where a request's latency goes, once its load's timings say which tier took longest."""
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            tracked.source = source

    def step(self, scheduler_output: Any) -> list[FirstToken]:
        """Read the new tokens of every tracked request; returns the requests that had their first one."""
        now = self.clock()
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None and tracked.scheduled_at is None:
                tracked.scheduled_at, tracked.computed_at_schedule = now, new.num_computed_tokens
        firsts = []
        for tracked in self._tracked.values():
            first = self._read(tracked, now)
            if first is not None:
                firsts.append(first)
        return firsts

    def finish(self, request: Request) -> tuple[str, FirstToken | None, list[float]] | None:
        """A finished request's source, its first token if only now seen, and its ITL gaps; None if untracked."""
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return None
        now = self.clock()
        first = self._read(tracked, now)
        if first is None and tracked.outputs == 0:  # it never had a first token: it waited at least this long
            first = FirstToken(tracked.source, self.wall() - tracked.request.arrival_time, 0, 0.0,
                               now - tracked.looked_up_at)
        return tracked.source, first, tracked.gaps

    def _read(self, tracked: _Tracked, now: float) -> FirstToken | None:
        outputs = tracked.request.num_output_tokens
        new = outputs - tracked.outputs
        if new <= 0:
            return None
        first = None
        if tracked.outputs == 0:
            request = tracked.request
            scheduled = tracked.scheduled_at
            computed = request.num_prompt_tokens - tracked.computed_at_schedule if scheduled is not None else 0
            first = FirstToken(tracked.source, self.wall() - request.arrival_time, computed,
                               now - scheduled if scheduled is not None else 0.0, now - tracked.looked_up_at)
            new -= 1  # no gap before the first token; more in the same step (speculative decoding) come at once
            gap = 0.0
        else:
            gap = (now - tracked.last_token_at) / new
        tracked.gaps.extend([gap] * new)
        tracked.outputs, tracked.last_token_at = outputs, now
        return first
