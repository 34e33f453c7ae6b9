"""N engines with local caches vs one global pool (`kvtier.sim.cluster`), on the Mooncake traces.

Each test pins a behaviour a bug would change: one engine is one cache (and agrees with policy_replay and the
LRU miss-ratio curve), a shared pool of the same total capacity never loses to partitioned caches, routing
with prefix affinity beats routing blind to the cache, unlimited capacity reaches the trace's reuse ceiling,
and a seed fixes every result.
"""

from __future__ import annotations

from functools import cache

import pytest

from kvtier.layout import KVLayout
from kvtier.sim.cluster import ClusterConfig, simulate_cluster
from kvtier.sim.cost import CostModel, ModelCompute
from kvtier.sim.mrc import lru_mrc
from kvtier.sim.policy_replay import policy_replay
from kvtier.traces.mooncake import read_mooncake
from kvtier.traces.request import TraceRequest
from tests.conftest import PUBLIC_TRACES

SHARED = PUBLIC_TRACES
TRACES = ("conversation", "synthetic")
PER_ENGINE = 3_000_000 // 512  # Figure 10: 3M tokens per prefill node
HUGE = 1 << 30


@cache
def mooncake(name: str) -> tuple[TraceRequest, ...]:
    return tuple(read_mooncake(SHARED / "mooncake" / f"{name}_trace.jsonl"))


@cache
def run(name: str, engines: int, capacity: int, mode: str, routing: str = "affinity", seed: int = 0, k: int = 2):
    return simulate_cluster(mooncake(name), ClusterConfig(engines, capacity, mode, routing, seed=seed,
                                                          affinity_blocks=k))


@pytest.mark.parametrize("name", TRACES)
def test_one_engine_is_one_cache(name):
    """N = 1: local, global and tiered hit the same tokens, which are policy_replay's and the LRU curve's."""
    requests = mooncake(name)
    hits = {mode: run(name, 1, PER_ENGINE, mode).hit_tokens for mode in ("local", "global", "tiered")}
    assert hits["local"] == hits["global"] == hits["tiered"]
    assert hits["local"] == policy_replay(requests, "lru", PER_ENGINE).hit_tokens
    assert hits["local"] == lru_mrc(requests).hits(PER_ENGINE, "tokens")


@pytest.mark.parametrize("name", TRACES)
def test_global_pool_beats_local_caches_of_the_same_total(name):
    local = run(name, 10, PER_ENGINE, "local")
    pool = run(name, 10, PER_ENGINE, "global")
    tiered = run(name, 10, PER_ENGINE, "tiered")
    assert pool.input_tokens == local.input_tokens == sum(r.input_tokens for r in mooncake(name))
    assert pool.hit_ratio > local.hit_ratio
    assert pool.mean("prefill_s") < local.mean("prefill_s")  # fewer tokens to prefill
    # the tiered shared tier sees the global pool's accesses with its capacity: it is that pool, plus local
    assert tiered.hit_tokens >= pool.hit_tokens
    # one global pool of 10 x 3M is one LRU of 30M blocks, whatever the routing
    assert pool.hit_tokens == policy_replay(mooncake(name), "lru", 10 * PER_ENGINE).hit_tokens
    assert run(name, 10, PER_ENGINE, "global", "random").hit_tokens == pool.hit_tokens


@pytest.mark.parametrize("name", TRACES)
def test_prefix_affinity_beats_routing_blind_to_the_cache(name):
    affinity = run(name, 10, PER_ENGINE, "local")
    hashed = run(name, 10, PER_ENGINE, "local", "hash")
    random_ = run(name, 10, PER_ENGINE, "local", "random")
    blind = run(name, 10, PER_ENGINE, "local", "least_loaded")
    assert affinity.hit_ratio > 2 * random_.hit_ratio
    assert affinity.hit_ratio > 2 * blind.hit_ratio
    assert hashed.hit_ratio > 2 * random_.hit_ratio
    # load-aware affinity keeps the engines even; cache-blind routing cannot do better on wait time
    assert affinity.imbalance < 1.3
    assert affinity.mean("ttft_s") < random_.mean("ttft_s")


def test_longest_prefix_routing_collapses_on_a_shared_system_prompt():
    """Every conversation request starts with block 0: load-blind longest-prefix routing sends them all to the
    engine that cached it first. (Why Mooncake's scheduler, and `affinity`, weigh the queue too.)"""
    assert all(r.blocks[0] == mooncake("conversation")[0].blocks[0] for r in mooncake("conversation"))
    prefix = run("conversation", 10, PER_ENGINE, "local", "prefix")
    assert max(prefix.per_engine) == prefix.requests
    # hashing the first block only is the same collapse; two blocks spread the conversations
    assert run("conversation", 10, PER_ENGINE, "local", "hash", k=1).imbalance == 10
    assert run("conversation", 10, PER_ENGINE, "local", "hash", k=2).imbalance < 1.2


@pytest.mark.parametrize("name", TRACES)
def test_unlimited_capacity_reaches_the_trace_reuse_ceiling(name):
    curve = lru_mrc(mooncake(name))
    ceiling = curve.hits(curve.distinct_blocks, "tokens")
    assert run(name, 10, HUGE, "global").hit_tokens == ceiling
    assert run(name, 10, HUGE, "tiered").hit_tokens == ceiling
    for routing in ("affinity", "hash"):
        local = run(name, 10, HUGE, "local", routing)
        assert local.hit_tokens <= ceiling  # every engine's first sight of a shared block misses
        assert local.hit_ratio > curve.hit_ratio(curve.distinct_blocks, "tokens") - 0.06


def test_seeded_and_deterministic():
    requests = mooncake("synthetic")[:1500]
    for routing in ("random", "hash", "affinity"):
        config = ClusterConfig(4, 500, "local", routing, seed=7)
        assert simulate_cluster(requests, config) == simulate_cluster(requests, config)
    a = simulate_cluster(requests, ClusterConfig(4, 500, "local", "random", seed=1))
    b = simulate_cluster(requests, ClusterConfig(4, 500, "local", "random", seed=2))
    assert a.per_engine != b.per_engine


# ---------------------------------------------------------------- the clock, on hand-made requests

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="bfloat16", name="tiny")
ONE_SECOND_PER_TOKEN = CostModel(LAYOUT, ModelCompute(params=0.5, attn_pair_flops=0.0), flops_per_s=1.0)


def req(t: float, blocks: tuple[int, ...], tokens: int | None = None) -> TraceRequest:
    return TraceRequest(t, blocks, tokens or 10 * len(blocks), 1, 10)


def test_affinity_follows_the_cached_prefix_until_the_queue_outweighs_it():
    cost = ONE_SECOND_PER_TOKEN
    # a 40-token conversation, then its next turn (60 tokens, 40 cached) while its engine is idle
    first = [req(0, (1, 2, 3, 4)), req(100, (1, 2, 3, 4, 5, 6))]
    r = simulate_cluster(first, ClusterConfig(2, 100, "local"), cost)
    assert sorted(r.per_engine) == [0, 2] and r.hit_tokens == 40
    assert r.mean("prefill_s") == pytest.approx((40 + 20) / 2)
    # a long request with the same prefix takes that engine for 960 s; the next turn arriving then is
    # recomputed on the idle engine (60 s) rather than wait for its prefix (960 + 20 s)
    busy = [req(0, (1, 2, 3, 4)), req(100, (1, 2, 3, 4, 9), 1000), req(100, (1, 2, 3, 4, 5, 6))]
    r = simulate_cluster(busy, ClusterConfig(2, 100, "local"), cost)
    assert sorted(r.per_engine) == [1, 2] and r.hit_tokens == 40 and r.remote_hit_tokens == 0
    assert r.ttft_s == pytest.approx(40 + 960 + 60, rel=1e-4)  # + microseconds of PCIe for the hit
    # with a global pool it gets its prefix on the idle engine too, over the network
    r = simulate_cluster(busy, ClusterConfig(2, 100, "global"), cost)
    assert r.hit_tokens == r.remote_hit_tokens == 80
    assert r.ttft_s == pytest.approx(40 + 960 + 20, rel=1e-4)


def test_queueing_adds_to_ttft():
    cost = ONE_SECOND_PER_TOKEN
    same_time = [req(0, (1,)), req(0, (2,))]
    one = simulate_cluster(same_time, ClusterConfig(1, 10, "local"), cost)
    two = simulate_cluster(same_time, ClusterConfig(2, 10, "local"), cost)
    assert one.ttft_s == pytest.approx(10 + 20) and two.ttft_s == pytest.approx(10 + 10)
    assert one.prefill_s == two.prefill_s == pytest.approx(20)


@pytest.mark.parametrize("bad", [{"engines": 0}, {"capacity_blocks": 0}, {"mode": "pool"}, {"routing": "nearest"},
                                 {"shared_blocks": 0}, {"affinity_blocks": 0}])
def test_config_errors_name_the_field(bad):
    fields = {"engines": 2, "capacity_blocks": 10} | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        ClusterConfig(**fields)
