"""The interface every eviction policy implements.

The directory calls `insert` when a block enters the tier, `touch` on a hit, `remove` when a block leaves
for a reason the policy did not choose (promotion, cascade, invalidation), and walks `candidates()` when it
needs room: it evicts the first candidate that is not pinned or in flight and then calls `evicted(key)`.
Candidates are produced lazily, so a policy may reorganise itself while it searches (S3-FIFO moves blocks
from its small queue to its main queue, as in the paper). Between two calls to `candidates()` the directory
always calls `evicted` or stops iterating, never both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Iterator

Key = Hashable
DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority (0..100)


class EvictionPolicy(ABC):
    name: str = "?"
    # candidates() ignores `incoming`, and evicting one leaves the others in their order: the directory may
    # then pick several victims in one walk (`Room.victims`)
    stable_order: bool = False

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        self.capacity = capacity_blocks

    @abstractmethod
    def insert(self, key: Key, priority: int = DEFAULT_PRIORITY) -> None: ...

    @abstractmethod
    def touch(self, key: Key) -> None: ...

    def insert_many(self, keys: Iterable[Key], priority: int = DEFAULT_PRIORITY) -> None:
        """`insert` each of `keys`, in order (a stored run of blocks)."""
        for key in keys:
            self.insert(key, priority)

    def touch_many(self, keys: Iterable[Key]) -> None:
        """`touch` each of `keys`, in order (a hit on a chain)."""
        for key in keys:
            self.touch(key)

    @abstractmethod
    def remove(self, key: Key) -> None: ...

    @abstractmethod
    def candidates(self, incoming: Key | None = None) -> Iterator[Key]:
        """Victims, best first. `incoming` is the block that needs the room (ARC adapts to it)."""

    @abstractmethod
    def evicted(self, key: Key) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: Key) -> bool: ...
