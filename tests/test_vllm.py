"""kvtier inside a real vLLM engine (CPU build): exact restores from host and disk, restart, faults, bad config.

Exactness baseline: vLLM's own prefix-cache hit of the same prompt (kvtier off), of the same cached length. The
engine's output depends on that length (the shapes of the forward that computes the rest: on the tiny model a
hit of 128 tokens gives other logprobs than one of 0 or 1,920), and a kvtier restore takes exactly the cache-hit
path, so it must match that hit bit for bit. Every run checks that no load fell short of what was promised
(`kvtier_load_shortfall_tokens_total`): vLLM recomputes such blocks, and the cached length is then another.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DEMOTE_ALL
from tests.vllm.zygote import Zygote

ROOT = Path(__file__).resolve().parent.parent
vllm = pytest.importorskip("vllm") if os.environ.get("CI") != "true" else __import__("vllm")


@pytest.fixture(scope="session")
def engines(tmp_path_factory) -> Iterator[Zygote]:
    """Where each scenario's engine process comes from: forked, vLLM already imported (`tests.vllm.zygote`)."""
    zygote = Zygote(ROOT, tmp_path_factory.mktemp("scenarios"))
    yield zygote
    zygote.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 4-layer Llama with random weights, built locally (nothing is downloaded)."""
    from kvtier.integrations.vllm.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def run(engines: Zygote, model: str, config: dict | str, *prompts: str, expect_rc: int = 0,
        figures: dict | None = None, prometheus: dict | None = None, separate_engine: bool = False,
        redis=None, engine: dict | None = None) -> list[dict] | str:
    """The outputs of `prompts` in a fresh engine process (from `engines`); `figures` receives kvtier's worker
    figures, `prometheus` the engine's kvtier series (both halves, aggregated by vLLM). `redis`: the test's
    server, which the prompts `!redis-kill` and `!redis-start` kill and start again.
    `separate_engine`: vLLM's default mode, the engine core in a process of its own. `engine`: other vLLM engine
    arguments, and `engine_blocks` (`tests.vllm.scenario`)."""
    if isinstance(config, dict) and config.get("secondary_tiers") and "load_policy" not in config:
        config = {**config, "load_policy": "always"}  # what a load delivers is tested here; whether, on its own
    cfg = config if isinstance(config, str) else json.dumps(config)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if separate_engine else "0"}
    if engine is not None:
        env["KVTIER_TEST_ENGINE"] = json.dumps(engine)
    if redis is not None:
        env["KVTIER_TEST_REDIS"] = f"{redis.binary}|{redis.port}|{redis.dir}|{redis.proc.pid}"
    proc = engines.run("tests.vllm.scenario", [model, cfg, *prompts], env, ROOT)
    if expect_rc:
        assert proc.returncode != 0, proc.stdout[-2000:]
        return proc.stderr
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"requests"')))
    short = {k: v for k, v in data["prometheus"].items() if k.startswith("kvtier_load_shortfall_tokens_total") and v}
    # vLLM recomputes what a load could not stage, so its outputs would be those of another cached length
    assert not short, f"a load fell short of its promise: {short}"
    if figures is not None:
        figures.update(data["kvtier"])
    if prometheus is not None:
        prometheus.update(data["prometheus"])
    return data["requests"]


def max_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"]))


EVICT = ("A", "B", "C", "D", "A")  # B, C and D push A out of the engine's 48 blocks


@pytest.fixture(scope="session")
def engine_only(engines, tiny_model) -> list[dict]:
    return run(engines, tiny_model, "off", *EVICT, "A")  # the last A is vLLM's own prefix-cache hit


def test_host_tier_restores_exactly(engines, tiny_model, engine_only, tmp_path):
    out = run(engines, tiny_model, {"cpu_bytes_to_use": 256 << 20}, *EVICT)
    restored, engine_hit = out[-1], engine_only[-1]
    assert engine_only[-2]["cached"] == 0  # without kvtier A was really evicted and recomputed
    assert restored["cached"] == 1920  # every block but the last came back from the host tier
    assert restored["tokens"] == engine_hit["tokens"] == engine_only[0]["tokens"]
    assert max_diff(restored, engine_hit) == 0.0


SMALL_BLOCKS = {"block_size": 32, "engine_blocks": 130}  # 16 is refused: "No common block size for 16 (CPU_ATTN:
# [MultipleOf(32)])"; 130 blocks hold one 4,064-token prompt (127 blocks) and little more


def test_a_long_request_in_the_smallest_engine_blocks_restores_exactly_one_step_per_block(engines, tiny_model):
    """A 4,064-token prompt in 32-token blocks, the smallest the CPU backend accepts: 127 blocks stored, one PUT step
    each; another long prompt evicts it from the engine but for a block or so; the rest of its 126 cacheable blocks
    comes back from the host tier, one GET step per block, and the answer equals vLLM's own cache hit of the same
    4,032 tokens."""
    engine_hit = run(engines, tiny_model, "off", "L@4064", "L@4064", engine=SMALL_BLOCKS)[-1]
    assert engine_hit["cached"] == 4032  # 126 whole blocks: vLLM computes the last token again
    figures: dict = {}
    series: dict = {}
    out = run(engines, tiny_model, {"cpu_bytes_to_use": 64 << 20}, "L@4064", "M@4064", "L@4064",
              engine=SMALL_BLOCKS, figures=figures, prometheus=series)
    restored = out[-1]
    assert restored["cached"] == 4032
    assert restored["tokens"] == engine_hit["tokens"] == out[0]["tokens"]
    assert max_diff(restored, engine_hit) == 0.0
    kept = series['kvtier_lookup_tokens_total{source="engine"}'] // 32  # L's blocks the engine still had
    assert kept < 126 // 2  # M took most of the engine's memory: the host tier served the rest
    block_bytes = 4 * 2 * 2 * 64 * 32 * 2  # layers, K and V, KV heads, head size, tokens, bf16
    moves, moved = figures["moves"], figures["move_bytes"]
    assert moves["caller->host"] == 2 * 127  # L's blocks and M's, one step each
    assert moves["host->caller"] == 126 - kept  # one step per block loaded
    assert series['kvtier_lookup_tokens_total{source="host"}'] == moves["host->caller"] * 32
    assert moved["caller->host"] == moves["caller->host"] * block_bytes
    assert moved["host->caller"] == moves["host->caller"] * block_bytes


def test_kvtier_blocks_of_several_engine_blocks_restore_exactly_one_step_per_kvtier_block(engines, tiny_model):
    """kvtier blocks of four 32-token engine blocks (`block_size: 128`, as a long-context deployment sets 256 over
    vLLM's 16): a 4,064-token prompt is 31 whole kvtier blocks (3,968 tokens; its last 96 are not stored), one PUT
    step each. Another prompt evicts it from the engine but for 30 leading engine blocks, which end inside a kvtier
    block; then its first 3,969 tokens are asked for: the load starts with that kvtier block, one GET step per
    kvtier block, writes only the engine blocks vLLM lacks, and the answer equals vLLM's own cache hit of the same
    3,968 tokens of the same prompt (computed by the same 4,064-token prefill: the same lineage)."""
    engine_hit = run(engines, tiny_model, "off", "L@4064", "L@3969", engine=SMALL_BLOCKS)[-1]
    assert engine_hit["cached"] == 3968  # 124 whole engine blocks: vLLM computes the last token again
    figures: dict = {}
    series: dict = {}
    # M (3,136 tokens and 4 generated: 99 engine blocks) evicts 97 of L's 127 from the 129 the engine has
    out = run(engines, tiny_model, {"cpu_bytes_to_use": 64 << 20, "block_size": 128}, "L@4064", "M@3136", "L@3969",
              engine=SMALL_BLOCKS, figures=figures, prometheus=series)
    restored = out[-1]
    assert restored["cached"] == 3968
    assert restored["tokens"] == engine_hit["tokens"]
    assert max_diff(restored, engine_hit) == 0.0
    kept = series["vllm:prefix_cache_hits_total{}"] // 32  # L's engine blocks vLLM's own cache still had
    assert kept % 4 and kept < 124 // 2  # they end inside a kvtier block; the host tier served most of L
    first = kept // 4  # the kvtier block they end in: loaded whole, written where vLLM lacks it
    moves, moved = figures["moves"], figures["move_bytes"]
    assert moves["caller->host"] == 31 + 24  # L's kvtier blocks and M's, one step each
    assert moves["host->caller"] == 31 - first
    # tokens as served: the engine's 960, the host's 3,008 (of the kvtier block both share, the part vLLM lacked)
    assert series['kvtier_lookup_tokens_total{source="engine"}'] == kept * 32
    assert series['kvtier_lookup_tokens_total{source="host"}'] == 3968 - kept * 32
    kvtier_block = 4 * 2 * 2 * 64 * 128 * 2  # layers, K and V, KV heads, head size, tokens, bf16
    assert moved["caller->host"] == moves["caller->host"] * kvtier_block
    assert moved["host->caller"] == moves["host->caller"] * kvtier_block


def test_a_prefix_cache_reset_reaches_every_tier(engines, tiny_model, engine_only, tmp_path):
    """After vLLM's reset_prefix_cache (a weight update), nothing stored before is served: A is recomputed."""
    disk = {"type": "fs", **DEMOTE_ALL,
            "root_dir": str(tmp_path / "kv"), "max_bytes": 64 << 20, "write_policy": "write_through"}
    out = run(engines, tiny_model, {"cpu_bytes_to_use": 256 << 20, "secondary_tiers": [disk]}, *EVICT[:-1], "!reset",
              "A")
    assert out[-1]["cached"] == 0
    assert out[-1]["tokens"] == engine_only[0]["tokens"] and out[-1]["logprobs"] == engine_only[0]["logprobs"]


def test_aborts_and_preemptions_leak_nothing_and_later_hits_stay_exact(engines, tiny_model, engine_only, tmp_path):
    """vLLM preempts (4 requests of 1,900 + 300 tokens against 48 blocks of 128) and two requests are aborted
    while kvtier loads and stores: afterwards no block is held by anyone, and A served from kvtier is vLLM's own
    hit, bit for bit."""
    disk = {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "kv"), "max_bytes": 64 << 20}
    config = {"cpu_bytes_to_use": 16 << 20, "secondary_tiers": [disk]}  # 32 blocks of host: disk has work too
    proc = engines.run("tests.vllm.aborts", [tiny_model, json.dumps(config)],
                       {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = last_json(proc.stdout)
    assert set(data["finished"]) == {"P", "R"} and data["preempted"], "Q and S aborted; vLLM preempted"
    engine_hit = engine_only[-1]
    assert data["again"]["cached"] == engine_hit["cached"] == 1920
    assert data["again"]["tokens"][:4] == engine_hit["tokens"]
    assert data["again"]["logprobs"][:4] == engine_hit["logprobs"]
    assert data["vllm_free_blocks"] == data["vllm_blocks"] - 1, "every engine block is free again"
    assert data["kvtier_pinned"] == 0 and not data["kvtier_pending"] and data["kvtier_orphans"] == 0


def test_host_tier_in_a_separate_engine_process(engines, tiny_model, engine_only):
    out = run(engines, tiny_model, {"cpu_bytes_to_use": 256 << 20}, *EVICT, separate_engine=True)
    assert out[-1]["cached"] == 1920
    assert out[-1]["tokens"] == engine_only[-1]["tokens"] and max_diff(out[-1], engine_only[-1]) == 0.0


def test_disk_tier_restores_exactly_and_survives_a_restart(engines, tiny_model, engine_only, tmp_path):
    config = {"cpu_bytes_to_use": 4 << 20,  # 8 blocks: A's blocks must come back from disk
              "secondary_tiers": [{"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "kv"), "max_bytes": 1 << 30}]}
    out = run(engines, tiny_model, config, *EVICT)
    assert out[-1]["cached"] == 1920 and max_diff(out[-1], engine_only[-1]) == 0.0
    second = run(engines, tiny_model, config, "A")  # a new engine process: the prefix comes from the disk tier
    assert second[0]["cached"] == 1920
    assert second[0]["tokens"] == engine_only[-1]["tokens"] and max_diff(second[0], engine_only[-1]) == 0.0


def test_the_default_disk_admission_writes_a_prefix_seen_once_only_after_prefixes_come_back(engines, tiny_model,
                                                                                            engine_only, tmp_path):
    """`min_sightings: auto`, the default: A, B, C and D seen once leave host and are dropped, not written. A
    comes back (recomputed); now blocks come back, so what host evicts goes down, and A's third request is
    served from disk, exactly."""
    config = {"cpu_bytes_to_use": 4 << 20, "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv"),
                                                                "max_bytes": 1 << 30}]}
    prometheus: dict = {}
    out = run(engines, tiny_model, config, *EVICT, "B", "C", "D", "A", prometheus=prometheus)
    assert out[4]["cached"] == 0  # no tier kept A's first sighting
    assert prometheus['kvtier_admission_rejects_total{reason="sightings",tier="disk"}'] >= 8
    assert prometheus['kvtier_admission_sightings_needed{tier="disk"}'] == 1  # it learned: blocks come back
    assert out[-1]["cached"] == 1920 and prometheus['kvtier_lookup_tokens_total{source="disk"}'] >= 1920
    assert out[-1]["tokens"] == engine_only[-1]["tokens"] and max_diff(out[-1], engine_only[-1]) == 0.0


def test_corrupt_disk_block_is_recomputed_not_served(engines, tiny_model, engine_only, tmp_path):
    root = tmp_path / "kv"
    config = {"cpu_bytes_to_use": 4 << 20, "secondary_tiers": [{"type": "fs", **DEMOTE_ALL, "root_dir": str(root),
                                                                "max_bytes": 1 << 30, "write_policy": "write_through"}]}
    run(engines, tiny_model, config, "A")
    files = sorted(root.rglob("*.kv"))
    assert len(files) >= 8  # A alone is 8 blocks of 256 tokens
    for path in files:  # flip one payload byte in every file: nothing of A may be served
        with open(path, "r+b") as f:
            f.seek(4096 + 10)
            byte = f.read(1)
            f.seek(4096 + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
    figures: dict = {}
    out = run(engines, tiny_model, config, "A", figures=figures)
    assert figures["integrity_failures"]["disk"] >= 1  # detected and counted
    assert out[0]["tokens"] == engine_only[0]["tokens"]
    assert max_diff(out[0], engine_only[0]) == 0.0  # recomputed in full, exactly as with kvtier off


def test_full_store_queue_drops_stores_counts_them_and_requests_complete(engines, tiny_model, engine_only):
    prometheus: dict = {}
    out = run(engines, tiny_model, {"cpu_bytes_to_use": 256 << 20, "queue_depth": 1}, "A+B", "C",
              prometheus=prometheus)
    # A and B finish in the same step: one store fills the queue, the other's 16 blocks (of 128 tokens) are dropped
    assert prometheus['kvtier_stores_dropped_total{reason="queue_full"}'] == 16
    assert prometheus['kvtier_moves_total{dst="host",src="caller"}'] == 16 + 16  # the other store, and C's
    assert [o["tokens"] for o in out] == [engine_only[0]["tokens"], engine_only[1]["tokens"], engine_only[2]["tokens"]]


def redis_tier(server, **extra) -> dict:
    """A throwaway redis-server on loopback, trusted (unsigned blocks): the engine tests test the tier's path, and the
    signed path is test_signed's and test_cache_redis'. Its lookups may take their time: on a machine as busy as a
    CPU engine makes it, the first one (which connects) can take longer than the default deadline, and these tests
    are about what Redis serves, not about going on without it (test_bounds)."""
    return {"type": "redis", "url": server.url, "max_bytes": 1 << 30, "trusted_network": True,
            "lookup_deadline_s": 10, **extra}


def test_a_second_engine_gets_the_first_engines_prefix_from_redis(engines, tiny_model, engine_only, redis_server):
    config = {"cpu_bytes_to_use": 256 << 20, "secondary_tiers": [redis_tier(redis_server)]}
    run(engines, tiny_model, config, "A")  # engine 1 computes A and writes it through to Redis, then exits
    prometheus: dict = {}
    out = run(engines, tiny_model, config, "A", prometheus=prometheus)  # engine 2: an empty host tier of its own
    assert out[0]["cached"] == 1920  # every block but the last came from Redis
    assert out[0]["tokens"] == engine_only[-1]["tokens"] and max_diff(out[0], engine_only[-1]) == 0.0
    assert prometheus['kvtier_lookup_tokens_total{source="redis"}'] == 1920
    assert prometheus['kvtier_moves_total{dst="caller",src="redis"}'] == 15  # straight into the engine's blocks
    assert prometheus['kvtier_shared_tier_authenticated{tier="redis"}'] == 0  # trusted_network, and /metrics says so
    assert prometheus['kvtier_tier_capacity_bytes{tier="redis"}'] == 1 << 30  # Redis' bound reaches vLLM's /metrics
    assert prometheus['kvtier_tier_used_bytes{tier="redis"}'] > 0


def test_two_engines_share_a_prefix_through_a_redis_cluster(engines, tiny_model, engine_only, redis_cluster):
    """The same through a real 6-node Redis Cluster: the chain lives in the partition its first tokens pick, on
    whichever primary owns it, and the second engine's output is bit-identical to vLLM's own cache hit."""
    tier = {**redis_tier(redis_cluster.nodes[0]), "url": redis_cluster.seed_url, "cluster": True}
    config = {"cpu_bytes_to_use": 256 << 20, "secondary_tiers": [tier]}
    run(engines, tiny_model, config, "A")
    prometheus: dict = {}
    out = run(engines, tiny_model, config, "A", prometheus=prometheus)
    assert out[0]["cached"] == 1920
    assert out[0]["tokens"] == engine_only[-1]["tokens"] and max_diff(out[0], engine_only[-1]) == 0.0
    assert prometheus['kvtier_lookup_tokens_total{source="redis"}'] == 1920
    assert prometheus['kvtier_tier_capacity_bytes{tier="redis"}'] == 1 << 30  # the partitions' shares, summed


def test_redis_killed_and_restarted_mid_workload(engines, tiny_model, engine_only, redis_server):
    """No request fails, every output stays exact, the breaker opens while Redis is away and closes after."""
    config = {"cpu_bytes_to_use": 4 << 20,  # 16 blocks: A must come back from Redis, not from host
              "secondary_tiers": [redis_tier(redis_server, breaker_failures=1, breaker_cooldown_s=0.2,
                                             socket_timeout_s=0.5)]}
    prometheus: dict = {}
    # after the restart, the breakers' cooldown passes before the next request: its calls probe Redis
    out = run(engines, tiny_model, config, "A", "!redis-kill", *EVICT[1:], "!redis-start", "!sleep:0.3", *EVICT[1:],
              "B", prometheus=prometheus, redis=redis_server)
    reference = {"A": engine_only[0], "B": engine_only[1], "C": engine_only[2], "D": engine_only[3]}
    for o in out:
        assert o["tokens"] == reference[o["prompt"]]["tokens"], o["prompt"]
    assert out[4]["prompt"] == "A" and out[4]["cached"] == 0  # Redis away: A recomputed, not a failed request
    assert max_diff(out[4], engine_only[0]) == 0.0
    assert out[-1]["prompt"] == "B" and out[-1]["cached"] == 1920  # Redis back (empty): B stored again, served
    assert prometheus['kvtier_redis_breaker_opens_total{side="rank0",tier="redis"}'] >= 1
    assert prometheus['kvtier_redis_breaker_opens_total{side="scheduler",tier="redis"}'] >= 1
    assert prometheus['kvtier_redis_breaker_state{side="rank0",tier="redis"}'] == 0  # closed again
    assert prometheus['kvtier_redis_breaker_state{side="scheduler",tier="redis"}'] == 0


def test_bad_config_stops_the_engine_naming_the_field(engines, tiny_model):
    err = run(engines, tiny_model, {"cpu_bytes_to_use": -1}, "A", expect_rc=1)
    assert "cpu_bytes_to_use" in err
    err = run(engines, tiny_model, {"cpu_bytes_to_use": 1 << 20, "block_size": 100}, "A", expect_rc=1)
    assert "block_size" in err


def test_stats_reach_prometheus_under_the_design_names():
    """vLLM aggregates both halves' deltas and hands them to the connector's Prometheus metrics."""
    import functools

    import prometheus_client
    from vllm.config import KVTransferConfig, VllmConfig

    from kvtier.integrations.vllm import KVTierConnector

    config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="KVTierConnector", kv_role="kv_both", kv_connector_module_path="kvtier.integrations.vllm"))
    registry = prometheus_client.CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry)
             for cls in (prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)}
    prom = KVTierConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["tiny", 0]})
    worker = KVTierConnector.build_kv_connector_stats(
        {"counters": {"moves": {"disk|host": 3}, "integrity_failures": {"disk": 1}}, "gauges": {}})
    scheduler = KVTierConnector.build_kv_connector_stats(
        {"counters": {"lookup_tokens": {"host": 512, "miss": 256}, "moves": {"disk|host": 2}},
         "gauges": {"tier_used_bytes": {"host": 4096}, "orphan_blocks": {"host": 0}}})
    total = worker.aggregate(scheduler)
    assert total.reduce()["moves[disk|host]"] == 5 and not total.is_empty()
    prom.observe(total.data, 0)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'kvtier_moves_total{dst="host",engine="0",model_name="tiny",src="disk"} 5.0' in text
    assert 'kvtier_lookup_tokens_total{engine="0",model_name="tiny",source="host"} 512.0' in text
    assert 'kvtier_integrity_failures_total{engine="0",model_name="tiny",tier="disk"} 1.0' in text
    assert 'kvtier_tier_used_bytes{engine="0",model_name="tiny",tier="host"} 4096.0' in text


# A disk load of a prompt takes a few hundred ms on this machine, its recompute about 100: a healthy disk is
# within the budget, a disk whose reads sleep 0.6 s is not (each load waits for two rounds of reads), with a
# margin of two on both sides.
GUARD = {"ttft_p99_ms": 600, "window_s": 5, "breach_windows": 2, "of_windows": 3, "min_requests": 2, "hold_s": 6,
         "probe_share": 0.5}


def last_json(stdout: str) -> dict:
    """A scenario's findings: its last JSON line (vLLM's and kvtier's log lines go to stdout too)."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))


def slowed(engines: Zygote, model: str, config: dict, delay: float | str, requests: int | None = None) -> dict:
    """tests/vllm/guard.py's findings: a real engine whose disk reads sleep `delay` (seconds, or "Nx": N times
    the engine's recompute of a prompt on this machine)."""
    args = [model, json.dumps(config), str(delay), *([str(requests)] if requests else [])]
    proc = engines.run("tests.vllm.guard", args, {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return last_json(proc.stdout)


def exact_by_cached_length(requests: list[dict]) -> None:
    """Every serving of a prompt with the same number of cached tokens has the same logprobs, bit for bit:
    restored from disk, recomputed, or vLLM's own cache hit."""
    seen: dict[tuple[str, int], list[float]] = {}
    for r in requests:
        first = seen.setdefault((r["prompt"], r["cached"]), r["logprobs"])
        assert r["logprobs"] == first, (r["prompt"], r["cached"], r["phase"])


def test_the_guard_turns_a_slow_disk_off_keeps_host_on_and_brings_the_disk_back_through_a_probe(engines,
                                                                                                 tiny_model, tmp_path):
    disk = {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "kv"), "max_bytes": 64 << 20}
    config = {"cpu_bytes_to_use": 8 << 20, "load_policy": "always", "secondary_tiers": [disk], "guard": GUARD}
    found = slowed(engines, tiny_model, config, delay=0.6)
    requests, transitions = found["requests"], found["transitions"]
    slow = [r for r in requests if r["phase"] == "slow"]
    assert slow[0]["disk_tokens"] and slow[0]["ttft"] > 1.2, "the delay was injected and the disk served"
    assert [t["tier"] for t in transitions] == ["disk"] * len(transitions), transitions  # host stays on
    assert transitions[0]["to"] == "off" and transitions[-1]["to"] == "on", transitions
    assert "ttft p99" in transitions[0]["reason"]
    off = [r for r in requests if r["state"] == r["state_after"] == "off"]
    assert off and not any(r["disk_tokens"] for r in off), "while off, nothing is read from the disk"
    assert any(r["disk_tokens"] for r in requests if r["phase"] == "healed"), "the probe read the disk again"
    enabled = [r["disk_enabled"] for r in requests]
    steps = [v for i, v in enumerate(enabled) if i == 0 or v != enabled[i - 1]]
    assert steps[0] == 1 and 0 in steps and steps[-1] == 1, steps  # Prometheus saw 1 -> 0 -> 1
    prom = found["prometheus"]
    assert prom['kvtier_tier_enabled{tier="host"}'] == 1
    assert prom['kvtier_guard_transitions_total{tier="disk",to="off"}'] >= 1
    assert prom['kvtier_guard_transitions_total{tier="disk",to="on"}'] == 1
    assert any(k.startswith("kvtier_guard_window_p99_seconds{") for k in prom)
    exact_by_cached_length(requests)
    assert any(r["phase"] == "engine hit" and r["cached"] == 2048 for r in requests)


def test_the_decision_recomputes_what_a_slow_disk_would_serve_late(engines, tiny_model, tmp_path):
    # a load here may take 4x a recompute (two rounds of reads): on a slow machine, past the default deadline, which
    # would fail it (vLLM recomputes part of the prefix: another lineage, under the same cached length)
    disk = {"type": "fs", **DEMOTE_ALL, "root_dir": str(tmp_path / "kv"), "max_bytes": 64 << 20,
            "load_timeout_s": 600}
    # each disk read sleeps twice a recompute of the prompt on this machine: any load loses to recomputing
    found = slowed(engines, tiny_model, {"cpu_bytes_to_use": 8 << 20, "secondary_tiers": [disk]}, delay="2x",
                   requests=16)
    slow = [r for r in found["requests"] if r["phase"] == "slow"]
    from_disk = [r for r in slow if r["disk_tokens"]]
    assert 1 <= len(from_disk) <= 3, "the first loads measure the disk; then its loads lose to recomputing"
    decisions = found["decisions"]  # by each request's slowest tier: a prompt loaded once is in host afterwards
    assert decisions.get("disk|load", 0) + decisions.get("disk|partial", 0) == len(from_disk)
    assert decisions["disk|recompute"] >= len(slow) // 2
    assert found["prometheus"]['kvtier_load_decisions_total{decision="recompute",tier="disk"}'] == \
        decisions["disk|recompute"]
    exact_by_cached_length(found["requests"])


def test_the_vllm_benchs_engines_serve_its_steps_and_a_failed_one_says_why(tiny_model, tmp_path):
    """`kvtier bench --vllm`'s engine processes: a restore comes back from the host tier, a batch of unique prompts
    is timed one by one, and an engine that cannot start fails the bench with its name and its log's last lines."""
    from kvtier.bench.vllm_process import PROMPT, Engine
    from kvtier.rollout.server import temp_env

    env = temp_env(str(tmp_path))
    with Engine("host", tiny_model, {"cpu_bytes_to_use": 64 << 20, "load_policy": "always"}, tmp_path, env) as host, \
            Engine("broken", tiny_model, {"cpu_bytes_to_use": "lots"}, tmp_path, env) as broken:
        with pytest.raises(RuntimeError, match=r"(?s)engine 'broken' exited with [1-9].*cpu_bytes_to_use"):
            broken.ready()
        host.ready()
        rep = host.ask("restore", 0)
        assert rep["restored_cached"] >= PROMPT - 128  # every whole engine block of the prompt, from host
        assert rep["restored"] < rep["cold"]
        ttfts = host.ask("unique", 0, 2)
        assert len(ttfts) == 2 and all(t > 0 for t in ttfts)
