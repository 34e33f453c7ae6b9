"""What every store reports back, so that the mover and the metrics treat all tiers alike."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no such block (removed behind our back, or never written)
    CORRUPT = "corrupt"  # checksum, length or header mismatch: torn or flipped bytes
    FOREIGN = "foreign"  # a valid block of another namespace or another key

    @property
    def is_integrity_failure(self) -> bool:
        return self in (ReadStatus.CORRUPT, ReadStatus.FOREIGN)


@dataclass(frozen=True)
class RecoveredBlock:
    """A valid block found by a restart scan; `age_rank` orders blocks oldest first for the eviction policy."""

    key: bytes
    parent: bytes | None
    mtime_ns: int
