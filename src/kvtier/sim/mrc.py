"""The LRU hit ratio at every capacity, in one pass over a trace (stack distances, Mattson et al. 1970).

An LRU cache of C blocks hits an access exactly when fewer than C other distinct blocks were accessed since
the block's previous access (its *stack distance*). So one histogram of stack distances gives the hit count
at every capacity at once, where a simulator would need one replay per capacity.

What is replayed: each request's blocks are accessed in order (block 0 first), each access makes its block
the most recent, a miss inserts it and evicts the least recent one. That is libCacheSim's LRU fed the trace's
block sequence, and the hit counts here equal it exactly (tests check that). On prefix-chained traces (every
block always follows the same parent, as in Mooncake's hash ids and kvtier's chained keys) the hits of a
request are always a *leading run* of its blocks: if block k-1 is missing, block k is either missing too or
the least recent block, and the insertion of k-1 evicts it. Per-block hits are then prefix hits, the only
ones an engine can use, and the token weighting below ("hit tokens = min(hit blocks x block_tokens, input
tokens)") needs no other definition. On traces that are not chained, `hit_prefix_blocks` counts only the
leading run of each request and may fall below `hit_blocks`.

Stack distances are counted offline with numpy: distance(i) = #{j in (p, i): prev[j] < p}, where p is the
previous access of the block at i, = #{j < i: prev[j] < p} - (p + 1), a dominance count answered level by
level of a merge-sort tree. Requests are consumed in chunks; between chunks the history is compacted to one
access per distinct block in recency order (which keeps every stack distance), so memory follows the
distinct blocks plus one chunk, never the trace. No torch, no vLLM: this is the metadata plane.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvtier.layout import KVLayout, preset
from kvtier.traces.request import TraceRequest

CHUNK_ACCESSES = 1 << 21  # block accesses per numpy pass, at least (a pass also re-reads the distinct blocks)


@dataclass(frozen=True)
class MissRatioCurve:
    """Hits of an LRU cache at every capacity from 0 to `distinct_blocks` blocks (index = capacity)."""

    hit_blocks: np.ndarray  # block accesses that hit
    hit_prefix_blocks: np.ndarray  # blocks in each request's leading run of hits (= hit_blocks on chained traces)
    hit_tokens: np.ndarray  # sum over requests of min(leading hit blocks x block_tokens, input_tokens)
    accesses: int
    input_tokens: int
    requests: int
    block_tokens: int | None  # tokens per block when every request uses the same size, else None

    @property
    def distinct_blocks(self) -> int:
        """The capacity beyond which nothing changes: every access but the first of each block hits."""
        return len(self.hit_blocks) - 1

    @property
    def capacities(self) -> np.ndarray:
        return np.arange(len(self.hit_blocks), dtype=np.int64)

    @property
    def hit_ratio_blocks(self) -> np.ndarray:
        return self.hit_blocks / max(self.accesses, 1)

    @property
    def hit_ratio_tokens(self) -> np.ndarray:
        return self.hit_tokens / max(self.input_tokens, 1)

    def hits(self, capacity_blocks: int, weight: str = "blocks") -> int:
        """Block (or token) hits of an LRU cache of `capacity_blocks` blocks."""
        c = min(max(int(capacity_blocks), 0), self.distinct_blocks)
        if weight == "blocks":
            return int(self.hit_blocks[c])
        if weight == "tokens":
            return int(self.hit_tokens[c])
        raise ValueError(f"weight must be 'blocks' or 'tokens', got {weight!r}")

    def hit_ratio(self, capacity_blocks: int, weight: str = "blocks") -> float:
        """Share of block accesses (or of input tokens) that an LRU cache of `capacity_blocks` blocks serves."""
        total = self.accesses if weight == "blocks" else self.input_tokens
        return self.hits(capacity_blocks, weight) / total if total else 0.0

    def blocks_for_tokens(self, capacity_tokens: float) -> int:
        """How many whole blocks a capacity given in tokens holds."""
        return int(capacity_tokens // self._uniform_block_tokens())

    def capacity_bytes(self, layout: KVLayout | str) -> np.ndarray:
        """The capacities in bytes of KV for a model (a `KVLayout` or a preset name): a block is always whole."""
        return self.capacities * (self._uniform_block_tokens() * _layout(layout).bytes_per_token)

    def hit_bytes(self, layout: KVLayout | str) -> np.ndarray:
        """KV bytes served from the cache at every capacity (hit tokens x bytes per token)."""
        return self.hit_tokens * _layout(layout).bytes_per_token

    def _uniform_block_tokens(self) -> int:
        if self.block_tokens is None:
            raise ValueError("the trace mixes block sizes: capacities in tokens or bytes are ambiguous")
        return self.block_tokens


def lru_mrc(requests: Iterable[TraceRequest], chunk_accesses: int = CHUNK_ACCESSES) -> MissRatioCurve:
    """The LRU miss-ratio curve of a request sequence, in one pass (see the module docstring)."""
    history = np.zeros(0, dtype=np.int64)  # distinct blocks so far, least recent first
    block_hist = np.zeros(1, dtype=np.int64)  # accesses per stack distance
    prefix_hist = np.zeros(1, dtype=np.int64)
    token_hist = np.zeros(1, dtype=np.int64)
    totals = {"accesses": 0, "input_tokens": 0, "requests": 0}
    sizes: set[int] = set()
    blocks: list[int] = []
    lengths: list[int] = []
    inputs: list[int] = []
    block_tokens: list[int] = []

    def flush() -> None:
        nonlocal history, block_hist, prefix_hist, token_hist
        ids = np.asarray(blocks, dtype=np.int64)
        distance, history = _stack_distances(ids, history)
        lead, tokens = _leading_runs(distance, lengths, inputs, block_tokens)
        block_hist = _add(block_hist, distance)
        prefix_hist = _add(prefix_hist, lead)
        token_hist = _add(token_hist, lead, tokens)
        for buffer in (blocks, lengths, inputs, block_tokens):
            buffer.clear()

    for request in requests:
        blocks.extend(request.blocks)
        lengths.append(len(request.blocks))
        inputs.append(request.input_tokens)
        block_tokens.append(request.block_tokens)
        sizes.add(request.block_tokens)
        totals["accesses"] += len(request.blocks)
        totals["input_tokens"] += request.input_tokens
        totals["requests"] += 1
        if len(blocks) >= max(chunk_accesses, len(history)):  # each pass also re-reads the history
            flush()
    if lengths:
        flush()
    distinct = len(history)

    def curve(hist: np.ndarray) -> np.ndarray:
        hist = np.pad(hist, (0, max(0, distinct - len(hist))))[:distinct]  # distances are < distinct
        return np.concatenate(([0], np.cumsum(hist)))

    return MissRatioCurve(
        hit_blocks=curve(block_hist),
        hit_prefix_blocks=curve(prefix_hist),
        hit_tokens=curve(token_hist),
        block_tokens=next(iter(sizes)) if len(sizes) == 1 else None,
        **totals,
    )


def stack_distances(blocks: np.ndarray) -> np.ndarray:
    """The LRU stack distance of every access of a block sequence; -1 where a block is seen for the first time.

    An LRU cache of C blocks hits access i exactly when 0 <= distance[i] < C.
    """
    return _stack_distances(np.asarray(blocks, dtype=np.int64), np.zeros(0, dtype=np.int64))[0]


def _stack_distances(chunk: np.ndarray, history: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distances of `chunk`'s accesses after `history` (distinct blocks, least recent first), and the new history."""
    seq = np.concatenate((history, chunk))
    n = len(seq)
    order = np.argsort(seq, kind="stable")  # by block, then by time
    same = seq[order[1:]] == seq[order[:-1]]
    prev = np.full(n, -1, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    last = order[np.append(~same, True)]  # the last access of every distinct block
    new_history = seq[np.sort(last)]

    distance = np.full(len(chunk), -1, dtype=np.int64)
    at = np.nonzero(prev[len(history) :] >= 0)[0] + len(history)
    if len(at):
        p = prev[at]
        distance[at - len(history)] = _count_below_before(prev + 1, at, p + 1) - p - 1
    return distance, new_history


def _count_below_before(values: np.ndarray, xs: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """For every query q: #{j < xs[q] : values[j] < limits[q]} (values >= 0), with a merge-sort tree.

    [0, x) is the union of one aligned block of size 2**k per set bit k of x. Level k of the tree keeps each
    aligned block's values sorted, keyed block * span + value, so one searchsorted per level answers every
    query whose x has bit k set; the next level merges pairs of sorted runs.
    """
    n = len(values)
    span = np.int64(int(values.max()) + 2) if n else np.int64(2)
    out = np.zeros(len(xs), dtype=np.int64)
    position = np.arange(n, dtype=np.int64)
    keys = position * span + values  # level 0: blocks of one
    k = 0
    while (1 << k) <= n:
        ask = np.nonzero((xs >> k) & 1)[0]
        if len(ask):
            block = (xs[ask] >> k) - 1
            out[ask] += np.searchsorted(keys, block * span + limits[ask]) - (block << k)
        value = keys - (position >> k) * span
        keys = np.sort((position >> (k + 1)) * span + value, kind="stable")
        k += 1
    return out


def _leading_runs(
    distance: np.ndarray, lengths: list[int], inputs: list[int], block_tokens: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Per access: the largest distance among its request's blocks up to it (a block is in the request's
    leading run of hits at capacity C iff that is < C; -1 if any of them is a first access), and the input
    tokens the block adds to the hit when it is in the run (min(hit blocks x block_tokens, input) in steps)."""
    n_req = len(lengths)
    length = np.asarray(lengths, dtype=np.int64)
    request = np.repeat(np.arange(n_req, dtype=np.int64), length)
    start = np.repeat(np.cumsum(length) - length, length)
    index = np.arange(len(distance), dtype=np.int64) - start
    bt = np.repeat(np.asarray(block_tokens, dtype=np.int64), length)
    tokens = np.clip(np.repeat(np.asarray(inputs, dtype=np.int64), length) - index * bt, 0, bt)
    cold = int(distance.max(initial=0)) + 1  # a first access misses at every capacity
    big = cold + 1
    d = np.where(distance < 0, cold, distance)
    lead = np.maximum.accumulate(d + request * big) - request * big  # running max, restarted per request
    return np.where(lead == cold, -1, lead), tokens


def _add(hist: np.ndarray, distance: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """`hist` plus the histogram of the finite distances (optionally weighted), grown as needed."""
    keep = distance >= 0
    w = None if weights is None else weights[keep]
    counts = np.bincount(distance[keep], weights=w, minlength=len(hist))
    counts = counts.astype(np.int64) if w is not None else counts  # token sums stay far below 2**53
    counts[: len(hist)] += hist
    return counts


def _layout(layout: KVLayout | str) -> KVLayout:
    return preset(layout) if isinstance(layout, str) else layout
