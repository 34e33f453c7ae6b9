"""What the directory hands the mover, and what the mover reports back.

A *plan* is chains of steps. Steps of one chain run in order (a victim is demoted out of a host slot before
the new block is written into that slot); chains run in parallel. The mover reports each step back with a
status, and only then does a copy become readable or a slot reusable. A step carries only what the mover
needs to move bytes (and its id, to report it by); the directory keeps its own bookkeeping by that id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

CALLER = "caller"  # the engine or the user's tensors: source of stores, destination of loads


class Op(enum.Enum):
    PUT = "put"  # caller -> tier
    COPY = "copy"  # tier -> tier (demotion, promotion, write-through)
    GET = "get"  # tier -> caller
    DELETE = "delete"  # remove from an unslotted tier (a file, a shared-store key)


class Status(enum.Enum):
    OK = "ok"
    FAILED = "failed"  # the destination could not be written (I/O error, skipped after a failed step)
    SOURCE_LOST = "source_lost"  # the source was missing, corrupt or foreign: it is gone now


@dataclass(slots=True)
class Step:
    op: Op
    key: bytes
    src: str
    dst: str
    src_slot: int | None = None
    dst_slot: int | None = None
    index: int = -1  # position in the caller's block list (PUT source, GET destination)
    parent: bytes | None = None  # written into the block's header by stores that keep one
    needs_prev: bool = False  # skip (as FAILED) when an earlier step of the chain for this key failed
    id: int = 0  # unique within its directory: completions are matched by it (also across processes)
    route: bytes | None = None  # a shared tier's step: what picks its chain's partition (`keys.chain_route`)


def pack_chains(chains: list[list[Step]]) -> tuple[list[int], list[tuple]]:
    """Chains as what pickles cheaply: each chain's length, and every step as a tuple of its fields. vLLM's
    multiprocess executor pickles a step's plans to its workers on the scheduler's thread; a long prompt's plan
    is a step per block, and a dataclass with slots pickles its fields as a dict per step: about 4x the time to
    pickle, and twice the time to unpickle."""
    return [len(chain) for chain in chains], [
        (s.op, s.key, s.src, s.dst, s.src_slot, s.dst_slot, s.index, s.parent, s.needs_prev, s.id, s.route)
        for chain in chains for s in chain]


def unpack_chains(packed: tuple[list[int], list[tuple]]) -> list[list[Step]]:
    """The chains `pack_chains` packed."""
    lengths, rows = packed
    steps = [Step(*row) for row in rows]
    if lengths.count(1) == len(lengths):  # one step per chain: a long prompt's loads and stores
        return [[step] for step in steps]
    chains, start = [], 0
    for n in lengths:
        chains.append(steps[start : start + n])
        start += n
    return chains


@dataclass
class Plan:
    chains: list[list[Step]]
    keys: list[bytes] = field(default_factory=list)  # loads: the prefix being loaded, pinned
    sources: list[str] = field(default_factory=list)  # loads: the tier each block came from

    @property
    def steps(self) -> int:
        return sum(len(c) for c in self.chains)
