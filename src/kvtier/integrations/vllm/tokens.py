"""How many of a request's tokens each of its kvtier blocks brings, between what vLLM holds and where a load ends.

A long prompt is thousands of blocks, worked out on vLLM's scheduler thread: the blocks between the two edges
are whole, so only the edge blocks are worked out one by one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def tokens_by_block(first: int, count: int, bt: int, start: int, end: int) -> list[int]:
    """The tokens each of the `count` kvtier blocks of `bt` tokens from `first` on brings a request that holds
    `start` tokens and may load up to `end`, as far as the last block that brings any (what the decision weighs)."""
    n = min(count, max(0, -(-end // bt) - first))  # the blocks that begin before `end`
    while n and _part(first + n - 1, bt, start, end) <= 0:
        n -= 1
    if n <= 2:
        return [_part(first + i, bt, start, end) for i in range(n)]
    return [_part(first, bt, start, end), *[bt] * (n - 2), _part(first + n - 1, bt, start, end)]


def tokens_served(sources: Sequence[str], first: int, bt: int, start: int, end: int) -> Counter:
    """The tokens each source serves a request: `sources[i]` serves kvtier block `first + i`, its tokens from
    `start` (what vLLM holds) up to `end`."""
    n = len(sources)
    lo = min(n, max(0, -(-start // bt) - first))  # blocks from `lo` to `hi` are whole
    hi = max(lo, min(n, end // bt - first))
    served = Counter({source: count * bt for source, count in Counter(sources[lo:hi]).items()})
    for i in [*range(lo), *range(hi, n)]:
        served[sources[i]] += max(0, _part(first + i, bt, start, end))
    return served


def _part(block: int, bt: int, start: int, end: int) -> int:
    """The tokens of kvtier block `block` from `start` up to `end` (none or fewer: 0 or less)."""
    return min((block + 1) * bt, end) - max(block * bt, start)
