"""One pass over a trace for the reuse questions: what is shared, how soon it comes back, what never does.

Memory is proportional to the distinct blocks (ids are dense ints, so per-block facts live in flat arrays)
plus two ints per request; distributions go into constant-size log histograms.

Definitions (all with an unbounded cache: what the traffic offers, before any capacity limit):
- a request's *reused prefix* is its longest run of leading blocks seen in an earlier request (blocks are
  prefix-chained, so this is all the request could take from any cache);
- a block's *reuse time* is the time since its previous use; its *age at reuse* the time since its first;
- a *one-shot* block is used by one request only: storing it is pure cost.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from kvtier.analyze.histogram import LogHistogram
from kvtier.traces.request import TraceRequest


@dataclass(frozen=True)
class SharedPrefix:
    """A prefix that more requests share than share any longer extension of it."""

    tokens: int
    blocks: int
    requests: int
    first_seen_s: float
    last_seen_s: float

    @property
    def saved_tokens(self) -> int:
        return (self.requests - 1) * self.tokens


class ReuseStats:
    def __init__(self) -> None:
        self.requests = 0
        self.block_tokens = 0
        self.total_tokens = 0
        self.reused_tokens = 0
        self.accesses = 0
        self.reuses = 0
        self.first_time = 0.0
        self.last_time = 0.0
        self.reuse_time = LogHistogram()
        self.age_at_reuse = LogHistogram()
        self.request_input = array("I")  # tokens, per request
        self.request_reused = array("I")  # tokens of the reused prefix, per request
        self._count = array("I")
        self._first = array("d")
        self._last = array("d")
        self._parent = array("q")
        self._depth = array("I")

    def observe_all(self, requests: Iterable[TraceRequest]) -> Iterator[TraceRequest]:
        """Pass requests through while recording them: lets another one-pass consumer read the same stream."""
        for request in requests:
            self.observe(request)
            yield request

    def observe(self, request: TraceRequest) -> None:
        t = request.timestamp
        if not self.requests:
            self.first_time, self.block_tokens = t, request.block_tokens
        self.requests += 1
        self.last_time = t
        blocks = request.blocks
        if blocks and (need := max(blocks) + 1 - len(self._count)) > 0:
            self._grow(need)
        count, first, last = self._count, self._first, self._last
        hit, leading = 0, True
        parent = -1
        for i, b in enumerate(blocks):
            c = count[b]
            if c:
                if leading:
                    hit += 1
                self.reuse_time.add(t - last[b])
                self.age_at_reuse.add(t - first[b])
                self.reuses += 1
            else:
                leading = False
                first[b] = t
                self._parent[b] = parent
                self._depth[b] = i + 1
            count[b] = c + 1
            last[b] = t
            parent = b
        self.accesses += len(blocks)
        reused = min(hit * request.block_tokens, request.input_tokens)
        self.total_tokens += request.input_tokens
        self.reused_tokens += reused
        self.request_input.append(request.input_tokens)
        self.request_reused.append(reused)

    def _grow(self, n: int) -> None:
        self._count.extend(repeat(0, n))
        self._first.extend(repeat(0.0, n))
        self._last.extend(repeat(0.0, n))
        self._parent.extend(repeat(-1, n))
        self._depth.extend(repeat(0, n))

    # ---------------------------------------------------------------- figures

    @property
    def distinct_blocks(self) -> int:
        return int(np.count_nonzero(np.frombuffer(self._count, dtype=np.uint32))) if self._count else 0

    @property
    def reused_token_share(self) -> float:
        return self.reused_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def span_s(self) -> float:
        return self.last_time - self.first_time

    def one_shot(self) -> dict:
        """Question 4: blocks no second request uses, and what 'store on the second sighting' would trade."""
        count = np.frombuffer(self._count, dtype=np.uint32) if self._count else np.zeros(0, np.uint32)
        seen = count[count > 0]
        one_shot = int(np.count_nonzero(seen == 1))
        reused_blocks = len(seen) - one_shot
        return {
            "distinct_blocks": len(seen),
            "one_shot_blocks": one_shot,
            "one_shot_fraction": one_shot / len(seen) if len(seen) else 0.0,
            "max_uses": int(seen.max()) if len(seen) else 0,
            "second_sighting_stores_saved": one_shot / len(seen) if len(seen) else 0.0,
            "second_sighting_hits_lost": reused_blocks / self.reuses if self.reuses else 0.0,
        }

    def top_prefixes(self, n: int = 10) -> list[SharedPrefix]:
        """Question 1: the maximal shared prefixes that save the most tokens."""
        if not self._count:
            return []
        count = np.frombuffer(self._count, dtype=np.uint32).astype(np.int64)
        parent = np.frombuffer(self._parent, dtype=np.int64)
        depth = np.frombuffer(self._depth, dtype=np.uint32).astype(np.int64)
        child_max = np.zeros_like(count)
        has_parent = parent >= 0
        np.maximum.at(child_max, parent[has_parent], count[has_parent])
        maximal = np.nonzero((count >= 2) & (count > child_max))[0]
        saved = (count[maximal] - 1) * depth[maximal]
        top = maximal[np.argsort(-saved, kind="stable")[:n]]
        bt = self.block_tokens
        return [SharedPrefix(int(depth[b]) * bt, int(depth[b]), int(count[b]), self._first[b] - self.first_time,
                             self._last[b] - self.first_time) for b in top]
