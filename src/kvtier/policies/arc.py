"""ARC (Megiddo & Modha, FAST'03): recency list T1 and frequency list T2, ghosts B1/B2 steer the target p."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.policies.base import DEFAULT_PRIORITY, EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self.p = 0.0  # target size of T1
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._adapted_for: Key | None = None  # the incoming key whose ghost hit already moved p
        self._discard: Key | None = None  # evicted from T1 without a ghost (|T1| + |B1| = c)

    def _adapt(self, key: Key) -> None:
        if key == self._adapted_for:
            return
        if key in self._b1:
            self.p = min(self.capacity, self.p + max(len(self._b2) / len(self._b1), 1.0))
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
        else:
            return
        self._adapted_for = key

    def insert(self, key: Key, priority: int = DEFAULT_PRIORITY) -> None:
        self.remove(key)
        self._adapt(key)
        self._adapted_for = None
        if self._b1.pop(key, 0) is None or self._b2.pop(key, 0) is None:
            self._t2[key] = None
            return
        if len(self._t1) + len(self._b1) >= self.capacity and self._b1:
            self._b1.popitem(last=False)
        elif len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) >= 2 * self.capacity and self._b2:
            self._b2.popitem(last=False)
        self._t1[key] = None
        while len(self._b1) + len(self._b2) > 2 * self.capacity:  # only after many non-eviction removals
            (self._b1 if len(self._b1) > len(self._b2) else self._b2).popitem(last=False)

    def touch(self, key: Key) -> None:
        if self._t1.pop(key, 0) is None:
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if self._t1.pop(key, 0) is not None:
            self._t2.pop(key, None)

    def candidates(self, incoming: Key | None = None) -> Iterator[Key]:
        if incoming is not None:
            self._adapt(incoming)
            fresh = incoming not in self._b1 and incoming not in self._b2
            if fresh and len(self._t1) + len(self._b1) >= self.capacity and not self._b1 and self._t1:
                self._discard = next(iter(self._t1))  # case IV.A with |T1| = c: no ghost
        t1_first = bool(self._t1) and (
            len(self._t1) > self.p or (incoming is not None and incoming in self._b2 and len(self._t1) == self.p)
        )
        first, second = (self._t1, self._t2) if t1_first else (self._t2, self._t1)
        # Lazy: the directory stops iterating as soon as it evicts, so nothing changes under the iterators.
        yield from iter(first)
        yield from iter(second)

    def evicted(self, key: Key) -> None:
        if self._t1.pop(key, 0) is None:
            if key != self._discard:
                self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None
        self._discard = None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: Key) -> bool:
        return key in self._t1 or key in self._t2
