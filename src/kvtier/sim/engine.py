"""The engine's own prefix cache (tier 0) as the simulator sees it: an LRU of blocks, longest-prefix hits.

kvtier does not own this tier; vLLM does. It is modelled so that the tiers below it are asked only for what
the engine misses, as in a real run: a host tier helps only blocks the engine has already evicted.
Running requests' blocks are not pinned here: the engine's memory is taken as all cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class EngineCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(0, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def hit_prefix(self, blocks: Sequence[int]) -> int:
        """Leading blocks cached now; touches them."""
        n = 0
        cached = self._blocks
        for block in blocks:
            if block not in cached:
                break
            cached.move_to_end(block)
            n += 1
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        """A prefill left these blocks in the engine (ancestors end up more recent than descendants)."""
        if not self.capacity:
            return
        cached = self._blocks
        for block in reversed(blocks):
            cached[block] = None
            cached.move_to_end(block)
        while len(cached) > self.capacity:
            cached.popitem(last=False)
