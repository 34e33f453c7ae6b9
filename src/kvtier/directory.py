"""The directory: the metadata plane. Which key lives in which tier, in which state, and what to move.

Pure Python and deterministic: no I/O, no torch, no threads of its own. The in-process cache, the vLLM
connector's scheduler half and the simulator all drive this same class, so what is simulated is what runs.

It hands out *plans*: chains of steps that the mover executes. Steps of one chain run in order (a victim is
demoted out of a host slot before the new block is written into that slot); chains run in parallel. The mover
reports each step back through `complete`, and only then does a copy become readable or a slot reusable.

Invariants kept here (each has a test): every tier stays within its bytes; a pinned, writing or
being-read copy is never evicted; a writing copy is never readable; a block whose parent is in no tier is
dropped with all its descendants (no orphans); eviction prefers blocks whose loss orphans nothing.

A *shared* tier (Redis, `SharedSpec`) is different: other engines add and remove its blocks, so the directory
owns neither its contents nor its bytes (the store keeps both, for all engines). The directory only plans
moves through it: write-through from the first tier (`plan_store`: a COPY first->shared step for each block
of the chain with a first-tier copy, parents first) and fetches into the first tier (`plan_load` with
`shared_end`: the caller asked the store which blocks after the local prefix it holds). A fetched block enters
the directory like a promoted one (a WRITING first-tier copy, pinned, then a GET); a fetch that fails or finds
the value gone, corrupt or foreign completes not OK, and the block leaves with its descendants: a miss.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.admission import AdmissionRule
from kvtier.policies import EvictionPolicy, make_policy
from kvtier.policies.base import DEFAULT_PRIORITY

CALLER = "caller"  # the engine or the user's tensors: source of stores, destination of loads
LEAF_SCAN = 32  # how many evictable candidates to look past for one whose loss orphans nothing


class State(enum.Enum):
    WRITING = "writing"
    READY = "ready"


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
    parent: bytes | None = None
    needs_prev: bool = False  # skip (as FAILED) when an earlier step of the chain for this key failed
    holds_src: bool = False  # the source copy is held (readers) until this step completes
    accounted: bool = False  # a DELETE whose bytes are still counted against the tier until it runs
    id: int = 0  # set by drivers that ship steps to another process and match completions by id


@dataclass
class Plan:
    chains: list[list[Step]]
    keys: list[bytes] = field(default_factory=list)  # loads: the prefix being loaded, pinned
    sources: list[str] = field(default_factory=list)  # loads: the tier each block came from

    @property
    def steps(self) -> int:
        return sum(len(c) for c in self.chains)


@dataclass(slots=True)
class Copy:
    slot: int | None
    state: State
    readers: int = 0


@dataclass(slots=True, eq=False)
class Block:
    key: bytes
    parent: bytes | None
    priority: int
    copies: dict[str, Copy] = field(default_factory=dict)
    children: set[bytes] | None = None
    pins: int = 0
    seen: int = 1
    doomed: bool = False


@dataclass
class TierSpec:
    """How the directory sees a tier: bounded bytes, a fixed footprint per block, a policy, admission."""

    name: str
    capacity_bytes: int
    block_bytes: int
    slotted: bool = False  # fixed slots in one buffer (host) rather than named objects (files, keys)
    policy: str = "lru"
    admission: AdmissionRule = field(default_factory=AdmissionRule)
    write_through: bool = False  # stored at once with the tier above, instead of on eviction from it

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.block_bytes

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.block_bytes <= 0:
            raise ValueError(f"tier {self.name!r}: capacity_bytes and block_bytes must be > 0")
        if self.capacity_bytes < self.block_bytes:
            raise ValueError(
                f"tier {self.name!r}: capacity {self.capacity_bytes} B holds no block of {self.block_bytes} B"
            )


@dataclass
class SharedSpec:
    """A tier shared with other engines: known to the directory only as a place to write to and fetch from."""

    name: str
    block_bytes: int  # what one block costs its write path (the admission budget)
    admission: AdmissionRule = field(default_factory=AdmissionRule)


class Tier:
    """A tier's live accounting: bytes used (including deletes still pending), free slots, policy order."""

    def __init__(self, spec: TierSpec, index: int) -> None:
        self.spec = spec
        self.name = spec.name
        self.index = index
        self.capacity_blocks = spec.capacity_bytes // spec.block_bytes
        self.policy: EvictionPolicy = make_policy(spec.policy, self.capacity_blocks)
        self.used_blocks = 0
        self.free_slots = list(range(self.capacity_blocks - 1, -1, -1)) if spec.slotted else []

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.spec.block_bytes

    @property
    def full(self) -> bool:
        return self.used_blocks >= self.capacity_blocks


@dataclass
class DirectoryStats:
    """Plain counters: cheap on the hot path, exported to Prometheus at scrape time by `kvtier.metrics`."""

    lookup_blocks: Counter = field(default_factory=Counter)  # source tier or "miss"
    evictions: Counter = field(default_factory=Counter)  # (tier, reason)
    admission_rejects: Counter = field(default_factory=Counter)  # (tier, reason)
    stores_dropped: Counter = field(default_factory=Counter)  # reason
    planned_moves: Counter = field(default_factory=Counter)  # (src, dst)


class NoRoom(Exception):
    """Every block that could make room is pinned or in flight."""


class Directory:
    def __init__(
        self,
        tiers: Sequence[TierSpec],
        clock: Callable[[], float] = time.monotonic,
        record_events: bool = False,
        sightings_capacity: int | None = None,
        shared: SharedSpec | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a directory needs at least one tier")
        names = [t.name for t in tiers] + ([shared.name] if shared is not None else [])
        if len(set(names)) != len(names) or CALLER in names:
            raise ValueError(f"tier names must be unique and not {CALLER!r}: {names}")
        self.tiers = [Tier(spec, i) for i, spec in enumerate(tiers)]
        self.tier = {t.name: t for t in self.tiers}
        self._order = [t.name for t in tiers]
        self.shared = shared
        self.clock = clock
        self.stats = DirectoryStats()
        self._blocks: dict[bytes, Block] = {}
        self._retiring: dict[bytes, Block] = {}  # dropped, with a transfer still in flight
        self._garbage: list[Step] = []  # deletes found outside a plan (cascades during completions)
        self._deleting: Counter[tuple[str, bytes]] = Counter()  # (tier, key) deletes in flight: no rewrite meanwhile
        cap = sightings_capacity or 4 * sum(t.capacity_blocks for t in self.tiers)
        self._sightings: OrderedDict[bytes, int] = OrderedDict()
        self._sightings_capacity = max(1024, cap)
        self._events: list[tuple[str, bytes, str]] | None = [] if record_events else None

    # ---------------------------------------------------------------- lookups

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """The tier each block of the longest readable prefix would come from (fastest first). No side effects."""
        found: list[str] = []
        blocks, order, ready = self._blocks, self._order, State.READY
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

    def record_lookup(self, sources: Sequence[str], total_blocks: int) -> None:
        """Count a request's lookup result by source (hits per tier, the rest as misses)."""
        counter = self.stats.lookup_blocks
        for name in sources:
            counter[name] += 1
        counter["miss"] += total_blocks - len(sources)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def residency(self, key: bytes) -> dict[str, State]:
        block = self._blocks.get(key)
        return {} if block is None else {name: c.state for name, c in block.copies.items()}

    # ---------------------------------------------------------------- loads

    def plan_load(self, keys: Sequence[bytes], shared_end: int = 0) -> Plan:
        """Pin the readable prefix and plan its way to the caller; blocks in slower tiers are staged in the first.

        `shared_end`: the shared tier holds `keys[:shared_end]` beyond the local prefix (the caller asked it,
        outside the directory); those blocks are fetched through the first tier after the local prefix, as far
        as room allows. A stale answer costs a failed fetch (a miss), never a wrong block.
        """
        sources = self.lookup(keys)
        first = self.tiers[0]
        plan = Plan(chains=[], keys=list(keys[: len(sources)]), sources=sources)
        for key in plan.keys:
            self._blocks[key].pins += 1
        promoted: list[Block] = []
        whole = True  # the local prefix is planned to its end: fetches may follow it
        for i, (key, source) in enumerate(zip(plan.keys, sources)):
            block = self._blocks[key]
            block.seen += 1
            if source == first.name:
                plan.chains.append([Step(Op.GET, key, first.name, CALLER, src_slot=block.copies[source].slot, index=i)])
                continue
            if first.name in block.copies:  # another load is staging it: its slot is taken, its bytes not there yet
                self.finish_load(Plan(chains=[], keys=plan.keys[i:]))
                del plan.keys[i:], plan.sources[i:]
                whole = False
                break
            chain: list[Step] = []
            try:
                slot = self._allocate(first, chain, key)
            except NoRoom:
                self.stats.stores_dropped["no_space"] += 1
                self.finish_load(Plan(chains=[], keys=plan.keys[i:]))  # unpin what we cannot stage
                del plan.keys[i:], plan.sources[i:]
                if chain:  # evictions planned before we ran out of room still have to happen
                    plan.chains.append(chain)
                whole = False
                break
            src = block.copies[source]
            block.copies[first.name] = Copy(slot, State.WRITING)
            first.used_blocks += 1
            chain.append(Step(Op.COPY, key, source, first.name, src.slot, slot, parent=block.parent))
            chain.append(Step(Op.GET, key, first.name, CALLER, src_slot=slot, index=i, needs_prev=True))
            self.stats.planned_moves[(source, first.name)] += 1
            plan.chains.append(chain)
            promoted.append(block)
        fetched = self._plan_fetch(plan, keys, shared_end) if whole else []
        for block in promoted:
            first.policy.insert(block.key, block.priority)
        for block in reversed(fetched):  # leaf first: ancestors end up more recent than descendants
            first.policy.insert(block.key, block.priority)
        self._touch_chain([self._blocks[k] for k in plan.keys if k in self._blocks])
        return plan

    def _plan_fetch(self, plan: Plan, keys: Sequence[bytes], shared_end: int) -> list[Block]:
        """Extend a load past its local prefix with blocks fetched from the shared tier into the first tier."""
        shared, first = self.shared, self.tiers[0]
        fetched: list[Block] = []
        if shared is None:
            return fetched
        for i in range(len(plan.keys), min(shared_end, len(keys))):
            key = keys[i]
            parent = keys[i - 1] if i else None
            if key in self._blocks or key in self._retiring:  # here, but not readable: a transfer is on it
                break
            chain: list[Step] = []
            try:
                slot = self._allocate(first, chain, key)
            except NoRoom:
                self.stats.stores_dropped["no_space"] += 1
                if chain:
                    plan.chains.append(chain)
                break
            if parent is not None and parent not in self._blocks:  # never: the parent is pinned by this load
                self._unallocate(first, slot, chain)
                if chain:
                    plan.chains.append(chain)
                break
            block = Block(key, parent, DEFAULT_PRIORITY, seen=self._sightings.pop(key, 0) + 1, pins=1)
            block.copies[first.name] = Copy(slot, State.WRITING)
            first.used_blocks += 1
            self._link(block)
            chain.append(Step(Op.COPY, key, shared.name, first.name, None, slot, parent=parent))
            chain.append(Step(Op.GET, key, first.name, CALLER, src_slot=slot, index=i, needs_prev=True))
            self.stats.planned_moves[(shared.name, first.name)] += 1
            plan.chains.append(chain)
            plan.keys.append(key)
            plan.sources.append(shared.name)
            fetched.append(block)
        return fetched

    def finish_load(self, plan: Plan) -> None:
        """Unpin a load's prefix once the caller holds its bytes."""
        for key in plan.keys:
            block = self._blocks.get(key) or self._retiring.get(key)
            if block is None:
                continue
            block.pins -= 1
            if block.doomed:
                self._release_idle(block)

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
        offer = self.shared is not None  # write-through to the shared tier, until its admission says no
        through = [t for t in self.tiers[1:] if t.spec.write_through]
        plan = Plan(chains=[])
        chain_blocks: list[Block] = []
        new: set[bytes] = set()
        held: list[Block] = []  # the chain's existing blocks stay put while we make room for the new ones
        if parent is not None and (parent_block := self._blocks.get(parent)) is not None:
            held.append(parent_block)
            parent_block.pins += 1
        parent_key = parent
        for i, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is not None:
                block.seen += 1
                chain_blocks.append(block)
                held.append(block)
                block.pins += 1
                parent_key = key
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
            chain: list[Step] = []
            try:
                slot = self._allocate(first, chain, key)
            except NoRoom:
                self.stats.stores_dropped["no_space"] += len(keys) - i
                if chain:
                    plan.chains.append(chain)
                break
            if parent_key is not None and parent_key not in self._blocks:  # making room dropped the parent
                self._unallocate(first, slot, chain)
                self.stats.stores_dropped["orphan"] += len(keys) - i
                if chain:
                    plan.chains.append(chain)
                break
            block = Block(key, parent_key, priority, seen=self._sightings.pop(key, 1))
            block.copies[first.name] = Copy(slot, State.WRITING)
            first.used_blocks += 1
            self._link(block)
            chain.append(Step(Op.PUT, key, CALLER, first.name, dst_slot=slot, index=i, parent=parent_key))
            self.stats.planned_moves[(CALLER, first.name)] += 1
            for tier in through:
                self._copy_down(block, first, tier, chain, needs_prev=True)
            if offer:
                offer = self._offer_shared(block, chain, new=True)
            plan.chains.append(chain)
            chain_blocks.append(block)
            new.add(key)
            parent_key = key
        self.finish_load(Plan(chains=[], keys=[b.key for b in held]))
        for block in reversed(chain_blocks):  # leaf first: ancestors end up more recent than descendants
            if self._blocks.get(block.key) is not block:  # dropped while planning (retiring until its steps end)
                continue
            for name, copy in block.copies.items():
                policy = self.tier[name].policy
                if block.key in new:
                    policy.insert(block.key, priority)
                elif copy.state is State.READY and block.key in policy:
                    policy.touch(block.key)
        return plan

    def _offer_shared(self, block: Block, chains: list, new: bool) -> bool:
        """Plan writing `block` through from the first tier to the shared tier; False once admission refuses
        (its descendants would be orphans there). A new block's step is appended to its own chain (`chains`
        is that chain) after its PUT; an existing block's is a chain of its own, appended to `chains`."""
        shared, first = self.shared, self.tiers[0]
        assert shared is not None
        copy = block.copies.get(first.name)
        if copy is None or block.doomed or (copy.state is not State.READY and not new):
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
        step = Step(Op.COPY, block.key, first.name, shared.name, copy.slot, None, parent=block.parent,
                    needs_prev=new)
        if new:
            chains.append(step)
        else:
            chains.append([step])
        self.stats.planned_moves[(first.name, shared.name)] += 1
        return True

    def _store_refusal(self, key: bytes, parent_key: bytes | None, priority: int, first: Tier) -> str | None:
        if key in self._retiring:
            return "retiring"
        if parent_key is not None and parent_key not in self._blocks:
            return "orphan"
        seen = self._sight(key)
        reason = first.spec.admission.reject_reason(priority, seen, first.spec.block_bytes, self.clock())
        if reason is not None:
            self.stats.admission_rejects[(first.name, reason)] += 1
            return "admission"
        return None

    def _sight(self, key: bytes) -> int:
        """Count a sighting of a block not stored (bounded memory: the oldest sightings are forgotten)."""
        seen = self._sightings.get(key, 0) + 1
        self._sightings[key] = seen
        self._sightings.move_to_end(key)
        if len(self._sightings) > self._sightings_capacity:
            self._sightings.popitem(last=False)
        return seen

    def _copy_down(
        self, block: Block, src: Tier, dst: Tier, chain: list[Step], src_slot: int | None = None,
        needs_prev: bool = False,
    ) -> bool:
        """Plan a copy of `block` from `src` into `dst`, if admitted and room is found.

        Write-through: the source copy stays resident and is held (readers) until the copy completes.
        Demotion: the source copy has already left the directory; `src_slot` is where its bytes still are.
        """
        if (dst.name, block.key) in self._deleting:  # the delete of its old copy, run late, would undo this write
            self.stats.stores_dropped["deleting"] += 1
            return False
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
        chain.append(
            Step(Op.COPY, block.key, src.name, dst.name, src_slot, room, parent=block.parent,
                 needs_prev=needs_prev, holds_src=holds)
        )
        self.stats.planned_moves[(src.name, dst.name)] += 1
        return True

    # ---------------------------------------------------------------- completions

    def complete(self, step: Step, status: Status) -> None:
        """The mover finished `step`. Only now does a copy become readable or a slot reusable."""
        if step.op is Op.DELETE:
            if self._deleting[(step.src, step.key)] > 1:
                self._deleting[(step.src, step.key)] -= 1
            else:
                self._deleting.pop((step.src, step.key), None)
            if step.accounted:
                self.tier[step.src].used_blocks -= 1
            return
        block = self._blocks.get(step.key) or self._retiring.get(step.key)
        if block is None:
            return
        if self.shared is not None and step.dst == self.shared.name:  # a write-through: it pinned the block
            block.pins -= 1
            if block.doomed:
                self._release_idle(block)
            return
        if step.holds_src and (src := block.copies.get(step.src)) is not None:
            src.readers -= 1
        if status is Status.SOURCE_LOST and step.src in block.copies:  # a demotion's source already left
            self._remove_copy(block, self.tier[step.src], already_deleted=True)
        if step.op is Op.GET:
            if not block.copies and not block.doomed:
                self._drop(block)
            return
        dst = block.copies.get(step.dst)
        if dst is not None and dst.state is State.WRITING:
            if status is Status.OK:
                dst.state = State.READY  # a dropped block's copy is released below, once no transfer reads it
                if not block.doomed:
                    self._event("stored", block.key, step.dst)
            else:
                self._remove_copy(block, self.tier[step.dst], already_deleted=status is not Status.OK)
        if block.doomed:
            self._release_idle(block)
        elif not block.copies:
            self._drop(block)

    def take_garbage(self) -> list[Step]:
        """Deletes that became necessary outside a plan; the caller hands them to the mover."""
        garbage, self._garbage = self._garbage, []
        return garbage

    def take_events(self) -> list[tuple[str, bytes, str]]:
        events, self._events = (self._events or []), ([] if self._events is not None else None)
        return events

    # ---------------------------------------------------------------- restart recovery

    def adopt(self, tier_name: str, blocks: Iterable[tuple[bytes, bytes | None]]) -> list[Step]:
        """Take back blocks a restart found in a persistent tier (oldest first). Returns deletes for the rest:
        orphans, blocks the directory already has there, and whatever exceeds the tier's capacity."""
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
            self._evict(tier, victim, deletes, reason="capacity")
        return deletes + self.take_garbage()

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

    # ---------------------------------------------------------------- eviction

    def _allocate(self, tier: Tier, chain: list[Step], incoming: bytes) -> int | None:
        """Room for one block in `tier`, evicting as needed; the slot (slotted tiers) or None. Raises NoRoom."""
        while tier.full:
            victim = self._pick_victim(tier, incoming)
            if victim is None:
                raise NoRoom(tier.name)
            self._evict(tier, victim, chain, reason="capacity")
        if not tier.spec.slotted:
            return None
        return tier.free_slots.pop()  # LIFO: the victim's slot, reused only after its demotion step in `chain`

    def _unallocate(self, tier: Tier, slot: int | None, chain: list[Step], since: int = 0) -> None:
        """Give back a slot that `_allocate` found but nothing will be written to. If a step of `chain` still
        reads the evicted block's bytes there (its demotion), that block keeps the slot until the step is done.

        An unslotted tier's room came from evictions whose DELETEs (in `chain[since:]`) were not counted: the
        write they made room for was to follow them in the chain. Without that write, nothing keeps another
        chain from using the room while the victims' files are still there (their DELETEs may run late): count
        those files until their DELETEs run, like any other pending delete."""
        if slot is None:
            for step in chain[since:]:
                if step.op is Op.DELETE and step.src == tier.name and not step.accounted:
                    step.accounted = True
                    tier.used_blocks += 1
            return
        reader = next((s for s in chain if s.src == tier.name and s.src_slot == slot), None)
        block = None if reader is None else self._blocks.get(reader.key) or self._retiring.get(reader.key)
        if block is None:
            tier.free_slots.append(slot)
            return
        block.copies[tier.name] = Copy(slot, State.READY, readers=1)
        reader.holds_src = True
        tier.used_blocks += 1
        if not block.doomed:
            tier.policy.insert(block.key, block.priority)

    def _pick_victim(self, tier: Tier, incoming: bytes | None) -> Block | None:
        """The policy's first evictable candidate, unless a few more on its list can go without orphaning."""
        fallback: Block | None = None
        looked = 0
        has_lower = tier.index + 1 < len(self.tiers)
        for key in tier.policy.candidates(incoming):
            block = self._blocks[key]
            copy = block.copies[tier.name]
            if copy.state is not State.READY or copy.readers or block.pins:
                continue
            if has_lower or not block.children or len(block.copies) > 1:
                return block
            fallback = fallback or block
            looked += 1
            if looked > LEAF_SCAN:
                break
        return fallback

    def _evict(self, tier: Tier, block: Block, chain: list[Step], reason: str) -> None:
        """Take `block` out of `tier`: demote it to the next tier if admitted, else drop it (and its orphans)."""
        copy = block.copies.pop(tier.name)
        tier.policy.evicted(block.key)
        self.stats.evictions[(tier.name, reason)] += 1
        self._event("evicted", block.key, tier.name)
        lower = self.tiers[tier.index + 1 :]
        if lower and not any(t.name in block.copies for t in lower):
            self._copy_down(block, tier, lower[0], chain, src_slot=copy.slot)
        if tier.spec.slotted:
            tier.free_slots.append(copy.slot)
            tier.used_blocks -= 1
        else:
            chain.append(self._delete(tier.name, block.key))  # its bytes go to the incoming block
            tier.used_blocks -= 1
        if not block.copies and block.key in self._blocks:
            self._drop(block)

    def _drop(self, block: Block) -> None:
        """`block` is in no tier any more: it and every descendant leave the directory."""
        stack = [block]
        while stack:
            b = stack.pop()
            if self._blocks.pop(b.key, None) is None:
                continue
            self._event("removed", b.key, "")
            if b.parent is not None and (parent := self._blocks.get(b.parent)) is not None and parent.children:
                parent.children.discard(b.key)
            if b.children:
                stack.extend(self._blocks[k] for k in b.children if k in self._blocks)
                b.children = None
            b.doomed = True
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
        if tier.spec.slotted:
            tier.free_slots.append(copy.slot)
            tier.used_blocks -= 1
        elif already_deleted:
            tier.used_blocks -= 1
        else:  # the bytes stay counted until the file (or shared key) is really gone
            self._garbage.append(self._delete(tier.name, block.key, accounted=True))

    def _delete(self, tier_name: str, key: bytes, accounted: bool = False) -> Step:
        self._deleting[(tier_name, key)] += 1
        return Step(Op.DELETE, key, tier_name, CALLER, accounted=accounted)

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

    def _event(self, kind: str, key: bytes, tier: str) -> None:
        if self._events is not None:
            self._events.append((kind, key, tier))
