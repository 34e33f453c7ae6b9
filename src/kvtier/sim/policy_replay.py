"""Replay a trace's block sequence through kvtier's own eviction policies.

The full simulator drives the directory (tiers, states, pins, chains) and pays for it per block. To compare
policies and capacities on a long trace, this replays just one cache of `capacity_blocks` blocks with the
same policy objects the runtime uses, through the same calls the directory makes for a single-block request:
a hit is `touch`, a miss evicts the first of `candidates(incoming)` when the cache is full, then `insert`s.
For LRU this is exactly libCacheSim's LRU on the same sequence, hence exactly `lru_mrc`'s count.

A policy given by name (LRU, ARC, S3-FIFO) replays compiled (`compiled_policy_replay`: the same decisions, proven
equal by the tests); a policy object, or the priority policy, replays through its Python methods.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from kvtier.policies import EvictionPolicy, make_policy
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.traces.request import TraceRequest

COMPILED_POLICIES = ("lru", "arc", "s3fifo")  # replayed by `compiled_policy_replay`


@dataclass(frozen=True)
class PolicyReplayResult:
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
            raise ValueError("a policy replay needs an empty policy")
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


def policy_replay(
    requests: Iterable[TraceRequest], policy: str | EvictionPolicy, capacity_blocks: int | None = None
) -> PolicyReplayResult:
    """Replay every request's blocks in order through one cache; count block hits and prefix (token) hits."""
    if isinstance(policy, str) and policy in COMPILED_POLICIES:
        return _compiled(list(requests), policy, _policy(policy, capacity_blocks).capacity)
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
    return PolicyReplayResult(p.name, capacity, n_requests, accesses, hits, prefix_hits, hit_tokens, input_tokens)


def _compiled(requests: list[TraceRequest], policy: str, capacity: int) -> PolicyReplayResult:
    from kvtier.sim.compiled_policy_replay import dense_ids, replay_ids  # here: numba is imported on first use only

    lengths = np.fromiter((len(r.blocks) for r in requests), np.int64, len(requests))
    starts = np.zeros(len(requests) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    blocks = np.fromiter(chain.from_iterable(r.blocks for r in requests), np.int64, int(starts[-1]))
    hits, lead = replay_ids(policy, dense_ids(blocks), starts, capacity)
    block_tokens = np.fromiter((r.block_tokens for r in requests), np.int64, len(requests))
    input_tokens = np.fromiter((r.input_tokens for r in requests), np.int64, len(requests))
    return PolicyReplayResult(policy, capacity, len(requests), int(starts[-1]), int(hits.sum()), int(lead.sum()),
                              int(np.minimum(lead * block_tokens, input_tokens).sum()), int(input_tokens.sum()))
