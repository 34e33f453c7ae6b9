"""A graceful stop's flush: the host tier's blocks written to the first disk tier, within that tier's bound.

The directory, which bounds the disk tier while the engine runs, lives in the scheduler process and is gone by
the time a worker stops. So the worker bounds what it writes by what its disk store tells: the files it holds
(a scan: their keys, parents and ages) and the tier's capacity. The host tier holds the blocks used last, so
they go in place of the oldest files, as the restart's policy (oldest first) would have evicted those anyway;
leaves go first and a parent never before its children, so nothing written or kept is an orphan at the restart.
Files are removed before blocks are written: at no moment does the tier hold more than its bound.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from collections.abc import Sequence

from kvtier.stores.base import LocalStore, RecoveredBlock, SlotStore

log = logging.getLogger(__name__)
Labelled = tuple[int, bytes, bytes | None]  # (host slot, key, parent)


def flush(host: SlotStore, disk: LocalStore, budget_s: float) -> tuple[int, int]:
    """Write host blocks no file holds to `disk`, for `budget_s` at most: (written, blocks in host)."""
    deadline = time.monotonic() + budget_s
    held = host.labelled()
    written = 0
    try:
        files, _ = disk.scan()  # before any write: the mover is closed, so a temp file is a stray one
        wanted = _parents_first(held, {f.key for f in files})
        capacity = disk.capacity_blocks
        if capacity is not None:
            wanted = wanted[:capacity]
            _make_room(disk, files, wanted, capacity)
        for slot, key, parent in wanted:
            if time.monotonic() > deadline:
                log.warning("kvtier: shutdown: flush stopped after %.1f s (shutdown_flush_s)", budget_s)
                break
            disk.write(key, parent, host.view(slot))
            written += 1
    except Exception as exc:  # a failing disk stops the flush (a child is never written without its parent)
        log.warning("kvtier: shutdown: flush stopped: %s", exc)
    return written, len(held)


def _parents_first(held: Sequence[Labelled], on_disk: set[bytes]) -> list[Labelled]:
    """The host blocks no file holds whose chain reaches a root or a file, each after its parent. A block whose
    parent is in neither tier (only in the shared one) would be an orphan on disk: left out."""
    by_key = {key: (slot, key, parent) for slot, key, parent in held if key not in on_disk}
    depth: dict[bytes, int | None] = {}
    for key in by_key:
        path: list[bytes] = []
        at: bytes | None = key
        base: int | None = -1  # the depth of what the chain rests on: -1 for a root or a file
        while at is not None and at not in depth and at not in on_disk:  # iteratively: chains may be long
            if at not in by_key or at in path:
                base = None  # in no local tier (an orphan), or labels that loop
                break
            path.append(at)
            at = by_key[at][2]
        if at is not None and at in depth:
            base = depth[at]
        for k in reversed(path):
            base = None if base is None else base + 1
            depth[k] = base
    reachable = [by_key[k] for k, d in depth.items() if d is not None and k in by_key]
    return sorted(reachable, key=lambda b: depth[b[1]] or 0)


def _make_room(disk: LocalStore, files: list[RecoveredBlock], wanted: list[Labelled], capacity: int) -> None:
    """Remove the oldest files whose loss orphans nothing (no file and no block to write is their child) until
    the files and `wanted` fit in `capacity`; where only parents of `wanted` are left, the last of `wanted` go."""
    parent_of = {f.key: f.parent for f in files}
    children = Counter(p for p in parent_of.values() if p is not None)
    children.update(parent for _, _, parent in wanted if parent is not None)
    age = {f.key: (f.mtime_ns, f.key) for f in files}  # oldest first; the key breaks ties alike on every rank
    leaves = [age[k] for k in parent_of if not children[k]]
    heapq.heapify(leaves)
    kept = len(files)
    while kept + len(wanted) > capacity:
        if not leaves:
            _, _, parent = wanted.pop()  # the deepest: nothing else wanted is its child
            if parent is not None:
                children[parent] -= 1
                if parent in parent_of and not children[parent]:
                    heapq.heappush(leaves, age[parent])
            continue
        _, key = heapq.heappop(leaves)
        if not disk.delete(key) and disk.holds(key):
            continue  # it stays, and counts: another one goes
        kept -= 1
        parent = parent_of[key]
        if parent is not None and parent in parent_of:
            children[parent] -= 1
            if not children[parent]:
                heapq.heappush(leaves, age[parent])
