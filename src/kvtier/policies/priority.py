"""Priority retention with TensorRT-LLM's semantics: lowest priority (0..100) goes first, LRU within a level.

Whether a block is offloaded at all (`secondary_offload_min_priority`) is an admission rule, not an
eviction order; it lives in `kvtier.admission`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.policies.base import DEFAULT_PRIORITY, EvictionPolicy, Key

MIN_PRIORITY, MAX_PRIORITY = 0, 100


class PriorityPolicy(EvictionPolicy):
    name = "priority"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._levels = [OrderedDict[Key, None]() for _ in range(MAX_PRIORITY + 1)]
        self._level_of: dict[Key, int] = {}

    def insert(self, key: Key, priority: int = DEFAULT_PRIORITY) -> None:
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [0, 100], got {priority}")
        self.remove(key)
        self._level_of[key] = priority
        self._levels[priority][key] = None

    def touch(self, key: Key) -> None:
        self._levels[self._level_of[key]].move_to_end(key)

    def remove(self, key: Key) -> None:
        level = self._level_of.pop(key, None)
        if level is not None:
            del self._levels[level][key]

    def candidates(self, incoming: Key | None = None) -> Iterator[Key]:
        for level in self._levels:
            yield from level

    def evicted(self, key: Key) -> None:
        self.remove(key)

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, key: Key) -> bool:
        return key in self._level_of
