"""The guard (the rollback rule) and the load-or-recompute decision on synthetic streams: pure Python, own clock."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import ConfigError, GuardConfig, parse_config, parse_guard
from kvtier.decide import Decider, LinkEstimate
from kvtier.directory import Directory, TierSpec
from kvtier.guard import ENGINE, RECOMPUTE, Guard, TierState, request_source
from kvtier.sim.instant_mover import complete_instantly
from kvtier.stores.base import TierKind

TIERS = ["host", "disk", "redis"]
CONFIG = GuardConfig(ttft_p99_ms=100, window_s=10, breach_windows=2, of_windows=3, min_requests=5, hold_s=30,
                     probe_share=0.5)


def feed(guard: Guard, start: float, end: float, latency: dict[str, float], per_window: int = 10) -> None:
    """`per_window` requests from each source of `latency` in every window of [start, end), with that TTFT."""
    step = guard.config.window_s / per_window
    t = start
    while t < end:
        skip = guard.route(t)
        for source, seconds in latency.items():
            if source not in skip:
                guard.observe(source, t, ttft_s=seconds)
        t += step
    guard.tick(end)


def test_trips_only_after_the_configured_breach_windows_then_holds_probes_and_comes_back():
    guard = Guard(CONFIG, TIERS)
    feed(guard, 0, 10, {"disk": 0.5, "host": 0.01})  # one breached window of 3: not yet
    guard.tick(10)
    assert guard.enabled("disk")
    feed(guard, 10, 20, {"disk": 0.5, "host": 0.01})  # the second: off, at the end of that window
    assert guard.state("disk") is TierState.OFF and guard.history[-1].at == 20
    assert guard.enabled("host")  # its own requests were within budget
    assert "ttft p99 500 ms > 100 ms" in guard.history[-1].reason
    assert "disk" in guard.route(25) and "disk" in guard.off()
    feed(guard, 20, 49, {"host": 0.01})  # held for 30 s: still off
    assert guard.state("disk") is TierState.OFF
    guard.tick(50)
    assert guard.state("disk") is TierState.PROBE
    routes = [guard.route(50 + i * 0.01) for i in range(10)]
    assert sum("disk" not in r for r in routes) == 5  # the probe share, exactly
    assert "disk" in guard.off()  # nothing is written to a tier on probe
    feed(guard, 50, 60, {"disk": 0.02, "host": 0.01})  # probe windows within budget: one ...
    assert guard.state("disk") is TierState.PROBE
    feed(guard, 60, 70, {"disk": 0.02, "host": 0.01})  # ... and two in a row: back on
    assert guard.state("disk") is TierState.ON and guard.off() == frozenset()
    assert [(t.tier, t.to) for t in guard.history] == [("disk", TierState.OFF), ("disk", TierState.PROBE),
                                                      ("disk", TierState.ON)]
    assert guard.transitions[("disk", "off")] == 1 and guard.transitions[("disk", "on")] == 1


def test_a_probe_that_breaches_turns_the_tier_off_again_for_another_hold():
    guard = Guard(CONFIG, TIERS)
    feed(guard, 0, 20, {"disk": 0.5})
    guard.tick(50)
    feed(guard, 50, 60, {"disk": 0.5})
    assert guard.state("disk") is TierState.OFF and guard.history[-1].reason.startswith("probe: ")
    guard.tick(89)
    assert guard.state("disk") is TierState.OFF
    guard.tick(90)
    assert guard.state("disk") is TierState.PROBE


def test_too_few_requests_say_nothing():
    guard = Guard(CONFIG, TIERS)
    feed(guard, 0, 100, {"disk": 5.0}, per_window=4)  # 4 < min_requests per window
    assert guard.enabled("disk") and not guard.history


def test_itl_budget_alone_and_per_source_attribution():
    guard = Guard(GuardConfig(itl_p99_ms=50, window_s=1, breach_windows=1, of_windows=1, min_requests=2), TIERS)
    for t in (0.1, 0.2, 0.3):
        guard.observe("redis", t, itl_s=[0.01, 0.2])
        guard.observe("disk", t, itl_s=[0.01, 0.02])
        guard.observe(RECOMPUTE, t, itl_s=[0.5])
    guard.tick(1.0)
    assert guard.state("redis") is TierState.OFF and guard.enabled("disk") and guard.enabled("host")
    assert guard.window_p99[("redis", "itl")] == pytest.approx(0.2)
    assert guard.window_p99[(RECOMPUTE, "itl")] == pytest.approx(0.5)  # reported, never turned off


def test_one_tier_at_a_time_the_newest_first_by_default_or_by_order():
    for order, first in ((None, "redis"), (["disk"], "disk")):
        cfg = CONFIG.model_copy(update={"order": order})
        guard = Guard(cfg, TIERS)
        feed(guard, 0, 20, {"disk": 0.5, "redis": 0.5})
        assert [t.tier for t in guard.history] == [first]  # the other is judged again on what follows
        feed(guard, 20, 40, {"disk": 0.5, "redis": 0.5})
        assert {t.tier for t in guard.history if t.to is TierState.OFF} == {"disk", "redis"}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), margin=st.floats(0.0, 0.03))
def test_never_flaps_on_a_stream_at_the_budget_and_never_turns_off_the_engine(seed, margin):
    """Windows alternate just above and just below the budget: it may trip once, but never comes back on only to
    trip again; the engine and recompute sources are over budget all along, and nothing turns them off."""
    rng = random.Random(seed)
    guard = Guard(CONFIG, TIERS)
    for w in range(60):
        above = w % 2 == 0
        t0 = w * CONFIG.window_s
        skip = guard.route(t0)
        for k in range(10):
            value = 0.1 * (1 + margin if above else 1 - margin) * (1 if k == 9 else rng.uniform(0.5, 1.0))
            for source in ("disk", ENGINE, RECOMPUTE):
                if source not in skip:
                    guard.observe(source, t0 + k, ttft_s=value if source == "disk" else 5.0)
    guard.tick(60 * CONFIG.window_s)
    assert guard.transitions[("disk", "on")] == 0
    assert guard.transitions[("disk", "off")] <= (1 if margin > 0 else 0) + guard.transitions[("disk", "probe")]
    assert {t.tier for t in guard.history} <= {"disk"}
    assert not any(t.tier in (ENGINE, RECOMPUTE) for t in guard.history)


def test_exactly_at_the_budget_is_within_it():
    guard = Guard(CONFIG, TIERS)
    feed(guard, 0, 100, {"disk": 0.1})
    assert guard.enabled("disk") and not guard.history


def test_request_source_is_the_slowest_tier_that_served_it():
    assert request_source(["host", "disk", "host"], TIERS, True) == "disk"
    assert request_source(["host"], TIERS, True) == "host"
    assert request_source([], TIERS, True) == ENGINE
    assert request_source([], TIERS, False) == RECOMPUTE


def test_an_idle_gap_closes_empty_windows_that_breach_nothing():
    guard = Guard(CONFIG, TIERS)
    feed(guard, 0, 10, {"disk": 0.5})
    guard.tick(10_000)  # a long quiet night: the breached window is far behind
    feed(guard, 10_000, 10_010, {"disk": 0.5})
    assert guard.enabled("disk")


def test_guard_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="a guard needs a budget"):
        parse_guard({"window_s": 5})
    with pytest.raises(ConfigError, match="breach_windows .4. exceeds of_windows .3."):
        parse_guard({"ttft_p99_ms": 1, "breach_windows": 4, "of_windows": 3})
    with pytest.raises(ConfigError, match="probe_share"):
        parse_guard('{"ttft_p99_ms": 1, "probe_share": 0}')
    with pytest.raises(ConfigError, match=r"guard.order names \['disk'\]"):
        parse_config({"cpu_bytes_to_use": 1 << 20, "guard": {"ttft_p99_ms": 1, "order": ["disk"]}})


# ---------------------------------------------------------------- the decision


def test_link_estimate_fits_latency_and_bandwidth_and_forgets_old_samples():
    link = LinkEstimate()
    link.add(10**9, 100.0, now=0)  # the first transfer pays one-time costs: not a sample
    assert link.seconds(1, now=0) == 0
    for i in range(200):
        nbytes = 1_000_000 * (1 + i % 5)
        link.add(nbytes, 0.002 + nbytes / 1e9, now=i * 0.1)
    latency, per_byte = link.fit()
    assert latency == pytest.approx(0.002, rel=0.05) and 1 / per_byte == pytest.approx(1e9, rel=0.05)
    assert link.seconds(4e6, now=20) == pytest.approx(0.006, rel=0.05)
    assert link.seconds(4e6, now=20 + 60) == 0  # no transfer for a minute: measure again


def test_decider_offers_the_longest_prefix_whose_load_beats_its_recompute():
    block = 1 << 20
    decider = Decider("auto", None, prior_tokens_per_s=10_000, block_bytes=block)  # 0.1 ms per token
    for tier in ("host", "disk"):
        decider.transferred(tier, block, 100.0, now=0)  # warm-up, not a sample
    decider.transferred("host", block, 0.001, now=0)  # 1 ms a block: wins against 25.6 ms of recompute
    decider.transferred("disk", block, 0.2, now=0)  # 200 ms a block: loses against 25.6 ms
    sources, tokens = ["host"] * 3 + ["disk"] * 2, [256] * 5
    assert decider.blocks_to_load(sources, tokens, now=1, count_as="disk") == 3
    assert decider.decisions[("disk", "partial")] == 1
    assert decider.blocks_to_load(["disk"] * 2, [256] * 2, now=1, count_as="disk") == 0
    assert decider.decisions[("disk", "recompute")] == 1
    decider.prefill.add(tokens=256, seconds=1.0)  # the engine turns out slow: the disk wins now
    assert decider.blocks_to_load(["disk"] * 2, [256] * 2, now=1, count_as="disk") == 2
    decider.queued["host"] = 10_000 * block  # a long queue on the host link: its load loses too
    assert decider.blocks_to_load(["host"], [256], now=1) == 0


def test_always_and_max_load_tokens():
    decider = Decider("always", 600, prior_tokens_per_s=1e9, block_bytes=1)
    decider.transferred("disk", 1, 100.0, now=0)
    decider.transferred("disk", 1, 100.0, now=0)
    assert decider.blocks_to_load(["disk"] * 5, [256] * 5, now=1, count_as="disk") == 2  # 512 <= 600
    assert decider.decisions[("disk", "partial")] == 1


def test_a_tier_the_guard_turned_off_is_read_and_written_by_nothing_and_keeps_its_blocks():
    specs = [TierSpec("host", 2 * 64, 64, kind=TierKind.HOST), TierSpec("disk", 8 * 64, 64, kind=TierKind.DISK)]
    d = Directory(specs)
    keys = [bytes([i]) * 8 for i in range(4)]
    complete_instantly(d, d.plan_store(keys[:2]))
    complete_instantly(d, d.plan_store(keys[2:], parent=keys[1]))  # the oldest is demoted to disk
    assert d.lookup(keys) == ["disk", "host", "host"]
    assert d.lookup(keys, skip={"disk"}) == []  # the chain starts on disk
    assert d.lookup(keys, skip={"host"}) == []  # host stages every other tier
    d.disabled = frozenset({"disk"})
    more = [bytes([9, i]) * 4 for i in range(2)]
    complete_instantly(d, d.plan_store(more))  # evicts the host blocks: not demoted to a tier that is off
    assert d.keys_in("disk") == keys[:1] and keys[2] not in d  # kept, not wiped; nothing demoted to it
    assert d.lookup(keys) == ["disk"]  # back once the guard lets readers in
    d.disabled = frozenset({"host"})
    plan = d.plan_store([b"new-key1"])
    assert not plan.chains and d.stats.stores_dropped["tier_off"] == 1
