"""Least recently used: an ordered dict, oldest first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvtier.policies.base import DEFAULT_PRIORITY, EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    name = "lru"
    stable_order = True

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, priority: int = DEFAULT_PRIORITY) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def insert_many(self, keys: Iterable[Key], priority: int = DEFAULT_PRIORITY) -> None:
        keys = list(keys)
        if self._order.keys().isdisjoint(keys):  # new keys: appended in order, in one call
            self._order.update(dict.fromkeys(keys))
        else:
            super().insert_many(keys, priority)

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)

    def touch_many(self, keys: Iterable[Key]) -> None:
        move = self._order.move_to_end
        for key in keys:
            move(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def candidates(self, incoming: Key | None = None) -> Iterator[Key]:
        return iter(self._order)

    def evicted(self, key: Key) -> None:
        del self._order[key]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Key) -> bool:
        return key in self._order
