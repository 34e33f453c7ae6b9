"""Planning a store: new blocks of one chain into the first tier, written through where configured.

The chain stops at the first block that is not admitted or finds no room: storing its descendants would
create orphans. Blocks already present are touched; one a load read straight from a slower tier is given a
first-tier copy from the caller's bytes (a promotion off the request's path). With a shared tier, every
block of the chain that has a first-tier copy is offered to it, parents first, until its admission refuses.

The common case of a long prompt's store, a run of new blocks that the first tier admits as they are and has
room for (free, or made by evictions found in one walk), with nothing written through, is planned as one run
(`_run`): what the per-block path would plan, in bulk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvtier.directory.blocks import Block, Copy, CopyState
from kvtier.directory.plan import CALLER, Op, Plan, Step
from kvtier.directory.recency import Recency
from kvtier.directory.room import Room
from kvtier.directory.shared import SharedTierPlans
from kvtier.directory.stats import DirectoryStats
from kvtier.directory.tiers import Tier
from kvtier.policies.base import DEFAULT_PRIORITY


class StorePlanner:
    def __init__(self, room: Room, shared: SharedTierPlans | None, read_below: Recency[bytes, None],
                 stats: DirectoryStats) -> None:
        self.room = room
        self.table = room.table
        self.shared = shared
        self.read_below = read_below
        self.stats = stats

    def plan(self, keys: Sequence[bytes], parent: bytes | None = None, priority: int = DEFAULT_PRIORITY,
             route: bytes | None = None) -> Plan:
        """See `Directory.plan_store`."""
        table, disabled = self.table, self.room.disabled
        first = table.tiers[0]
        plan = Plan(chains=[])
        if first.name in disabled:
            self.stats.stores_dropped["tier_off"] += sum(1 for key in keys if key not in table.blocks)
            return plan
        shared = self.shared if self.shared is not None and self.shared.name not in disabled else None
        if shared is None and (whole := self._had_whole(keys)) is not None:
            self._touch_whole(whole)
            return plan
        through = [t for t in table.tiers[1:] if t.spec.write_through and t.name not in disabled]
        chain_blocks: list[Block] = []
        new: set[bytes] = set()
        promoted: set[bytes] = set()  # blocks only slower tiers held, now given a first-tier copy too
        held: list[bytes] = []  # the chain's existing blocks stay put while we make room for the new ones
        bulk = not through and shared is None  # the new blocks may be planned as one run (`_run`)
        run: list[Block] = []
        if parent is not None and (parent_block := table.blocks.get(parent)) is not None:
            held.append(parent)
            parent_block.pins += 1
        parent_key = parent
        for i, key in enumerate(keys):
            block = table.blocks.get(key)
            if block is not None:
                chain_blocks.append(block)
                held.append(key)
                parent_key = key
                if self._existing(block, i, plan):
                    promoted.add(key)
                if shared is not None and not shared.offer(block, plan.chains, route, new=False):
                    shared = None  # write-through stops where the shared tier's admission says no
                continue
            if bulk and (run := self._run(keys, i, parent_key, priority, plan)):
                break
            bulk = False  # tried once: a run that cannot be one here will not become one further on
            made = self._new(keys, i, parent_key, priority, plan)
            if made is None:
                break
            block, chain = made
            for tier in through:
                self.room.copy_down(block, first, tier, chain, needs_prev=True)
            if shared is not None and not shared.offer(block, chain, route, new=True):
                shared = None
            plan.chains.append(chain)
            chain_blocks.append(block)
            new.add(key)
            parent_key = key
        table.unpin(held)
        first.policy.insert_many([block.key for block in reversed(run)], priority)  # the leaf end of the chain
        self._order_stored(chain_blocks, new, promoted)
        return plan

    def _had_whole(self, keys: Sequence[bytes]) -> list[Block] | None:
        """The chain's blocks, each seen again, if the directory has every one and no load read any from a slower
        tier: a hit's request ending, which leaves nothing to store or promote, and no room to make (so no block to
        hold while it is made). None otherwise: the per-block loop decides."""
        blocks = self.table.blocks
        if not keys or keys[-1] not in blocks:  # a chain with a new block: most stores, decided at once
            return None
        found = list(map(blocks.get, keys))
        if None in found or not self.read_below.isdisjoint(keys):
            return None
        whole = cast(list[Block], found)
        for block in whole:
            block.seen += 1
        return whole

    def _existing(self, block: Block, index: int, plan: Plan) -> bool:
        """A block of the chain the directory has: seen again, held while room is made for the new ones, and
        promoted if a load read it from a slower tier (True)."""
        block.seen += 1
        block.pins += 1
        return block.key in self.read_below and self._promote(block, index, plan)

    def _new(self, keys: Sequence[bytes], i: int, parent_key: bytes | None, priority: int,
             plan: Plan) -> tuple[Block, list[Step]] | None:
        """`keys[i]`, a block the directory has not, given a first-tier copy written from the caller's `i`-th
        block: the block and the chain that writes it; None when it is not stored (nor is any after it)."""
        table, first = self.table, self.table.tiers[0]
        key, left = keys[i], len(keys) - i
        reason = self._refusal(key, parent_key, priority, first)
        if reason is not None:
            self.stats.stores_dropped[reason] += left
            for later in keys[i + 1 :]:  # seen too: with "store on the second sighting", the next request
                if later not in table.blocks:  # stores the whole chain, not one more block
                    table.sightings.sight(later)
            return None
        made = self.room.make(first, key, plan, dropped=left)
        if made is None:
            return None
        slot, chain = made
        if parent_key is not None and parent_key not in table.blocks:  # making room dropped the parent
            self.room.give_back(first, slot, chain, plan)
            self.stats.stores_dropped["orphan"] += left
            return None
        block = Block(key, parent_key, priority, seen=table.sightings.take(key, 1))
        table.link(block)
        self.room.put(block, slot, chain, i)
        return block, chain

    def _run(self, keys: Sequence[bytes], i: int, parent_key: bytes | None, priority: int,
             plan: Plan) -> list[Block]:
        """`keys[i:]`, all new, stored as `_new` would store them one by one, if nothing could tell them apart: the
        first tier admits each as it is (no sightings counted, no byte budget, the priority high enough) and has
        room for all, free or made by evictions `Room.victims` finds in one walk; none is retiring or repeated,
        the parent is here. Else none (`[]`)."""
        table, first = self.table, self.table.tiers[0]
        n, admission = len(keys) - i, first.spec.admission
        take = min(n, first.capacity_blocks - first.used_blocks)  # free room; the rest is made by evictions
        if (n < 2 or table.sightings.counting or admission.max_bytes_per_s is not None
                or priority < admission.min_priority or admission.sightings_needed > 1
                or (first.slotted and len(first.free_slots) < take)
                or (parent_key is not None and parent_key not in table.blocks)):
            return []
        rest, blocks, retiring = keys[i:], table.blocks, table.retiring
        if not blocks.keys().isdisjoint(rest) or not retiring.keys().isdisjoint(rest) or len(set(rest)) < n:
            return []
        if take < n and not first.slotted:  # a file's eviction adds a step to the chain
            return []
        victims = self.room.victims(first, n - take) if take < n else []
        if victims is None:
            return []
        slots: Sequence[int | None] = [None] * n
        if first.slotted:  # as many `pop()`s would give them: the free slots, then each victim's as it leaves
            free_slots = first.free_slots
            taken = free_slots[: -take - 1 : -1]
            del free_slots[len(free_slots) - take :]
            self.room.drop_victims(first, victims)
            made = free_slots[len(free_slots) - len(victims) :]
            del free_slots[len(free_slots) - len(victims) :]
            slots = taken + made
        writing, name = CopyState.WRITING, first.name
        run = [Block(key, parent, priority, {name: Copy(slot, writing)})
               for key, parent, slot in zip(rest, [parent_key, *rest[:-1]], slots)]
        for block, child in zip(run, rest[1:]):
            block.children = child
        table.link(run[0])
        blocks.update(zip(rest, run))
        ids = table.ledger.take_ids(n)
        plan.chains += [[Step(Op.PUT, block.key, CALLER, name, None, slot, index, block.parent, False, step_id)]
                        for block, slot, index, step_id in zip(run, slots, range(i, i + n), ids)]
        first.used_blocks += n
        self.stats.planned_moves[(CALLER, name)] += n
        return run

    def _promote(self, block: Block, index: int, plan: Plan) -> bool:
        """A first-tier copy of a block a load read from a slower tier, PUT from the caller's bytes (its
        `index`-th block), if room can be made without dropping a store. Only a block at rest in slower tiers:
        while one of its copies is being written, a step of the chain that writes it may still count on the
        first-tier copy it had (a failed PUT's write-through)."""
        self.read_below.pop(block.key, None)
        first = self.table.tiers[0]
        if first.name in block.copies or any(c.state is not CopyState.READY for c in block.copies.values()):
            return False
        made = self.room.make(first, block.key, plan, dropped=0)
        if made is None:
            return False
        slot, chain = made
        if self.table.blocks.get(block.key) is not block:  # making room dropped an ancestor, and this block too
            self.room.give_back(first, slot, chain, plan)
            return False
        self.room.put(block, slot, chain, index)
        plan.chains.append(chain)
        return True

    def _order_stored(self, blocks: Sequence[Block], new: set[bytes], promoted: set[bytes]) -> None:
        """Insert a stored chain's new copies into their tiers' policies (every copy of a new block, the first-tier
        copy of a promoted one), touch the others; leaf first, so that ancestors end up more recent than
        descendants."""
        table = self.table
        if not new and not promoted and self._touch_whole(blocks):
            return
        first = table.tiers[0].name
        for block in reversed(blocks):
            if table.blocks.get(block.key) is not block:  # dropped while planning (retiring until its steps end)
                continue
            for name, copy in block.copies.items():
                policy = table.tier[name].policy
                if block.key in new or (name == first and block.key in promoted):
                    policy.insert(block.key, block.priority)
                elif copy.state is CopyState.READY and block.key in policy:
                    policy.touch(block.key)

    def _touch_whole(self, blocks: Sequence[Block]) -> bool:
        """What `_order_stored` does for a chain the directory had whole (a hit's request ending), each tier's
        touches in one call: with nothing inserted, only each policy's own order counts. True: done."""
        table, ready = self.table, CopyState.READY
        live = [block for block in reversed(blocks) if table.blocks.get(block.key) is block]
        for tier in table.tiers:
            name, policy = tier.name, tier.policy
            policy.touch_many([block.key for block in live if (copy := block.copies.get(name)) is not None
                               and copy.state is ready and block.key in policy])
        return True

    def _refusal(self, key: bytes, parent_key: bytes | None, priority: int, first: Tier) -> str | None:
        """Why a new block is not stored (None: it is)."""
        table = self.table
        if key in table.retiring:
            return "retiring"
        if parent_key is not None and parent_key not in table.blocks:
            return "orphan"
        seen = table.sightings.sight(key)
        if seen > 1:  # reuse that no tier held
            for tier in table.tiers[1:]:
                tier.spec.admission.came_back()
        reason = first.spec.admission.reject_reason(priority, seen, first.spec.block_bytes, self.room.clock())
        if reason is not None:
            self.stats.admission_rejects[(first.name, reason)] += 1
            return "admission"
        return None
