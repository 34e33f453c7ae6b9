"""The tables of docs/scaling.md: N engines with local caches vs one global pool vs kvtier's tiers, on the
Mooncake traces (`kvtier.sim.cluster` replays them), beside the paper's Figure 10 where it has the figure.

    python -m kvtier.bench.cluster        # both traces from $KVTIER_TRACES_DIR/mooncake; --engines, --capacity-tokens
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from kvtier.config import finite_float
from kvtier.sim.cluster import MODES, ROUTINGS, ClusterConfig, paper_cost, simulate_cluster
from kvtier.sim.cost import CostModel
from kvtier.traces.locate import ENV, public_trace, traces_dir
from kvtier.traces.read import read_trace
from kvtier.traces.request import TraceRequest

FIG10 = "fig10_local_vs_global_10_prefill_nodes_3M_tokens_each"
ROUTING_HEADER = ["trace", "routing (N=10)", "hit local", "hit global", "global / local",
                  "prefill s local / global", "ratio", "TTFT s local / global", "local imbalance"]
SCALING_HEADER = ["trace", "N", "hit local", "hit global", "global / local", "hit tiered", "prefill s local / global",
                  "TTFT s local / global / tiered", "busy (local)"]


def routing_rows(
    traces: dict[str, Sequence[TraceRequest]], engines: int, capacity_tokens: float, routings: Sequence[str],
    cost: CostModel | None = None, paper: dict | None = None,
) -> list[list[str]]:
    """Figure 10's setting (N engines, local vs one global pool of the same total) under each routing rule."""
    rows = []
    for name, requests in traces.items():
        capacity = int(capacity_tokens // requests[0].block_tokens)
        for routing in routings:
            lo, gl = (simulate_cluster(requests, ClusterConfig(engines, capacity, m, routing), cost)
                      for m in ("local", "global"))
            rows.append([name, routing, f"{lo.hit_ratio:.3f}", f"{gl.hit_ratio:.3f}",
                         f"{gl.hit_ratio / lo.hit_ratio:.2f}x",
                         f"{lo.mean('prefill_s'):.2f} / {gl.mean('prefill_s'):.2f}",
                         f"{gl.mean('prefill_s') / lo.mean('prefill_s'):.2f}x",
                         f"{lo.mean('ttft_s'):.2f} / {gl.mean('ttft_s'):.2f}", f"{lo.imbalance:.2f}"])
        if paper and name in paper["hit_rate_local"]:
            rows.append([name, "**Figure 10** (10 nodes)", f"{paper['hit_rate_local'][name]:.3f}",
                         f"{paper['hit_rate_global'][name]:.3f}", f"{paper['hit_rate_ratio_exact'][name]:.2f}x",
                         (f"{paper['prefill_gpu_time_s_local'][name]:.2f} / "
                          f"{paper['prefill_gpu_time_s_global'][name]:.2f}"),
                         f"{paper['prefill_time_ratio_exact'][name]:.2f}x", "", ""])
    return rows


def scaling_rows(
    traces: dict[str, Sequence[TraceRequest]], engines: Sequence[int], capacity_tokens: float,
    routing: str = "affinity", cost: CostModel | None = None,
) -> list[list[str]]:
    """Local vs global vs tiered as the number of engines grows (each with `capacity_tokens`)."""
    from kvtier.sim.mrc import lru_mrc

    rows = []
    for name, requests in traces.items():
        capacity = int(capacity_tokens // requests[0].block_tokens)
        span = requests[-1].timestamp - requests[0].timestamp
        for n in engines:
            lo, gl, ti = (simulate_cluster(requests, ClusterConfig(n, capacity, m, routing), cost) for m in MODES)
            rows.append([name, str(n), f"{lo.hit_ratio:.3f}", f"{gl.hit_ratio:.3f}",
                         f"{gl.hit_ratio / lo.hit_ratio:.2f}x", f"{ti.hit_ratio:.3f}",
                         f"{lo.mean('prefill_s'):.2f} / {gl.mean('prefill_s'):.2f}",
                         f"{lo.mean('ttft_s'):.2f} / {gl.mean('ttft_s'):.2f} / {ti.mean('ttft_s'):.2f}",
                         f"{(lo.prefill_s + lo.load_s) / (n * span):.0%}" if span > 0 else "-"])
        ceiling = lru_mrc(requests).hit_ratio(1 << 62, "tokens")
        rows.append([name, "inf. cache", "", f"{ceiling:.3f}", "", "", "", "", ""])
    return rows


def traffic_rows(
    traces: dict[str, Sequence[TraceRequest]], engines: int, capacity_tokens: float, cost: CostModel | None = None,
    scale_to: int = 100,
) -> list[list[str]]:
    """The shared tier's traffic in `tiered` mode (affinity routing), and the same per engine at `scale_to`."""
    cost = cost or paper_cost()
    rows = []
    for name, requests in traces.items():
        bt = requests[0].block_tokens
        ti = simulate_cluster(requests, ClusterConfig(engines, int(capacity_tokens // bt), "tiered"), cost)
        gb_token = cost.layout.bytes_per_token / 1e9
        reads = ti.remote_hit_tokens * gb_token / ti.span_s
        writes = ti.shared_stored_blocks * bt * gb_token / ti.span_s
        k = scale_to / engines
        rows.append([name, str(engines), f"{ti.requests / ti.span_s:.1f}", f"{reads:.1f}", f"{writes:.1f}",
                     f"{ti.shared_stored_blocks / ti.span_s:.0f}", f"{reads * k:.0f}", f"{writes * k:.0f}",
                     f"{(reads + writes) * k / 12.5:.0f}"])
    return rows


def partition_rows(
    traces: dict[str, Sequence[TraceRequest]], total_tokens: float, partitions: Sequence[int],
    prefix_blocks: Sequence[int],
) -> list[list[str]]:
    """One shared pool cut into S equal LRU partitions, a chain's partition = hash of its first k blocks (the
    per-slot accounting of docs/scaling.md): the same replay as `local` mode with `hash` routing, N = S."""
    rows = []
    for name, requests in traces.items():
        total = int(total_tokens // requests[0].block_tokens)
        one = simulate_cluster(requests, ClusterConfig(1, total, "global")).hit_ratio
        for k in prefix_blocks:
            for n in partitions:
                r = simulate_cluster(requests, ClusterConfig(n, max(total // n, 1), "local", "hash", affinity_blocks=k))
                rows.append([name, str(k), str(n), f"{one:.3f}", f"{r.hit_ratio:.3f}", f"{r.imbalance:.2f}"])
    return rows


TRAFFIC_HEADER = ["trace", "N", "req/s", "shared reads GB/s", "shared writes GB/s", "block writes/s",
                  "reads GB/s at 100 engines", "writes GB/s at 100", "100 Gbit/s links at 100"]
PARTITION_HEADER = ["trace", "k (blocks hashed)", "S partitions", "hit, one pool", "hit, S partitions",
                    "hottest partition (x mean requests)"]


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench.cluster", description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="*", type=Path, help="Mooncake traces (default: both in $KVTIER_TRACES_DIR)")
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 5, 10, 20], help="N for the scaling table")
    ap.add_argument("--capacity-tokens", type=finite_float, default=3e6, help="per engine (default 3M, as Figure 10)")
    ap.add_argument("--routing", choices=ROUTINGS, default="affinity", help="for the scaling table")
    args = ap.parse_args(argv)
    paths = args.traces or [public_trace(f"mooncake/{t}_trace.jsonl") for t in ("conversation", "synthetic")]
    traces: dict[str, Sequence[TraceRequest]] = {
        p.name.removesuffix(".jsonl").removesuffix("_trace"): list(read_trace(p)) for p in paths}
    figures = traces_dir() / "reference_figures.json" if os.environ.get(ENV) else None
    paper = json.loads(figures.read_text())["mooncake_fast25"][FIG10] if figures and figures.is_file() else None
    print(_markdown(ROUTING_HEADER, routing_rows(traces, 10, args.capacity_tokens, ROUTINGS, paper=paper)))
    print()
    print(_markdown(SCALING_HEADER, scaling_rows(traces, args.engines, args.capacity_tokens, args.routing)))
    print()
    print(_markdown(TRAFFIC_HEADER, traffic_rows(traces, 10, args.capacity_tokens)))
    print()
    print(_markdown(PARTITION_HEADER, partition_rows(traces, 10 * args.capacity_tokens, [1, 16, 64, 256], [1, 2])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
