"""A map that remembers only its most recently set keys: past its capacity, the oldest is forgotten.

The directory's memory of blocks it does not hold (sightings, blocks read from a slower tier) must stay
bounded however many distinct blocks the traffic brings.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recency(Generic[K, V]):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()

    def set(self, key: K, value: V) -> None:
        """Set `key` and make it the most recent; forget the oldest key past the capacity."""
        items = self._items
        items[key] = value
        items.move_to_end(key)
        if len(items) > self.capacity:
            items.popitem(last=False)

    def get(self, key: K, default: V) -> V:
        return self._items.get(key, default)

    def pop(self, key: K, default: V) -> V:
        return self._items.pop(key, default)

    def clear(self) -> None:
        self._items.clear()

    def isdisjoint(self, keys: Iterable[K]) -> bool:
        """None of `keys` is here (one pass in C)."""
        return self._items.keys().isdisjoint(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
