"""N engines, each with its own cache, with and without a shared tier: the Mooncake Figure 10 question.

Each engine (a prefill node) has a local cache of `capacity_blocks` blocks, ordered by one of kvtier's own
eviction policies, driven exactly as `fast_replay` drives one cache: a request's blocks are accessed in order,
a hit is `touch`, a miss evicts the first of `candidates()` when the cache is full and `insert`s. Three modes:

- `local`:  a request hits only the cache of the engine it is routed to (no sharing).
- `global`: one pool of `engines x capacity_blocks` blocks that every engine reads (Mooncake's global pool,
            the same total capacity as `local`); routing changes the timing, never the hits.
- `tiered`: kvtier's deployment: every engine's local cache plus one shared tier of `shared_blocks` blocks
            (Redis). A request uses the longer of its engine's cached prefix and the shared tier's; the blocks
            beyond the local prefix come over the network. Every request's blocks go to both.

Hits are prefix hits, token-weighted: hit tokens = min(leading hit blocks x block_tokens, input tokens).

Routing rules (`routing`), all deterministic for a given `seed`:

- `affinity` (default; Mooncake's Conductor without hot-spot migration): the engine with the lowest estimated
  TTFT = its queue wait + loading this request's cached prefix there + prefilling the rest. Cache- and
  load-aware: a long cached prefix attracts a request until that engine's queue outweighs it.
- `prefix`: the engine with the longest cached prefix of the request, load-blind.
- `hash`: a hash of the request's first `affinity_blocks` block ids picks the engine (stateless; what a plain
  prefix-hashing load balancer does).
- `least_loaded`: the engine whose queue empties first, cache-blind. `random`: a seeded uniform choice.

Ties go to the engine the `hash` rule would pick, then the next ones in order.

The clock, as in Figure 10 (outputs limited to one token): requests arrive at their timestamps; each engine
prefills one request at a time, first come first served. A request's service = load + prefill: its local hit
crosses PCIe, its remote hit crosses the network then PCIe (pipelined: the slower link sets the time), and the
rest is prefilled by `CostModel.prefill_seconds(new, cached)`. TTFT = queue wait + service. A request's blocks
enter the caches when it is routed (as in `fast_replay`), not when its prefill ends. No torch, no vLLM.

    python -m kvtier.sim.cluster          # the Figure 10 table on both Mooncake traces (docs/scaling.md)
"""

from __future__ import annotations

import argparse
import hashlib
import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.policies import EvictionPolicy, make_policy
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.sim.cost import CostModel, cost_model
from kvtier.traces.locate import shared_traces_dir
from kvtier.traces.request import TraceRequest

MODES = ("local", "global", "tiered")
ROUTINGS = ("affinity", "prefix", "hash", "least_loaded", "random")


def paper_cost() -> CostModel:
    """Mooncake FAST'25 Table 1 hardware for LLaMA3-70B: one node = 8 x A800 (8 x 312 TFLOP/s peak, taken at
    40% utilisation), host -> GPU 128 GB/s, 800 Gbit/s NIC (100 GB/s)."""
    return cost_model("llama-3.1-70b", tflops=0.4 * 8 * 312, pcie_gbs=128, network_gbs=100)


@dataclass(frozen=True)
class ClusterConfig:
    engines: int
    capacity_blocks: int  # per engine (its local tiers)
    mode: str = "local"
    routing: str = "affinity"
    shared_blocks: int | None = None  # tiered: the shared tier's blocks (default engines x capacity_blocks)
    policy: str = "lru"
    affinity_blocks: int = 2  # blocks hashed by the `hash` rule (and for ties)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("engines", "capacity_blocks", "affinity_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.shared_blocks is not None and self.shared_blocks <= 0:
            raise ValueError(f"shared_blocks must be > 0, got {self.shared_blocks}")


@dataclass
class ClusterResult:
    config: ClusterConfig
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0  # local + remote
    remote_hit_tokens: int = 0  # served by the global pool / shared tier beyond the engine's own prefix
    prefill_s: float = 0.0  # sums over requests
    load_s: float = 0.0
    ttft_s: float = 0.0
    shared_stored_blocks: int = 0  # blocks written to the global pool / shared tier (its write traffic)
    span_s: float = 0.0  # last arrival - first arrival
    per_engine: list[int] = field(default_factory=list)  # requests routed to each engine

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def mean(self, name: str) -> float:
        """Mean per request of 'prefill_s', 'load_s' or 'ttft_s'."""
        return getattr(self, name) / self.requests if self.requests else 0.0

    @property
    def imbalance(self) -> float:
        """Requests on the busiest engine / the mean per engine (1.0 = perfectly even)."""
        return max(self.per_engine) * len(self.per_engine) / self.requests if self.requests else 0.0


class _Cache:
    """One cache of blocks in the order of a kvtier policy, accessed as `fast_replay` accesses it."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.p, self.size = policy, 0

    def lead(self, blocks: Sequence[Hashable]) -> int:
        """Leading blocks already cached (no side effects)."""
        n = 0
        for key in blocks:
            if key not in self.p:
                break
            n += 1
        return n

    def access(self, blocks: Sequence[Hashable], priority: int) -> int:
        """Touch the cached blocks, insert the others (evicting as the policy says); returns the inserts."""
        p, inserted = self.p, 0
        for key in blocks:
            if key in p:
                p.touch(key)
                continue
            if self.size >= p.capacity:
                p.evicted(next(iter(p.candidates(key))))
            else:
                self.size += 1
            p.insert(key, priority)
            inserted += 1
        return inserted


def _hash_engine(blocks: Sequence[int], k: int, engines: int, seed: int) -> int:
    digest = hashlib.blake2b(repr((seed, tuple(blocks[:k]))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % engines


def simulate_cluster(
    requests: Iterable[TraceRequest], config: ClusterConfig, cost: CostModel | None = None
) -> ClusterResult:
    """Replay requests (in the given order, which should be arrival order) on N engines; see the docstring."""
    cluster = _Cluster(config, cost or paper_cost())
    for r in requests:
        cluster.serve(r)
    return cluster.result


class _Cluster:
    def __init__(self, config: ClusterConfig, cost: CostModel) -> None:
        c, n = config, config.engines
        self.config, self.cost = c, cost
        self.local = [_Cache(make_policy(c.policy, c.capacity_blocks)) for _ in range(n)] if c.mode != "global" else []
        self.shared = None
        if c.mode == "global":
            self.shared = _Cache(make_policy(c.policy, n * c.capacity_blocks))
        elif c.mode == "tiered":
            self.shared = _Cache(make_policy(c.policy, c.shared_blocks or n * c.capacity_blocks))
        self.free_at = [0.0] * n
        self.rng = random.Random(c.seed)
        self.result = ClusterResult(c, per_engine=[0] * n)
        self.first: float | None = None

    def hits(self, r: TraceRequest, engine: int, shared_lead: int) -> tuple[int, int]:
        """(local, remote) hit tokens of request `r` on `engine`."""
        own = self.local[engine].lead(r.blocks) if self.local else 0
        mine = min(own * r.block_tokens, r.input_tokens)
        return mine, min(max(own, shared_lead) * r.block_tokens, r.input_tokens) - mine

    def service(self, r: TraceRequest, hits: tuple[int, int]) -> tuple[float, float]:
        """(load, prefill) seconds of request `r` with these hits."""
        cost, (mine, remote) = self.cost, hits
        hit, per_token = mine + remote, cost.layout.bytes_per_token
        load = max(cost.pcie.seconds(hit * per_token), cost.network.seconds(remote * per_token))
        new = max(r.input_tokens - hit, 1)  # at least the last token is computed
        return load, cost.prefill_seconds(new, min(hit, r.input_tokens - new))

    def serve(self, r: TraceRequest) -> None:
        c, n, t, local = self.config, self.config.engines, r.timestamp, self.local
        start = _hash_engine(r.blocks, c.affinity_blocks, n, c.seed)
        order = [(start + i) % n for i in range(n)]
        shared_lead = self.shared.lead(r.blocks) if self.shared is not None else 0
        if c.routing == "affinity":  # the lowest estimated TTFT; the first of `order` wins a tie
            best = None
            for e in order:
                hits = self.hits(r, e, shared_lead)
                load, prefill = self.service(r, hits)
                est = max(self.free_at[e] - t, 0.0) + load + prefill
                if best is None or est < best[0]:
                    best = (est, e, hits, load, prefill)
            _, engine, hits, load, prefill = best
        else:
            if c.routing == "prefix":
                engine = max(order, key=lambda e: local[e].lead(r.blocks)) if local else start
            elif c.routing == "hash":
                engine = start
            elif c.routing == "least_loaded":
                engine = min(order, key=self.free_at.__getitem__)
            else:
                engine = self.rng.randrange(n)
            hits = self.hits(r, engine, shared_lead)
            load, prefill = self.service(r, hits)

        begin = max(t, self.free_at[engine])
        self.free_at[engine] = begin + load + prefill
        priority = DEFAULT_PRIORITY if r.priority is None else r.priority
        res = self.result
        if local:
            local[engine].access(r.blocks, priority)
        if self.shared is not None:
            res.shared_stored_blocks += self.shared.access(r.blocks, priority)
        self.first = t if self.first is None else self.first
        res.span_s = t - self.first
        res.requests += 1
        res.input_tokens += r.input_tokens
        res.hit_tokens += hits[0] + hits[1]
        res.remote_hit_tokens += hits[1]
        res.prefill_s += prefill
        res.load_s += load
        res.ttft_s += begin - t + load + prefill
        res.per_engine[engine] += 1


# ---------------------------------------------------------------- the tables of docs/scaling.md

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
    import json

    from kvtier.traces.read import read_trace

    ap = argparse.ArgumentParser(prog="python -m kvtier.sim.cluster", description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="*", type=Path, help="Mooncake traces (default: both in shared/traces)")
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 5, 10, 20], help="N for the scaling table")
    ap.add_argument("--capacity-tokens", type=float, default=3e6, help="per engine (default 3M, as Figure 10)")
    ap.add_argument("--routing", choices=ROUTINGS, default="affinity", help="for the scaling table")
    args = ap.parse_args(argv)
    shared = shared_traces_dir()
    paths = args.traces or [shared / "mooncake" / f"{t}_trace.jsonl" for t in ("conversation", "synthetic")]
    traces = {p.name.removesuffix(".jsonl").removesuffix("_trace"): list(read_trace(p)) for p in paths}
    figures = shared / "reference_figures.json"
    paper = json.loads(figures.read_text())["mooncake_fast25"][FIG10] if figures.is_file() else None
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
