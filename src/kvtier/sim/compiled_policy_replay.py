"""LRU, ARC and S3-FIFO replays compiled with numba: the policy objects' exact decisions, at C-like speed.

A replay drives one cache the way `policy_replay` drives a policy object: a hit touches, a miss evicts the first
candidate when the cache is full, then inserts. Here each policy's queues are doubly linked lists over dense
block ids (arrays, not dicts), and the rules are transcribed from `kvtier.policies` step by step, including
ARC's ghost bookkeeping and adaptation and S3-FIFO's warm-up and clock. Tests compare every count with the
policy objects on random and real traces; the objects stay the reference and the runtime's code.

`policy_replay` imports this module on first use: numba's import and compilation are paid only by replays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit

from kvtier.policies.s3fifo import GHOST_RATIO, MOVE_TO_MAIN_THRESHOLD, SMALL_RATIO

_NONE = -1
# queue numbers (0: in no queue)
_LRU, _T1, _T2, _B1, _B2 = 1, 1, 2, 3, 4
_SMALL, _MAIN, _GHOST = 1, 2, 3


def replay_ids(policy: str, ids: np.ndarray, starts: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request (`ids[starts[i]:starts[i+1]]`): its block hits and the length of its leading run of hits.
    `ids` are dense (0 .. n-1)."""
    distinct = int(ids.max()) + 1 if len(ids) else 0
    return KERNELS[policy](ids, starts, capacity, distinct)


def dense_ids(blocks: np.ndarray) -> np.ndarray:
    """Block ids as dense ints, so that queues can be arrays indexed by block (traces intern theirs already)."""
    if len(blocks) and (blocks.min() < 0 or blocks.max() >= 2 * len(blocks)):
        return np.unique(blocks, return_inverse=True)[1].astype(np.int64)
    return blocks.astype(np.int64, copy=False)


@njit(inline="always")
def append(q, key, where, prev, nxt, head, tail, size):
    where[key] = q
    last = tail[q]
    prev[key] = last
    nxt[key] = _NONE
    if last == _NONE:
        head[q] = key
    else:
        nxt[last] = key
    tail[q] = key
    size[q] += 1


@njit(inline="always")
def unlink(key, where, prev, nxt, head, tail, size):
    q = where[key]
    before, after = prev[key], nxt[key]
    if before == _NONE:
        head[q] = after
    else:
        nxt[before] = after
    if after == _NONE:
        tail[q] = before
    else:
        prev[after] = before
    size[q] -= 1
    where[key] = 0


@njit(inline="always")
def queues(distinct, count):
    where = np.zeros(distinct, np.int8)
    prev = np.full(distinct, _NONE, np.int64)
    nxt = np.full(distinct, _NONE, np.int64)
    head = np.full(count + 1, _NONE, np.int64)
    tail = np.full(count + 1, _NONE, np.int64)
    size = np.zeros(count + 1, np.int64)
    return where, prev, nxt, head, tail, size


@njit(cache=True, nogil=True)
def lru(ids, starts, capacity, distinct):
    where, prev, nxt, head, tail, size = queues(distinct, 1)
    n = len(starts) - 1
    hits, lead = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for r in range(n):
        leading = True
        for j in range(starts[r], starts[r + 1]):
            key = ids[j]
            if where[key] == _LRU:
                unlink(key, where, prev, nxt, head, tail, size)
                append(_LRU, key, where, prev, nxt, head, tail, size)
                hits[r] += 1
                lead[r] += leading
                continue
            leading = False
            if size[_LRU] >= capacity:
                unlink(head[_LRU], where, prev, nxt, head, tail, size)
            append(_LRU, key, where, prev, nxt, head, tail, size)
    return hits, lead


# one loop that mirrors the policy object's methods rule for rule (the complexity is theirs, inlined)
@njit(cache=True, nogil=True)
def arc(ids, starts, capacity, distinct):  # noqa: C901
    """ARCPolicy: candidates(key) (adapt, the |T1| = c discard, which list first), evicted, insert."""
    where, prev, nxt, head, tail, size = queues(distinct, 4)
    p = 0.0
    n = len(starts) - 1
    hits, lead = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for r in range(n):
        leading = True
        for j in range(starts[r], starts[r + 1]):
            key = ids[j]
            q = where[key]
            if q == _T1 or q == _T2:
                unlink(key, where, prev, nxt, head, tail, size)
                append(_T2, key, where, prev, nxt, head, tail, size)
                hits[r] += 1
                lead[r] += leading
                continue
            leading = False
            # adapt p to a ghost hit (once per incoming key: in candidates, else in insert)
            if q == _B1:
                p = min(float(capacity), p + max(size[_B2] / size[_B1], 1.0))
            elif q == _B2:
                p = max(0.0, p - max(size[_B1] / size[_B2], 1.0))
            if size[_T1] + size[_T2] >= capacity:
                discard = _NONE
                if q == 0 and size[_T1] + size[_B1] >= capacity and size[_B1] == 0 and size[_T1] > 0:
                    discard = head[_T1]
                t1_first = size[_T1] > 0 and (size[_T1] > p or (q == _B2 and size[_T1] == p))
                if t1_first or size[_T2] == 0:
                    victim = head[_T1]
                    unlink(victim, where, prev, nxt, head, tail, size)
                    if victim != discard:
                        append(_B1, victim, where, prev, nxt, head, tail, size)
                else:
                    victim = head[_T2]
                    unlink(victim, where, prev, nxt, head, tail, size)
                    append(_B2, victim, where, prev, nxt, head, tail, size)
            if q == _B1 or q == _B2:
                unlink(key, where, prev, nxt, head, tail, size)
                append(_T2, key, where, prev, nxt, head, tail, size)
                continue
            if size[_T1] + size[_B1] >= capacity and size[_B1] > 0:
                unlink(head[_B1], where, prev, nxt, head, tail, size)
            elif size[_T1] + size[_T2] + size[_B1] + size[_B2] >= 2 * capacity and size[_B2] > 0:
                unlink(head[_B2], where, prev, nxt, head, tail, size)
            append(_T1, key, where, prev, nxt, head, tail, size)
            while size[_B1] + size[_B2] > 2 * capacity:
                ghost = _B1 if size[_B1] > size[_B2] else _B2
                unlink(head[ghost], where, prev, nxt, head, tail, size)
    return hits, lead


# one loop that mirrors the policy object's methods rule for rule (the complexity is theirs, inlined)
@njit(cache=True, nogil=True)
def s3fifo(ids, starts, capacity, distinct):  # noqa: C901
    """S3FIFOPolicy at its defaults: small FIFO, main FIFO with a 2-bit clock, ghost FIFO; warm-up."""
    where, prev, nxt, head, tail, size = queues(distinct, 3)
    freq = np.zeros(distinct, np.int64)
    small_capacity = max(1, int(capacity * SMALL_RATIO))
    main_capacity = max(1, capacity - small_capacity)
    ghost_capacity = int(capacity * GHOST_RATIO)
    has_evicted = False
    n = len(starts) - 1
    hits, lead = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for r in range(n):
        leading = True
        for j in range(starts[r], starts[r + 1]):
            key = ids[j]
            q = where[key]
            if q == _SMALL or q == _MAIN:
                freq[key] += 1
                hits[r] += 1
                lead[r] += leading
                continue
            leading = False
            if size[_SMALL] + size[_MAIN] >= capacity:
                has_evicted = True
                budget = 2 * (size[_SMALL] + size[_MAIN]) + 2
                while True:
                    if budget <= 0:
                        raise RuntimeError("S3-FIFO found no victim")
                    budget -= 1
                    if size[_MAIN] > main_capacity or size[_SMALL] == 0:
                        victim = head[_MAIN]
                        unlink(victim, where, prev, nxt, head, tail, size)
                        if freq[victim] >= 1:
                            freq[victim] = min(freq[victim], 3) - 1
                            append(_MAIN, victim, where, prev, nxt, head, tail, size)
                            continue
                        break
                    victim = head[_SMALL]
                    unlink(victim, where, prev, nxt, head, tail, size)
                    if freq[victim] >= MOVE_TO_MAIN_THRESHOLD:
                        freq[victim] = 0
                        append(_MAIN, victim, where, prev, nxt, head, tail, size)
                        continue
                    if ghost_capacity > 0:
                        append(_GHOST, victim, where, prev, nxt, head, tail, size)
                        if size[_GHOST] > ghost_capacity:
                            unlink(head[_GHOST], where, prev, nxt, head, tail, size)
                    break
            freq[key] = 0
            if where[key] == _GHOST:
                unlink(key, where, prev, nxt, head, tail, size)
                append(_MAIN, key, where, prev, nxt, head, tail, size)
            elif not has_evicted and size[_SMALL] >= small_capacity:
                append(_MAIN, key, where, prev, nxt, head, tail, size)
            else:
                append(_SMALL, key, where, prev, nxt, head, tail, size)
    return hits, lead


KERNELS: dict[str, Callable] = {"lru": lru, "arc": arc, "s3fifo": s3fifo}
