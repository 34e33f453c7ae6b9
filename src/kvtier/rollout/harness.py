"""The rollout's harness: its options, the servers it starts, the traffic it sends and the figures it reads off
them. `kvtier.rollout.steps` runs the steps through it, `kvtier.rollout.drills` the drills; `kvtier.rollout.run`
is the command's entry."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.rollout import client, workload
from kvtier.rollout.server import MAX_MODEL_LEN, Server, embedded_command, free_port, template_command
from kvtier.timing import percentile

STEPS = ("reference", "baseline", "headroom", "host", "host+disk", "rollback")
KV_BYTES_PER_TOKEN = 2048  # the tiny model: 4 layers x K and V x 2 KV heads x 64 x bf16
BLOCK_TOKENS = 256  # kvtier's block
BLOCK_NBYTES = BLOCK_TOKENS * KV_BYTES_PER_TOKEN
KVTIER_FIGURES = ("kvtier_lookup_tokens_total", "kvtier_guard_transitions_total", "kvtier_stores_dropped_total",
                  "kvtier_load_decisions_total", "kvtier_evictions_total")
DRILL_WINDOW_BUDGETS = 3  # the rollback drill's guard window, in budgets: two slowed requests and a margin
SOURCES = {"device": "engine", "host": "host", "disk": "disk", "external_unspecified": "remote", "p2p": "remote"}


@dataclass(frozen=True)
class Options:
    requests: int = 24  # per level
    levels: tuple[int, ...] = (1, 2, 4)  # concurrency; level 1 is closed loop (one request at a time)
    max_tokens: int = 8
    trace: Path | None = None
    command: str | None = None  # a template (`kvtier.rollout.server`); None: the embedded tiny model
    model: Path | None = None  # the embedded server's model, written by `kvtier tiny-model`; None: built here
    steps: tuple[str, ...] = STEPS
    ttft_budget_ms: float | None = None  # None: 1.5 x the baseline's worst p99
    host_bytes: int = 24 * BLOCK_NBYTES  # deliberately tight: the disk tier has work to do
    disk_bytes: int = 400 * (BLOCK_NBYTES + 4096)
    seed: int = 0

    def check(self) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown:
            raise ValueError(f"--steps: unknown step {unknown[0]!r} (known: {', '.join(STEPS)})")
        if self.requests <= 0 or self.max_tokens <= 0 or any(c <= 0 for c in self.levels):
            raise ValueError("--requests, --max-tokens and every --levels value must be > 0")
        if self.command and "{port}" not in self.command:
            raise ValueError("--command: the template needs {port} (and {kv_transfer_config} for kvtier's steps)")
        if self.command and "reference" in self.steps:
            raise ValueError("--steps: 'reference' needs the embedded server (it sets the engine cache size)")


@dataclass
class Rollout:
    opts: Options
    root: Path
    progress: Any
    model: str | None = None
    report: dict = field(default_factory=dict)
    service_s: float | None = None  # mean e2e at level 1 of the first step: open-loop rates are levels of it

    # ---------------------------------------------------------------- servers

    def start(self, name: str, kvtier: dict | None, engine_blocks: int, env: dict[str, str] | None = None) -> Server:
        port = free_port()
        if self.opts.command:
            command = template_command(self.opts.command, kvtier, port)
        else:
            assert self.model is not None
            command = embedded_command(self.model, kvtier, engine_blocks, port)
        server = Server(command, port, self.root / "logs" / f"{name}.log", env,
                        model=None if self.opts.command else self.model)
        self.ready(server, name)
        return server

    def ready(self, server: Server, name: str) -> float:
        """Seconds until the (just started) server answers, then one request it computes before any measured
        one: the engine's first-request costs are not the tiers'."""
        task = self.progress.add_task(f"{name}: starting the server", total=None)
        try:
            seconds = server.wait_ready()
            client.send(server.url, server.model or "", [client.Prompt([7] * 300, "warm-up", 2)], None)
            return seconds
        except BaseException:
            server.kill()
            raise
        finally:
            self.progress.remove_task(task)

    def guard(self, step: str) -> dict | None:
        """Windows short enough to act within a run: 5 s, or, for the rollback drill, long enough to hold two of
        its requests, each slowed past the budget (one request at a time)."""
        budget = self.report.get("drill_budget_ms" if step == "rollback" else "budget_ms")
        if budget is None:
            return None
        window_s = max(5.0, DRILL_WINDOW_BUDGETS * budget / 1e3) if step == "rollback" else 5.0
        return {"ttft_p99_ms": budget, "window_s": window_s, "breach_windows": 2, "of_windows": 3,
                "min_requests": 2, "hold_s": 6, "probe_share": 0.5}

    def kvtier(self, step: str) -> dict:
        guard = self.guard(step)
        host = {"cpu_bytes_to_use": self.opts.host_bytes, **({"guard": guard} if guard else {})}
        if step == "host":
            return host
        disk = {"type": "fs", "root_dir": str(self.root / step / "kv"), "max_bytes": self.opts.disk_bytes}
        if step == "rollback":  # the drill is about the guard: the disk keeps what host evicts, and is read
            return {**host, "secondary_tiers": [{**disk, "admission": {"min_sightings": 1}}], "load_policy": "always"}
        return {**host, "secondary_tiers": [disk]}

    # ---------------------------------------------------------------- traffic

    def workload(self, salt: int) -> list[client.Prompt]:
        limit = MAX_MODEL_LEN - self.opts.max_tokens - 1
        if self.opts.trace is not None:
            return workload.from_trace(self.opts.trace, self.opts.requests, salt, self.opts.max_tokens, limit)
        return workload.builtin(self.opts.requests, self.opts.seed * 1000 + salt, self.opts.max_tokens, limit)

    def measure(self, server: Server, label: str, prompts: list[client.Prompt], rate: float | None) -> dict:
        """Send `prompts` and summarize: latency from the client, tokens by source from /metrics deltas."""
        task = self.progress.add_task(label, total=len(prompts))
        before = server.metrics()
        results = client.send(server.url, server.model or "", prompts, rate, seed=self.opts.seed,
                             on_done=lambda: self.progress.advance(task))
        time.sleep(1.0)  # the engine's last stats reach /metrics
        after = server.metrics()
        self.progress.remove_task(task)
        return summarize(label, results, rate, delta(before, after))

    def levels(self, server: Server, step: str) -> list[dict]:
        out = []
        for index, level in enumerate(self.opts.levels):
            rate = None if level == 1 else level / (self.service_s or 1.0)
            summary = self.measure(server, f"{step}: concurrency {level}", self.workload(index + 1), rate)
            summary["level"] = level
            if level == 1 and self.service_s is None:
                self.service_s = sum(r["e2e"] for r in summary["results"]) / len(summary["results"])
            out.append(summary)
        return out


# ---------------------------------------------------------------- figures


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def quantiles(values: list[float]) -> dict[str, float]:
    return {q: 1e3 * percentile(values, p) for q, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}


def tokens_by_source(d: dict[str, float]) -> dict[str, int]:
    """Prompt tokens by where their KV came from, as vLLM counted them (its by-source counter)."""
    out = {"prompt": int(d.get("vllm:prompt_tokens_total{}", 0)), "engine": 0, "host": 0, "disk": 0, "remote": 0}
    for source, name in SOURCES.items():
        out[name] += int(d.get(f'vllm:prompt_tokens_cached_by_source_total{{source="{source}"}}', 0))
    out["recomputed"] = out["prompt"] - sum(out[s] for s in ("engine", "host", "disk", "remote"))
    return out


def summarize(label: str, results: list[client.Result], rate: float | None, d: dict[str, float]) -> dict:
    ok = [r for r in results if r.error is None]
    return {
        "label": label, "rate_per_s": rate, "requests": len(results), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "ttft_ms": quantiles([r.ttft for r in ok]), "itl_ms": quantiles([t for r in ok for t in r.itl]),
        "e2e_ms": quantiles([r.e2e for r in ok]), "tokens": tokens_by_source(d),
        "client_cached_tokens": sum(r.cached for r in ok), "client_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "kvtier": {k: v for k, v in d.items() if k.startswith(KVTIER_FIGURES)},
        "results": [r.as_dict() for r in results],
    }


def budget_from(baseline: list[dict]) -> float:
    """The rollback rule's TTFT budget when none is given: 1.5 x the baseline's worst p99, up to 10 ms."""
    return 10 * math.ceil(1.5 * max(level["ttft_ms"]["p99"] for level in baseline) / 10)


def drill_budget_from(baseline: list[dict]) -> float:
    """The rollback drill's budget when none is given: the rule applied to the baseline at the drill's own load,
    one request at a time. Its worst level can be queueing (open-loop arrivals past a CPU server's capacity)."""
    closed = [level for level in baseline if level["rate_per_s"] is None]
    return budget_from(closed or baseline[:1])
