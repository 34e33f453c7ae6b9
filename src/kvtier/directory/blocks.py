"""What the directory knows of one block: its place in the chain and its copies in tiers.

A block has at most one copy per tier. A copy is WRITING until the step that fills it completes OK, then
READY (readable); `readers` counts transfers reading it, `pins` on the block count loads that promised it.
A block that left the directory (dropped) while a transfer still touches one of its copies is *retiring*:
no longer found by lookups, its copies still counted until the last transfer completes.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field


class CopyState(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True)
class Copy:
    slot: int | None
    state: CopyState
    readers: int = 0


@dataclass(slots=True, eq=False)
class Block:
    key: bytes
    parent: bytes | None
    priority: int
    copies: dict[str, Copy] = field(default_factory=dict)
    # the children's keys, None without any; one child is its key alone: most blocks of a chain have one, and a
    # set would be one more object per block for the garbage collector to scan (and some 200 bytes)
    children: bytes | set[bytes] | None = None
    pins: int = 0
    seen: int = 1
    retiring: bool = False  # dropped: lookups no longer find it; its copies go once no transfer touches them

    def add_child(self, key: bytes) -> None:
        children = self.children
        if children is None or children == key:
            self.children = key
        elif isinstance(children, bytes):
            self.children = {children, key}
        else:
            children.add(key)

    def remove_child(self, key: bytes) -> None:
        children = self.children
        if children == key:
            self.children = None
        elif isinstance(children, set):
            children.discard(key)
            if not children:
                self.children = None

    def child_keys(self) -> Collection[bytes]:
        children = self.children
        if children is None:
            return ()
        return (children,) if isinstance(children, bytes) else children
