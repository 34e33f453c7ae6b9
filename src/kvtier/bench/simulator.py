"""Simulator benchmark: kvtier's miss-ratio curve and policy replay against libCacheSim, in the same run.

- mrc_vs_libcachesim        time for the whole LRU miss-ratio curve of the Mooncake conversation trace (every
                            capacity, `lru_mrc` over the parsed requests) / time libCacheSim's C simulator
                            (`process_trace` over the same block sequence, pre-converted to its binary
                            oracleGeneral format, hash table sized to the trace) needs for 10 capacities.
                            Target < 1. The hit counts of both at those 10 capacities must agree exactly.
- replay_*_accesses_per_s   `policy_replay` of kvtier's LRU, ARC and S3-FIFO by name (compiled, conversion of the
                            requests included; compilation is timed apart, `replay_compile_s`), beside
                            the same replay through the runtime's policy objects (`replay_*_objects_...`, whose
                            results must be equal: `replay_*_equals_objects`) and libCacheSim's speed on the
                            same sequence and capacity: its C loop, and a Python loop calling its `get` per
                            access (the same harness cost as the objects').
- simulate_command_s        `kvtier simulate TRACE --json` as a user runs it (its 7 built-in configurations,
                            a fresh process, parsing included), once, with each configuration's token hit ratio.

Ours and the baseline alternate so that they share the machine's noise; figures are medians over the
repeats, and ratios are medians of the per-repeat ratios. Trace parsing is timed apart (`trace_parse_s`):
libCacheSim gets its trace already converted, we get ours already parsed.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.policies import make_policy
from kvtier.sim.mrc import lru_mrc
from kvtier.sim.policy_replay import PolicyReplayResult, policy_replay
from kvtier.timing import timed
from kvtier.traces.locate import SOURCES, public_trace
from kvtier.traces.mooncake import read_mooncake
from kvtier.traces.request import TraceRequest

TARGETS = {"mrc_vs_libcachesim": 1.0, "replay_lru_accesses_per_s": 3_000_000,  # below / at least
           "replay_arc_accesses_per_s": 3_000_000, "replay_s3fifo_accesses_per_s": 3_000_000}
TRACE_NAME = "mooncake/conversation_trace.jsonl"
MRC_POINTS = 10
REPLAY_CAPACITY_TOKENS = 3_000_000  # Figure 9's annotated point: one node's DRAM for LLaMA3-70B
POLICIES = ("lru", "arc", "s3fifo")


def default_trace() -> Path:
    """The Mooncake conversation trace in the public traces' folder, $KVTIER_TRACES_DIR (`traces.locate`)."""
    return public_trace(TRACE_NAME)


def run(quick: bool = False, trace: str | Path | None = None) -> dict[str, Any]:
    """Every figure of the simulator benchmark, as a dict. `quick`: fewer repeats and a shorter replay."""
    path = Path(trace) if trace is not None else default_trace()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file; the Mooncake conversation trace is at {SOURCES[TRACE_NAME]}")
    repeats = 3 if quick else 7
    started = time.perf_counter()
    requests = list(read_mooncake(path))
    parse_s = time.perf_counter() - started
    blocks = np.fromiter((b for r in requests for b in r.blocks), dtype=np.int64)
    distinct = int(blocks.max()) + 1 if len(blocks) else 0
    result: dict[str, Any] = {
        "trace": str(path),
        "requests": len(requests),
        "accesses": len(blocks),
        "distinct_blocks": distinct,
        "trace_parse_s": parse_s,
        "repeats": repeats,
        "targets": TARGETS,
    }
    try:
        import libcachesim  # a test dependency: without it only our own speeds are reported
    except ImportError:
        libcachesim = None
        result["libcachesim"] = "not installed"
    replay_requests = requests if not quick else _first_accesses(requests, 60_000)
    replay_blocks = blocks[: sum(len(r.blocks) for r in replay_requests)]
    capacity = REPLAY_CAPACITY_TOKENS // requests[0].block_tokens
    result["replay_compile_s"] = timed(lambda: [policy_replay(replay_requests[:1], p, capacity) for p in POLICIES])[0]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-sim-") as tmp:
        if libcachesim is None:
            result |= _mrc_alone(requests, repeats)
            result |= _replay_alone(replay_requests, capacity, repeats)
        else:
            oracle = _Oracle(libcachesim, blocks, distinct, Path(tmp))
            result |= _mrc_case(requests, oracle, repeats)
            replay_oracle = _Oracle(libcachesim, replay_blocks, distinct, Path(tmp) / "replay")
            result |= _replay_case(replay_requests, replay_oracle, capacity, repeats)
        if not quick:
            result |= _simulate_command(path, Path(tmp) / "simulate.json")
    result["replay_capacity_blocks"] = capacity
    result["replay_accesses"] = len(replay_blocks)
    result["targets_met"] = {
        "mrc_vs_libcachesim": result.get("mrc_vs_libcachesim") is not None
        and result["mrc_vs_libcachesim"] < TARGETS["mrc_vs_libcachesim"],
        **{f"replay_{p}_accesses_per_s": result[f"replay_{p}_accesses_per_s"] >= TARGETS[f"replay_{p}_accesses_per_s"]
           for p in POLICIES},
    }
    return result


def _simulate_command(trace: Path, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvtier.cli", "simulate", str(trace), "--json", str(out)], check=True,
                   capture_output=True)
    seconds = time.perf_counter() - started
    report = json.loads(out.read_text())
    return {"simulate_command_s": seconds, "simulate_workers": min(len(report["results"]), os.cpu_count() or 1),
            "simulate_hit_ratios": {r["name"]: r["hit_ratio_tokens"] for r in report["results"]}}


class _Oracle:
    """libCacheSim on one block sequence: its C simulator over a binary trace, or a Python loop of `get`."""

    def __init__(self, lcs: Any, blocks: np.ndarray, distinct: int, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        record = np.dtype([("time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"), ("next_access_vtime", "<i8")])
        rows = np.zeros(len(blocks), dtype=record)
        rows["time"] = np.arange(len(blocks))
        rows["obj_id"] = blocks
        rows["obj_size"] = 1
        rows["next_access_vtime"] = -1
        self.path = folder / "blocks.oracleGeneral"
        rows.tofile(self.path)
        self.lcs = lcs
        self.blocks = blocks.tolist()
        self.distinct = distinct
        self.hashpower = max(16, math.ceil(math.log2(max(distinct, 2))))  # its default (24) costs more than the run
        self.reader = lcs.TraceReader(str(self.path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        self.classes = {"lru": lcs.LRU, "arc": lcs.ARC, "s3fifo": lcs.S3FIFO}

    def c_hits(self, policy: str, capacity: int) -> int:
        cache = self.classes[policy](cache_size=capacity, hashpower=self.hashpower)
        miss_ratio, _ = cache.process_trace(self.reader)
        return len(self.blocks) - round(miss_ratio * len(self.blocks))

    def python_hits(self, policy: str, capacity: int) -> int:
        get = self.classes[policy](cache_size=capacity, hashpower=self.hashpower).get
        req = self.lcs.Request()
        req.obj_size = 1
        hits = 0
        for block in self.blocks:
            req.obj_id = block
            hits += get(req)
        return hits


def _mrc_case(requests: list[TraceRequest], oracle: _Oracle, repeats: int) -> dict[str, Any]:
    points = sorted({int(c) for c in np.geomspace(16, max(oracle.distinct, 16), MRC_POINTS)})
    ours_s, theirs_s, ratios = [], [], []
    equal = True
    for _ in range(repeats):
        t_ours, curve = timed(lambda: lru_mrc(requests))
        t_theirs, hits = timed(lambda: [oracle.c_hits("lru", c) for c in points])
        equal &= hits == [curve.hits(c) for c in points]
        ours_s.append(t_ours)
        theirs_s.append(t_theirs)
        ratios.append(t_ours / t_theirs)
    return {
        "mrc_s": statistics.median(ours_s),
        "libcachesim_lru_points": points,
        "libcachesim_lru_points_s": statistics.median(theirs_s),
        "libcachesim_hashpower": oracle.hashpower,
        "mrc_vs_libcachesim": statistics.median(ratios),
        "mrc_equals_libcachesim": equal,
    }


def _mrc_alone(requests: list[TraceRequest], repeats: int) -> dict[str, Any]:
    return {"mrc_s": statistics.median(timed(lambda: lru_mrc(requests))[0] for _ in range(repeats)),
            "mrc_vs_libcachesim": None}


def _replay_case(requests: list[TraceRequest], oracle: _Oracle, capacity: int, repeats: int) -> dict[str, Any]:
    n = len(oracle.blocks)
    out: dict[str, Any] = {}
    for policy in POLICIES:
        runs: dict[str, Callable[[], Any]] = {
            "ours": partial(policy_replay, requests, policy, capacity),
            "objects": partial(_through_objects, requests, policy, capacity),
            "c": partial(oracle.c_hits, policy, capacity),
            "python": partial(oracle.python_hits, policy, capacity),
        }
        speeds: dict[str, list[float]] = {name: [] for name in runs}
        results: dict[str, Any] = {}
        for _ in range(repeats):
            for name, fn in runs.items():
                seconds, results[name] = timed(fn)
                speeds[name].append(n / seconds)
        out[f"replay_{policy}_accesses_per_s"] = statistics.median(speeds["ours"])
        out[f"replay_{policy}_objects_accesses_per_s"] = statistics.median(speeds["objects"])
        out[f"replay_{policy}_equals_objects"] = results["ours"] == results["objects"]
        out[f"libcachesim_{policy}_accesses_per_s"] = statistics.median(speeds["c"])
        out[f"libcachesim_py_{policy}_accesses_per_s"] = statistics.median(speeds["python"])
        out[f"replay_{policy}_vs_libcachesim"] = statistics.median(
            a / b for a, b in zip(speeds["ours"], speeds["c"], strict=True)
        )
        out[f"replay_{policy}_vs_libcachesim_py"] = statistics.median(
            a / b for a, b in zip(speeds["ours"], speeds["python"], strict=True)
        )
        out[f"replay_{policy}_hit_ratio"] = results["ours"].hit_ratio
        out[f"libcachesim_{policy}_hit_ratio"] = results["c"] / n
    return out


def _replay_alone(requests: list[TraceRequest], capacity: int, repeats: int) -> dict[str, Any]:
    n = sum(len(r.blocks) for r in requests)
    out: dict[str, Any] = {}
    for policy in POLICIES:
        run_once = partial(policy_replay, requests, policy, capacity)
        out[f"replay_{policy}_accesses_per_s"] = statistics.median(n / timed(run_once)[0] for _ in range(repeats))
        out[f"replay_{policy}_equals_objects"] = run_once() == _through_objects(requests, policy, capacity)
    return out


def _through_objects(requests: list[TraceRequest], policy: str, capacity: int) -> PolicyReplayResult:
    """The same replay through the runtime's policy objects: the reference the compiled one must equal."""
    return policy_replay(requests, make_policy(policy, capacity))


def _first_accesses(requests: list[TraceRequest], accesses: int) -> list[TraceRequest]:
    out, total = [], 0
    for request in requests:
        if total >= accesses:
            break
        out.append(request)
        total += len(request.blocks)
    return out
