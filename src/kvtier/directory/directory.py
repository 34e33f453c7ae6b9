"""The directory: the metadata plane. Which key lives in which tier, in which state, and what to move.

Pure Python and deterministic: no I/O, no torch, no threads of its own. The in-process cache, the vLLM
connector's scheduler half and the simulator all drive this same class, so what is simulated is what runs.

`Directory` is a facade over parts that each hold one idea: the block table (blocks, chain links, the drop
cascade, retiring blocks), room (eviction, demotion, copies into a tier), the step ledger (what each step in
flight must settle), the load and store planners, and the shared tier's planning. Drivers call `plan_load`,
`plan_store` and `finish_load`, hand the plans to the mover, and apply the mover's reports with `complete`;
`adopt` takes back what a restart found, `usage` and the inspection methods tell what is where.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from types import MappingProxyType

from kvtier.directory.adopt import adopt
from kvtier.directory.blocks import Block, CopyState
from kvtier.directory.ledger import StepLedger
from kvtier.directory.loading import LoadPlanner
from kvtier.directory.plan import CALLER, Op, Plan, Status, Step
from kvtier.directory.recency import Recency
from kvtier.directory.room import Room
from kvtier.directory.shared import SharedTierPlans
from kvtier.directory.sightings import Sightings
from kvtier.directory.stats import DirectoryStats
from kvtier.directory.storing import StorePlanner
from kvtier.directory.table import BlockTable, ChangeHook
from kvtier.directory.tiers import SharedSpec, Tier, TierSpec
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.stores.base import TierKind


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int
    sightings_needed: int  # by admission now: `min_sightings: auto` moves it between 1 and 2


class Directory:
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
        of a block read that way gives it a first-tier copy, off that path. The vLLM connector loads this way.
        `sightings_capacity`: how many blocks seen but not stored are remembered for admission."""
        if not tiers:
            raise ValueError("a directory needs at least one tier")
        names = [t.name for t in tiers] + ([shared.name] if shared is not None else [])
        if len(set(names)) != len(names) or CALLER in names:
            raise ValueError(f"tier names must be unique and not {CALLER!r}: {names}")
        self.tiers = [Tier(spec, i) for i, spec in enumerate(tiers)]
        self.tier = {t.name: t for t in self.tiers}
        self.shared = shared
        self.stage_loads = stage_loads
        self.stats = DirectoryStats()
        # blocks the first tier refused come back within a few of its sizes; blocks that left a slower tier, within
        # its size (what it could have held)
        below = sum(t.capacity_blocks for t in self.tiers[1:])
        counting = any(t.admission.counts_sightings for t in tiers) or (
            shared is not None and shared.admission.counts_sightings)
        self._sightings = Sightings(max(1024, sightings_capacity or 4 * self.tiers[0].capacity_blocks + below),
                                    counting)
        self._read_below: Recency[bytes, None] = Recency(max(1024, self.tiers[0].capacity_blocks))
        self._ledger = StepLedger()
        self._table = BlockTable(self.tiers, self._ledger, self._sightings)
        self._room = Room(self._table, self.stats, clock)
        self._shared = SharedTierPlans(shared, self._room, self.stats, clock, stage_loads) if shared else None
        self._loads = LoadPlanner(self._room, self._shared, self._read_below, stage_loads)
        self._stores = StorePlanner(self._room, self._shared, self._read_below, self.stats)

    # ---------------------------------------------------------------- what the drivers set

    @property
    def disabled(self) -> frozenset[str]:
        """Tiers nothing new is written to (the guard turned them off): set by `kvtier.control.Control` only."""
        return self._room.disabled

    @disabled.setter
    def disabled(self, names: AbstractSet[str]) -> None:
        self._room.disabled = frozenset(names)

    @property
    def on_change(self) -> ChangeHook | None:
        """Called with (key, tier, stored) when a copy becomes readable in a tier (stored) or leaves it, and with
        (key, None, False) when a block leaves the directory: the vLLM connector's KV events."""
        return self._table.on_change

    @on_change.setter
    def on_change(self, hook: ChangeHook | None) -> None:
        self._table.on_change = hook

    # ---------------------------------------------------------------- the tiers

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

    def used_bytes(self, tier_name: str) -> int:
        return self.tier[tier_name].used_bytes

    # ---------------------------------------------------------------- lookups

    def lookup(self, keys: Sequence[bytes], skip: AbstractSet[str] = frozenset()) -> list[str]:
        """The tier each block of the longest readable prefix would come from (fastest first), reading none of
        the tiers in `skip` (the guard's). Without the first tier, none: it stages every other. No side effects."""
        return self._table.lookup(keys, skip)

    def record_lookup(self, sources: Sequence[str], total_blocks: int) -> None:
        """Count a request's lookup result by source (hits per tier, the rest as misses)."""
        counter = self.stats.lookup_blocks
        for name in sources:
            counter[name] += 1
        counter["miss"] += total_blocks - len(sources)

    # ---------------------------------------------------------------- plans

    def plan_load(self, keys: Sequence[bytes], shared_end: int = 0, parent: bytes | None = None,
                  skip: AbstractSet[str] = frozenset(), route: bytes | None = None) -> Plan:
        """Pin the readable prefix and plan its way to the caller; blocks in slower tiers are staged in the first
        (unless `stage_loads` is off: then read straight into the caller).

        `shared_end`: the shared tier holds `keys[:shared_end]` beyond the local prefix (the caller asked it,
        outside the directory); those blocks are fetched through the first tier after the local prefix, as far
        as room allows. A stale answer costs a failed fetch (a miss), never a wrong block. `parent`: the key
        before `keys[0]`, when the caller holds a prefix of the chain itself. `skip`: tiers this load must not
        read (the guard's route for its request). `route`: what picks the chain's partition in a partitioned
        shared tier (`keys.chain_route` of the whole chain), carried on its fetches.
        """
        return self._loads.plan(keys, shared_end, parent, skip, route)

    def finish_load(self, plan: Plan) -> None:
        """Unpin a load's prefix once the caller holds its bytes: every block it pinned, which is every block but
        those read straight from the shared tier (none of ours; a store may have added one since, pinned by
        others)."""
        self._loads.finish(plan)

    def plan_store(
        self, keys: Sequence[bytes], parent: bytes | None = None, priority: int = DEFAULT_PRIORITY,
        route: bytes | None = None,
    ) -> Plan:
        """Plan storing the blocks of one chain (`keys[i]`'s parent is `keys[i-1]`, the first's is `parent`).

        Blocks already present are touched. The chain stops at the first block that is not admitted or finds
        no room: storing its descendants would create orphans.

        With a shared tier, every block of the chain that has a first-tier copy (new or not) is also written
        through to it, parents first, until the shared tier's admission refuses one. Its step is the last of
        the block's chain (or a chain of its own); the mover runs these steps as batches after the rest of
        the plan, and skips the blocks the shared tier already holds. `route`: as for `plan_load`, carried on
        the write-through steps.
        """
        return self._stores.plan(keys, parent, priority, route)

    def take_garbage(self) -> list[Step]:
        """Deletes that became necessary outside a plan; the caller hands them to the mover."""
        return self._table.take_garbage()

    # ---------------------------------------------------------------- completions

    def complete(self, step: Step, status: Status) -> None:
        """The mover finished `step`. Only now does a copy become readable or a slot reusable."""
        if step.op is Op.DELETE:
            self._delete_done(step, ok=status is Status.OK)
            return
        copy = step.op is Op.COPY  # only a COPY pins its block (a write-through) or holds the copy it reads
        if copy and self._shared is not None and self._shared.step_done(step):
            return
        if step.dst == CALLER and self.shared is not None and step.src == self.shared.name:
            return  # a fetch read straight into the caller: no block of ours
        holds = copy and self._ledger.release_hold(step)
        block = self._table.find(step.key)
        if block is None:
            return
        if holds and (src := block.copies.get(step.src)) is not None:
            src.readers -= 1
        if status is Status.SOURCE_LOST and step.src in block.copies:  # gone behind our back, or a demotion's
            self._table.remove_copy(block, self.tier[step.src], already_deleted=True)  # source already left
            self.stats.evictions[(step.src, "lost")] += 1
        if step.op is Op.GET:
            if not block.copies and not block.retiring:
                self._table.drop(block)
            return
        self._written(block, step, status)

    def complete_many(self, steps: Iterable[Step], status: Status) -> None:
        """`complete` each of `steps` in turn, all with `status`. Those that succeeded and change no more than a
        state take a short way: a PUT into a live block's copy being written (it becomes readable), a GET from a
        live block of ours (nothing to do): a long request's steps, nearly all."""
        if status is not Status.OK:
            for step in steps:
                self.complete(step, status)
            return
        blocks, table = self._table.blocks, self._table
        put, get, writing, ready = Op.PUT, Op.GET, CopyState.WRITING, CopyState.READY
        shared = self.shared.name if self.shared is not None else None
        for step in steps:
            op = step.op
            block = blocks.get(step.key)
            if block is not None and not block.retiring:
                if op is put:
                    copy = block.copies.get(step.dst)
                    if copy is not None and copy.state is writing:
                        copy.state = ready
                        table.announce(step.key, step.dst, True)
                        continue
                elif op is get and block.copies and step.src != shared:
                    continue
            self.complete(step, status)

    def _written(self, block: Block, step: Step, status: Status) -> None:
        """A COPY or PUT into `step.dst` ended: its copy there is readable now, or gone; a block left in no tier,
        or dropped meanwhile, leaves (or retires) once no transfer touches it."""
        table = self._table
        dst = block.copies.get(step.dst)
        if dst is not None and dst.state is CopyState.WRITING:
            if status is Status.OK:
                dst.state = CopyState.READY  # a dropped block's copy is released below, once no transfer reads it
                if not block.retiring:
                    table.announce(step.key, step.dst, True)
            else:
                table.remove_copy(block, self.tier[step.dst], already_deleted=True)
        if block.retiring:
            table.release_idle(block)
        elif not block.copies:
            table.drop(block)

    def _delete_done(self, step: Step, ok: bool) -> None:
        """A delete ran: its key may be written again, and its bytes stop counting. One that failed may have
        left its file: its bytes stay counted (the next restart's scan finds the file and takes it back)."""
        accounted = self._ledger.delete_done(step)
        if ok and accounted:
            self.tier[step.src].used_blocks -= 1
        elif not ok:
            self.stats.failed_deletes[step.src] += 1
            if not accounted:  # its bytes went to the write after it in the chain, which the mover now skips:
                self._ledger.owe(step.src)  # that write's count stays, for this file (see `BlockTable.remove_copy`)

    # ---------------------------------------------------------------- restart, reset

    def adopt(self, tier_name: str, blocks: Iterable[tuple[bytes, bytes | None]]) -> list[Step]:
        """Take back blocks a restart found in a persistent tier (oldest first). Returns deletes (and nothing
        else) for the rest: orphans, and whatever exceeds the tier's capacity (dropped, not demoted: nothing
        runs the copies of a restart). Blocks the directory already has there are skipped."""
        return adopt(self._room, tier_name, blocks)

    def drop_all(self) -> None:
        """Forget every block (the engine's weights changed): each leaves as any dropped block does, its copies
        freed once no transfer touches them, its files deleted (`take_garbage`)."""
        table = self._table
        for block in list(table.blocks.values()):
            if block.key in table.blocks:  # not dropped already, as a descendant
                table.drop(block)
        self._sightings.clear()
        self._read_below.clear()

    # ---------------------------------------------------------------- inspection, for metrics and tests

    def __contains__(self, key: bytes) -> bool:
        return key in self._table.blocks

    def __len__(self) -> int:
        return len(self._table.blocks)

    def residency(self, key: bytes) -> dict[str, CopyState]:
        block = self._table.blocks.get(key)
        return {} if block is None else {name: c.state for name, c in block.copies.items()}

    def blocks(self) -> Mapping[bytes, Block]:
        """The blocks lookups find, by key (read-only)."""
        return MappingProxyType(self._table.blocks)

    def retiring(self) -> Mapping[bytes, Block]:
        """Dropped blocks a transfer still touches, by key (read-only): their copies still count."""
        return MappingProxyType(self._table.retiring)

    def keys_in(self, tier_name: str, state: CopyState | None = None) -> list[bytes]:
        return self._table.keys_in(tier_name, state)

    def pinned(self) -> list[bytes]:
        return self._table.pinned()

    def accounted(self, step: Step) -> bool:
        """True while `step` (a delete) still has its bytes counted against its tier."""
        return self._ledger.accounted(step)

    def owed(self, tier_name: str) -> int:
        """Files a failed delete left in `tier_name` whose count a lost copy has not taken over yet."""
        return self._ledger.owed(tier_name)

    def orphans(self) -> int:
        """Blocks whose parent is in no tier. Always 0 unless there is a bug."""
        return self._table.orphans()

    def orphans_by_tier(self) -> dict[str, int]:
        return self._table.orphans_by_tier()
