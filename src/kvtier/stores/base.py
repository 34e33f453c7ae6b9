"""What a store is, by the medium its bytes live in, and what it reports back.

Stores are dumb: they put, get and delete bytes at a slot or under a key, with integrity checks, and import
nothing of the metadata plane. Which slot or key, and when, is the directory's business; how bytes travel
between two stores is the mover's. A tier's bytes live in one of three media (`TierKind`), each behind one
small protocol:

- HOST: slots of one buffer in this process (`SlotStore`); the directory picks the slot. The bytes never
  leave the process, so they carry no header.
- DISK: one self-checking object per block on a local file system (`LocalStore`): write, read (verified),
  delete, and a scan that finds them again after a restart.
- SHARED: self-checking objects in a store that other engines write too (`SharedStore`): the same, in
  batches of one round trip, plus a lookup of how much of a chain it holds.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvtier.stores.buffers import Buffer


class TierKind(enum.Enum):
    HOST = "host"
    DISK = "disk"
    SHARED = "shared"


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no such block (removed behind our back, or never written)
    CORRUPT = "corrupt"  # checksum, length or header mismatch: torn or flipped bytes
    FOREIGN = "foreign"  # a valid block of another namespace or another key
    UNAUTHENTICATED = "unauthenticated"  # whole, but not signed with our key: written by whoever could write there

    @property
    def is_integrity_failure(self) -> bool:
        return self is not ReadStatus.OK and self is not ReadStatus.MISSING


class PutStatus(enum.Enum):
    """STORED and EXISTS mean the tier has the block; the rest are stores not done, each its own reason."""

    STORED = "stored"
    EXISTS = "exists"  # already in the tier (another engine stored it): touched, not rewritten
    ORPHAN = "orphan"  # its parent is not in the tier: storing it would break the chain invariant
    NO_ROOM = "no_room"  # making room would have evicted its own parent
    TOO_BIG = "too_big"  # larger than max_bytes
    DROPPED = "dropped"  # not tried: the breaker is open
    FAILED = "failed"  # the store failed or refused the write

    @property
    def held(self) -> bool:
        return self in (PutStatus.STORED, PutStatus.EXISTS)


@dataclass(frozen=True)
class RecoveredBlock:
    """A valid block found by a restart scan; `mtime_ns` orders blocks oldest first for the eviction policy."""

    key: bytes
    parent: bytes | None
    mtime_ns: int


class SlotStore(Protocol):
    """HOST: fixed-size slots of one buffer; a slot is a contiguous view of one block's payload, as a uint8
    tensor (for copies to and from the engine's tensors) or as a memoryview (for the other stores)."""

    payload_nbytes: int

    def slot(self, i: int) -> torch.Tensor: ...

    def slots_as(self, dtype: torch.dtype, shape: Sequence[int]) -> Sequence[torch.Tensor]: ...

    def view(self, i: int) -> memoryview: ...

    def label(self, i: int, block: tuple[bytes, bytes | None] | None) -> None: ...

    def labelled(self) -> list[tuple[int, bytes, bytes | None]]: ...

    def forget_labels(self) -> None: ...

    def close(self) -> None: ...


class ObjectStore(Protocol):
    """DISK (and SHARED, one block at a time): a block's bytes under its key, checked when read back."""

    payload_nbytes: int

    def write(self, key: bytes, parent: bytes | None, src: Buffer) -> None:
        """Store `src` (payload_nbytes); raise OSError when the store does not have it after."""
        ...

    def read(self, key: bytes, into: Buffer) -> ReadStatus:
        """Anything but OK leaves `into` undefined; a CORRUPT or FOREIGN block is removed, never served."""
        ...

    def delete(self, key: bytes) -> bool: ...

    def close(self) -> None: ...


class LocalStore(ObjectStore, Protocol):
    """DISK: an ObjectStore whose blocks outlive the process, found again by a restart scan."""

    namespace: str

    @property
    def capacity_blocks(self) -> int | None:
        """How many blocks the tier's bound allows this store (None: none given)."""
        ...

    def holds(self, key: bytes) -> bool: ...

    def scan(self) -> tuple[list[RecoveredBlock], dict[str, int]]:
        """The valid blocks, oldest first, and how many files were removed, by reason."""
        ...

    def remove_other_namespaces(self, keep: Collection[str]) -> list[str]:
        """Remove what namespaces other than `keep` left where this store keeps its own; the names removed."""
        ...

    def reusing(self) -> AbstractContextManager[None]:
        """Within it, what this thread deletes makes room for what it writes next (a full tier's store)."""
        ...


class SharedStore(ObjectStore, Protocol):
    """SHARED: other engines add and evict blocks too; every batch call is one round trip. A store cut into
    partitions (a cluster) keeps each chain in one, picked by the call's `route` (`keys.chain_route` of the
    whole chain, which the store cannot see: its calls start mid-chain); a store of one partition ignores it."""

    max_bytes: int

    def lookup(self, chain: Sequence[bytes], route: bytes | None = None) -> int:
        """How many leading blocks of a chain (parents first) the store holds now."""
        ...

    def put_chain(
        self, items: Sequence[tuple[bytes, bytes | None, Buffer]], held: set[bytes], route: bytes | None = None
    ) -> list[PutStatus]:
        """Store blocks parents first, skipping those the store holds and those whose parent it lacks."""
        ...

    def get_many(self, keys: Sequence[bytes], into_buffers: Sequence[Buffer],
                 route: bytes | None = None) -> list[ReadStatus]: ...

    def stats(self) -> dict[str, Any]: ...

    def used_bytes(self) -> int | None: ...

    def capacity_bytes(self) -> int: ...

    @property
    def authenticated(self) -> bool:
        """Whether only blocks signed with the deployment's key are served."""
        ...


@dataclass
class Stores:
    """One worker's stores by tier name, grouped by medium: what the mover picks its handlers from."""

    host_name: str
    host: SlotStore
    local: dict[str, LocalStore] = field(default_factory=dict)  # the disk tiers, fastest first
    shared: dict[str, SharedStore] = field(default_factory=dict)

    def __getitem__(self, name: str) -> SlotStore | ObjectStore:
        if name == self.host_name:
            return self.host
        return self.local.get(name) or self.shared[name]

    def objects(self) -> Iterator[tuple[str, ObjectStore]]:
        """Every store that keeps blocks under their keys: the local ones, then the shared ones."""
        yield from self.local.items()
        yield from self.shared.items()

    def close(self) -> None:
        for _, store in self.objects():
            store.close()
        self.host.close()
