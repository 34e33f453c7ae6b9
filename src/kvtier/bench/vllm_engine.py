"""`kvtier bench --vllm`: TTFT ratios on a real vLLM engine (CPU, tiny model), each against a baseline measured
in the same run on the same machine. Medians over several prompts; one fresh engine process per configuration.

- ttft_host_vs_recompute   a ~4k-token prefix evicted from vLLM's cache, back from the host tier, ÷ recomputing it
- ttft_disk_vs_recompute   the same from the disk tier (O_DIRECT reads: the page cache is bypassed), which admits
                           every block host evicts (`min_sightings: 1`), as do the slow-disk figures' tiers
- ttft_host_vs_engine_hit  the host-tier hit ÷ vLLM's own prefix-cache hit of the same prompt right after, in the
                           same engine: the median over prompts of each prompt's ratio (its hits' median below it)
- ttft_redis_vs_recompute  the prefix back from a Redis tier (a redis-server of the bench's own, on loopback)
- p99_ttft_no_reuse_on_vs_off  unique prompts only: p99 TTFT with kvtier as it starts (the host tier, no secondary
                               tiers configured) ÷ without; a round runs one fresh engine of each configuration,
                               in the reverse order every other round (an engine's place in the round moves its
                               figures), and the figure is the median of the rounds' ratios
- p99_ttft_no_reuse_disk_on_vs_off  the same with host + disk tiers as configured by default (the disk's admission
                                    `auto`: no block comes back, so none seen once is demoted)
- p99_ttft_no_reuse_disk_1st_sighting_on_vs_off  the same with every unique block demoted (`min_sightings: 1`)
- ttft_slow_disk_auto_vs_recompute  eight 2k-token prefixes served once (they end up on disk), then in turn with
                                    every disk read slowed on purpose (`rollout.faults.slow_reads`): TTFT with the
                                    decision (`load_policy: auto`) ÷ recomputing (kvtier off), the median of the
                                    requests' paired ratios (the same prompt at the same position)
- ttft_slow_disk_always_vs_recompute  the same, loading every block found (`load_policy: always`)

Every timed request of the TTFT figures (not the no-reuse rounds) reaches an idle engine, as on a server with time
between requests: the stores of the requests before it have run (`_settle`), not in its first step.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtier.bench.redis_server import throwaway_redis
from kvtier.rollout.server import temp_env
from kvtier.timing import percentile

PROMPT = 4032  # tokens: a ~4k prefix and the last engine block, within the tiny model's 4,096 positions
FILLER = 2048
REPS = 7
HITS = 3  # vLLM's own hits of each restored prompt: the restore's paired baseline is their median
UNIQUE = 96  # per round: the p99 of 96 is the second slowest, not just the slowest
ROUNDS = 6  # of the no-reuse comparison: fresh engines differ by several percent, so pair them and repeat;
# even, so that each order of the engines runs as often
BLOCK_NBYTES = 2 * 128 * 2048  # a 256-token block of the tiny model
SLOW_PROMPTS, SLOW_REQUESTS, SLOW_DELAY_S = 8, 24, 0.3  # prefixes, requests served slowed, seconds per disk read


def _tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


def _tiers_main(model: str, config_json: str, out_path: str, reps: int, unique: int) -> None:
    """One engine: per rep, a fresh prompt cold, then after fillers evicted it, then at once again; then
    `unique` prompts that share nothing."""
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.tiny_model import start_engine
    from vllm import SamplingParams

    llm = start_engine(model, json.loads(config_json))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)

    def ttft(tokens: list[int], settle: bool = True) -> tuple[float, int]:
        if settle:
            _settle(llm)
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        return out.metrics.first_token_latency, out.num_cached_tokens

    ttft(_tokens("warm-up", PROMPT))
    result: dict[str, list] = {"cold": [], "restored": [], "engine_hit": [], "restored_cached": [], "unique": []}
    for rep in range(reps):
        prompt = _tokens(f"prompt-{rep}", PROMPT)
        result["cold"].append(ttft(prompt)[0])
        for k in range(3):  # 6,144 tokens of other traffic: the prompt leaves the engine's 48 blocks
            ttft(_tokens(f"filler-{rep}-{k}", FILLER))
        seconds, cached = ttft(prompt)
        result["restored"].append(seconds)
        result["restored_cached"].append(cached)
        result["engine_hit"].append(statistics.median(ttft(prompt)[0] for _ in range(HITS)))
    for i in range(unique):  # back to back: the stores of one request land in the next one's steps, as under load
        result["unique"].append(ttft(_tokens(f"unique-{i}", FILLER), settle=False)[0])
    Path(out_path).write_text(json.dumps(result))


def _settle(llm: Any, max_steps: int = 1000) -> None:
    """Step the engine until it holds no work, the connector's pending stores included: what `vllm serve`'s engine
    loop does between requests (`Scheduler.has_requests`), and what the offline `LLM` skips once its requests are
    done."""
    core = llm.llm_engine.engine_core.engine_core  # the in-process engine (`start_engine`)
    for _ in range(max_steps):
        if not core.scheduler.has_requests():
            return
        core.step_fn()


def _slow_disk_main(model: str, config_json: str, out_path: str) -> None:
    """One engine: SLOW_PROMPTS prompts served once, then SLOW_REQUESTS in turn with disk reads slowed."""
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.tiny_model import start_engine
    from kvtier.rollout.faults import slow_reads
    from vllm import SamplingParams

    delay = Path(out_path).with_suffix(".delay")
    slow_reads(delay)
    llm = start_engine(model, json.loads(config_json))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [_tokens(f"slow-{i}", FILLER) + _tokens(f"suffix-{i}", 64) for i in range(SLOW_PROMPTS)]

    def ttft(tokens: list[int]) -> tuple[float, int]:
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        return out.metrics.first_token_latency, out.num_cached_tokens

    for tokens in prompts:
        ttft(tokens)
    delay.write_text(str(SLOW_DELAY_S))
    served = [ttft(prompts[i % SLOW_PROMPTS]) for i in range(SLOW_REQUESTS)]
    Path(out_path).write_text(json.dumps({"ttft": [t for t, _ in served], "cached": [c for _, c in served]}))


def run_vllm_bench(json_path: str | None = None, console: Any = None) -> dict:
    from rich.console import Console
    from rich.table import Table

    from kvtier.integrations.vllm.tiny_model import build_tiny_llama

    console = console or Console()
    with tempfile.TemporaryDirectory(prefix="kvtier-vbench-") as tmp:
        root = Path(tmp)
        scratch_env = temp_env(tmp)  # what the engines leave in their temp folder goes with this one
        model = build_tiny_llama(root / "model")
        disk = {"type": "fs", "root_dir": str(root / "kv"), "max_bytes": 256 * (BLOCK_NBYTES + 4096)}
        every = {**disk, "admission": {"min_sightings": 1}}  # the disk paths themselves: every eviction goes down
        configs = {
            "off": None,
            # The restore paths themselves: every block found is loaded (the decision would skip a disk slower
            # than recomputing; the slow-disk figures measure it)
            "host": {"cpu_bytes_to_use": 256 << 20, "load_policy": "always"},
            # 16 host slots: the fillers push the prompt's 16 blocks down to disk, and it comes back from there
            "disk": {"cpu_bytes_to_use": 16 * BLOCK_NBYTES, "load_policy": "always", "secondary_tiers": [every]},
            "disk_default": {"cpu_bytes_to_use": 16 * BLOCK_NBYTES, "load_policy": "always",
                             "secondary_tiers": [disk]},
        }

        def engine(label: str, mode: str, config: dict | None, *args: int) -> dict[str, list]:
            """One engine process (`mode`: "tiers" or "slow"), a fresh disk tier, its findings."""
            console.print(f"[bold]engine: {label}[/bold]")
            out = root / "engine.json"
            shutil.rmtree(root / "kv", ignore_errors=True)
            proc = subprocess.run([sys.executable, "-m", "kvtier.bench.vllm_engine", mode, model, json.dumps(config),
                                   str(out), *map(str, args)], capture_output=True, text=True, env=scratch_env)
            if proc.returncode != 0:
                raise RuntimeError(f"engine '{label}' failed:\n{proc.stderr[-3000:]}")
            return json.loads(out.read_text())

        runs = {name: engine(name, "tiers", configs[name], REPS, 0) for name in ("off", "host", "disk")}
        with throwaway_redis() as url:  # the prompt comes back from Redis, straight into the engine's blocks
            shared = {"type": "redis", "url": url, "max_bytes": 256 * (BLOCK_NBYTES + 4096),
                      "trusted_network": True}  # the bench's own server, on loopback: unsigned, as measured before
            runs["redis"] = engine("redis", "tiers", {"cpu_bytes_to_use": 16 * BLOCK_NBYTES, "load_policy": "always",
                                                      "secondary_tiers": [shared]}, REPS, 0)
        orders = [list(configs), list(reversed(configs))]
        no_reuse = [{name: engine(name, "tiers", configs[name], 0, UNIQUE)["unique"] for name in orders[i % 2]}
                    for i in range(ROUNDS)]
        slow = {"recompute": engine("slow disk, kvtier off", "slow", None)}
        for policy in ("auto", "always"):
            config = {"cpu_bytes_to_use": 16 * BLOCK_NBYTES, "load_policy": policy, "secondary_tiers": [every]}
            slow[policy] = engine(f"slow disk, load_policy {policy}", "slow", config)
    med = {name: {k: statistics.median(v) for k, v in r.items() if v} for name, r in runs.items()}
    p99_ratios = {on: [percentile(r[on], 0.99) / percentile(r["off"], 0.99) for r in no_reuse]
                  for on in ("host", "disk", "disk_default")}
    engine_hit_ratios = [a / b for a, b in zip(runs["host"]["restored"], runs["host"]["engine_hit"])]  # per prompt
    slow_ratios = {policy: [a / b for a, b in zip(slow[policy]["ttft"], slow["recompute"]["ttft"])]
                   for policy in ("auto", "always")}
    result = {
        "ttft_host_vs_recompute": med["host"]["restored"] / med["off"]["restored"],
        "ttft_disk_vs_recompute": med["disk"]["restored"] / med["off"]["restored"],
        "ttft_host_vs_engine_hit": statistics.median(engine_hit_ratios),
        "ttft_host_vs_engine_hit_per_prompt": engine_hit_ratios,
        "ttft_redis_vs_recompute": med["redis"]["restored"] / med["off"]["restored"],
        "p99_ttft_no_reuse_on_vs_off": statistics.median(p99_ratios["host"]),
        "p99_ttft_no_reuse_disk_on_vs_off": statistics.median(p99_ratios["disk_default"]),
        "p99_ttft_no_reuse_disk_1st_sighting_on_vs_off": statistics.median(p99_ratios["disk"]),
        "p99_ttft_no_reuse_rounds": p99_ratios,
        "ttft_slow_disk_auto_vs_recompute": statistics.median(slow_ratios["auto"]),
        "ttft_slow_disk_always_vs_recompute": statistics.median(slow_ratios["always"]),
        "slow_disk": {"delay_s_per_read": SLOW_DELAY_S, "requests": SLOW_REQUESTS,
                      "ratio_p10_p90": {p: [percentile(v, 0.1), percentile(v, 0.9)] for p, v in slow_ratios.items()},
                      "ttft_ms_median": {n: 1e3 * statistics.median(r["ttft"]) for n, r in slow.items()},
                      "served_from_disk": {n: sum(c > 0 for c in r["cached"]) for n, r in slow.items()}},
        "no_reuse_ttft_ms": [{name: {"p50": 1e3 * statistics.median(v), "p99": 1e3 * percentile(v, 0.99)}
                              for name, v in r.items()} for r in no_reuse],
        "ttft_ms": {name: {k: 1e3 * v for k, v in m.items() if k != "restored_cached"} for name, m in med.items()},
        "restored_cached_tokens": {name: r["restored_cached"] for name, r in runs.items()},
        "targets": {"ttft_host_vs_recompute": 0.3, "ttft_disk_vs_recompute": 0.3, "ttft_host_vs_engine_hit": 1.2,
                    "p99_ttft_no_reuse_on_vs_off": 1.03, "p99_ttft_no_reuse_disk_on_vs_off": 1.05,
                    "ttft_slow_disk_auto_vs_recompute": 1.05},
        "prompt_tokens": PROMPT, "repetitions": REPS, "unique_prompts": UNIQUE, "no_reuse_rounds": ROUNDS,
    }
    table = Table(title=f"kvtier on vLLM (CPU, tiny model): TTFT ratios, medians of {REPS} prompts of {PROMPT} tokens")
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
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    if sys.argv[1] == "slow":
        _slow_disk_main(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        _tiers_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
