"""The shared tier (Redis), as the directory plans it: a place to write through to and to fetch from.

Other engines add and remove the shared tier's blocks, so the directory owns neither its contents nor its
bytes (its store keeps both, for all engines). It only plans moves through it:

- write-through from the first tier (`offer`, called by the store planner): a COPY first->shared step for
  each block of the chain with a first-tier copy, parents first, until the shared tier's admission says no.
  The step pins its block until it completes, so that its first-tier bytes stay put while they are sent.
- fetches (`fetch`, called by the load planner with `shared_end`: the caller asked the store which blocks
  after the local prefix it holds). Staged, a fetched block enters the directory like a promoted one (a
  WRITING first-tier copy, pinned, then a GET); a fetch that fails or finds the value gone, corrupt or
  foreign completes not OK, and the block leaves with its descendants: a miss. With `stage_loads` off it is
  read straight into the caller and stays out of the directory: no first-tier slot to make room in on the
  request's path, and the request's store gives it one, as it does any block it computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.directory.blocks import Block, CopyState
from kvtier.directory.plan import CALLER, Op, Plan, Step
from kvtier.directory.room import Room
from kvtier.directory.stats import DirectoryStats
from kvtier.directory.tiers import SharedSpec
from kvtier.policies.base import DEFAULT_PRIORITY


class SharedTierPlans:
    def __init__(self, spec: SharedSpec, room: Room, stats: DirectoryStats, clock: Callable[[], float],
                 stage_loads: bool) -> None:
        self.spec = spec
        self.name = spec.name
        self.room = room
        self.table = room.table
        self.ledger = room.ledger
        self.stats = stats
        self.clock = clock
        self.stage_loads = stage_loads  # fetched blocks go through a first-tier slot (or straight to the caller)

    def offer(self, block: Block, chains: list, route: bytes | None, new: bool) -> bool:
        """Plan writing `block` through from the first tier to the shared tier; False once admission refuses
        (its descendants would be orphans there). A new block's step is appended to its own chain (`chains`
        is that chain) after its PUT; an existing block's is a chain of its own, appended to `chains`."""
        shared, first = self.spec, self.table.tiers[0]
        copy = block.copies.get(first.name)
        if copy is None or block.retiring or (copy.state is not CopyState.READY and not new):
            return True  # no bytes in the first tier to send (the shared tier may hold it anyway)
        # an existing block is most likely in the shared tier already: it spends none of the byte budget
        nbytes = shared.block_bytes if new else 0
        reason = shared.admission.reject_reason(block.priority, block.seen, nbytes, self.clock())
        if reason is not None:
            self.stats.admission_rejects[(shared.name, reason)] += 1
            return False
        # Pinned, not just held (readers): no copy of the shared tier keeps it in the directory, and a failed
        # PUT removes its first-tier copy at once; the pin keeps this very block (retiring, if it was dropped)
        # until the step completes, so that no later block of the same key takes the completion for its own.
        # Its first-tier copy stays put (and its slot unused by others) as long as the pin.
        block.pins += 1
        step = self.ledger.step(Op.COPY, block.key, first.name, shared.name, copy.slot, None, parent=block.parent,
                                needs_prev=new)
        step.route = route
        self.ledger.pin(step)
        chains.append(step if new else [step])
        self.stats.planned_moves[(first.name, shared.name)] += 1
        return True

    def fetch(self, plan: Plan, keys: Sequence[bytes], shared_end: int, parent: bytes | None,
              route: bytes | None) -> list[Block]:
        """Extend a load past its local prefix with blocks fetched from the shared tier (module docstring).

        `parent` is the key before `keys[0]` (the caller's own prefix), if any. A staged block whose parent is in
        no tier of ours (the engine holds it, we do not) is served to this request but not kept: kept, it would
        be an orphan. It retires once the load is done. `route` goes on every fetch (`Directory.plan_load`)."""
        table, first = self.table, self.table.tiers[0]
        fetched: list[Block] = []
        for i in range(len(plan.keys), min(shared_end, len(keys))):
            key = keys[i]
            parent = keys[i - 1] if i else parent
            if key in table.blocks or key in table.retiring:  # here, but not readable: a transfer is on it
                break
            if self.stage_loads:
                room = self.room.make(first, key, plan)
                if room is None:
                    break
                slot, chain = room
                block = Block(key, parent, DEFAULT_PRIORITY, seen=table.sightings.take(key, 0) + 1, pins=1)
                if parent is None or parent in table.blocks:
                    table.link(block)
                else:  # the engine's prefix, or a block making room just dropped: this request's only
                    table.retire(block)
                self.room.stage(block, self.name, None, slot, chain, i, plan)
                fetched.append(block)
            else:
                plan.chains.append([self.ledger.step(Op.GET, key, self.name, CALLER, index=i)])
            plan.keys.append(key)
            plan.sources.append(self.name)
        for chain in plan.chains:
            for step in chain:
                if step.src == self.name:
                    step.route = route
        return fetched

    def step_done(self, step: Step) -> bool:
        """True if `step` was a write-through to the shared tier (now done): its pin is released."""
        if not self.ledger.release_pin(step):
            return False
        self.table.unpin([step.key])
        return True
