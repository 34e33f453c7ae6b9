"""N engines, each with its own cache, with and without a shared tier: the Mooncake Figure 10 question.

Each engine (a prefill node) has a local cache of `capacity_blocks` blocks, ordered by one of kvtier's own
eviction policies, driven exactly as `policy_replay` drives one cache: a request's blocks are accessed in order,
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
enter the caches when it is routed (as in `policy_replay`), not when its prefill ends. No torch, no vLLM.

The tables of docs/scaling.md come from `python -m kvtier.bench.cluster`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.policies import EvictionPolicy, make_policy
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.sim.cost import CostModel, cost_model
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
    """One cache of blocks in the order of a kvtier policy, accessed as `policy_replay` accesses it."""

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
            best: tuple[float, int, tuple[int, int], float, float] | None = None
            for e in order:
                hits = self.hits(r, e, shared_lead)
                load, prefill = self.service(r, hits)
                est = max(self.free_at[e] - t, 0.0) + load + prefill
                if best is None or est < best[0]:
                    best = (est, e, hits, load, prefill)
            assert best is not None
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
