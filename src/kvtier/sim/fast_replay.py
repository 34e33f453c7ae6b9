"""Replay a trace's block sequence through kvtier's own eviction policies, a million accesses a second.

The full simulator drives the directory (tiers, states, pins, chains) and pays for it per block. To compare
policies and capacities on a long trace, this replays just one cache of `capacity_blocks` blocks with the
same policy objects the runtime uses, through the same calls the directory makes for a single-block request:
a hit is `touch`, a miss evicts the first of `candidates(incoming)` when the cache is full, then `insert`s.
For LRU this is exactly libCacheSim's LRU on the same sequence, hence exactly `lru_mrc`'s count.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from kvtier.policies import EvictionPolicy, make_policy
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.traces.request import TraceRequest


@dataclass(frozen=True)
class FastReplayResult:
    policy: str
    capacity_blocks: int
    requests: int
    accesses: int
    hits: int  # block accesses that hit
    hit_prefix_blocks: int  # blocks in each request's leading run of hits: what an engine can use
    hit_tokens: int  # sum over requests of min(leading hit blocks x block_tokens, input_tokens)
    input_tokens: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def _policy(policy: str | EvictionPolicy, capacity_blocks: int | None) -> EvictionPolicy:
    if isinstance(policy, EvictionPolicy):
        if len(policy):
            raise ValueError("fast replay needs an empty policy")
        return policy
    if capacity_blocks is None:
        raise ValueError("capacity_blocks is required with a policy name")
    return make_policy(policy, capacity_blocks)


def replay_blocks(
    blocks: Iterable[Hashable], policy: str | EvictionPolicy, capacity_blocks: int | None = None
) -> int:
    """Hits of one cache on a block sequence (each item one access)."""
    p = _policy(policy, capacity_blocks)
    contains, touch, insert, candidates, evicted = p.__contains__, p.touch, p.insert, p.candidates, p.evicted
    capacity, size, hits = p.capacity, 0, 0
    for key in blocks:
        if contains(key):
            touch(key)
            hits += 1
            continue
        if size >= capacity:
            evicted(next(iter(candidates(key))))
        else:
            size += 1
        insert(key)
    return hits


def fast_replay(
    requests: Iterable[TraceRequest], policy: str | EvictionPolicy, capacity_blocks: int | None = None
) -> FastReplayResult:
    """Replay every request's blocks in order through one cache; count block hits and prefix (token) hits."""
    p = _policy(policy, capacity_blocks)
    contains, touch, insert, candidates, evicted = p.__contains__, p.touch, p.insert, p.candidates, p.evicted
    capacity, size = p.capacity, 0
    n_requests = accesses = hits = prefix_hits = hit_tokens = input_tokens = 0
    for request in requests:
        priority = DEFAULT_PRIORITY if request.priority is None else request.priority
        lead = 0
        leading = True
        for key in request.blocks:
            if contains(key):
                touch(key)
                hits += 1
                lead += leading
                continue
            leading = False
            if size >= capacity:
                evicted(next(iter(candidates(key))))
            else:
                size += 1
            insert(key, priority)
        n_requests += 1
        accesses += len(request.blocks)
        prefix_hits += lead
        hit_tokens += min(lead * request.block_tokens, request.input_tokens)
        input_tokens += request.input_tokens
    return FastReplayResult(p.name, capacity, n_requests, accesses, hits, prefix_hits, hit_tokens, input_tokens)
