"""Miss-ratio curves and policy replays: against a brute-force LRU, libCacheSim, and the published Figure 9.

Figure 9 of the Mooncake FAST'25 paper does not say how its hit rate is weighted. Token-weighted prefix hits
(hit tokens = min(hit blocks x 512, input tokens), summed over requests, / all input tokens) land inside the
published values +- 0.05 at every capacity on both traces, and closest to them; block-weighted hits land
inside too but nearer the edge on the conversation trace; a per-request mean does not (0.10 against 0.045 at
10k tokens on the conversation trace, 0.43 against 0.66 at 50M tokens on the synthetic one).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from functools import cache

import libcachesim  # a test dependency: a missing package must fail here, never skip
import numpy as np
import pytest

from kvtier.bench import simulator as bench_sim
from kvtier.layout import preset
from kvtier.policies import make_policy
from kvtier.sim.compiled_policy_replay import dense_ids, replay_ids
from kvtier.sim.mrc import lru_mrc, stack_distances
from kvtier.sim.policy_replay import policy_replay, replay_blocks
from kvtier.traces.mooncake import read_mooncake
from kvtier.traces.request import TraceRequest
from tests.conftest import PUBLIC_TRACES

SHARED = PUBLIC_TRACES
TRACES = ("conversation", "synthetic")


@cache
def mooncake(name: str) -> tuple[TraceRequest, ...]:
    return tuple(read_mooncake(SHARED / "mooncake" / f"{name}_trace.jsonl"))


@cache
def mooncake_curve(name: str):
    return lru_mrc(mooncake(name))


def block_sequence(requests) -> list[int]:
    return [b for r in requests for b in r.blocks]


# ---------------------------------------------------------------- against a brute-force LRU


def reference_lru(requests, capacity: int) -> tuple[int, int, int]:
    """(block hits, leading-run hits, hit tokens) of a plain LRU: blocks accessed in order, a miss evicts the LRU."""
    cache_: OrderedDict[int, None] = OrderedDict()
    hits = lead_hits = tokens = 0
    for r in requests:
        lead, leading = 0, True
        for b in r.blocks:
            hit = b in cache_
            if hit:
                cache_.move_to_end(b)
            elif capacity:
                if len(cache_) >= capacity:
                    cache_.popitem(last=False)
                cache_[b] = None
            hits += hit
            leading &= hit
            lead += leading
        lead_hits += lead
        tokens += min(lead * r.block_tokens, r.input_tokens)
    return hits, lead_hits, tokens


def random_trace(seed: int, n: int = 120, chained: bool = True, block_tokens: int = 4) -> list[TraceRequest]:
    """Chained: every request extends a prefix of an earlier one with new blocks. Not chained: any ids, repeats too."""
    rng = np.random.default_rng(seed)
    out: list[TraceRequest] = []
    next_id = 0
    for i in range(n):
        if chained:
            base = out[rng.integers(len(out))].blocks if out and rng.random() < 0.8 else ()
            keep = base[: rng.integers(0, len(base) + 1)]
            extra = int(rng.integers(0 if keep else 1, 4))
            blocks = keep + tuple(range(next_id, next_id + extra))
            next_id += extra
        else:
            blocks = tuple(int(b) for b in rng.integers(0, 30, size=rng.integers(1, 6)))
        input_tokens = (len(blocks) - 1) * block_tokens + int(rng.integers(1, block_tokens + 1))
        out.append(TraceRequest(float(i), blocks, input_tokens, 0, block_tokens))
    return out


def test_stack_distances_match_their_definition() -> None:
    rng = np.random.default_rng(0)
    for _ in range(100):
        seq = rng.integers(0, 8, size=rng.integers(1, 60)).tolist()
        last: dict[int, int] = {}
        expected = []
        for i, b in enumerate(seq):
            expected.append(len(set(seq[last[b] + 1 : i])) if b in last else -1)
            last[b] = i
        assert stack_distances(np.array(seq)).tolist() == expected


@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_the_curve_equals_a_brute_force_lru_at_every_capacity(chained: bool, chunk: int) -> None:
    for seed in range(3):
        requests = random_trace(seed, chained=chained)
        curve = lru_mrc(requests, chunk_accesses=chunk)
        assert curve.distinct_blocks == len(set(block_sequence(requests)))
        for capacity in range(curve.distinct_blocks + 3):
            hits, lead, tokens = reference_lru(requests, capacity)
            assert curve.hits(capacity) == hits
            assert curve.hit_prefix_blocks[min(capacity, curve.distinct_blocks)] == lead
            assert curve.hits(capacity, weight="tokens") == tokens
        if chained:  # a request's hits are always a leading run of its blocks
            assert np.array_equal(curve.hit_blocks, curve.hit_prefix_blocks)


def test_on_unchained_traces_a_hit_after_a_miss_is_not_a_prefix_hit() -> None:
    requests = [TraceRequest(0, (2,), 4, 0, 4), TraceRequest(1, (0, 1), 8, 0, 4), TraceRequest(2, (9, 1), 8, 0, 4)]
    curve = lru_mrc(requests)  # capacity 2: 9 misses and evicts 0, then 1 hits
    assert (curve.hits(2), curve.hit_prefix_blocks[2], curve.hits(2, "tokens")) == (1, 0, 0)


def test_an_empty_trace_has_an_empty_curve() -> None:
    curve = lru_mrc([])
    assert curve.distinct_blocks == 0 and curve.hit_ratio(10) == 0.0 and curve.hit_ratio(10, "tokens") == 0.0


def test_capacities_in_tokens_and_bytes_use_a_model_preset() -> None:
    curve = mooncake_curve("synthetic")
    per_token = preset("llama-3.1-70b").bytes_per_token
    assert per_token == 320 * 1024  # the paper's LLaMA3-70B: 320 KB per token, 160 MiB per 512-token block
    assert curve.capacity_bytes("llama-3.1-70b")[1000] == 1000 * 512 * per_token
    assert np.array_equal(curve.hit_bytes("llama-3.1-70b"), curve.hit_tokens * per_token)
    assert curve.blocks_for_tokens(3e6) == 5859
    assert curve.hit_ratio(10**9) == curve.hit_ratio(curve.distinct_blocks) == 1 - 43_924 / 121_877
    with pytest.raises(ValueError, match="weight"):
        curve.hit_ratio(10, weight="bytes")


# ---------------------------------------------------------------- the real traces


def test_chunked_and_whole_curves_agree_on_a_real_trace() -> None:
    whole, chunked = mooncake_curve("synthetic"), lru_mrc(mooncake("synthetic"), chunk_accesses=10_000)
    for field in ("hit_blocks", "hit_prefix_blocks", "hit_tokens"):
        assert np.array_equal(getattr(whole, field), getattr(chunked, field)), field


@pytest.mark.parametrize("name", TRACES)
def test_figure_9_hit_rates_within_the_published_band(name: str) -> None:
    figure = json.loads((SHARED / "reference_figures.json").read_text())
    fig9 = figure["mooncake_fast25"]["fig9_hit_rate_vs_capacity_tokens_digitized"]
    curve = mooncake_curve(name)
    assert np.array_equal(curve.hit_blocks, curve.hit_prefix_blocks)  # Mooncake ids are chained
    for tokens, published in zip(fig9["capacity_tokens"], fig9[name], strict=True):
        capacity = curve.blocks_for_tokens(tokens)
        ours = curve.hit_ratio(capacity, weight="tokens")
        assert abs(ours - published) <= 0.05, (name, tokens, ours, published)


@pytest.mark.parametrize("name", TRACES)
def test_the_curve_equals_libcachesim_lru_exactly(name: str) -> None:
    blocks, curve = block_sequence(mooncake(name)), mooncake_curve(name)
    for capacity in (1, 19, 1953, 5859, 19531):
        lru = libcachesim.LRU(cache_size=capacity, hashpower=18)
        req = libcachesim.Request()
        req.obj_size = 1
        hits = 0
        for b in blocks:
            req.obj_id = b
            hits += lru.get(req)
        assert curve.hits(capacity) == hits, capacity


# ---------------------------------------------------------------- policy replay through kvtier's own policies


@pytest.mark.parametrize("name", TRACES)
def test_fast_lru_replay_equals_the_curve(name: str) -> None:
    requests, curve = mooncake(name), mooncake_curve(name)
    for capacity in (19, 1953, 19531):
        result = policy_replay(requests, "lru", capacity)
        assert result.accesses == curve.accesses and result.input_tokens == curve.input_tokens
        assert result.hits == curve.hits(capacity)
        assert result.hit_prefix_blocks == curve.hit_prefix_blocks[capacity]
        assert result.hit_tokens == curve.hits(capacity, weight="tokens")
    # priority retention with one priority everywhere is LRU; the block-only replay counts the same hits
    assert policy_replay(requests, "priority", 1953).hits == curve.hits(1953)
    assert replay_blocks(block_sequence(requests), "lru", 1953) == curve.hits(1953)


ORACLE = {"arc": libcachesim.ARC, "s3fifo": libcachesim.S3FIFO}


@pytest.mark.parametrize("policy", sorted(ORACLE))
@pytest.mark.parametrize("capacity", [200, 2000, 20000])
def test_policy_replay_is_within_a_percent_of_libcachesim(policy: str, capacity: int) -> None:
    """The tolerance of tests/test_policies.py, on the conversation trace's block sequence."""
    requests = mooncake("conversation")
    blocks = block_sequence(requests)
    oracle = ORACLE[policy](cache_size=capacity, hashpower=18)
    req = libcachesim.Request()
    req.obj_size = 1
    theirs = 0
    for b in blocks:
        req.obj_id = b
        theirs += oracle.get(req)
    ours = policy_replay(requests, policy, capacity).hits
    assert abs(ours - theirs) / len(blocks) <= 0.01, (ours, theirs)


def test_policy_replay_refuses_a_used_policy() -> None:
    from kvtier.policies import LRUPolicy

    policy = LRUPolicy(4)
    policy.insert(1)
    with pytest.raises(ValueError, match="empty"):
        replay_blocks([1, 2], policy)


def test_bench_sim_quick_reports_every_figure() -> None:
    result = bench_sim.run(quick=True)
    assert result["mrc_equals_libcachesim"] is True
    for name in ("mrc_vs_libcachesim", "replay_lru_accesses_per_s", "replay_arc_accesses_per_s",
                 "replay_s3fifo_accesses_per_s", "libcachesim_arc_accesses_per_s", "libcachesim_s3fifo_accesses_per_s"):
        assert isinstance(result[name], float) and result[name] > 0, name
    for policy in ("lru", "arc", "s3fifo"):  # same sequence, same capacity: the hit ratios agree
        assert abs(result[f"replay_{policy}_hit_ratio"] - result[f"libcachesim_{policy}_hit_ratio"]) <= 0.01
        assert result[f"replay_{policy}_equals_objects"] is True
        assert result[f"replay_{policy}_objects_accesses_per_s"] > 0


# ---------------------------------------------------------------- compiled replays against the policy objects


def replay_objects(requests, policy: str, capacity: int) -> tuple[list[int], list[int]]:
    """Per request: block hits and leading hits, through the runtime's policy objects (policy_replay's loop)."""
    cache_ = make_policy(policy, capacity)
    hits, leads = [], []
    for r in requests:
        hit = lead = 0
        leading = True
        for b in r.blocks:
            if b in cache_:
                cache_.touch(b)
                hit += 1
                lead += leading
                continue
            leading = False
            if len(cache_) >= capacity:
                cache_.evicted(next(iter(cache_.candidates(b))))
            cache_.insert(b)
        hits.append(hit)
        leads.append(lead)
    return hits, leads


def replay_compiled(requests, policy: str, capacity: int) -> tuple[list[int], list[int]]:
    starts = np.cumsum([0] + [len(r.blocks) for r in requests])
    blocks = np.array([b for r in requests for b in r.blocks], dtype=np.int64)
    hits, leads = replay_ids(policy, dense_ids(blocks), starts, capacity)
    return hits.tolist(), leads.tolist()


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_compiled_replays_decide_as_the_policy_objects_request_by_request(policy: str) -> None:
    """Small caches over repeating ids: every ghost, discard, warm-up and clock path is taken many times."""
    for seed in range(12):
        for chained in (True, False):
            requests = random_trace(seed, n=300, chained=chained)
            for capacity in (1, 2, 3, 5, 8, 13, 40):
                assert replay_compiled(requests, policy, capacity) == replay_objects(requests, policy, capacity), (
                    seed, chained, capacity)


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_policy_replay_by_name_equals_the_policy_objects_on_a_real_trace(policy: str) -> None:
    requests = mooncake("conversation")
    for capacity in (200, 5859, 20000):
        compiled = policy_replay(requests, policy, capacity)
        assert compiled == policy_replay(requests, make_policy(policy, capacity))
        assert compiled.hits > 0


def test_compiled_replay_takes_sparse_ids() -> None:
    """Ids far apart (hashes, negatives) are made dense first: the same hits as the objects."""
    requests = [TraceRequest(float(i), tuple(b * 7_919_000_003 - 10**12 for b in r.blocks), r.input_tokens, 0,
                             r.block_tokens) for i, r in enumerate(random_trace(3, n=200, chained=False))]
    assert replay_compiled(requests, "arc", 6) == replay_objects(requests, "arc", 6)
