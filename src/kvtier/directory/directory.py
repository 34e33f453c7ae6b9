"""The directory: the metadata plane. Which key lives in which tier, in which state, and what to move.

Pure Python and deterministic: no I/O, no torch, no threads of its own. The in-process cache, the vLLM
connector's scheduler half and the simulator all drive this same class, so what is simulated is what runs.

It plans loads (pin the readable prefix, stage blocks of slower tiers through the first, or with
`stage_loads=False` read them straight into the caller) and stores (new blocks into the first tier, written
through where configured; with `stage_loads=False`, a block a load read from a slower tier is promoted
into the first when it is stored), hands the plans to the mover, and applies the mover's reports in
`complete`. The rules that keep the tiers consistent are the block table's (`kvtier.directory.table`); the
shared tier's part of the plans is `kvtier.directory.shared`'s.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from kvtier.directory.plan import CALLER, Op, Plan, Status, Step
from kvtier.directory.shared import SharedTierPlans
from kvtier.directory.state import Block, Copy, SharedSpec, State, Tier, TierSpec
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.stores.base import TierKind


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int
    sightings_needed: int  # by admission now: `min_sightings: auto` moves it between 1 and 2


class Directory(SharedTierPlans):
    def __init__(
        self,
        tiers: Sequence[TierSpec],
        clock: Callable[[], float] = time.monotonic,
        sightings_capacity: int | None = None,
        shared: SharedSpec | None = None,
        stage_loads: bool = True,
    ) -> None:
        """`stage_loads=False`: a load reads a slower tier's block (local or shared) straight into the caller (no
        first-tier slot to make room in, no victim to write down first, on the request's path); the next store
        of a block read that way gives it a first-tier copy, off that path. The vLLM connector loads this way."""
        names = [t.name for t in tiers] + ([shared.name] if shared is not None else [])
        if len(set(names)) != len(names) or CALLER in names:
            raise ValueError(f"tier names must be unique and not {CALLER!r}: {names}")
        super().__init__(tiers, clock, sightings_capacity, shared)
        self.stage_loads = stage_loads
        self._read_below: OrderedDict[bytes, None] = OrderedDict()  # read from a slower tier, not yet promoted

    def record_lookup(self, sources: Sequence[str], total_blocks: int) -> None:
        """Count a request's lookup result by source (hits per tier, the rest as misses)."""
        counter = self.stats.lookup_blocks
        for name in sources:
            counter[name] += 1
        counter["miss"] += total_blocks - len(sources)

    @property
    def names(self) -> list[str]:
        """Every tier's name, fastest first, the shared tier last."""
        return [t.name for t in self.tiers] + ([self.shared.name] if self.shared is not None else [])

    def kind(self, tier_name: str) -> TierKind:
        """The medium of a tier (local or shared) by its name."""
        if self.shared is not None and tier_name == self.shared.name:
            return self.shared.kind
        return self.tier[tier_name].spec.kind

    def usage(self) -> dict[str, TierUsage]:
        """Bytes used and configured, per local tier: what the metrics of every driver export."""
        return {t.name: TierUsage(t.used_bytes, t.capacity_bytes, t.spec.admission.sightings_needed)
                for t in self.tiers}

    def drop_all(self) -> None:
        """Forget every block (the engine's weights changed): each leaves as any dropped block does, its copies
        freed once no transfer touches them, its files deleted (`take_garbage`)."""
        for block in list(self._blocks.values()):
            if block.key in self._blocks:  # not dropped already, as a descendant
                self._drop(block)
        self._sightings.clear()
        self._read_below.clear()

    # ---------------------------------------------------------------- loads

    def plan_load(self, keys: Sequence[bytes], shared_end: int = 0, parent: bytes | None = None,
                  skip: AbstractSet[str] = frozenset()) -> Plan:
        """Pin the readable prefix and plan its way to the caller; blocks in slower tiers are staged in the first
        (unless `stage_loads` is off: then read straight into the caller).

        `shared_end`: the shared tier holds `keys[:shared_end]` beyond the local prefix (the caller asked it,
        outside the directory); those blocks are fetched through the first tier after the local prefix, as far
        as room allows. A stale answer costs a failed fetch (a miss), never a wrong block. `parent`: the key
        before `keys[0]`, when the caller holds a prefix of the chain itself. `skip`: tiers this load must not
        read (the guard's route for its request).
        """
        sources = self.lookup(keys, skip)
        first = self.tiers[0]
        plan = Plan(chains=[], keys=list(keys[: len(sources)]), sources=sources)
        for key in plan.keys:
            self._blocks[key].pins += 1
        promoted: list[Block] = []
        whole = True  # the local prefix is planned to its end: fetches may follow it
        for i, (key, source) in enumerate(zip(plan.keys, sources)):
            block = self._blocks[key]
            block.seen += 1
            below = source != first.name
            if below:
                self.tier[source].spec.admission.came_back()
            if not below or not self.stage_loads:  # pinned: its copy there stays until the GET is done
                plan.chains.append([self._step(Op.GET, key, source, CALLER, src_slot=block.copies[source].slot,
                                               index=i)])
                if below:
                    self._remember_read_below(key)
                continue
            # another load is staging it (its slot is taken, its bytes not there yet), or there is no room
            room = None if first.name in block.copies else self._room(first, key, plan)
            if room is None:
                self._unpin(plan.keys[i:])
                del plan.keys[i:], plan.sources[i:]
                whole = False
                break
            slot, chain = room
            self._stage(block, source, block.copies[source].slot, slot, chain, i, plan)
            promoted.append(block)
        fetch = whole and self.shared is not None and self.shared.name not in skip
        fetched = self._plan_fetch(plan, keys, shared_end, parent) if fetch else []
        # Making room may have evicted an ancestor the load does not pin (the engine's own hit), dropping blocks
        # of this load with it: they are still served to this request (pinned), but retire after it and never
        # enter a policy. Fetched blocks go in leaf first: ancestors end up more recent than descendants.
        for block in [*promoted, *reversed(fetched)]:
            if not block.retiring:
                first.policy.insert(block.key, block.priority)
        self._touch_chain([self._blocks[k] for k in plan.keys if k in self._blocks])
        return plan

    def _remember_read_below(self, key: bytes) -> None:
        """A block a load read from a slower tier, for its next store to promote (bounded: the oldest are
        forgotten)."""
        self._read_below[key] = None
        self._read_below.move_to_end(key)
        if len(self._read_below) > max(1024, self.tiers[0].capacity_blocks):
            self._read_below.popitem(last=False)

    def finish_load(self, plan: Plan) -> None:
        """Unpin a load's prefix once the caller holds its bytes: every block it pinned, which is every block but
        those read straight from the shared tier (none of ours; a store may have added one since, pinned by
        others)."""
        unstaged = self.shared.name if self.shared is not None and not self.stage_loads else None
        self._unpin([key for key, source in zip(plan.keys, plan.sources) if source != unstaged])

    # ---------------------------------------------------------------- stores

    def plan_store(
        self, keys: Sequence[bytes], parent: bytes | None = None, priority: int = DEFAULT_PRIORITY
    ) -> Plan:
        """Plan storing the blocks of one chain (`keys[i]`'s parent is `keys[i-1]`, the first's is `parent`).

        Blocks already present are touched. The chain stops at the first block that is not admitted or finds
        no room: storing its descendants would create orphans.

        With a shared tier, every block of the chain that has a first-tier copy (new or not) is also written
        through to it, parents first, until the shared tier's admission refuses one. Its step is the last of
        the block's chain (or a chain of its own); the mover runs these steps as batches after the rest of
        the plan, and skips the blocks the shared tier already holds.
        """
        first = self.tiers[0]
        plan = Plan(chains=[])
        if first.name in self.disabled:
            self.stats.stores_dropped["tier_off"] += sum(1 for key in keys if key not in self._blocks)
            return plan
        # write-through to the shared tier, until its admission says no
        offer = self.shared is not None and self.shared.name not in self.disabled
        through = [t for t in self.tiers[1:] if t.spec.write_through and t.name not in self.disabled]
        chain_blocks: list[Block] = []
        new: set[bytes] = set()
        promoted: set[bytes] = set()  # blocks only slower tiers held, now given a first-tier copy too
        held: list[bytes] = []  # the chain's existing blocks stay put while we make room for the new ones
        if parent is not None and (parent_block := self._blocks.get(parent)) is not None:
            held.append(parent)
            parent_block.pins += 1
        parent_key = parent
        for i, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is not None:
                block.seen += 1
                chain_blocks.append(block)
                held.append(key)
                block.pins += 1
                parent_key = key
                if key in self._read_below and self._promote(block, i, plan):
                    promoted.add(key)
                if offer:
                    offer = self._offer_shared(block, plan.chains, new=False)
                continue
            reason = self._store_refusal(key, parent_key, priority, first)
            if reason is not None:
                self.stats.stores_dropped[reason] += len(keys) - i
                for later in keys[i + 1 :]:  # seen too: with "store on the second sighting", the next request
                    if later not in self._blocks:  # stores the whole chain, not one more block
                        self._sight(later)
                break
            room = self._room(first, key, plan, dropped=len(keys) - i)
            if room is None:
                break
            slot, chain = room
            if parent_key is not None and parent_key not in self._blocks:  # making room dropped the parent
                self._give_back(first, slot, chain, plan)
                self.stats.stores_dropped["orphan"] += len(keys) - i
                break
            block = Block(key, parent_key, priority, seen=self._sightings.pop(key, 1))
            self._link(block)
            self._plan_put(block, slot, chain, i)
            for tier in through:
                self._copy_down(block, first, tier, chain, needs_prev=True)
            if offer:
                offer = self._offer_shared(block, chain, new=True)
            plan.chains.append(chain)
            chain_blocks.append(block)
            new.add(key)
            parent_key = key
        self._unpin(held)
        self._order_stored(chain_blocks, new, promoted)
        return plan

    def _promote(self, block: Block, index: int, plan: Plan) -> bool:
        """A first-tier copy of a block a load read from a slower tier, PUT from the caller's bytes (its
        `index`-th block), if room can be made without dropping a store. Only a block at rest in slower tiers:
        while one of its copies is being written, a step of the chain that writes it may still count on the
        first-tier copy it had (a failed PUT's write-through)."""
        del self._read_below[block.key]
        first = self.tiers[0]
        if first.name in block.copies or any(c.state is not State.READY for c in block.copies.values()):
            return False
        room = self._room(first, block.key, plan, dropped=0)
        if room is None:
            return False
        slot, chain = room
        if self._blocks.get(block.key) is not block:  # making room dropped an ancestor, and this block with it
            self._give_back(first, slot, chain, plan)
            return False
        self._plan_put(block, slot, chain, index)
        plan.chains.append(chain)
        return True

    def _plan_put(self, block: Block, slot: int | None, chain: list[Step], index: int) -> None:
        """A first-tier copy of `block` in `slot`, written from the caller's `index`-th block."""
        first = self.tiers[0]
        block.copies[first.name] = Copy(slot, State.WRITING)
        first.used_blocks += 1
        chain.append(self._step(Op.PUT, block.key, CALLER, first.name, dst_slot=slot, index=index,
                                parent=block.parent))
        self.stats.planned_moves[(CALLER, first.name)] += 1

    def _order_stored(self, blocks: Sequence[Block], new: set[bytes], promoted: set[bytes]) -> None:
        """Insert a stored chain's new copies into their tiers' policies (every copy of a new block, the first-tier
        copy of a promoted one), touch the others; leaf first, so that ancestors end up more recent than
        descendants."""
        first = self.tiers[0].name
        for block in reversed(blocks):
            if self._blocks.get(block.key) is not block:  # dropped while planning (retiring until its steps end)
                continue
            for name, copy in block.copies.items():
                policy = self.tier[name].policy
                if block.key in new or (name == first and block.key in promoted):
                    policy.insert(block.key, block.priority)
                elif copy.state is State.READY and block.key in policy:
                    policy.touch(block.key)

    def _store_refusal(self, key: bytes, parent_key: bytes | None, priority: int, first: Tier) -> str | None:
        if key in self._retiring:
            return "retiring"
        if parent_key is not None and parent_key not in self._blocks:
            return "orphan"
        seen = self._sight(key)
        if seen > 1:  # reuse that no tier held
            for tier in self.tiers[1:]:
                tier.spec.admission.came_back()
        reason = first.spec.admission.reject_reason(priority, seen, first.spec.block_bytes, self.clock())
        if reason is not None:
            self.stats.admission_rejects[(first.name, reason)] += 1
            return "admission"
        return None

    # ---------------------------------------------------------------- completions

    def complete(self, step: Step, status: Status) -> None:
        """The mover finished `step`. Only now does a copy become readable or a slot reusable."""
        if step.op is Op.DELETE:
            self._delete_done(step, ok=status is Status.OK)
            return
        if self._shared_step_done(step):
            return
        if step.dst == CALLER and self.shared is not None and step.src == self.shared.name:
            return  # a fetch read straight into the caller: no block of ours
        holds = step.id in self._holding
        self._holding.discard(step.id)
        block = self._blocks.get(step.key) or self._retiring.get(step.key)
        if block is None:
            return
        if holds and (src := block.copies.get(step.src)) is not None:
            src.readers -= 1
        if status is Status.SOURCE_LOST and step.src in block.copies:  # gone behind our back, or a demotion's
            self._remove_copy(block, self.tier[step.src], already_deleted=True)  # source already left
            self.stats.evictions[(step.src, "lost")] += 1
        if step.op is Op.GET:
            if not block.copies and not block.retiring:
                self._drop(block)
            return
        dst = block.copies.get(step.dst)
        if dst is not None and dst.state is State.WRITING:
            if status is Status.OK:
                dst.state = State.READY  # a dropped block's copy is released below, once no transfer reads it
                if self.on_change is not None and not block.retiring:
                    self.on_change(step.key, step.dst, True)
            else:
                self._remove_copy(block, self.tier[step.dst], already_deleted=status is not Status.OK)
        if block.retiring:
            self._release_idle(block)
        elif not block.copies:
            self._drop(block)

    # ---------------------------------------------------------------- restart recovery

    def adopt(self, tier_name: str, blocks: Iterable[tuple[bytes, bytes | None]]) -> list[Step]:
        """Take back blocks a restart found in a persistent tier (oldest first). Returns deletes (and nothing
        else) for the rest: orphans, and whatever exceeds the tier's capacity (dropped, not demoted: nothing
        runs the copies of a restart). Blocks the directory already has there are skipped."""
        tier = self.tier[tier_name]
        deletes: list[Step] = []
        found = list(blocks)
        known = {key for key, _ in found} | set(self._blocks)
        adopted: list[Block] = []
        for key, parent in found:
            if key in self._blocks and tier_name in self._blocks[key].copies:
                continue
            if parent is not None and parent not in known:
                deletes.append(self._delete(tier_name, key))
                continue
            block = self._blocks.get(key) or Block(key, parent, DEFAULT_PRIORITY)
            block.copies[tier_name] = Copy(None, State.READY)
            tier.used_blocks += 1
            tier.policy.insert(key, block.priority)
            if key not in self._blocks:
                self._blocks[key] = block
                adopted.append(block)
        for block in adopted:
            self._link(block)
        for block in adopted:  # a parent that was on disk but not valid leaves orphans behind
            if block.key in self._blocks and block.parent is not None and block.parent not in self._blocks:
                self._drop(block)
        while tier.used_blocks > tier.capacity_blocks:
            victim = self._pick_victim(tier, None)
            if victim is None:
                break
            self._evict(tier, victim, deletes, reason="capacity", demote=False)
        for step in deletes:  # no write follows these: their files count until they are really gone
            if step.src == tier_name and step.id not in self._accounted:
                self._accounted.add(step.id)
                tier.used_blocks += 1
        return deletes + self.take_garbage()
