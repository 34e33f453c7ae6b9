"""Eviction policies: against libCacheSim as an oracle, each policy's order, and the chain rules of the directory.

The oracle runs the real directory (a single host tier, replayed by the simulator's mover) on single-block
requests, so a hit count that differs from libCacheSim's means the directory or the policy orders blocks
differently from the published algorithm.
"""

from __future__ import annotations

from functools import cache

import libcachesim  # a test dependency: a missing package must fail here, never skip
import numpy as np
import pytest

from kvtier.admission import AdmissionRule
from kvtier.directory import CopyState, Directory, TierSpec
from kvtier.policies import ARCPolicy, LRUPolicy, PriorityPolicy, S3FIFOPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.sim.instant_mover import complete_instantly, replay
from kvtier.stores.base import TierKind

# ---------------------------------------------------------------- oracle: libCacheSim on the same requests


@cache
def zipf_and_scans(n: int = 100_000, objects: int = 2000, alpha: float = 0.9, seed: int = 7) -> list[int]:
    """Zipf popularity, interrupted by scans of one-hit wonders and sweeps over a run of (mostly cold) objects."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, objects + 1) ** alpha
    perm = rng.permutation(objects)
    out: list[int] = []
    fresh = objects
    while len(out) < n:
        out.extend(perm[rng.choice(objects, size=2000, p=weights / weights.sum())].tolist())
        if rng.random() < 0.5:
            out.extend(range(fresh, fresh + 300))
            fresh += 300
        else:
            start = int(rng.integers(0, objects - 400))
            out.extend(perm[start : start + 400].tolist())
    return out[:n]


ORACLE = {"lru": libcachesim.LRU, "arc": libcachesim.ARC, "s3fifo": libcachesim.S3FIFO}


def oracle_hits(name: str, capacity: int) -> int:
    cache = ORACLE[name](cache_size=capacity)
    req = libcachesim.Request()
    req.obj_size = 1
    hits = 0
    for obj in zipf_and_scans():
        req.obj_id = obj
        hits += bool(cache.get(req))
    return hits


def directory_hits(name: str, capacity: int) -> int:
    d = Directory([TierSpec("host", capacity, 1, kind=TierKind.HOST, policy=name)])
    trace = zipf_and_scans()
    result = replay(d, ([obj.to_bytes(8, "little")] for obj in trace))
    assert result.blocks == len(trace) and set(result.hits) <= {"host"}
    assert d.tier["host"].used_blocks == capacity  # the trace fills the tier; nothing leaks
    return result.hits["host"]


@pytest.mark.parametrize("capacity", [50, 200, 800])
def test_lru_hits_equal_libcachesim(capacity: int) -> None:
    assert directory_hits("lru", capacity) == oracle_hits("lru", capacity)


@pytest.mark.parametrize("name", ["arc", "s3fifo"])
@pytest.mark.parametrize("capacity", [50, 200, 800])
def test_hit_ratio_within_a_percent_of_libcachesim(name: str, capacity: int) -> None:
    ours, theirs = directory_hits(name, capacity), oracle_hits(name, capacity)
    assert abs(ours - theirs) / len(zipf_and_scans()) <= 0.01, (ours, theirs)


def test_the_trace_separates_the_policies() -> None:
    """Scan resistance matters on this trace: an oracle that could not tell LRU from ARC would prove little."""
    lru, arc, s3 = (oracle_hits(n, 200) / len(zipf_and_scans()) for n in ("lru", "arc", "s3fifo"))
    assert arc > lru + 0.03 and s3 > lru + 0.03


# ---------------------------------------------------------------- each policy's order


def evict(policy: EvictionPolicy, incoming: object = None) -> object:
    """What the directory does when nothing is pinned: take the first candidate."""
    victim = next(iter(policy.candidates(incoming)))
    policy.evicted(victim)
    return victim


def test_lru_evicts_least_recently_used() -> None:
    p = LRUPolicy(4)
    for k in "abcd":
        p.insert(k)
    p.touch("a")
    p.remove("c")
    assert list(p.candidates()) == ["b", "d", "a"]
    assert evict(p) == "b" and "b" not in p and len(p) == 2
    p.insert("b")
    assert list(p.candidates()) == ["d", "a", "b"]


def test_priority_evicts_lowest_priority_first_then_lru() -> None:
    p = PriorityPolicy(8)
    p.insert("keep", 90)
    p.insert("old", 35)
    p.insert("low", 10)
    p.insert("new", 35)
    p.touch("old")  # now more recent than "new", within its level
    p.touch("keep")
    assert list(p.candidates()) == ["low", "new", "old", "keep"]
    assert evict(p) == "low"
    p.insert("new", 95)  # re-inserting moves a block to its new level
    assert list(p.candidates()) == ["old", "keep", "new"]
    with pytest.raises(ValueError):
        p.insert("x", 101)


def test_s3fifo_sends_a_ghost_back_to_main_and_a_newcomer_to_small() -> None:
    p = S3FIFOPolicy(10)  # small 1, main 9, ghost 9
    for i in range(10):
        p.insert(f"k{i}")  # k0 in small; while nothing was evicted the rest warm up main
    assert evict(p) == "k0"  # small first: unhit, it leaves for the ghost queue
    p.insert("k0")  # seen again while a ghost: straight to main
    p.insert("new")  # never seen: small
    assert evict(p) == "k1"  # main is over its share: its oldest unhit block goes
    assert evict(p) == "new"  # then small's newcomer, which was never hit
    assert "k0" in p and len(p) == 9


def test_s3fifo_promotes_a_block_hit_in_small_and_gives_main_blocks_a_second_chance() -> None:
    p = S3FIFOPolicy(10)
    for i in range(10):
        p.insert(f"k{i}")
    evict(p)  # k0 -> ghost; from now on newcomers go to small
    p.insert("hot")
    p.touch("hot")
    p.touch("hot")  # two hits: it moves to main instead of being evicted
    p.touch("k1")  # one hit in main: passed over once
    victims = [evict(p) for _ in range(3)]
    assert victims == ["k2", "k3", "k4"]
    assert "hot" in p and "k1" in p


def test_arc_adapts_p_to_ghost_hits() -> None:
    p = ARCPolicy(4)
    for k in "ab":
        p.insert(k)
        p.touch(k)  # a, b: frequency list T2
    p.insert("c")
    p.insert("d")  # c, d: recency list T1
    assert p.p == 0
    assert evict(p, "e") == "c"  # T1 exceeds its target p = 0: its LRU block leaves for ghost list B1
    p.insert("e")
    assert evict(p, "c") == "d" and p.p == 1  # a hit in B1: recency deserved more room
    p.insert("c")  # back from B1: it goes to T2
    assert evict(p, "f") == "a"  # |T1| = 1 is not above p = 1: T2's LRU block leaves, for ghost list B2
    p.insert("f")
    assert evict(p, "a") == "e" and p.p == 0  # a hit in B2: frequency deserved more room, T1 gives it
    p.insert("a")
    assert sorted(k for k in "abcdef" if k in p) == ["a", "b", "c", "f"] and len(p) == 4


# ---------------------------------------------------------------- the chain: leaves go first, roots take their subtree


def settle(d: Directory, plan) -> None:
    complete_instantly(d, plan)
    d.finish_load(plan)


def test_pressure_evicts_a_chain_from_its_leaf() -> None:
    d = Directory([TierSpec("host", 4, 1, kind=TierKind.HOST), TierSpec("disk", 8, 1)])
    chain = [b"a", b"b", b"c", b"d"]
    settle(d, d.plan_store(chain))
    left: list[bytes] = []
    for i in range(4):
        settle(d, d.plan_store([f"u{i}".encode()]))
        left += [k for k in chain if "host" not in d.residency(k) and k not in left]
        assert d.lookup(chain) == ["host"] * (3 - i) + ["disk"] * (i + 1)
    assert left == chain[::-1]
    assert d.orphans() == 0


def test_the_last_tier_evicts_leaves_even_when_a_root_is_oldest() -> None:
    d = Directory([TierSpec("host", 1, 1, kind=TierKind.HOST), TierSpec("disk", 3, 1)])
    chain = [b"r", b"c1", b"c2"]
    assert d.adopt("disk", [(b"r", None), (b"c1", b"r"), (b"c2", b"c1")]) == []  # the root is the oldest
    settle(d, d.plan_store([b"u1"]))
    settle(d, d.plan_store([b"u2"]))  # u1 -> disk: one block of the chain must go
    assert d.lookup(chain) == ["disk", "disk"]
    settle(d, d.plan_store([b"u3"]))  # u2 -> disk
    assert d.lookup(chain) == ["disk"]
    assert d.orphans() == 0


def test_dropping_a_root_from_the_last_tier_drops_its_descendants_in_every_tier() -> None:
    d = Directory([TierSpec("host", 2, 1, kind=TierKind.HOST), TierSpec("disk", 2, 1)])
    r, c1, c2 = b"r", b"c1", b"c2"
    settle(d, d.plan_store([r]))
    settle(d, d.plan_store([c1], parent=r))
    settle(d, d.plan_store([b"x"]))  # r -> disk
    settle(d, d.plan_store([c2], parent=c1))  # x -> disk
    settle(d, d.plan_store([b"y"]))  # c1 -> disk, which drops the leaf x
    settle(d, d.plan_store([c2], parent=c1))  # c2 is used again: y is now the oldest in host
    assert d.residency(r) == {"disk": CopyState.READY} and d.residency(c1) == {"disk": CopyState.READY}
    assert d.residency(c2) == {"host": CopyState.READY}
    settle(d, d.plan_store([b"z"]))  # y -> disk, where only r and c1 are: no leaf left, so r goes
    for k in (r, c1, c2):
        assert k not in d and d.residency(k) == {}
    assert d.lookup([r, c1, c2]) == [] and d.lookup([c1]) == [] and d.lookup([c2]) == []
    assert d.orphans() == 0
    assert sorted(d.keys_in("host")) == [b"z"] and sorted(d.keys_in("disk")) == [b"y"]
    assert d.used_bytes("host") == 1 and d.used_bytes("disk") == 1


def test_admission_on_sightings_stores_on_the_second_request() -> None:
    d = Directory([TierSpec("host", 4, 1, kind=TierKind.HOST, admission=AdmissionRule(min_sightings=2))])
    settle(d, d.plan_store([b"a"]))
    assert b"a" not in d
    settle(d, d.plan_store([b"a"]))
    assert d.lookup([b"a"]) == ["host"]
