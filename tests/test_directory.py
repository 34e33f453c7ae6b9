"""The directory under random traffic, with a mover that completes steps late, out of order and with faults.

A hypothesis state machine drives a Directory of 2-3 tiers (a slotted host tier, one or two unslotted disk
tiers; random policies, admission and write-through) with requests that are chains of one random prefix tree,
so that requests share prefixes. Plans are held "in flight": their steps complete later, interleaved with new
lookups, loads and stores, in a random order (steps of one chain in order, as the mover runs them), and each
completes OK, FAILED or SOURCE_LOST (reads from a disk tier). Deletes from `take_garbage()` run too.

Next to the directory runs a model of the bytes: which key each host slot holds and which files each disk tier
holds, updated as the simulated mover executes each step. That is what makes the checks strong: a READY copy
must hold its bytes, a read must find the bytes it was planned for, nothing may be left behind.

Checked after every operation:
- no tier exceeds its capacity, in the directory's accounting or in bytes that exist;
- slots: no two copies share one, a free slot is held by no copy and touched by no transfer in flight, two
  transfers of different chains never touch the same slot if one of them writes it, no slot leaks;
- pins: every key of an unfinished load is still in the directory with the copy it is read from
  (unless a read of that block reported SOURCE_LOST);
- no orphans: `orphans() == 0` and every block's parent is in the directory;
- lookups return only READY copies that really hold their bytes: a writing block is never readable.
And after draining everything: exact accounting, no pins, no readers, no orphaned bytes.
"""

from __future__ import annotations

import pickle
import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.admission import AdmissionRule
from kvtier.directory import CALLER, CopyState, Directory, Op, Plan, Status, Step, TierSpec, pack_chains, unpack_chains
from kvtier.sim.instant_mover import complete_instantly
from kvtier.stores.base import TierKind

BLOCK = 4096
POLICIES = ["lru", "arc", "s3fifo", "priority"]
Path = tuple[int, ...]


def key(path: Path) -> bytes:
    """(1, 2, 3) names the block whose parent is (1, 2): one node of the prefix tree."""
    return b"k" + bytes(path)


def chain(path: Path) -> list[bytes]:
    return [key(path[: i + 1]) for i in range(len(path))]


@st.composite
def tier_specs(draw: st.DrawFn) -> list[TierSpec]:
    def admission(adaptive: bool = False) -> AdmissionRule:
        return AdmissionRule(min_sightings=draw(st.integers(1, 2)), adaptive=adaptive)

    specs = [TierSpec("host", draw(st.integers(4, 12)) * BLOCK, BLOCK, kind=TierKind.HOST,
                      policy=draw(st.sampled_from(POLICIES)), admission=admission())]
    for name in ["disk", "disk1"][: draw(st.integers(1, 2))]:
        specs.append(TierSpec(name, draw(st.integers(6, 20)) * BLOCK, BLOCK, policy=draw(st.sampled_from(POLICIES)),
                              admission=admission(draw(st.booleans())), write_through=draw(st.booleans())))
    return specs


paths = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)
priorities = st.sampled_from([10, 35, 80])
ROLLS = 20  # how a step ends: a roll of 0-16 is OK, 17-18 FAILED, 19 SOURCE_LOST (for reads from a disk tier)
rolls = st.integers(0, ROLLS - 1)


@dataclass
class Load:
    plan: Plan
    open_chains: int = 0
    lost_from: int = 1 << 30  # keys from this index on may lose their copies (a read reported SOURCE_LOST)


@dataclass
class Chain:
    steps: deque[Step]
    load: Load | None
    failed: set[bytes] = field(default_factory=set)  # the mover skips (as FAILED) a needs_prev step of these keys
    full: set[str] = field(default_factory=set)  # ... and a write into a tier where a delete of the chain failed


@dataclass
class Bytes:
    """What really is where: the content of every host slot, the files of every disk tier."""

    slots: dict[str, list[bytes | None]] = field(default_factory=dict)
    files: dict[str, set[bytes]] = field(default_factory=dict)
    lost: dict[str, set[bytes]] = field(default_factory=dict)  # files found corrupt (SOURCE_LOST), now gone
    left: dict[str, set[bytes]] = field(default_factory=dict)  # files whose delete failed: still there

    def holds(self, tier: str, key: bytes, slot: int | None) -> bool:
        return self.slots[tier][slot] == key if tier in self.slots else key in self.files[tier]


def all_blocks(directory: Directory):
    """Blocks in the directory and blocks dropped with a transfer still in flight (they still hold slots)."""
    yield from directory.blocks().values()
    yield from directory.retiring().values()


class DirectoryMachine(RuleBasedStateMachine):
    @initialize(specs=tier_specs(), stage_loads=st.booleans())
    def setup(self, specs: list[TierSpec], stage_loads: bool) -> None:
        """`stage_loads`: as TieredCache loads (through the host), or as the vLLM connector (straight from disk)."""
        self.d = self._listened(Directory(specs, clock=lambda: 0.0, stage_loads=stage_loads))
        self.adopted: set[tuple[bytes, str]] = set()
        self.slotted = {s.name for s in specs if s.slotted}
        self.bytes = Bytes(
            slots={s.name: [None] * (s.capacity_bytes // s.block_bytes) for s in specs if s.slotted},
            files={s.name: set() for s in specs if not s.slotted},
            lost={s.name: set() for s in specs if not s.slotted},
            left={s.name: set() for s in specs if not s.slotted},
        )
        self.chains: dict[int, Chain] = {}
        self.next_id = 0
        self.loads: list[Load] = []
        self.seen: set[Path] = set()

    # ------------------------------------------------------------ requests

    @rule(path=paths, priority=priorities)
    def request(self, path: Path, priority: int) -> None:
        """What an engine does: load the readable prefix, store the rest (both left in flight)."""
        self.load(path)
        keys, hit = chain(path), len(self.loads[-1].plan.keys)
        if hit < len(keys):
            self.store(path, hit, priority)

    @rule(requests=st.lists(paths, min_size=1, max_size=12), priority=priorities, seed=st.integers(0, 1 << 32))
    def traffic(self, requests: list[Path], priority: int, seed: int) -> None:
        """A burst of requests, each served before the next, while the plans already in flight stay there."""
        rnd = random.Random(seed)
        for path in requests:
            first = self.next_id
            self.request(path, priority)
            while any(cid >= first for cid in self.chains):
                mine = [cid for cid in sorted(self.chains) if cid >= first]
                self._complete_next(rnd.choice(mine), rnd.randrange(ROLLS))
            self.finish_loads()

    @rule(path=paths, cut=st.integers(0, 5), priority=priorities)
    def store(self, path: Path, cut: int, priority: int) -> None:
        """Store the chain's suffix from `cut` on, with its parent (which may or may not be there)."""
        self.seen.add(path)
        keys = chain(path)
        cut = min(cut, len(keys) - 1)
        plan = self.d.plan_store(keys[cut:], parent=keys[cut - 1] if cut else None, priority=priority)
        assert all(s.op is not Op.GET for c in plan.chains for s in c)
        self._submit(plan, None)

    @rule(path=paths)
    def load(self, path: Path) -> None:
        self.seen.add(path)
        keys = chain(path)
        readable = self.d.lookup(keys)
        plan = self.d.plan_load(keys)
        assert plan.keys == keys[: len(plan.keys)]
        assert plan.sources == readable[: len(plan.keys)], "a load must read what the lookup promised"
        gets = sorted(s.index for c in plan.chains for s in c if s.op is Op.GET)
        assert gets == list(range(len(plan.keys))), "one GET per loaded block"
        load = Load(plan)
        self.loads.append(load)
        self._submit(plan, load)

    # ------------------------------------------------------------ the mover

    @rule(pick=st.integers(0, 1 << 16), roll=rolls)
    def complete_one(self, pick: int, roll: int) -> None:
        if self.chains:
            ids = sorted(self.chains)
            self._complete_next(ids[pick % len(ids)], roll)

    @rule(seed=st.integers(0, 1 << 32), n=st.integers(1, 12))
    def complete_some(self, seed: int, n: int) -> None:
        rnd = random.Random(seed)
        for _ in range(n):
            if not self.chains:
                break
            self._complete_next(rnd.choice(sorted(self.chains)), rnd.randrange(ROLLS))

    @rule()
    def finish_loads(self) -> None:
        """The caller got the bytes of every load whose steps all completed: unpin them."""
        for load in [x for x in self.loads if x.open_chains == 0]:
            self.loads.remove(load)
            self.d.finish_load(load.plan)
        self._collect_garbage()

    @rule(seed=st.integers(0, 1 << 32))
    def drain(self, seed: int) -> None:
        """Let every transfer finish (random order, faults included), then check the quiet state."""
        rnd = random.Random(seed)
        while self.chains or self.loads:
            while self.chains:
                self._complete_next(rnd.choice(sorted(self.chains)), rnd.randrange(ROLLS))
            self.finish_loads()
        self.check_quiet()

    @rule(seed=st.integers(0, 1 << 32))
    def restart(self, seed: int) -> None:
        """A restart: host memory is gone, each disk tier's files are adopted back (or deleted)."""
        self.drain(seed)
        self.d = self.fresh_directory()
        for slots in self.bytes.slots.values():
            slots[:] = [None] * len(slots)
        for left in self.bytes.left.values():  # a restart's scan finds every file: none is left over any more
            left.clear()
        rnd = random.Random(seed)
        for name, files in self.bytes.files.items():
            found = sorted(files)
            rnd.shuffle(found)
            for step in self.d.adopt(name, [(k, k[:-1] if len(k) > 2 else None) for k in found]):
                assert step.op is Op.DELETE
                self._execute(step, 0)
                self.d.complete(step, Status.OK)
        self.adopted = {(k, name) for k, b in self.d.blocks().items() for name in b.copies}
        self.check_quiet()

    def fresh_directory(self) -> Directory:
        """The directory a restarted process builds from the same config."""
        return self._listened(Directory([t.spec for t in self.d.tiers], clock=lambda: 0.0,
                                        stage_loads=self.d.stage_loads))

    def _listened(self, d: Directory) -> Directory:
        """`announced`: the (key, tier) pairs the directory's change hook says are readable (the KV events)."""
        self.announced: set[tuple[bytes, str]] = set()

        def on_change(key: bytes, tier: str | None, stored: bool) -> None:
            if tier is None:
                self.announced = {(k, t) for k, t in self.announced if k != key}
            elif stored:
                assert (key, tier) not in self.announced, "announced twice"
                self.announced.add((key, tier))
            else:
                self.announced.discard((key, tier))

        d.on_change = on_change
        return d

    def teardown(self) -> None:
        if hasattr(self, "d"):  # not when setup itself failed
            self.drain(0)

    def _submit(self, plan: Plan, load: Load | None) -> None:
        for steps in plan.chains:
            assert steps, "a plan has no empty chains"
            self.chains[self.next_id] = Chain(deque(steps), load)
            self.next_id += 1
            if load is not None:
                load.open_chains += 1
        self._collect_garbage()

    def _collect_garbage(self) -> None:
        for step in self.d.take_garbage():
            assert step.op is Op.DELETE and self.d.accounted(step) and step.src not in self.slotted
            self._submit(Plan(chains=[[step]]), None)

    def _complete_next(self, chain_id: int, roll: int) -> None:
        c = self.chains[chain_id]
        step = c.steps.popleft()
        if not c.steps:
            del self.chains[chain_id]
            if c.load is not None:
                c.load.open_chains -= 1
        if (step.needs_prev and step.key in c.failed) or step.dst in c.full:
            status = Status.FAILED
        else:
            status = self._execute(step, roll)
        if status is not Status.OK and step.op is Op.DELETE:
            c.full.add(step.src)
        elif status is not Status.OK:
            c.failed.add(step.key)
        if status is Status.SOURCE_LOST:
            for load in self.loads:
                if step.key in load.plan.keys:
                    load.lost_from = min(load.lost_from, load.plan.keys.index(step.key))
        self.d.complete(step, status)
        self._collect_garbage()

    def _execute(self, step: Step, roll: int) -> Status:
        """Do what the mover would do to the bytes; return the status it would report."""
        b = self.bytes
        if step.op is Op.DELETE:
            if roll >= ROLLS - 2 and step.key in b.files[step.src]:  # an I/O error: the file stays
                b.left[step.src].add(step.key)
                return Status.FAILED
            b.files[step.src].discard(step.key)
            b.left[step.src].discard(step.key)
            return Status.OK
        if step.src != CALLER:
            if step.src in self.slotted:  # a slab has no checksum: wrong bytes here would be served silently
                assert b.slots[step.src][step.src_slot] == step.key, f"{step} reads slot holding other bytes"
            elif step.key not in b.files[step.src]:
                assert step.key in b.lost[step.src], f"{step} reads a file the directory deleted"
                return self._failed(step, Status.SOURCE_LOST)
            elif roll == ROLLS - 1:  # the file turned out corrupt: the store removes it
                b.files[step.src].discard(step.key)
                b.left[step.src].discard(step.key)
                b.lost[step.src].add(step.key)
                return self._failed(step, Status.SOURCE_LOST)
        if roll >= ROLLS - 3:
            return self._failed(step, Status.FAILED)
        if step.dst in self.slotted:
            b.slots[step.dst][step.dst_slot] = step.key
        elif step.dst != CALLER:
            b.files[step.dst].add(step.key)
            b.lost[step.dst].discard(step.key)
        return Status.OK

    def _failed(self, step: Step, status: Status) -> Status:
        if step.dst in self.slotted:
            self.bytes.slots[step.dst][step.dst_slot] = None  # torn
        return status  # a disk write goes to a temp file, renamed only on success: nothing changes

    # ------------------------------------------------------------ invariants

    @invariant()
    def announced_is_what_is_readable(self) -> None:
        """Every READY copy of a live block was announced once (or adopted at a restart: not announced), and
        nothing else is announced."""
        ready = {(k, name) for k, b in self.d.blocks().items() for name, c in b.copies.items()
                 if c.state is CopyState.READY}
        assert self.announced <= ready, self.announced - ready
        assert ready <= self.announced | self.adopted, ready - self.announced - self.adopted

    @invariant()
    def within_capacity(self) -> None:
        for tier in self.d.tiers:
            assert 0 <= tier.used_blocks <= tier.capacity_blocks, (tier.name, tier.used_blocks)
        for name, files in self.bytes.files.items():
            assert len(files) <= self.d.tier[name].capacity_blocks, f"{name} holds more files than it may"

    @invariant()
    def slots_are_exclusive(self) -> None:
        for name in self.slotted:
            tier = self.d.tier[name]
            held = Counter(b.copies[name].slot for b in all_blocks(self.d) if name in b.copies)
            assert all(n == 1 for n in held.values()), f"{name}: two copies share a slot: {held}"
            free = tier.free_slots
            assert len(set(free)) == len(free), f"{name}: a slot is free twice"
            assert not set(free) & set(held), f"{name}: a free slot is held by a copy"
            assert len(free) + len(held) == tier.capacity_blocks, f"{name}: a slot leaked"
            assert tier.used_blocks == len(held), f"{name}: used_blocks {tier.used_blocks} != copies {len(held)}"
            touched: dict[int, list[tuple[int, bool]]] = {}
            for cid, step in self._live_steps():
                if step.src == name:
                    touched.setdefault(step.src_slot, []).append((cid, False))
                if step.dst == name:
                    touched.setdefault(step.dst_slot, []).append((cid, True))
            for slot, users in touched.items():
                assert slot not in free, f"{name}: slot {slot} is free while a transfer touches it"
                if any(write for _, write in users):
                    assert len({cid for cid, _ in users}) == 1, (
                        f"{name}: slot {slot} written by one chain, used by another")

    @invariant()
    def accounting_is_exact(self) -> None:
        pending_deletes = Counter(s.src for c in self.chains.values() for s in c.steps
                                  if s.op is Op.DELETE and self.d.accounted(s))
        for name in self.bytes.files:
            copies = sum(1 for b in all_blocks(self.d) if name in b.copies)
            # files a failed delete left count for good, once a lost copy's count went to them (`_owed`)
            left = self.d.stats.failed_deletes[name] - self.d.owed(name)
            assert self.d.tier[name].used_blocks == copies + pending_deletes[name] + left, name
        for tier in self.d.tiers:  # the policy orders exactly the tier's live copies
            live = self.d.keys_in(tier.name)
            assert len(tier.policy) == len(live) and all(k in tier.policy for k in live), tier.name

    @invariant()
    def loads_stay_pinned(self) -> None:
        for load in self.loads:
            for i, (k, source) in enumerate(zip(load.plan.keys, load.plan.sources)):
                if i >= load.lost_from:
                    break
                held = self.held_in(source)
                if held is None:
                    continue
                assert k in self.d, f"pinned block {k!r} left the directory during its load"
                assert held in self.d.residency(k), f"pinned block {k!r} lost its {held} copy during its load"

    def held_in(self, source: str) -> str | None:
        """The tier whose copy a load keeps pinned: the one it reads from (None: a block not in our tiers)."""
        return source

    @invariant()
    def no_orphans(self) -> None:
        assert self.d.orphans() == 0
        for b in self.d.blocks().values():
            assert b.parent is None or b.parent in self.d, f"{b.key!r} is in the directory, its parent is not"
        assert not set(self.d.blocks()) & set(self.d.retiring()), "a key is both live and retiring"

    @invariant()
    def ready_copies_hold_their_bytes(self) -> None:
        for b in all_blocks(self.d):
            for name, copy in b.copies.items():
                if copy.state is CopyState.READY:
                    assert self.bytes.holds(name, b.key, copy.slot), f"READY {name} copy of {b.key!r} has no bytes"

    @invariant()
    def lookups_return_ready_copies(self) -> None:
        for path in self.seen:
            keys = chain(path)
            found = self.d.lookup(keys)
            for k, name in zip(keys, found):
                assert k in self.d, f"lookup returned dropped block {k!r}"
                assert self.d.residency(k)[name] is CopyState.READY, f"lookup counts a {name} copy still writing"
            if len(found) < len(keys):  # the prefix stops where nothing READY is left
                nxt = self.d.residency(keys[len(found)])
                assert CopyState.READY not in nxt.values()

    def _live_steps(self):
        """Steps in flight that will really run (not those the mover will skip after a failed step)."""
        for cid, c in self.chains.items():
            for step in c.steps:
                if step.needs_prev and step.key in c.failed:
                    continue  # assume the others succeed: they may still run
                yield cid, step

    def check_quiet(self) -> None:
        """Nothing in flight: nothing pinned or held, accounting exact, the bytes are exactly the directory's."""
        assert not self.d.pinned()
        assert not self.d.retiring(), "a dropped block never retired"
        for b in self.d.blocks().values():
            assert b.copies, f"{b.key!r} is in no tier"
            for name, copy in b.copies.items():
                assert copy.state is CopyState.READY and copy.readers == 0, (b.key, name, copy)
        for name, files in self.bytes.files.items():
            known = set(self.d.keys_in(name)) | self.bytes.left[name]
            assert files == known, f"{name}: files and directory disagree (orphaned bytes?)"
        assert not any(self.d.owed(t.name) for t in self.d.tiers), (
            "every write a failed delete stopped has completed, and handed its count over")
        for tier in self.d.tiers:
            left = self.d.stats.failed_deletes[tier.name]
            assert tier.used_blocks - left == len(self.d.keys_in(tier.name)) == len(tier.policy), tier.name


DirectoryMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDirectory = DirectoryMachine.TestCase


# ---------------------------------------------------------------- regressions: the bugs the machine found, one each


def done(d: Directory, plan: Plan) -> Plan:
    """Complete a plan at once, every step OK (and the garbage it leaves)."""
    complete_instantly(d, plan)
    return plan


def slots_read(plan: Plan, tier: str) -> set[int]:
    return {s.src_slot for c in plan.chains for s in c if s.src == tier}


def test_dropped_block_keeps_its_slot_until_its_write_through_copy_read_it() -> None:
    d = Directory([TierSpec("host", 4, 1, kind=TierKind.HOST), TierSpec("disk", 8, 1, write_through=True)])
    (put_a, copy_a), (put_b, copy_b) = d.plan_store([b"a", b"b"]).chains
    d.complete(put_a, Status.FAILED)
    d.complete(copy_a, Status.FAILED)  # skipped by the mover: `a` is gone, and `b` with it
    d.complete(put_b, Status.OK)  # `b` is dropped, but its write-through copy has yet to read the slot
    assert put_b.dst_slot not in d.tier["host"].free_slots
    d.complete(copy_b, Status.OK)
    for step in d.take_garbage():
        d.complete(step, Status.OK)
    assert put_b.dst_slot in d.tier["host"].free_slots
    assert len(d) == 0 and d.used_bytes("host") == d.used_bytes("disk") == 0


def test_two_loads_of_one_disk_block_stage_it_once() -> None:
    d = Directory([TierSpec("host", 2, 1, kind=TierKind.HOST), TierSpec("disk", 8, 1)])
    for k in (b"x", b"y", b"z"):
        done(d, d.plan_store([k]))
    assert d.lookup([b"x"]) == ["disk"]
    first, second = d.plan_load([b"x"]), d.plan_load([b"x"])
    assert first.keys == [b"x"] and second.keys == []  # x's host copy is still being written
    host = d.tier["host"]
    assert host.used_blocks + len(host.free_slots) == host.capacity_blocks, "a host slot leaked"
    done(d, first)
    d.finish_load(first)
    assert d.lookup([b"x"]) == ["host"]


def test_a_write_through_copy_follows_the_put_it_depends_on() -> None:
    """The mover skips a needs_prev step when an earlier write of the same key in its chain failed."""
    d = Directory([TierSpec("host", 4, 1, kind=TierKind.HOST), TierSpec("disk", 2, 1, write_through=True),
                   TierSpec("disk1", 2, 1, write_through=True)])
    for k in (b"a", b"b", b"c"):
        plan = d.plan_store([k])
        for steps in plan.chains:
            for i, step in enumerate(steps):
                if step.needs_prev:
                    assert any(b.key == step.key and b.op in (Op.PUT, Op.COPY) and b.dst == step.src
                               for b in steps[:i]), steps
        done(d, plan)
    assert any(s.op is Op.DELETE for c in plan.chains for s in c), "the scenario makes room in the disk tiers"


def test_a_late_delete_never_undoes_a_newer_write_of_the_same_key() -> None:
    d = Directory([TierSpec("host", 2, 1, kind=TierKind.HOST),
                   TierSpec("disk", 4, 1, admission=AdmissionRule(min_priority=30))])
    done(d, d.plan_store([b"p"], priority=10))  # p may not go to disk
    done(d, d.plan_store([b"k"], parent=b"p", priority=80))
    d.finish_load(done(d, d.plan_load([b"p"])))
    done(d, d.plan_store([b"y"], priority=80))  # k goes to disk
    assert d.residency(b"k") == {"disk": CopyState.READY}
    d.finish_load(done(d, d.plan_load([b"y"])))
    for steps in d.plan_store([b"z"], priority=80).chains:  # p is evicted and dropped, and k with it
        for step in steps:
            d.complete(step, Status.OK)
    (late,) = d.take_garbage()  # k's file must go; the mover has not got to it yet
    assert late.key == b"k" and late.src == "disk" and b"k" not in d
    for k in (b"y", b"z"):
        d.finish_load(done(d, d.plan_load([k])))
    done(d, d.plan_store([b"p", b"k"], priority=80))
    assert d.lookup([b"p", b"k"]) == ["host", "host"]
    plan = done(d, d.plan_store([b"w"], priority=80))  # k is evicted from host while its old file's delete waits
    assert not any(s.key == b"k" and s.dst == "disk" for c in plan.chains for s in c), "k's new file would be deleted"
    d.complete(late, Status.OK)
    assert "disk" not in d.residency(b"k")


def test_source_lost_while_demoting_between_disk_tiers() -> None:
    d = Directory([TierSpec("host", 1, 1, kind=TierKind.HOST), TierSpec("disk", 1, 1), TierSpec("disk1", 4, 1)])
    done(d, d.plan_store([b"a"]))
    done(d, d.plan_store([b"b"]))  # a -> disk
    (steps,) = d.plan_store([b"c"]).chains  # b -> disk pushes a -> disk1
    copy = next(s for s in steps if s.src == "disk")
    d.complete(copy, Status.SOURCE_LOST)
    for step in steps[steps.index(copy) + 1 :]:
        d.complete(step, Status.OK)
    assert b"a" not in d and d.lookup([b"b"]) == ["disk"] and d.lookup([b"c"]) == ["host"]
    assert d.used_bytes("disk1") == 0


def test_making_room_never_frees_a_slot_that_a_demotion_still_reads() -> None:
    d = Directory([TierSpec("host", 2, 1, kind=TierKind.HOST), TierSpec("disk", 1, 1)])
    done(d, d.plan_store([b"k1"]))
    done(d, d.plan_store([b"k2"], parent=b"k1"))
    done(d, d.plan_store([b"v"]))  # k1 -> disk: host {k2, v}, disk {k1}
    plan = d.plan_store([b"k3"], parent=b"k2")  # v -> disk, which has room only if k1 goes, and k2 with it
    assert b"k2" not in d and b"k3" not in d and d.orphans() == 0
    assert not slots_read(plan, "host") & set(d.tier["host"].free_slots), "v's slot is free before v was read"
    done(d, plan)
    assert d.lookup([b"v"]) == ["host"] and "disk" in d.residency(b"v")
    host = d.tier["host"]
    assert host.used_blocks + len(host.free_slots) == host.capacity_blocks


def test_store_on_second_sighting_stores_the_whole_chain_the_second_time() -> None:
    d = Directory([TierSpec("host", 8, 1, kind=TierKind.HOST, admission=AdmissionRule(min_sightings=2))])
    keys = [bytes([i]) * 32 for i in range(4)]
    assert done(d, d.plan_store(keys)).chains == []  # first sighting: nothing stored
    second = done(d, d.plan_store(keys))
    assert [s.key for c in second.chains for s in c if s.op is Op.PUT] == keys  # not just the first block
    assert d.stats.admission_rejects[("host", "sightings")] == 1


def test_unstaged_loads_read_disk_straight_and_their_next_store_promotes_what_they_read() -> None:
    d = Directory([TierSpec("host", 2, 1, kind=TierKind.HOST), TierSpec("disk", 8, 1)], stage_loads=False)
    for k in (b"a", b"b", b"c"):
        done(d, d.plan_store([k]))  # the host holds 2: a is demoted to disk
    assert d.residency(b"a") == {"disk": CopyState.READY}
    plan = d.plan_store([b"a"])  # stored again without being read: nothing to promote
    assert not plan.chains and d.residency(b"a") == {"disk": CopyState.READY}
    load = done(d, d.plan_load([b"a"]))
    assert [[(s.op, s.src, s.dst) for s in c] for c in load.chains] == [[(Op.GET, "disk", CALLER)]]
    assert d.residency(b"a") == {"disk": CopyState.READY}  # no host slot taken on the request's path
    d.finish_load(load)
    plan = done(d, d.plan_store([b"a"]))  # the request's store: a PUT from the caller's bytes, after a victim left
    assert [s.op for c in plan.chains for s in c][-1] is Op.PUT
    assert d.residency(b"a") == {"host": CopyState.READY, "disk": CopyState.READY} and d.lookup([b"a"]) == ["host"]
    assert not done(d, d.plan_store([b"a"])).chains  # promoted once


# ---------------------------------------------------------------- admission that learns whether blocks come back


def two_tiers(min_sightings: int = 2, adaptive: bool = False) -> Directory:
    return Directory([TierSpec("host", 4, 1, kind=TierKind.HOST),
                      TierSpec("disk", 64, 1, admission=AdmissionRule(min_sightings=min_sightings, adaptive=adaptive))],
                     stage_loads=False)


def serve(d: Directory, chain: list[bytes]) -> list[str]:
    """What a request does: look the chain up, read what was found, store the whole chain."""
    load = done(d, d.plan_load(chain))
    d.finish_load(load)
    done(d, d.plan_store(chain))
    return load.sources


def test_a_dropped_block_remembers_its_sightings_so_the_second_one_demotes_it() -> None:
    d = two_tiers(min_sightings=2)
    a = [b"a"]
    serve(d, a)
    for k in range(4):  # a leaves host, seen once: refused by the disk, dropped
        serve(d, [bytes([k]) * 4])
    assert a[0] not in d and d.stats.admission_rejects[("disk", "sightings")] >= 1
    assert serve(d, a) == []  # a miss: the second sighting...
    for k in range(4):
        serve(d, [bytes([k]) * 5])
    assert d.residency(a[0]) == {"disk": CopyState.READY}  # ...demotes it when host evicts it again
    assert serve(d, a) == ["disk"]


def test_a_write_through_disk_counts_each_block_offered_to_it_once() -> None:
    """Offered when it is stored, and again when host evicts it (still not on disk): counted once, else the
    evidence that blocks come back would have to be twice as strong."""
    d = Directory([TierSpec("host", 4, 1, kind=TierKind.HOST),
                   TierSpec("disk", 64, 1, write_through=True,
                            admission=AdmissionRule(min_sightings=2, adaptive=True))], stage_loads=False)
    rule = d.tier["disk"].spec.admission
    chains = [[f"u{i}".encode()] for i in range(32)]
    for chain in chains:  # refused by the disk when stored (seen once), evicted from host later
        serve(d, chain)
    assert d.stats.evictions[("host", "capacity")] == 28
    for chain in chains[:3]:  # three come back, and no tier has them
        assert serve(d, chain) == []
    assert rule.sightings_needed == 1  # 3 came back of 35 offered


def test_auto_sightings_keep_unique_traffic_off_the_disk_and_admit_first_sightings_once_blocks_come_back() -> None:
    d = two_tiers(adaptive=True)
    rule = d.tier["disk"].spec.admission
    for i in range(40):  # unique chains: every block is offered to the disk once and never comes back
        serve(d, [f"u{i}-{j}".encode() for j in range(3)])
    assert rule.sightings_needed == 2 and d.keys_in("disk") == []
    assert d.stats.planned_moves[("host", "disk")] == 0 and d.stats.admission_rejects[("disk", "sightings")] > 100

    sessions = [[f"s{i}-{j}".encode() for j in range(2)] for i in range(8)]
    for session in sessions:  # seen once, pushed out of host by the next, dropped
        serve(d, session)
    for session in sessions:  # they come back and no tier has them: the disk would have served them
        assert serve(d, session) == []
    assert rule.sightings_needed == 1  # 16 came back, 150 were offered
    first_sighted = [[f"t{i}-{j}".encode() for j in range(2)] for i in range(8)]
    for session in first_sighted:
        serve(d, session)
    assert serve(d, first_sighted[0]) == ["disk", "disk"]  # seen once, demoted, read back

    for i in range(20_000):  # unique again: nothing comes back, and older evidence fades
        serve(d, [f"v{i}".encode()])
        if rule.sightings_needed == 2:
            break
    assert rule.sightings_needed == 2, "unique traffic kept the disk admitting first sightings"
    written = d.stats.planned_moves[("host", "disk")]
    for i in range(200):
        serve(d, [f"w{i}".encode()])
    assert d.stats.planned_moves[("host", "disk")] == written


@pytest.mark.parametrize("tiers", ["host+disk", "host", "host, disk turned off halfway"])
def test_runs_planned_in_bulk_plan_what_the_per_block_path_plans(monkeypatch, tiers: str) -> None:
    """The bulk paths (`StorePlanner._run`: a run of new blocks with room, or room its evictions make in one
    walk; `LoadPlanner._read_first`: the leading first-tier hits; `Directory.complete_many`: the completions that
    only change a state; `StorePlanner._had_whole` and `_touch_whole`: a whole chain stored again) shortcut the
    per-block loops: random traffic of a prefix tree, through a host tier that fills (and demotes to a disk tier,
    or drops what it evicts, or both once the disk is turned off), plans the same steps (ids, slots and indexes
    included) with them as without them, evicts the same blocks and leaves the same blocks in the same policy
    order."""
    from kvtier.directory.loading import LoadPlanner
    from kvtier.directory.room import Room
    from kvtier.directory.storing import StorePlanner

    rng = random.Random(7)
    trunks = [tuple(rng.randrange(1, 250) for _ in range(rng.randrange(1, 30))) for _ in range(6)]
    requests = [chain(rng.choice(trunks) + tuple(rng.randrange(1, 250) for _ in range(rng.randrange(0, 40))))
                for _ in range(300)]
    specs = [TierSpec("host", 64 * BLOCK, BLOCK, kind=TierKind.HOST)]
    if tiers != "host":
        specs.append(TierSpec("disk", 256 * BLOCK, BLOCK))

    def replay() -> tuple[list, list, Counter]:
        d = Directory(specs)
        plans: list = []
        for n, keys in enumerate(requests):
            if tiers.endswith("halfway") and n == len(requests) // 2:
                d.disabled = {"disk"}
            load = d.plan_load(keys)
            complete_instantly(d, load)
            d.finish_load(load)
            hit = len(load.keys)
            store = d.plan_store(keys[hit:], parent=keys[hit - 1] if hit else None)
            complete_instantly(d, store)
            again = d.plan_store(keys)  # the whole chain once more, as the vLLM connector stores a request's end
            complete_instantly(d, again)
            plans += [load.chains, load.sources, store.chains, again.chains]
        return plans, [list(t.policy.candidates()) for t in d.tiers], d.stats.evictions

    found = Counter()
    with monkeypatch.context() as m:
        victims = Room.victims
        m.setattr(Room, "victims", lambda *args: found.update(["victims"] * bool(v := victims(*args))) or v)
        bulk = replay()
    stats = Counter()
    with monkeypatch.context() as m:
        m.setattr(StorePlanner, "_run", lambda *args: stats.update(["run"]) or [])
        m.setattr(LoadPlanner, "_read_first", lambda *args: stats.update(["read_first"]) or 0)
        m.setattr(Directory, "complete_many", lambda d, steps, status: [d.complete(s, status) for s in steps])
        m.setattr(StorePlanner, "_touch_whole", lambda *args: stats.update(["touch_whole"]) or False)
        m.setattr(StorePlanner, "_had_whole", lambda *args: stats.update(["had_whole"]) or None)
        per_block = replay()
    assert stats["run"] > 50 and stats["read_first"] > 100  # the shortcuts had traffic to shortcut
    assert stats["touch_whole"] > 100 and stats["had_whole"] > 100
    assert sum(len(chains) for chains in bulk[0][2::4]) > 2000  # stores, many of them evicting
    assert (found["victims"] > 20) == (tiers != "host+disk")  # runs that evicted in one walk, where nothing demotes
    assert bulk == per_block


def test_chains_packed_for_another_process_come_back_as_they_were() -> None:
    """What the vLLM connector's multiprocess ranks get (`pack_chains`, pickled): a host tier demoting to disk
    plans chains of several steps and of one; each comes back with every field, a route and a parent included."""
    d = Directory([TierSpec("host", 8 * BLOCK, BLOCK, kind=TierKind.HOST), TierSpec("disk", 64 * BLOCK, BLOCK)])
    chains: list[list[Step]] = []
    for i in range(6):
        plan = d.plan_store(chain(tuple(range(10 * i + 1, 10 * i + 6))))
        complete_instantly(d, plan)
        chains += plan.chains
    chains.append([Step(Op.COPY, b"k", "host", "redis", 3, 4, 5, b"p", True, 99, b"r")])
    assert any(len(c) > 1 for c in chains) and any(len(c) == 1 for c in chains)
    back = unpack_chains(pickle.loads(pickle.dumps(pack_chains(chains), pickle.HIGHEST_PROTOCOL)))
    assert back == chains and back[-1][0].route == b"r" and back[-1][0].needs_prev
    assert unpack_chains(pack_chains([])) == []
