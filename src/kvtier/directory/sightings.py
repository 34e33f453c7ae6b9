"""How often the traffic showed blocks that no tier stores: the evidence "store on the 2nd sighting" and the
adaptive admission act on. Counted only where an admission rule uses it, and in bounded memory."""

from __future__ import annotations

from kvtier.directory.recency import Recency


class Sightings:
    def __init__(self, capacity: int, counting: bool) -> None:
        self.counting = counting
        self._seen: Recency[bytes, int] = Recency(capacity)

    def sight(self, key: bytes, times: int = 1) -> int:
        """Count `times` more sightings of `key`; how often it was seen in all (`times`, when not counting)."""
        if not self.counting:
            return times
        seen = self._seen.get(key, 0) + times
        self._seen.set(key, seen)
        return seen

    def take(self, key: bytes, default: int) -> int:
        """The sightings of a block about to be stored (forgotten here: the block counts them from now on)."""
        return self._seen.pop(key, default)

    def clear(self) -> None:
        self._seen.clear()
