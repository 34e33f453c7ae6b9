"""Room in a tier: eviction by the tier's policy, demotion of what it evicts, and copies into a tier.

Invariants kept here: every tier stays within its bytes; a pinned, writing or being-read copy is never
evicted; eviction prefers blocks whose loss orphans nothing; a slot is reused only after the step that
moves its old bytes out (the victim's demotion comes first in the same chain).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from collections.abc import Set as AbstractSet
from typing import cast

from kvtier.directory.blocks import Block, Copy, CopyState
from kvtier.directory.ledger import StepLedger
from kvtier.directory.plan import CALLER, Op, Plan, Step
from kvtier.directory.stats import DirectoryStats
from kvtier.directory.table import BlockTable
from kvtier.directory.tiers import Tier

LEAF_SCAN = 32  # how many evictable candidates to look past for one whose loss orphans nothing


class NoRoom(Exception):
    """Every block that could make room is pinned or in flight."""


class Room:
    def __init__(self, table: BlockTable, stats: DirectoryStats, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.ledger: StepLedger = table.ledger
        self.tiers = table.tiers
        self.stats = stats
        self.clock = clock
        self.disabled = frozenset()

    @property
    def disabled(self) -> frozenset[str]:
        """Tiers nothing new is written to (the guard turned them off)."""
        return self._disabled

    @disabled.setter
    def disabled(self, names: AbstractSet[str]) -> None:
        self._disabled = frozenset(names)  # and per tier, where its evictions go (None: dropped)
        self._demote_to = [next((t for t in self.tiers[i + 1 :] if t.name not in names), None)
                           for i in range(len(self.tiers))]

    # ---------------------------------------------------------------- room

    def allocate(self, tier: Tier, chain: list[Step], incoming: bytes) -> int | None:
        """Room for one block in `tier`, evicting as needed; the slot (slotted tiers) or None. Raises NoRoom."""
        while tier.full:
            victim = self.pick_victim(tier, incoming)
            if victim is None:
                raise NoRoom(tier.name)
            self.evict(tier, victim, chain, reason="capacity")
        if not tier.slotted:
            return None
        return tier.free_slots.pop()  # LIFO: the victim's slot, reused only after its demotion step in `chain`

    def make(self, tier: Tier, key: bytes, plan: Plan, dropped: int = 1) -> tuple[int | None, list[Step]] | None:
        """`allocate` for a new chain of `plan`: the slot and the chain that makes room, or None when nothing can
        make room (`dropped` stores counted; evictions planned before we ran out still happen)."""
        chain: list[Step] = []
        try:
            return self.allocate(tier, chain, key), chain
        except NoRoom:
            if dropped:
                self.stats.stores_dropped["no_space"] += dropped
            if chain:
                plan.chains.append(chain)
            return None

    def give_back(self, tier: Tier, slot: int | None, chain: list[Step], plan: Plan) -> None:
        """Room was made, but nothing will be written there: return it, keep the evictions."""
        self.unallocate(tier, slot, chain)
        if chain:
            plan.chains.append(chain)

    def unallocate(self, tier: Tier, slot: int | None, chain: list[Step], since: int = 0) -> None:
        """Give back a slot that `allocate` found but nothing will be written to. If a step of `chain` still
        reads the evicted block's bytes there (its demotion), that block keeps the slot until the step is done.

        An unslotted tier's room came from evictions whose DELETEs (in `chain[since:]`) were not counted: the
        write they made room for was to follow them in the chain. Without that write, nothing keeps another
        chain from using the room while the victims' files are still there (their DELETEs may run late): count
        those files until their DELETEs run, like any other pending delete."""
        if slot is None:
            for step in chain[since:]:
                if step.op is Op.DELETE and step.src == tier.name and self.ledger.account(step):
                    tier.used_blocks += 1
            return
        reader = next((s for s in chain if s.src == tier.name and s.src_slot == slot), None)
        block = None if reader is None else self.table.find(reader.key)
        if reader is None or block is None:
            tier.free_slots.append(slot)
            return
        block.copies[tier.name] = Copy(slot, CopyState.READY, readers=1)
        if not block.retiring:
            self.table.announce(block.key, tier.name, True)
        self.ledger.hold(reader)
        tier.used_blocks += 1
        if not block.retiring:
            tier.policy.insert(block.key, block.priority)

    # ---------------------------------------------------------------- eviction and demotion

    def pick_victim(self, tier: Tier, incoming: bytes | None) -> Block | None:
        """The policy's first evictable candidate, unless a few more on its list can go without orphaning."""
        fallback: Block | None = None
        looked = 0
        has_lower = self._demote_to[tier.index] is not None  # a demotion keeps it
        blocks = cast("dict[Hashable, Block]", self.table.blocks)  # a policy orders the keys we gave it
        name, ready = tier.name, CopyState.READY
        for key in tier.policy.candidates(incoming):
            block = blocks[key]
            copy = block.copies[name]
            if copy.state is not ready or copy.readers or block.pins:
                continue
            if has_lower or block.children is None or len(block.copies) > 1:
                return block
            fallback = fallback or block
            looked += 1
            if looked > LEAF_SCAN:
                break
        return fallback

    def victims(self, tier: Tier, want: int) -> list[Block] | None:
        """The `want` blocks that `want` calls of `allocate` would evict from `tier` one after another, if one walk
        of its policy finds them: a tier whose evictions are dropped (no tier below takes them) and whose policy
        keeps its order (`stable_order`). Each is the next evictable candidate, with no children left once the
        ones before it are gone (or another copy keeping it); None at the first candidate that would orphan
        blocks, where `pick_victim`'s search for a leaf decides, or when too few are evictable."""
        if want < 1 or self._demote_to[tier.index] is not None or not tier.policy.stable_order:
            return None
        blocks = cast("dict[Hashable, Block]", self.table.blocks)
        name, ready = tier.name, CopyState.READY
        found: list[Block] = []
        dropped: set[bytes] = set()  # victims with no other copy: they leave, and their parents lose a child
        for key in tier.policy.candidates(None):
            block = blocks[key]
            copies = block.copies
            copy = copies[name]
            if copy.state is not ready or copy.readers or block.pins:
                continue
            if len(copies) == 1:  # no other copy: it leaves, and must orphan nothing that stays
                children = block.children  # one child's key, or a set of them
                if children is not None and (children not in dropped if isinstance(children, bytes)
                                             else not dropped.issuperset(children)):
                    return None
                dropped.add(block.key)
            found.append(block)
            if len(found) == want:
                return found
        return None

    def evict(self, tier: Tier, block: Block, chain: list[Step], reason: str, demote: bool = True) -> None:
        """Take `block` out of `tier`: demote it to the next tier if admitted (and `demote`), else drop it (and
        its orphans)."""
        copy = block.copies.pop(tier.name)
        tier.policy.evicted(block.key)
        self.stats.evictions[(tier.name, reason)] += 1
        self.table.announce(block.key, tier.name, False)
        target = self._demote_to[tier.index]  # a write-through target was offered the block when it was stored
        if demote and target is not None and not any(t.name in block.copies for t in self.tiers[tier.index + 1 :]):
            self.copy_down(block, tier, target, chain, src_slot=copy.slot, offer=not target.spec.write_through)
        tier.used_blocks -= 1
        if copy.slot is not None:  # a slotted tier's
            tier.free_slots.append(copy.slot)
        else:
            chain.append(self.ledger.delete(tier.name, block.key))  # its bytes go to the incoming block
        if not block.copies and block.key in self.table.blocks:
            self.table.drop(block)

    def drop_victims(self, tier: Tier, victims: Sequence[Block]) -> None:
        """`evict` of each of `victims`, in turn, as `victims` found them (a slotted tier whose evictions are
        dropped), without what the general case needs: each victim's slot freed, and a victim with no copy left
        out of the table (a leaf by then: its children left before it)."""
        name, evicted, table = tier.name, tier.policy.evicted, self.table
        announce, free_slots, blocks = table.announce, tier.free_slots, table.blocks
        for block in victims:
            slot = block.copies.pop(name).slot
            assert slot is not None, f"drop_victims: {name} is not a slotted tier"
            evicted(block.key)
            announce(block.key, name, False)
            free_slots.append(slot)
            if not block.copies and block.key in blocks:
                table.drop_leaf(block)
        tier.used_blocks -= len(victims)
        self.stats.evictions[(name, "capacity")] += len(victims)

    def copy_down(
        self, block: Block, src: Tier, dst: Tier, chain: list[Step], src_slot: int | None = None,
        needs_prev: bool = False, offer: bool = True,
    ) -> bool:
        """Plan a copy of `block` from `src` into `dst`, if admitted and room is found. `offer`: count it among
        the blocks offered to `dst` (its adaptive admission's evidence), once per block.

        Write-through: the source copy stays resident and is held (readers) until the copy completes.
        Demotion: the source copy has already left the directory; `src_slot` is where its bytes still are.
        """
        if self.ledger.deleting(dst.name, block.key):  # the delete of its old copy, run late, would undo this write
            self.stats.stores_dropped["deleting"] += 1
            return False
        if offer:
            dst.spec.admission.offered()
        reason = dst.spec.admission.reject_reason(block.priority, block.seen, dst.spec.block_bytes, self.clock())
        if reason is not None:
            self.stats.admission_rejects[(dst.name, reason)] += 1
            return False
        since = len(chain)  # the steps `allocate` adds: what `unallocate` has to take back
        try:
            room = self.allocate(dst, chain, block.key)
        except NoRoom:
            self.stats.stores_dropped["no_space"] += 1
            return False
        if block.key not in self.table.blocks:  # making room in dst dropped an ancestor, and with it this block
            self.unallocate(dst, room, chain, since)
            return False
        src_copy = block.copies.get(src.name)
        if src_copy is not None:
            src_copy.readers += 1
            src_slot = src_copy.slot
        block.copies[dst.name] = Copy(room, CopyState.WRITING)
        dst.used_blocks += 1
        dst.policy.insert(block.key, block.priority)
        step = self.ledger.step(Op.COPY, block.key, src.name, dst.name, src_slot, room, parent=block.parent,
                                needs_prev=needs_prev)
        if src_copy is not None:
            self.ledger.hold(step)
        chain.append(step)
        self.stats.planned_moves[(src.name, dst.name)] += 1
        return True

    # ---------------------------------------------------------------- into the first tier

    def stage(self, block: Block, source: str, src_slot: int | None, slot: int | None, chain: list[Step],
              index: int, plan: Plan) -> None:
        """Plan `block`'s way from `source` through a new first-tier slot to the caller: a WRITING copy there,
        a COPY into it, then the GET (skipped by the mover if the COPY failed). Promotions and fetches alike."""
        first = self.tiers[0]
        block.copies[first.name] = Copy(slot, CopyState.WRITING)
        first.used_blocks += 1
        chain.append(self.ledger.step(Op.COPY, block.key, source, first.name, src_slot, slot, parent=block.parent))
        chain.append(self.ledger.step(Op.GET, block.key, first.name, CALLER, src_slot=slot, index=index,
                                      needs_prev=True))
        self.stats.planned_moves[(source, first.name)] += 1
        plan.chains.append(chain)

    def put(self, block: Block, slot: int | None, chain: list[Step], index: int) -> None:
        """A first-tier copy of `block` in `slot`, written from the caller's `index`-th block."""
        first = self.tiers[0]
        block.copies[first.name] = Copy(slot, CopyState.WRITING)
        first.used_blocks += 1
        chain.append(self.ledger.step(Op.PUT, block.key, CALLER, first.name, dst_slot=slot, index=index,
                                      parent=block.parent))
        self.stats.planned_moves[(CALLER, first.name)] += 1
