"""The step ledger: step ids, and what each step in flight must settle when the mover reports it.

The directory plans steps and learns of them only by id when they complete, maybe much later and from
another process. What a completion must undo or release is recorded here, by step id:

- *holding*: the step reads a copy it holds (it is one of that copy's `readers`);
- *pinning*: a write-through to the shared tier, which pins its block until it is sent;
- *deleting*: deletes in flight, by (tier, key): that key is not written to that tier meanwhile, or the late
  delete would undo the write;
- *accounted*: deletes whose bytes still count against their tier (no write took their room);
- *owed*: per tier, files that a failed delete left behind, counted in place of the next lost copy.
"""

from __future__ import annotations

import itertools
from collections import Counter

from kvtier.directory.plan import CALLER, Op, Step


class StepLedger:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._holding: set[int] = set()
        self._pinning: set[int] = set()
        self._deleting: Counter[tuple[str, bytes]] = Counter()
        self._accounted: set[int] = set()
        self._owed: Counter[str] = Counter()

    def step(self, op: Op, key: bytes, src: str, dst: str, src_slot: int | None = None, dst_slot: int | None = None,
             index: int = -1, parent: bytes | None = None, needs_prev: bool = False) -> Step:
        """A new step with an id unique within this directory."""
        return Step(op, key, src, dst, src_slot, dst_slot, index, parent, needs_prev, next(self._ids))

    def take_ids(self, n: int) -> list[int]:
        """The ids of `n` new steps, made by the caller (a run of them, planned in bulk)."""
        return list(itertools.islice(self._ids, n))

    # ---------------------------------------------------------------- reads and pins

    def hold(self, step: Step) -> None:
        self._holding.add(step.id)

    def release_hold(self, step: Step) -> bool:
        """True if `step` held a copy it read (its reader count is the caller's to decrement)."""
        if step.id in self._holding:
            self._holding.discard(step.id)
            return True
        return False

    def pin(self, step: Step) -> None:
        self._pinning.add(step.id)

    def release_pin(self, step: Step) -> bool:
        """True if `step` pinned its block (the pin is the caller's to release)."""
        if step.id in self._pinning:
            self._pinning.discard(step.id)
            return True
        return False

    # ---------------------------------------------------------------- deletes

    def delete(self, tier: str, key: bytes, accounted: bool = False) -> Step:
        """A DELETE of `key` from `tier`; `accounted`: its bytes count against the tier until it has run."""
        self._deleting[(tier, key)] += 1
        step = self.step(Op.DELETE, key, tier, CALLER)
        if accounted:
            self._accounted.add(step.id)
        return step

    def deleting(self, tier: str, key: bytes) -> bool:
        return (tier, key) in self._deleting

    def account(self, step: Step) -> bool:
        """Count a planned delete's bytes until it has run; False if they were counted already."""
        if step.id in self._accounted:
            return False
        self._accounted.add(step.id)
        return True

    def accounted(self, step: Step) -> bool:
        """True while `step` (a delete) still has its bytes counted against its tier."""
        return step.id in self._accounted

    def delete_done(self, step: Step) -> bool:
        """A delete ran (or failed): its key may be written again. True if its bytes were counted."""
        where = (step.src, step.key)
        if self._deleting[where] > 1:
            self._deleting[where] -= 1
        else:
            self._deleting.pop(where, None)
        accounted = step.id in self._accounted
        self._accounted.discard(step.id)
        return accounted

    # ---------------------------------------------------------------- files a failed delete left

    def owe(self, tier: str) -> None:
        self._owed[tier] += 1

    def pay(self, tier: str) -> bool:
        """Hand a lost copy's count to a file a failed delete left, if one is owed."""
        if self._owed[tier]:
            self._owed[tier] -= 1
            return True
        return False

    def owed(self, tier: str) -> int:
        return self._owed[tier]
