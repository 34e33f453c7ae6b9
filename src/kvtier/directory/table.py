"""The block table: which block has a copy in which tier, and the rules that keep that consistent.

Everything the directory plans goes through these primitives: find room in a tier (evicting by its policy),
demote an evicted block to the next tier if admitted, drop a block with all its descendants when it is in no
tier any more, and free a dropped block's copies only once no transfer touches them. Invariants kept here:
every tier stays within its bytes; a pinned, writing or being-read copy is never evicted; a block whose
parent is in no tier is dropped with all its descendants (no orphans); eviction prefers blocks whose loss
orphans nothing.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from kvtier.directory.plan import CALLER, Op, Plan, Step
from kvtier.directory.state import Block, Copy, DirectoryStats, NoRoom, State, Tier, TierSpec

LEAF_SCAN = 32  # how many evictable candidates to look past for one whose loss orphans nothing


class BlockTable:
    def __init__(self, tiers: Sequence[TierSpec], clock: Callable[[], float] = time.monotonic,
                 sightings_capacity: int | None = None) -> None:
        if not tiers:
            raise ValueError("a directory needs at least one tier")
        self.tiers = [Tier(spec, i) for i, spec in enumerate(tiers)]
        self.tier = {t.name: t for t in self.tiers}
        self._order = [t.name for t in tiers]
        self.clock = clock
        self.stats = DirectoryStats()
        # (key, tier, stored): a copy became readable in a tier (stored) or left it; tier None: the block left the
        # directory. The vLLM connector's KV events.
        self.on_change: Callable[[bytes, str | None, bool], None] | None = None
        self._blocks: dict[bytes, Block] = {}
        self._retiring: dict[bytes, Block] = {}  # dropped, with a transfer still in flight
        self._garbage: list[Step] = []  # deletes found outside a plan (cascades during completions)
        self._deleting: Counter[tuple[str, bytes]] = Counter()  # (tier, key) deletes in flight: no rewrite meanwhile
        self._ids = itertools.count(1)
        self._sightings: OrderedDict[bytes, int] = OrderedDict()  # blocks seen but not stored: admission
        # blocks the first tier refused come back within a few of its sizes; blocks that left a slower tier, within
        # its size (what it could have held)
        below = sum(t.capacity_blocks for t in self.tiers[1:])
        self._sightings_capacity = max(1024, sightings_capacity or 4 * self.tiers[0].capacity_blocks + below)
        self._sightings_count = any(t.admission.counts_sightings for t in tiers)
        # bookkeeping by step id, until the step completes
        self._holding: set[int] = set()  # the step reads a copy it holds (one of its readers)
        self._accounted: set[int] = set()  # a delete whose bytes still count against its tier
        self._owed: Counter[str] = Counter()  # tier -> files a failed delete left, counted by the next lost copy
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

    # ---------------------------------------------------------------- lookups

    def lookup(self, keys: Sequence[bytes], skip: AbstractSet[str] = frozenset()) -> list[str]:
        """The tier each block of the longest readable prefix would come from (fastest first), reading none of
        the tiers in `skip` (the guard's). Without the first tier, none: it stages every other. No side effects."""
        found: list[str] = []
        if self._order[0] in skip:
            return found
        blocks, ready = self._blocks, State.READY
        order = [name for name in self._order if name not in skip] if skip else self._order
        for key in keys:
            block = blocks.get(key)
            if block is None:
                break
            copies = block.copies
            for name in order:
                copy = copies.get(name)
                if copy is not None and copy.state is ready:
                    found.append(name)
                    break
            else:
                break
        return found

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def residency(self, key: bytes) -> dict[str, State]:
        block = self._blocks.get(key)
        return {} if block is None else {name: c.state for name, c in block.copies.items()}

    def accounted(self, step: Step) -> bool:
        """True while `step` (a delete) still has its bytes counted against its tier."""
        return step.id in self._accounted

    def take_garbage(self) -> list[Step]:
        """Deletes that became necessary outside a plan; the caller hands them to the mover."""
        garbage, self._garbage = self._garbage, []
        return garbage

    # ---------------------------------------------------------------- invariants, for metrics and tests

    def orphans(self) -> int:
        """Blocks whose parent is in no tier. Always 0 unless there is a bug."""
        return sum(1 for b in self._blocks.values() if b.parent is not None and b.parent not in self._blocks)

    def orphans_by_tier(self) -> dict[str, int]:
        counts = {t.name: 0 for t in self.tiers}
        for b in self._blocks.values():
            if b.parent is not None and b.parent not in self._blocks:
                for name in b.copies:
                    counts[name] += 1
        return counts

    def used_bytes(self, tier_name: str) -> int:
        return self.tier[tier_name].used_bytes

    def keys_in(self, tier_name: str, state: State | None = None) -> list[bytes]:
        return [
            b.key for b in self._blocks.values()
            if tier_name in b.copies and (state is None or b.copies[tier_name].state is state)
        ]

    def pinned(self) -> list[bytes]:
        return [b.key for b in self._blocks.values() if b.pins]

    def _sight(self, key: bytes, times: int = 1) -> int:
        """Count sightings of a block not stored (bounded memory: the oldest sightings are forgotten), where an
        admission rule counts them."""
        if not self._sightings_count:
            return times
        seen = self._sightings.get(key, 0) + times
        self._sightings[key] = seen
        self._sightings.move_to_end(key)
        if len(self._sightings) > self._sightings_capacity:
            self._sightings.popitem(last=False)
        return seen

    # ---------------------------------------------------------------- steps

    def _step(self, op: Op, key: bytes, src: str, dst: str, src_slot: int | None = None, dst_slot: int | None = None,
              index: int = -1, parent: bytes | None = None, needs_prev: bool = False) -> Step:
        return Step(op, key, src, dst, src_slot, dst_slot, index, parent, needs_prev, next(self._ids))

    def _delete(self, tier_name: str, key: bytes, accounted: bool = False) -> Step:
        self._deleting[(tier_name, key)] += 1
        step = self._step(Op.DELETE, key, tier_name, CALLER)
        if accounted:
            self._accounted.add(step.id)
        return step

    def _delete_done(self, step: Step, ok: bool) -> None:
        """A delete ran: its key may be written again, and its bytes stop counting. One that failed may have
        left its file: its bytes stay counted (the next restart's scan finds the file and takes it back)."""
        if self._deleting[(step.src, step.key)] > 1:
            self._deleting[(step.src, step.key)] -= 1
        else:
            self._deleting.pop((step.src, step.key), None)
        accounted = step.id in self._accounted
        self._accounted.discard(step.id)
        if ok and accounted:
            self.tier[step.src].used_blocks -= 1
        elif not ok:
            self.stats.failed_deletes[step.src] += 1
            if not accounted:  # its bytes went to the write after it in the chain, which the mover now skips:
                self._owed[step.src] += 1  # that write's count stays, for this file (see `_remove_copy`)

    # ---------------------------------------------------------------- room

    def _allocate(self, tier: Tier, chain: list[Step], incoming: bytes) -> int | None:
        """Room for one block in `tier`, evicting as needed; the slot (slotted tiers) or None. Raises NoRoom."""
        while tier.full:
            victim = self._pick_victim(tier, incoming)
            if victim is None:
                raise NoRoom(tier.name)
            self._evict(tier, victim, chain, reason="capacity")
        if not tier.slotted:
            return None
        return tier.free_slots.pop()  # LIFO: the victim's slot, reused only after its demotion step in `chain`

    def _room(self, tier: Tier, key: bytes, plan: Plan, dropped: int = 1) -> tuple[int | None, list[Step]] | None:
        """`_allocate` for a new chain of `plan`: the slot and the chain that makes room, or None when nothing
        can make room (`dropped` stores counted; evictions planned before we ran out still happen)."""
        chain: list[Step] = []
        try:
            return self._allocate(tier, chain, key), chain
        except NoRoom:
            if dropped:
                self.stats.stores_dropped["no_space"] += dropped
            if chain:
                plan.chains.append(chain)
            return None

    def _give_back(self, tier: Tier, slot: int | None, chain: list[Step], plan: Plan) -> None:
        """Room was made, but nothing will be written there: return it, keep the evictions."""
        self._unallocate(tier, slot, chain)
        if chain:
            plan.chains.append(chain)

    def _unallocate(self, tier: Tier, slot: int | None, chain: list[Step], since: int = 0) -> None:
        """Give back a slot that `_allocate` found but nothing will be written to. If a step of `chain` still
        reads the evicted block's bytes there (its demotion), that block keeps the slot until the step is done.

        An unslotted tier's room came from evictions whose DELETEs (in `chain[since:]`) were not counted: the
        write they made room for was to follow them in the chain. Without that write, nothing keeps another
        chain from using the room while the victims' files are still there (their DELETEs may run late): count
        those files until their DELETEs run, like any other pending delete."""
        if slot is None:
            for step in chain[since:]:
                if step.op is Op.DELETE and step.src == tier.name and step.id not in self._accounted:
                    self._accounted.add(step.id)
                    tier.used_blocks += 1
            return
        reader = next((s for s in chain if s.src == tier.name and s.src_slot == slot), None)
        block = None if reader is None else self._blocks.get(reader.key) or self._retiring.get(reader.key)
        if reader is None or block is None:
            tier.free_slots.append(slot)
            return
        block.copies[tier.name] = Copy(slot, State.READY, readers=1)
        if self.on_change is not None and not block.retiring:
            self.on_change(block.key, tier.name, True)
        self._holding.add(reader.id)
        tier.used_blocks += 1
        if not block.retiring:
            tier.policy.insert(block.key, block.priority)

    # ---------------------------------------------------------------- eviction and demotion

    def _pick_victim(self, tier: Tier, incoming: bytes | None) -> Block | None:
        """The policy's first evictable candidate, unless a few more on its list can go without orphaning."""
        fallback: Block | None = None
        looked = 0
        has_lower = self._demote_to[tier.index] is not None  # a demotion keeps it
        blocks, name, ready = self._blocks, tier.name, State.READY
        for key in tier.policy.candidates(incoming):
            block = blocks[key]
            copy = block.copies[name]
            if copy.state is not ready or copy.readers or block.pins:
                continue
            if has_lower or not block.children or len(block.copies) > 1:
                return block
            fallback = fallback or block
            looked += 1
            if looked > LEAF_SCAN:
                break
        return fallback

    def _evict(self, tier: Tier, block: Block, chain: list[Step], reason: str, demote: bool = True) -> None:
        """Take `block` out of `tier`: demote it to the next tier if admitted (and `demote`), else drop it (and
        its orphans)."""
        copy = block.copies.pop(tier.name)
        tier.policy.evicted(block.key)
        self.stats.evictions[(tier.name, reason)] += 1
        if self.on_change is not None:
            self.on_change(block.key, tier.name, False)
        target = self._demote_to[tier.index]  # a write-through target was offered the block when it was stored
        if demote and target is not None and not any(t.name in block.copies for t in self.tiers[tier.index + 1 :]):
            self._copy_down(block, tier, target, chain, src_slot=copy.slot, offer=not target.spec.write_through)
        tier.used_blocks -= 1
        if tier.slotted:
            tier.free_slots.append(copy.slot)
        else:
            chain.append(self._delete(tier.name, block.key))  # its bytes go to the incoming block
        if not block.copies and block.key in self._blocks:
            self._drop(block)

    def _copy_down(
        self, block: Block, src: Tier, dst: Tier, chain: list[Step], src_slot: int | None = None,
        needs_prev: bool = False, offer: bool = True,
    ) -> bool:
        """Plan a copy of `block` from `src` into `dst`, if admitted and room is found. `offer`: count it among
        the blocks offered to `dst` (its adaptive admission's evidence), once per block.

        Write-through: the source copy stays resident and is held (readers) until the copy completes.
        Demotion: the source copy has already left the directory; `src_slot` is where its bytes still are.
        """
        if (dst.name, block.key) in self._deleting:  # the delete of its old copy, run late, would undo this write
            self.stats.stores_dropped["deleting"] += 1
            return False
        if offer:
            dst.spec.admission.offered()
        reason = dst.spec.admission.reject_reason(block.priority, block.seen, dst.spec.block_bytes, self.clock())
        if reason is not None:
            self.stats.admission_rejects[(dst.name, reason)] += 1
            return False
        since = len(chain)  # the steps `_allocate` adds: what `_unallocate` has to take back
        try:
            room = self._allocate(dst, chain, block.key)
        except NoRoom:
            self.stats.stores_dropped["no_space"] += 1
            return False
        if block.key not in self._blocks:  # making room in dst dropped an ancestor, and with it this block
            self._unallocate(dst, room, chain, since)
            return False
        src_copy = block.copies.get(src.name)
        holds = src_copy is not None
        if holds:
            src_copy.readers += 1
            src_slot = src_copy.slot
        block.copies[dst.name] = Copy(room, State.WRITING)
        dst.used_blocks += 1
        dst.policy.insert(block.key, block.priority)
        step = self._step(Op.COPY, block.key, src.name, dst.name, src_slot, room, parent=block.parent,
                          needs_prev=needs_prev)
        if holds:
            self._holding.add(step.id)
        chain.append(step)
        self.stats.planned_moves[(src.name, dst.name)] += 1
        return True

    # ---------------------------------------------------------------- staging into the first tier

    def _stage(self, block: Block, source: str, src_slot: int | None, slot: int | None, chain: list[Step],
               index: int, plan: Plan) -> None:
        """Plan `block`'s way from `source` through a new first-tier slot to the caller: a WRITING copy there,
        a COPY into it, then the GET (skipped by the mover if the COPY failed). Promotions and fetches alike."""
        first = self.tiers[0]
        block.copies[first.name] = Copy(slot, State.WRITING)
        first.used_blocks += 1
        chain.append(self._step(Op.COPY, block.key, source, first.name, src_slot, slot, parent=block.parent))
        chain.append(self._step(Op.GET, block.key, first.name, CALLER, src_slot=slot, index=index, needs_prev=True))
        self.stats.planned_moves[(source, first.name)] += 1
        plan.chains.append(chain)

    # ---------------------------------------------------------------- dropping

    def _drop(self, block: Block) -> None:
        """`block` is in no tier any more: it and every descendant leave the directory."""
        stack = [block]
        while stack:
            b = stack.pop()
            if self._blocks.pop(b.key, None) is None:
                continue
            self._sight(b.key, b.seen)  # when it comes back, "the second sighting" counts what it was seen before
            if self.on_change is not None:
                self.on_change(b.key, None, False)
            if b.parent is not None and (parent := self._blocks.get(b.parent)) is not None and parent.children:
                parent.children.discard(b.key)
            if b.children:
                stack.extend(self._blocks[k] for k in b.children if k in self._blocks)
                b.children = None
            b.retiring = True
            for name in b.copies:  # in-flight copies stay counted, but are no longer candidates
                self.tier[name].policy.remove(b.key)
            self._retiring[b.key] = b
            self._release_idle(b)

    def _release_idle(self, block: Block) -> None:
        """Free the copies of a dropped block that no transfer touches; it retires once none is left."""
        for name in list(block.copies):
            copy = block.copies[name]
            if copy.state is State.READY and not copy.readers and not block.pins:
                self._remove_copy(block, self.tier[name], already_deleted=False)
        if not block.copies and not block.pins:
            self._retiring.pop(block.key, None)

    def _remove_copy(self, block: Block, tier: Tier, already_deleted: bool) -> None:
        copy = block.copies.pop(tier.name)
        tier.policy.remove(block.key)
        if self.on_change is not None:
            self.on_change(block.key, tier.name, False)
        if tier.slotted:
            tier.free_slots.append(copy.slot)
            tier.used_blocks -= 1
        elif already_deleted and self._owed[tier.name]:  # its count goes to a file a failed delete left
            self._owed[tier.name] -= 1
        elif already_deleted:
            tier.used_blocks -= 1
        else:  # the bytes stay counted until the file (or shared key) is really gone
            self._garbage.append(self._delete(tier.name, block.key, accounted=True))

    def _unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            block = self._blocks.get(key) or self._retiring.get(key)
            if block is None:
                continue
            block.pins -= 1
            if block.retiring:
                self._release_idle(block)

    def _link(self, block: Block) -> None:
        self._blocks[block.key] = block
        if block.parent is not None and (parent := self._blocks.get(block.parent)) is not None:
            if parent.children is None:
                parent.children = set()
            parent.children.add(block.key)

    def _touch_chain(self, blocks: Sequence[Block]) -> None:
        for block in reversed(blocks):  # leaf first, so that ancestors stay more recent than descendants
            for name, copy in block.copies.items():
                if copy.state is State.READY:
                    self.tier[name].policy.touch(block.key)
