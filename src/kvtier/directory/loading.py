"""Planning a load: pin the readable prefix and plan its way to the caller.

A block in the first tier is read from there. A block only a slower tier holds is staged through a new
first-tier slot (a promotion), or, with `stage_loads` off, read straight into the caller and remembered, so
that the request's store gives it a first-tier copy off the request's path (the vLLM connector loads this
way). After the local prefix, the shared tier's blocks are fetched (`SharedTierPlans.fetch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from kvtier.directory.blocks import Block
from kvtier.directory.plan import CALLER, Op, Plan, Step
from kvtier.directory.recency import Recency
from kvtier.directory.room import Room
from kvtier.directory.shared import SharedTierPlans


class LoadPlanner:
    def __init__(self, room: Room, shared: SharedTierPlans | None, read_below: Recency[bytes, None],
                 stage_loads: bool) -> None:
        self.room = room
        self.table = room.table
        self.ledger = room.ledger
        self.shared = shared
        self.read_below = read_below  # read from a slower tier, not yet promoted
        self.stage_loads = stage_loads

    def plan(self, keys: Sequence[bytes], shared_end: int = 0, parent: bytes | None = None,
             skip: AbstractSet[str] = frozenset(), route: bytes | None = None) -> Plan:
        """See `Directory.plan_load`."""
        table = self.table
        sources = table.lookup(keys, skip)
        first = table.tiers[0]
        plan = Plan(chains=[], keys=list(keys[: len(sources)]), sources=sources)
        hit = [table.blocks[key] for key in plan.keys]
        for block in hit:
            block.pins += 1
        lead = self._read_first(hit, plan)
        promoted: list[Block] = []
        whole = True  # the local prefix is planned to its end: fetches may follow it
        for i in range(lead, len(hit)):
            block, key, source = hit[i], plan.keys[i], sources[i]
            block.seen += 1
            below = source != first.name
            if below:
                table.tier[source].spec.admission.came_back()
            if not below or not self.stage_loads:  # pinned: its copy there stays until the GET is done
                plan.chains.append([self.ledger.step(Op.GET, key, source, CALLER,
                                                     src_slot=block.copies[source].slot, index=i)])
                if below:
                    self.read_below.set(key, None)
                continue
            # another load is staging it (its slot is taken, its bytes not there yet), or there is no room
            room = None if first.name in block.copies else self.room.make(first, key, plan)
            if room is None:
                table.unpin(plan.keys[i:])
                del plan.keys[i:], plan.sources[i:]
                whole = False
                break
            slot, chain = room
            self.room.stage(block, source, block.copies[source].slot, slot, chain, i, plan)
            promoted.append(block)
        shared = self.shared
        fetched = (shared.fetch(plan, keys, shared_end, parent, route) if whole and shared and shared.name not in skip
                   else [])
        # Making room may have evicted an ancestor the load does not pin (the engine's own hit), dropping blocks
        # of this load with it: they are still served to this request (pinned), but retire after it and never
        # enter a policy. Fetched blocks go in leaf first: ancestors end up more recent than descendants.
        for block in [*promoted, *reversed(fetched)]:
            if not block.retiring:
                first.policy.insert(block.key, block.priority)
        table.touch_chain([table.blocks[k] for k in plan.keys if k in table.blocks])
        return plan

    def _read_first(self, hit: list[Block], plan: Plan) -> int:
        """The GETs of the leading blocks the first tier holds (most loads' whole prefix), planned in bulk: how
        many. What the loop in `plan` would plan for each, one by one."""
        name = self.table.tiers[0].name
        lead = next((i for i, source in enumerate(plan.sources) if source != name), len(plan.sources))
        ids = self.ledger.take_ids(lead)
        plan.chains += [[Step(Op.GET, block.key, name, CALLER, block.copies[name].slot, None, i, None, False, step_id)]
                        for i, block, step_id in zip(range(lead), hit, ids)]
        for block in hit[:lead]:
            block.seen += 1
        return lead

    def finish(self, plan: Plan) -> None:
        """See `Directory.finish_load`."""
        if self.shared is None or self.stage_loads:
            self.table.unpin(plan.keys)
            return
        unstaged = self.shared.name  # read straight into the caller: never pinned (no block of ours)
        self.table.unpin([key for key, source in zip(plan.keys, plan.sources) if source != unstaged])
