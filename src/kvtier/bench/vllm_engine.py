"""`kvtier bench --vllm`: TTFT ratios on a real vLLM engine (CPU, tiny model), each against a baseline measured
in the same run on the same machine. One engine process per configuration, all started at once and kept to the
end (`vllm_process`); every step of the bench runs in each engine it compares, one after the other, in the
reverse order every other time (an engine measures slower right after an engine of another configuration).

- ttft_host_vs_recompute   a ~4k-token prefix evicted from vLLM's cache, back from the host tier, ÷ recomputing it
- ttft_disk_vs_recompute   the same from the disk tier (O_DIRECT reads: the page cache is bypassed), which admits
                           every block host evicts (`min_sightings: 1`), as do the slow-disk figures' tiers
- ttft_host_vs_engine_hit  the host-tier hit ÷ vLLM's own prefix-cache hit of the same prompt right after, in the
                           same engine: the median over prompts of each prompt's ratio (its hits' median below it)
- ttft_redis_vs_recompute  the prefix back from a Redis tier (a redis-server of the bench's own, on loopback)
- p99_ttft_no_reuse_on_vs_off  unique prompts only: p99 TTFT with kvtier as it starts (the host tier, no secondary
                               tiers configured) ÷ without; a round sends a batch of unique prompts to each engine
                               in turn, and the figure is the median of the rounds' ratios
- p99_ttft_no_reuse_disk_on_vs_off  the same with host + disk tiers as configured by default (the disk's admission
                                    `auto`: no block comes back, so none seen once is demoted)
- p99_ttft_no_reuse_disk_1st_sighting_on_vs_off  the same with every unique block demoted (`min_sightings: 1`)
- ttft_slow_disk_auto_vs_recompute  eight 2k-token prefixes served once (they end up on disk), then in turn with
                                    every disk read slowed on purpose (`rollout.faults.slow_reads`): TTFT with the
                                    decision (`load_policy: auto`) ÷ recomputing (kvtier off), the median of the
                                    requests' paired ratios (the same prompt at the same position)
- ttft_slow_disk_always_vs_recompute  the same, loading every block found (`load_policy: always`)

Every timed request of the TTFT figures (not the no-reuse rounds) reaches an idle engine, as on a server with time
between requests: the stores of the requests before it have run, not in its first step.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvtier.bench.redis_server import throwaway_redis
from kvtier.bench.vllm_process import PROMPT, UNIQUE_TOKENS, Engine
from kvtier.rollout.server import temp_env
from kvtier.timing import percentile

REPS = 5  # restored prompts per configuration
UNIQUE = 64  # unique prompts per engine and round: the p99 of 64 is the second slowest, not just the slowest
ROUNDS = 4  # of the no-reuse comparison; even, so that each order of the engines runs as often
BLOCK_NBYTES = 2 * 128 * 2048  # a 256-token block of the tiny model
SLOW_REQUESTS, SLOW_DELAY_S = 16, 0.3  # requests served slowed, seconds per disk read
RESTORE = ("off", "host", "disk", "redis")  # the engines of the restore figures
NO_REUSE = ("off", "host", "disk", "disk_default")
SLOW = ("off", "auto", "always")  # off: the slow-disk figures' recompute


def _configs(root: Path, redis_url: str) -> dict[str, tuple[dict | None, bool]]:
    """Each engine's kvtier config (None: kvtier off) and whether its disk reads can be slowed."""
    tier_bytes = 256 * (BLOCK_NBYTES + 4096)

    def disk(name: str, **more: Any) -> dict:  # a disk tier of the engine's own
        return {"type": "fs", "root_dir": str(root / f"kv-{name}"), "max_bytes": tier_bytes, **more}

    def below(policy: str, tier: dict) -> dict:  # 16 host slots: the fillers push a prompt down to `tier`
        return {"cpu_bytes_to_use": 16 * BLOCK_NBYTES, "load_policy": policy, "secondary_tiers": [tier]}

    every = {"min_sightings": 1}  # the disk paths themselves: every eviction goes down
    shared = {"type": "redis", "url": redis_url, "max_bytes": tier_bytes,
              "trusted_network": True}  # the bench's own server, on loopback: unsigned, as measured before
    # The restore paths themselves load every block found (the decision would skip a disk slower than
    # recomputing; the slow-disk figures measure it)
    return {
        "off": (None, True),
        "host": ({"cpu_bytes_to_use": 256 << 20, "load_policy": "always"}, False),
        "disk": (below("always", disk("disk", admission=every)), False),
        "disk_default": (below("always", disk("disk_default")), False),
        "redis": (below("always", shared), False),
        "auto": (below("auto", disk("auto", admission=every)), True),
        "always": (below("always", disk("always", admission=every)), True),
    }


def _turns(names: Sequence[str], times: int) -> Iterator[tuple[int, str]]:
    """(time, engine) for `times` turns of `names`, in the reverse order every other turn."""
    for i in range(times):
        for name in (names if i % 2 == 0 else reversed(names)):
            yield i, name


def run_vllm_bench(json_path: str | None = None, console: Any = None) -> dict:
    from rich.console import Console
    from rich.progress import Progress

    from kvtier.integrations.vllm.tiny_model import build_tiny_llama

    console = console or Console()
    steps = len(RESTORE) * REPS + len(NO_REUSE) * ROUNDS + len(SLOW) * (1 + SLOW_REQUESTS)
    with tempfile.TemporaryDirectory(prefix="kvtier-vbench-") as tmp, throwaway_redis() as url, ExitStack() as stack, \
            Progress(console=console) as progress:
        root = Path(tmp)
        env = temp_env(tmp)  # what the engines leave in their temp folder goes with this one
        model = build_tiny_llama(root / "model")
        engines = {name: stack.enter_context(Engine(name, model, config, root, env, slow_reads=slow))
                   for name, (config, slow) in _configs(root, url).items()}
        task = progress.add_task(f"starting {len(engines)} engines", total=len(engines))
        for engine in engines.values():
            engine.ready()
            progress.advance(task)
        task = progress.add_task("restored prompts", total=steps)
        runs: dict[str, list[dict]] = {name: [] for name in RESTORE}
        for rep, name in _turns(RESTORE, REPS):
            runs[name].append(engines[name].ask("restore", rep))
            progress.advance(task)
        engines.pop("redis").close()
        progress.update(task, description="unique prompts")
        no_reuse: list[dict[str, list[float]]] = [{} for _ in range(ROUNDS)]
        for round_, name in _turns(NO_REUSE, ROUNDS):
            no_reuse[round_][name] = engines[name].ask("unique", round_, UNIQUE)
            progress.advance(task)
        progress.update(task, description="slowed disk reads")
        for name in SLOW:
            engines[name].ask("slow_prime")
            engines[name].slow_down(SLOW_DELAY_S)
            progress.advance(task)
        slow: dict[str, list[tuple[float, int]]] = {name: [] for name in SLOW}
        for i, name in _turns(SLOW, SLOW_REQUESTS):
            slow[name].append(engines[name].ask("slow", i))
            progress.advance(task)
    result = _figures(runs, no_reuse, slow)
    _print_table(result, console)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result


def _figures(runs: dict[str, list[dict]], no_reuse: list[dict[str, list[float]]],
             slow: dict[str, list[tuple[float, int]]]) -> dict:
    med = {name: {k: statistics.median(rep[k] for rep in reps) for k in reps[0]} for name, reps in runs.items()}
    p99_rounds = {on: [percentile(r[on], 0.99) / percentile(r["off"], 0.99) for r in no_reuse]
                  for on in ("host", "disk", "disk_default")}
    engine_hit_ratios = [r["restored"] / r["engine_hit"] for r in runs["host"]]  # per prompt
    slow_ratios = {policy: [a[0] / b[0] for a, b in zip(slow[policy], slow["off"])] for policy in ("auto", "always")}
    return {
        "ttft_host_vs_recompute": med["host"]["restored"] / med["off"]["restored"],
        "ttft_disk_vs_recompute": med["disk"]["restored"] / med["off"]["restored"],
        "ttft_host_vs_engine_hit": statistics.median(engine_hit_ratios),
        "ttft_host_vs_engine_hit_per_prompt": engine_hit_ratios,
        "ttft_redis_vs_recompute": med["redis"]["restored"] / med["off"]["restored"],
        "p99_ttft_no_reuse_on_vs_off": statistics.median(p99_rounds["host"]),
        "p99_ttft_no_reuse_disk_on_vs_off": statistics.median(p99_rounds["disk_default"]),
        "p99_ttft_no_reuse_disk_1st_sighting_on_vs_off": statistics.median(p99_rounds["disk"]),
        "p99_ttft_no_reuse_rounds": p99_rounds,
        "ttft_slow_disk_auto_vs_recompute": statistics.median(slow_ratios["auto"]),
        "ttft_slow_disk_always_vs_recompute": statistics.median(slow_ratios["always"]),
        "slow_disk": {"delay_s_per_read": SLOW_DELAY_S, "requests": SLOW_REQUESTS,
                      "ratio_p10_p90": {p: [percentile(v, 0.1), percentile(v, 0.9)] for p, v in slow_ratios.items()},
                      "ttft_ms_median": {n: 1e3 * statistics.median(t for t, _ in r) for n, r in slow.items()},
                      # requests vLLM reports cached tokens for: the 8 prompts outlast its own cache (off: 0), so a
                      # tier's, the slowed disk's or host's where a load brought them back
                      "served_from_a_tier": {n: sum(c > 0 for _, c in r) for n, r in slow.items()}},
        "no_reuse_ttft_ms": [{name: {"p50": 1e3 * statistics.median(v), "p99": 1e3 * percentile(v, 0.99)}
                              for name, v in r.items()} for r in no_reuse],
        "ttft_ms": {name: {k: 1e3 * v for k, v in m.items() if k != "restored_cached"} for name, m in med.items()},
        "restored_cached_tokens": {name: [rep["restored_cached"] for rep in reps] for name, reps in runs.items()},
        "targets": {"ttft_host_vs_recompute": 0.3, "ttft_disk_vs_recompute": 0.3, "ttft_host_vs_engine_hit": 1.2,
                    "p99_ttft_no_reuse_on_vs_off": 1.03, "p99_ttft_no_reuse_disk_on_vs_off": 1.05,
                    "ttft_slow_disk_auto_vs_recompute": 1.05},
        "prompt_tokens": PROMPT, "repetitions": REPS, "unique_prompt_tokens": UNIQUE_TOKENS,
        "unique_prompts_per_round": UNIQUE, "no_reuse_rounds": ROUNDS,
    }


def _print_table(result: dict, console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"kvtier on vLLM (CPU, tiny model): TTFT ratios; restores: medians of {REPS} prompts of "
                        f"{PROMPT} tokens; p99s: medians of {ROUNDS} rounds of {UNIQUE} unique prompts of "
                        f"{UNIQUE_TOKENS} tokens")
    for col in ("figure", "ratio", "target", ""):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for name, target in result["targets"].items():
        ok = result[name] <= target
        table.add_row(name, f"{result[name]:.3f}", f"≤ {target}", "ok" if ok else "MISSED")
    for name in ("ttft_redis_vs_recompute",  # not targets: a Redis restore, what admission (and the decision)
                 "p99_ttft_no_reuse_disk_1st_sighting_on_vs_off",  # spare unique traffic, and a slow tier
                 "ttft_slow_disk_always_vs_recompute"):
        table.add_row(name, f"{result[name]:.3f}", "—", "reported")
    console.print(table)
