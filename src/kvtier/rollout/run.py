"""`kvtier rollout`: the seven-step method, one change at a time, against a real OpenAI-compatible server.

1 baseline: vLLM's prefix cache alone (and, on the embedded default, a reference whose engine cache holds the
  whole workload: what a bigger GPU would give, and the exactness oracle); 2 host headroom: what the host has
  left beside the server; 3 a small host tier, nothing else changed; 4 hit quality: prompt tokens by source
  (engine, host, disk, remote, recomputed) from the server's /metrics, deltas per level; 5 tail latency under
  contention: every step at rising concurrency, open-loop arrivals, streaming TTFT/ITL/e2e p50/p95/p99;
  6 a secondary tier, and its drills (`kvtier.rollout.drills`); 7 the rollback rule: the guard's TTFT budget
  applied to every level and drill, the guard running in the server, and a drill that breaks the budget.
Each step runs in a server of its own; each level sends a workload of its own (same shape, new tokens).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from kvtier.rollout import steps
from kvtier.rollout.harness import Rollout
from kvtier.rollout.options import Options


def run(opts: Options, console: Any = None) -> dict:
    from rich.progress import Progress

    from kvtier.report import readable_console

    opts.check()
    console = readable_console(console)
    with tempfile.TemporaryDirectory(prefix="kvtier-rollout-") as tmp, \
            Progress(console=console, transient=True) as progress:
        ro = Rollout(opts, Path(tmp), progress)
        ro.report = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in opts.__dict__.items()},
                     "budget_ms": opts.ttft_budget_ms, "drill_budget_ms": opts.ttft_budget_ms, "steps": []}
        steps.run_all(ro)
        return ro.report
