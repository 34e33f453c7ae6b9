"""The rollout's prediction: closed-loop clients as the rollout's client sends, the prompts as a trace, and the
prediction beside a measurement, with what missed most named."""

from __future__ import annotations

import random

import numpy as np

from kvtier.rollout import workload
from kvtier.rollout.client import Load, Prompt
from kvtier.rollout.predict import TOLERANCE, as_trace, compare, poisson, predict
from kvtier.sim.cost import apply_profile, cost_model
from kvtier.sim.profile import Profile, fit_line, fit_prefill_curve

PER_TOKEN = 4096  # KV bytes per token of the profiled model
BLOCK = 128


def profile(fixed_s: float = 0.05, per_token_s: float = 1e-4, itl: tuple[float, float] = (0.01, 0.005)) -> Profile:
    """A profile whose fits are exact: the simulator's costs are then known to the microsecond."""
    points = [(n, p, fixed_s + per_token_s * n) for n in (64, 256, 1024, 2048) for p in (0, 1024)]
    decode = [(b, itl[0] + itl[1] * b) for b in (1, 2, 4)]
    host = [(k * BLOCK * PER_TOKEN, 1e-4 + k * BLOCK * PER_TOKEN / 5e9) for k in (1, 4, 16)]
    return Profile({"cpu": "test"}, {"model": "tiny", "block_size": BLOCK, "kv_bytes_per_token": PER_TOKEN},
                   fit_prefill_curve(points), fit_line(decode, "decode"), {"host": fit_line(host, "host")})


def test_a_closed_loop_client_sends_its_next_request_when_its_last_one_ended_and_it_thought():
    cost = apply_profile(cost_model(), profile())
    prompts = [Prompt([random.Random(i).randrange(3, 999) for _ in range(300)], "unique", 5) for i in range(6)]
    think = 0.7
    result = predict(cost, prompts, Load(clients=1, think_s=think), None, 48, BLOCK, seed=3)
    draws = random.Random("3/client/0")
    service = cost.prefill_seconds(300) + 4 * cost.itl_at(1)  # first token, then four more
    expected, at = [], 0.0
    for _ in prompts:
        expected.append(at)
        at += service + draws.expovariate(1 / think)
    assert np.allclose(result.ttft_s, cost.prefill_seconds(300)), "one client: nothing queues"
    assert np.allclose(result.queue_s, 0)
    assert np.isclose(result.end_s, expected[-1] + service)


def test_two_clients_queue_behind_one_server_and_decode_as_a_batch():
    cost = apply_profile(cost_model(), profile())
    prompts = [Prompt([random.Random(i).randrange(3, 999) for _ in range(300)], "unique", 5) for i in range(2)]
    result = predict(cost, prompts, Load(clients=2, think_s=0.0), None, 48, BLOCK, seed=0)
    prefill = cost.prefill_seconds(300)
    assert np.allclose(result.ttft_s, [prefill, 2 * prefill]), "both sent at once: the second waits for the first"
    assert np.allclose(result.queue_s, [0, prefill])
    assert cost.itl_at(2) > cost.itl_at(1)


def test_prompts_share_blocks_exactly_where_they_share_tokens():
    a, b = list(range(3, 3 + 300)), list(range(3, 3 + 256)) + [7] * 44
    trace = as_trace([Prompt(a, "x", 1), Prompt(b, "y", 1)], BLOCK)
    assert trace[0].blocks[:2] == trace[1].blocks[:2] and trace[0].blocks[2] != trace[1].blocks[2]
    assert len(trace[0].blocks) == 3 and trace[0].input_tokens == 300  # a partial last block is kept
    arrivals = poisson(50, 2.0, 7)
    rng, at = random.Random(7), 0.0
    for t in arrivals:  # the rollout client's own draws
        assert t == at
        at += rng.expovariate(2.0)


def test_a_host_tier_serves_the_reused_prompts_the_engine_cache_lost():
    cost = apply_profile(cost_model(), profile())
    prompts = workload.builtin(40, 1, 8, 4000)
    engine_blocks = 16  # less than the hot set: the engine alone loses it
    host = {"cpu_bytes_to_use": 64 << 20}
    alone = predict(cost, prompts, Load(clients=1), None, engine_blocks, BLOCK, seed=0)
    tiered = predict(cost, prompts, Load(clients=1), host, engine_blocks, BLOCK, seed=0)
    assert tiered.hit_tokens["host"] > 0 and alone.hit_tokens["miss"] > tiered.hit_tokens["miss"]
    reused = [i for i, p in enumerate(prompts) if p.reused]
    assert tiered.ttft_s[reused].mean() < alone.ttft_s[reused].mean()
    assert tiered.load_s[reused].max() > 0, "a host load is charged to the TTFT"


def measured_level(result, prompts: list[Prompt], scale: dict[str, float]) -> dict:
    """A level's record as the rollout keeps it, its TTFTs the prediction's scaled per kind of prompt."""
    from kvtier.rollout.figures import quantiles
    from kvtier.rollout.predict import simulated_tokens

    ttfts = [float(result.ttft_s[i]) * scale.get(p.kind, 1.0) for i, p in enumerate(prompts)]
    return {"results": [{"error": None, "ttft": t} for t in ttfts], "ttft_ms": quantiles(ttfts),
            "tokens": simulated_tokens(result), "load": {"queue_ms_mean": 0.0}}


def test_a_prediction_that_misses_names_the_kind_of_prompt_it_missed_most():
    cost = apply_profile(cost_model(), profile())
    prompts = workload.builtin(40, 1, 8, 4000)
    result = predict(cost, prompts, Load(clients=1), {"cpu_bytes_to_use": 64 << 20}, 16, BLOCK, seed=0)
    exact = compare(result, prompts, measured_level(result, prompts, {}), judged=True)
    assert exact["within_tolerance"] and exact["largest_contributor"] is None
    assert exact["errors"]["ttft_p50"] == 0 and all(v == 0 for v in exact["errors"]["tokens_points"].values())
    slow = compare(result, prompts, measured_level(result, prompts, {"unique": 3.0}), judged=True)
    assert not slow["within_tolerance"] and abs(slow["errors"]["ttft_p99"]) > TOLERANCE["ttft_p99"]
    assert slow["largest_contributor"].startswith("unique prompts' TTFT")


def test_where_requests_overlap_other_draws_of_the_arrivals_give_the_quantiles_range():
    """At two clients which request waits behind which turns on each think time: the prediction's p50 over other
    draws spans a range that holds its own, and a miss says whether the measurement is inside it. At one client
    no request overlaps another: no other draws."""
    from kvtier.rollout.predict import DRAWS, other_draws

    cost = apply_profile(cost_model(), profile())
    prompts = workload.builtin(40, 1, 8, 4000)
    assert other_draws(cost, prompts, Load(clients=1, think_s=0.1), None, 16, BLOCK, seed=0) == []
    two = Load(clients=2, think_s=0.1)
    result = predict(cost, prompts, two, None, 16, BLOCK, seed=0)
    others = other_draws(cost, prompts, two, None, 16, BLOCK, seed=0)
    assert len(others) == DRAWS
    p50s = {round(float(np.median(o.ttft_s)), 6) for o in others}
    assert len(p50s) > 1, "the draws differ in who waits behind whom"
    level = measured_level(result, prompts, {"unique": 2.0})
    compared = compare(result, prompts, level, judged=False, others=others)
    low, high = compared["ttft_ms_range"]["p50"]
    assert low <= compared["ttft_ms"]["p50"] <= high and compared["draws"] == DRAWS + 1
    assert f"over {DRAWS + 1} draws of the arrivals" in compared["largest_contributor"]
