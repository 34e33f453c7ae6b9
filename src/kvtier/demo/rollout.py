"""`kvtier demo`: the rollout a careful operator would do, one change at a time, on a real vLLM engine (CPU).

A reference (vLLM with an engine cache that holds the whole workload: what a bigger GPU would give), then
baseline (vLLM's prefix cache only, a deliberately small engine KV budget) -> + host tier -> + host and disk
tiers, on one built-in workload (shared system prompts, RAG documents, multi-turn sessions that come back after
other traffic, unique prompts) arriving in waves of concurrent requests. Each configuration runs in a fresh
engine process. Reported per configuration: TTFT p50/p95/p99, ITL p50/p99, prompt tokens by source, bytes
moved, tier usage against its bound, and the exactness check against the reference (`kvtier.demo.exactness`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtier.bench.timing import percentile
from kvtier.demo import exactness
from kvtier.integrations.vllm.tiny_model import ENGINE_BLOCK_TOKENS, ENGINE_BLOCKS

MAX_PROMPT = 3800
MAX_TOKENS = 8
BLOCK_NBYTES = 2 * 128 * 2048  # a 256-token kvtier block of the tiny model: 2 KiB per token


def configurations(root: Path, prompts: list[list[int]]) -> list[tuple[str, dict | None, int]]:
    """(name, kvtier config or None, engine blocks of 128 tokens); the reference comes first."""
    host = {"cpu_bytes_to_use": 24 * BLOCK_NBYTES}  # deliberately tight: the disk tier has work to do
    disk = {"type": "fs", "root_dir": str(root / "kv"), "max_bytes": 400 * (BLOCK_NBYTES + 4096)}
    everything = sum(len(p) for p in prompts) // ENGINE_BLOCK_TOKENS + 64  # every prefix stays in the engine
    return [("reference", None, everything), ("baseline", None, ENGINE_BLOCKS), ("+ host", host, ENGINE_BLOCKS),
            ("+ host + disk", {**host, "secondary_tiers": [disk]}, ENGINE_BLOCKS)]


# ---------------------------------------------------------------- the engine process


def _engine_main(model: str, config_json: str, workload_json: str, concurrency: int, engine_blocks: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.tiny_model import start_engine

    llm = start_engine(model, json.loads(config_json), max_num_seqs=concurrency, engine_blocks=engine_blocks)
    prompts = json.loads(Path(workload_json).read_text())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=1)
    llm.generate([TokensPrompt(prompt_token_ids=[7] * 300)], params, use_tqdm=False)  # warm-up, not measured
    results = []
    for start in range(0, len(prompts), concurrency):
        wave = prompts[start : start + concurrency]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in wave], params, use_tqdm=False)
        for out in outs:
            m = out.metrics
            n = len(out.outputs[0].token_ids)
            itl = (m.last_token_ts - m.first_token_ts) / (n - 1) if m and n > 1 else 0.0
            completion = out.outputs[0]
            results.append({"tokens": list(completion.token_ids), "cached": out.num_cached_tokens,
                            "logprobs": [d[t].logprob for t, d in zip(completion.token_ids, completion.logprobs)],
                            "ttft": m.first_token_latency if m else 0.0, "itl": itl, "prompt": len(out.prompt_token_ids)})
        print(f"progress {len(results)}", flush=True)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 8)], params, use_tqdm=False)  # idle time: stores drain
    print("result " + json.dumps({"requests": results, "kvtier": _kvtier_figures(llm)}), flush=True)


def _kvtier_figures(llm: Any) -> dict:
    """The connector's own figures, read from both halves (both live in this process in in-process mode)."""
    figures: dict = {}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()._worker
        figures["moves"] = worker.metrics.snapshot()
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        figures["tokens"] = {k.removeprefix("tokens_"): v for k, v in scheduler.stats.items() if k.startswith("tokens_")}
        figures["tiers"] = {name: {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes}
                            for name, u in scheduler.directory.usage().items()}
        figures["orphans"] = scheduler.directory.orphans()
    except (AttributeError, AssertionError, ImportError):
        pass
    return figures


# ---------------------------------------------------------------- the operator's side


def workload(n_requests: int, seed: int) -> list[list[int]]:
    from kvtier.traces.workloads import shared_prefix_workload

    requests = shared_prefix_workload(n_requests, seed=seed, system_tokens=1024, document_tokens=1024,
                                      turn_tokens=256, unique_tokens=1024)
    return [list(r.tokens[-MAX_PROMPT:]) for r in requests]


def run_rollout(n_requests: int = 48, seed: int = 0, concurrency: int = 1, json_path: Path | None = None,
                plot_path: Path | None = None, console: Any = None) -> dict:
    from rich.progress import Progress

    from kvtier.integrations.vllm.tiny_model import build_tiny_llama
    from kvtier.report import readable_console

    console = readable_console(console)
    prompts = workload(n_requests, seed)
    report: dict = {"requests": n_requests, "concurrency": concurrency, "configurations": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-rollout-") as tmp:
        root = Path(tmp)
        model = build_tiny_llama(root / "tiny-llama")
        (root / "workload.json").write_text(json.dumps(prompts))
        with Progress(console=console, transient=True) as progress:
            for name, extra, blocks in configurations(root, prompts):
                task = progress.add_task(name, total=len(prompts))
                result = _run_engine(model, extra, blocks, root / "workload.json", concurrency, progress, task)
                report["configurations"].append(_summarize(name, extra, blocks, result))
    reference = report["configurations"][0]
    for cfg in report["configurations"][1:]:
        cfg["exactness"] = exactness.check(reference["requests"], cfg["requests"])
    # Requests computed together share matmuls whose shapes depend on the whole batch, which differs between
    # configurations: only requests computed alone can be held to bit-exactness (see kvtier.demo.exactness).
    report["exactness_required"] = concurrency == 1
    report["exact"] = all(cfg["exactness"]["exact"] for cfg in report["configurations"][1:])
    console.print(_table(report))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    if plot_path:
        _plot(report, plot_path)
        console.print(f"TTFT distributions: {plot_path}")
    return report


def _run_engine(model: str, extra: dict | None, blocks: int, workload_path: Path, concurrency: int, progress: Any,
                task: Any) -> dict:
    cmd = [sys.executable, "-m", "kvtier.demo.rollout", model, json.dumps(extra), str(workload_path),
           str(concurrency), str(blocks)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("progress "):
            progress.update(task, completed=int(line.split()[1]))
        elif line.startswith("result "):
            result = json.loads(line[len("result "):])
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.wait() != 0 or result is None:
        raise RuntimeError(f"engine process failed:\n{stderr[-3000:]}")
    return result


def _summarize(name: str, extra: dict | None, engine_blocks: int, result: dict) -> dict:
    reqs = result["requests"]
    ttft = [r["ttft"] for r in reqs]
    itl = [r["itl"] for r in reqs]
    prompt_tokens = sum(r["prompt"] for r in reqs)
    cached = sum(r["cached"] for r in reqs)
    tiers = result["kvtier"].get("tokens", {})
    from_tiers = sum(tiers.values())
    moved = result["kvtier"].get("moves", {}).get("move_bytes", {})
    return {
        "name": name, "config": extra,
        "ttft_ms": {q: 1e3 * percentile(ttft, p) for q, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))},
        "itl_ms": {q: 1e3 * percentile(itl, p) for q, p in (("p50", 0.5), ("p99", 0.99))},
        "ttft_all_ms": [1e3 * t for t in ttft],
        "tokens": {"engine": cached - from_tiers, **tiers, "recomputed": prompt_tokens - cached},
        "bytes_moved": moved, "tiers": result["kvtier"].get("tiers", {}), "orphans": result["kvtier"].get("orphans", 0),
        "engine_blocks": engine_blocks,
        "requests": [{k: r[k] for k in ("cached", "tokens", "logprobs")} for r in reqs],
    }


def _table(report: dict) -> Any:
    from rich.table import Table

    table = Table(title=f"kvtier rollout on vLLM (CPU): {report['requests']} requests, {report['concurrency']} at a "
                  "time; exact: requests with the reference's cached length that match it bit for bit",
                  title_justify="left")
    for col in ("configuration", "TTFT p50/p95/p99 ms", "ITL p50/p99 ms", "engine", "host", "disk", "recomputed",
                "moved MiB", "exact", "other length: same tokens"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for c in report["configurations"]:
        t, i, tok = c["ttft_ms"], c["itl_ms"], c["tokens"]
        moved = sum(c["bytes_moved"].values()) / 2**20
        e = c.get("exactness")
        verdict = "" if e is None or e["exact"] else " FAILED" if report["exactness_required"] else " (batched)"
        exact = "—" if e is None else f"{e['identical']}/{e['compared']}{verdict}"
        others = "" if e is None else f"{e['others_same_tokens']}/{e['others']}"
        table.add_row(c["name"], f"{t['p50']:.0f} / {t['p95']:.0f} / {t['p99']:.0f}", f"{i['p50']:.1f} / {i['p99']:.1f}",
                      f"{tok['engine']:,}", f"{tok.get('host', 0):,}", f"{tok.get('disk', 0):,}", f"{tok['recomputed']:,}",
                      f"{moved:,.0f}", exact, others)
    return table


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in report["configurations"]:
        values = sorted(c["ttft_all_ms"])
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=c["name"])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT by configuration (kvtier rollout, vLLM CPU)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    _engine_main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
