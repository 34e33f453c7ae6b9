"""How the directory sees a tier: what was configured (`TierSpec`, `SharedSpec`) and its live accounting (`Tier`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.admission import AdmissionRule
from kvtier.policies import EvictionPolicy, make_policy
from kvtier.stores.base import TierKind


@dataclass
class TierSpec:
    """A local tier: bounded bytes, a fixed footprint per block, a policy, admission."""

    name: str
    capacity_bytes: int
    block_bytes: int
    kind: TierKind = TierKind.DISK
    policy: str = "lru"
    admission: AdmissionRule = field(default_factory=AdmissionRule)
    write_through: bool = False  # stored at once with the tier above, instead of on eviction from it

    @property
    def slotted(self) -> bool:
        """Fixed slots in one buffer (host) rather than named objects (files, keys)."""
        return self.kind is TierKind.HOST

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.block_bytes

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.block_bytes <= 0:
            raise ValueError(f"tier {self.name!r}: capacity_bytes and block_bytes must be > 0")
        if self.capacity_bytes < self.block_bytes:
            raise ValueError(
                f"tier {self.name!r}: capacity {self.capacity_bytes} B holds no block of {self.block_bytes} B"
            )


@dataclass
class SharedSpec:
    """A tier shared with other engines: known to the directory only as a place to write to and fetch from."""

    name: str
    block_bytes: int  # what one block costs its write path (the admission budget)
    admission: AdmissionRule = field(default_factory=AdmissionRule)
    kind: TierKind = TierKind.SHARED


class Tier:
    """A local tier's live accounting: blocks used (including deletes still pending), free slots, policy order."""

    def __init__(self, spec: TierSpec, index: int) -> None:
        self.spec = spec
        self.name = spec.name
        self.index = index
        self.capacity_blocks = spec.capacity_bytes // spec.block_bytes
        self.policy: EvictionPolicy = make_policy(spec.policy, self.capacity_blocks)
        self.used_blocks = 0
        self.slotted = spec.slotted
        self.free_slots = list(range(self.capacity_blocks - 1, -1, -1)) if self.slotted else []

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.spec.block_bytes

    @property
    def capacity_bytes(self) -> int:
        """What the tier can hold in whole blocks (its configured bytes, rounded down)."""
        return self.capacity_blocks * self.spec.block_bytes

    @property
    def full(self) -> bool:
        return self.used_blocks >= self.capacity_blocks
