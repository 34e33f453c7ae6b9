"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO with a 2-bit clock, a ghost FIFO.

Parameters follow libCacheSim's S3FIFO: small = 10% of the capacity, ghost = 90%, and a block leaves the
small queue for the main one once it was hit `move_to_main_threshold` times.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.policies.base import DEFAULT_PRIORITY, EvictionPolicy, Key

SMALL_RATIO, GHOST_RATIO, MOVE_TO_MAIN_THRESHOLD = 0.10, 0.90, 2  # libCacheSim's S3FIFO


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(
        self,
        capacity_blocks: int,
        small_ratio: float = SMALL_RATIO,
        ghost_ratio: float = GHOST_RATIO,
        move_to_main_threshold: int = MOVE_TO_MAIN_THRESHOLD,
    ) -> None:
        super().__init__(capacity_blocks)
        self.small_capacity = max(1, int(capacity_blocks * small_ratio))
        self.main_capacity = max(1, capacity_blocks - self.small_capacity)
        self.ghost_capacity = int(capacity_blocks * ghost_ratio)
        self.threshold = move_to_main_threshold
        self._small: OrderedDict[Key, int] = OrderedDict()  # key -> hit count
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._has_evicted = False

    def insert(self, key: Key, priority: int = DEFAULT_PRIORITY) -> None:
        self.remove(key)
        if self._ghost.pop(key, 0) is None:
            self._main[key] = 0
        elif not self._has_evicted and len(self._small) >= self.small_capacity:
            self._main[key] = 0  # warm-up: fill main before anything was evicted
        else:
            self._small[key] = 0

    def touch(self, key: Key) -> None:
        queue = self._small if key in self._small else self._main
        queue[key] += 1

    def remove(self, key: Key) -> None:
        if self._small.pop(key, None) is None:
            self._main.pop(key, None)

    def candidates(self, incoming: Key | None = None) -> Iterator[Key]:
        self._has_evicted = True
        budget = 2 * (len(self._small) + len(self._main)) + 2  # every block may be passed over once
        while budget > 0 and (self._small or self._main):
            budget -= 1
            if len(self._main) > self.main_capacity or not self._small:
                key, hits = next(iter(self._main.items()))
                if hits >= 1:
                    self._main.move_to_end(key)
                    self._main[key] = min(hits, 3) - 1
                    continue
                yield key
                if key in self._main:  # passed over (pinned): give it another lap
                    self._main.move_to_end(key)
            else:
                key, hits = next(iter(self._small.items()))
                if hits >= self.threshold:
                    del self._small[key]
                    self._main[key] = 0
                    continue
                yield key
                if key in self._small:
                    self._small.move_to_end(key)

    def evicted(self, key: Key) -> None:
        if self._small.pop(key, None) is not None:
            if self.ghost_capacity > 0:
                self._ghost[key] = None
                if len(self._ghost) > self.ghost_capacity:
                    self._ghost.popitem(last=False)
        else:
            del self._main[key]

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: Key) -> bool:
        return key in self._small or key in self._main
