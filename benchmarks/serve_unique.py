"""Unique prompts through `vllm serve`: p99 TTFT with a disk tier against kvtier off (benchmarks/README.md,
docs/findings/disk-admission.md). Each round starts one fresh server per configuration (the rollout's embedded
command), in the reverse order every other round, and drives it with `vllm bench serve` one request at a time.

    .venv/bin/python benchmarks/serve_unique.py --rounds 4      # about 4 minutes a round on 2 cores
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtier.bench.vllm_engine import BLOCK_NBYTES
from kvtier.integrations.vllm.tiny_model import ENGINE_BLOCKS
from kvtier.rollout.server import Server, embedded_command, free_port

PROMPTS, PROMPT_TOKENS = 150, 2048


def configs(root: Path) -> dict[str, dict | None]:
    disk = {"type": "fs", "root_dir": str(root / "kv"), "max_bytes": 512 * (BLOCK_NBYTES + 4096)}
    return {
        "off": None,
        "disk_default": {"cpu_bytes_to_use": 16 * BLOCK_NBYTES, "secondary_tiers": [disk]},
        "disk_1st_sighting": {"cpu_bytes_to_use": 16 * BLOCK_NBYTES,
                              "secondary_tiers": [{**disk, "admission": {"min_sightings": 1}}]},
    }


def serve_and_bench(model: str, config: dict | None, root: Path, label: str, seed: int) -> dict:
    """p50 and p99 TTFT (ms) of PROMPTS unique prompts against a fresh server."""
    shutil.rmtree(root / "kv", ignore_errors=True)
    port = free_port()
    server = Server(embedded_command(model, config, ENGINE_BLOCKS, port), port, root / f"{label}.log", model=model)
    try:
        server.wait_ready(300)
        out = root / f"{label}.json"
        bench = subprocess.run(
            [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", server.url,
             "--model", model, "--tokenizer", model, "--dataset-name", "random", "--random-input-len",
             str(PROMPT_TOKENS), "--random-output-len", "4", "--num-prompts", str(PROMPTS), "--max-concurrency", "1",
             "--seed", str(seed), "--percentile-metrics", "ttft", "--metric-percentiles", "50,99", "--save-result",
             "--result-dir", str(root), "--result-filename", out.name],
            capture_output=True, text=True, timeout=900)
        if bench.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed for {label}:\n{bench.stdout[-2000:]}{bench.stderr[-2000:]}")
        result = json.loads(out.read_text())
        if result["completed"] != PROMPTS:
            raise RuntimeError(f"{label}: {result['completed']} of {PROMPTS} requests completed")
        return {"p50": result["median_ttft_ms"], "p99": result["p99_ttft_ms"]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of one server per configuration (default 4)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-unique-") as tmp:
        root = Path(tmp)
        model = str(root / "tiny")
        subprocess.run([sys.executable, "-m", "kvtier.cli", "tiny-model", model], check=True, capture_output=True)
        named = configs(root)
        rounds = []
        for i in range(args.rounds):
            order = list(named) if i % 2 == 0 else list(reversed(named))
            ttft = {name: serve_and_bench(model, named[name], root, f"{name}-{i}", seed=i) for name in order}
            rounds.append(ttft)
            print(json.dumps({"round": i, "order": order, "ttft_ms": ttft}), flush=True)
    for name in list(named)[1:]:
        for q in ("p99", "p50"):
            ratios = [r[name][q] / r["off"][q] for r in rounds]
            print(f"{name}: {q} TTFT / off, median {statistics.median(ratios):.3f}, rounds "
                  + ", ".join(f"{x:.3f}" for x in ratios))


if __name__ == "__main__":
    main()
