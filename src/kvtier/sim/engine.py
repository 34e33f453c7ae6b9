"""The engine's own prefix cache (tier 0) as the simulator sees it: an LRU of blocks, longest-prefix hits.

kvtier does not own this tier; vLLM does. It is modelled so that the tiers below it are asked only for what
the engine misses, as in a real run: a host tier helps only blocks the engine has already evicted.
Running requests' blocks are not pinned here, but the blocks a request holds beyond its cached ones (its partial
last block, its output) take cached blocks' room while it runs, as in vLLM.
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

    def insert(self, blocks: Sequence[int], held: int = 0) -> None:
        """A prefill left these blocks in the engine (ancestors end up more recent than descendants). `held`: the
        blocks the request holds at its longest (its prompt's partial last block and its output's), which vLLM
        takes from the least recently used cached blocks while it runs, though they cache nothing."""
        if not self.capacity:
            return
        cached = self._blocks
        for block in reversed(blocks):
            cached[block] = None
            cached.move_to_end(block)
        while cached and len(cached) + max(0, held - len(blocks)) > self.capacity:
            cached.popitem(last=False)
