"""How kvtier measures: ours and a baseline in the same run, alternated, as medians of paired ratios.

One place for the timing helper, the pairing (ABBA order, so that drift on a shared machine hits both alike),
the summary of paired runs, one percentile, and the machine's description (with how busy other processes
kept it: above about 0.3 CPUs the figures are noisy). The benchmarks (`kvtier.bench`) and the rollout's
latency figures (`kvtier.rollout`) both measure through it; it imports nothing of kvtier (torch only inside
`machine`), so the rollout stays free of the engine.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

MIN_REPS = 5  # pairs per figure, at least
BUDGET_S = 30.0  # seconds per figure after which no pair beyond MIN_REPS is started


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds one call of `fn` took, and what it returned."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def alternate(
    ours: Callable[[], Any], base: Callable[[], Any], reps: int, tick: Callable[[], None],
    budget_s: float = BUDGET_S,
) -> dict:
    """One untimed warm-up of each side, then `reps` pairs in ABBA order; each callable returns its seconds.

    Past `budget_s` (a machine so loaded that copies crawl) it stops after MIN_REPS pairs.
    """
    start = time.monotonic()
    ours(), base()
    tick()
    pairs = []
    for rep in range(reps):
        if rep % 2 == 0:
            o, b = ours(), base()
        else:
            b, o = base(), ours()
        pairs.append((o, b))
        tick()
        if len(pairs) >= MIN_REPS and time.monotonic() - start > budget_s:
            for _ in range(reps - len(pairs)):
                tick()
            break
    return {"ours_s": [o for o, _ in pairs], "baseline_s": [b for _, b in pairs]}


def summary(times: dict, nbytes: int) -> dict:
    """Throughputs of both sides (GB/s = 1e9 B/s) and the median of the paired ratios."""
    ours = [nbytes / s / 1e9 for s in times["ours_s"]]
    base = [nbytes / s / 1e9 for s in times["baseline_s"]]
    return {
        "ratio": statistics.median(o / b for o, b in zip(ours, base)),
        "ratio_of_medians": statistics.median(ours) / statistics.median(base),
        "ours_gbps": statistics.median(ours),
        "baseline_gbps": statistics.median(base),
        "ours_gbps_runs": [round(x, 3) for x in ours],
        "baseline_gbps_runs": [round(x, 3) for x in base],
        "bytes": nbytes,
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q`-quantile (q in [0, 1]) of `values`; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def machine() -> dict:
    import torch

    return {
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "loadavg_start": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def cpu_busy() -> tuple[float, float, float] | None:
    """(CPU-seconds busy on the whole machine, CPU-seconds of this process, wall time), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), time.process_time(), time.monotonic()


def others_load(start: tuple[float, float, float] | None) -> float | None:
    """CPUs kept busy by other processes since `start`, on average: above ~0.3 the figures are noisy."""
    end = cpu_busy()
    if start is None or end is None or end[2] <= start[2]:
        return None
    return max(0.0, ((end[0] - start[0]) - (end[1] - start[1])) / (end[2] - start[2]))


def fresh_keys(n: int) -> list[bytes]:
    """`n` random 32-byte keys: every round of a benchmark stores new blocks."""
    raw = os.urandom(32 * n)
    return [raw[i : i + 32] for i in range(0, 32 * n, 32)]
