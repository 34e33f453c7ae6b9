"""`kvtier simulate`: replay a trace through the runtime's own directory on a virtual clock, per configuration.

What each request does is what it does under vLLM with the kvtier connector (see
`integrations/vllm/scheduler.py`): at its start it takes the engine's cached prefix, then asks kvtier for the
rest (`plan_load` on the blocks after the engine's hit, disk blocks read straight into the engine); its
prefill leaves its blocks in the engine; when it finishes, its full blocks are stored (`plan_store` from the
first block, as `request_finished` does: which promotes the disk blocks it loaded into host).
Transfers complete at once in the directory; their time is charged by the cost model instead.

The clock: requests arrive at their timestamps and queue, first come first served, for `instances` prefill
servers that share one cache (engine KV + kvtier tiers, as with prefix-affinity routing). A request's server
is busy while its prefix loads and while it prefills the rest. Loads queue on their links (disk reads, then
host -> GPU over PCIe, pipelined); stores and demotions are background writes: counted in bytes, not in TTFT.
TTFT = queueing + load + prefill. Decode time (output tokens after the first x ITL, at the batch of requests
decoding then when a profile measured it) decides when the blocks are stored and, for closed-loop clients
(`sim/arrivals.py`), when the client's next request arrives.

The runtime's guard and decision run here on the virtual clock: each request loads only the prefix the
decision offers (fitted to the simulated transfers and prefills, as at runtime to measured ones), reads no
tier the guard has turned off, and reports its TTFT and ITL to the guard at its first token and at its end.
"""

from __future__ import annotations

import heapq
import math
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.config import GuardConfig
from kvtier.control import Control
from kvtier.decide import Decider
from kvtier.directory import CALLER, Directory
from kvtier.guard import TierState, Transition, request_source
from kvtier.policies.base import DEFAULT_PRIORITY
from kvtier.sim.arrivals import Arrivals, AtTimestamps, ClosedLoop
from kvtier.sim.configs import SimConfig
from kvtier.sim.cost import CostModel
from kvtier.sim.engine import EngineCache
from kvtier.sim.instant_mover import complete_instantly
from kvtier.sim.parallel import map_configs
from kvtier.sizing import tier_specs
from kvtier.stores.base import TierKind
from kvtier.traces.request import TraceRequest

TARGET_UTILIZATION = 0.7  # auto-sized servers: recomputing every prompt would keep them this busy
WORTH_IT = 0.05  # a tier must cut p99 TTFT by at least this share to be recommended over engine only
NEAR_BEST = 0.02  # configurations within this share of the best p99 count as equal: the smallest one wins
ENGINE = "engine"


@dataclass(frozen=True)
class ServingSetup:
    """What serves the trace, everything simulated besides the kvtier config: the model's costs, its block size,
    the engine's KV memory, the prefill servers."""

    cost: CostModel
    block_tokens: int
    engine_kv_bytes: int
    instances: int

    @property
    def block_bytes(self) -> int:
        return self.cost.block_bytes(self.block_tokens)

    @property
    def engine_blocks(self) -> int:
        return self.engine_kv_bytes // self.block_bytes


@dataclass
class SimResult:
    config: SimConfig
    requests: int = 0
    total_tokens: int = 0
    hit_blocks: Counter = field(default_factory=Counter)  # engine / host / disk / miss
    hit_tokens: Counter = field(default_factory=Counter)
    moved_bytes: Counter = field(default_factory=Counter)  # "src->dst"
    ttft_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per request, in arrival order
    queue_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # each TTFT's wait for a server
    load_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # each TTFT's load from kvtier's tiers
    evictions: Counter = field(default_factory=Counter)
    admission_rejects: Counter = field(default_factory=Counter)
    stores_dropped: Counter = field(default_factory=Counter)
    busy_s: float = 0.0
    load_decisions: Counter = field(default_factory=Counter)  # (tier, load | partial | recompute)
    guard: list[Transition] = field(default_factory=list)
    end_s: float = 0.0  # the virtual clock when the last request finished

    def guard_off(self) -> list[tuple[str, float, float | None]]:
        """(tier, from, until) for each time the guard turned a tier off; until None: off to the end."""
        spans: list[tuple[str, float, float | None]] = []
        open_since: dict[str, float] = {}
        for t in self.guard:
            if t.to is TierState.OFF and t.tier not in open_since:
                open_since[t.tier] = t.at
            elif t.to is TierState.ON and t.tier in open_since:
                spans.append((t.tier, open_since.pop(t.tier), t.at))
        spans += [(tier, since, None) for tier, since in open_since.items()]
        return sorted(spans, key=lambda s: s[1])

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def hit_ratio(self) -> float:
        """Share of prompt tokens not recomputed."""
        return 1 - self.hit_tokens["miss"] / self.total_tokens if self.total_tokens else 0.0

    def ttft(self, q: float) -> float:
        return float(np.percentile(self.ttft_s, q)) if len(self.ttft_s) else 0.0

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "kv_transfer_config": self.config.kv_transfer_config(),
            "requests": self.requests,
            "prompt_tokens": self.total_tokens,
            "hit_ratio_tokens": self.hit_ratio,
            "hit_blocks": dict(self.hit_blocks),
            "hit_tokens": dict(self.hit_tokens),
            "moved_bytes": dict(self.moved_bytes),
            "ttft_s": {"mean": float(self.ttft_s.mean()) if len(self.ttft_s) else 0.0,
                       **{f"p{q}": self.ttft(q) for q in (50, 95, 99)}},
            "server_busy_s": self.busy_s,
            "evictions": {f"{t}/{r}": n for (t, r), n in self.evictions.items()},
            "admission_rejects": {f"{t}/{r}": n for (t, r), n in self.admission_rejects.items()},
            "stores_dropped": dict(self.stores_dropped),
            "load_decisions": {f"{t}/{d}": n for (t, d), n in self.load_decisions.items()},
            "guard_off": [{"tier": t, "from_s": a, "until_s": b} for t, a, b in self.guard_off()],
            "guard_transitions": [{"tier": t.tier, "to": t.to.value, "at_s": t.at, "reason": t.reason}
                                  for t in self.guard],
        }


def auto_instances(requests: Sequence[TraceRequest], cost: CostModel) -> int:
    """Servers enough that recomputing every prompt would keep them TARGET_UTILIZATION busy."""
    if len(requests) < 2:
        return 1
    span = requests[-1].timestamp - requests[0].timestamp
    work = sum(cost.prefill_seconds(r.input_tokens) for r in requests)
    return max(1, math.ceil(work / span / TARGET_UTILIZATION)) if span > 0 else 1


class _Links:
    """Each link serves one transfer at a time, in order of arrival."""

    def __init__(self) -> None:
        self.free_at: defaultdict[str, float] = defaultdict(float)

    def transfer(self, link_name: str, seconds: float, at: float) -> float:
        begin = max(at, self.free_at[link_name])
        self.free_at[link_name] = begin + seconds
        return begin + seconds


def simulate(
    requests: Sequence[TraceRequest], configs: Sequence[SimConfig], setup: ServingSetup,
    on_request: Callable[[], None] | None = None, guard: GuardConfig | None = None, workers: int | None = None,
    clients: ClosedLoop | None = None,
) -> list[SimResult]:
    """One result per configuration, all from the same requests (in arrival order) and serving setup. `guard`:
    the guard of every configuration with tiers (else each runs its own config's, if it has one). `workers`:
    processes replaying configurations side by side (default: one per core; 1: all in this process). `clients`:
    closed-loop clients send the requests, in order, instead of the trace's timestamps."""
    requests = sorted(requests, key=lambda r: r.timestamp)
    keys = [[b.to_bytes(8, "little") for b in r.blocks] for r in requests]
    with tempfile.TemporaryDirectory(prefix="kvtier-sim-") as scratch:
        def replay(config: SimConfig, tick: Callable[[], None] | None) -> SimResult:
            arrivals = clients.start() if clients is not None else AtTimestamps()
            return _run(requests, keys, config, setup, Path(scratch), tick, guard, arrivals)

        return map_configs(replay, configs, on_request, workers, weight=SimConfig.tiers)


def _run(
    requests: Sequence[TraceRequest], keys: Sequence[list[bytes]], sim_config: SimConfig, setup: ServingSetup,
    scratch: Path, on_request: Callable[[], None] | None, guard_config: GuardConfig | None, arrivals: Arrivals,
) -> SimResult:
    now = [0.0]
    config = sim_config.validated(scratch)
    control: Control | None = None
    if config is not None:  # the runtime's directory, guard and decision, on the virtual clock
        tiers = Directory(tier_specs(config, setup.block_bytes), clock=lambda: now[0], stage_loads=False)
        first_arrival = requests[0].timestamp if requests else 0.0
        control = Control(tiers, config, setup.block_bytes, start=first_arrival, guard=guard_config, keep=None)
    directory = control.directory if control is not None else None
    tier_order = control.tiers if control is not None else []
    sources_of: list[str] = [ENGINE] * len(requests)
    engine = EngineCache(setup.engine_blocks)
    cost, block_bytes = setup.cost, setup.block_bytes
    result = SimResult(sim_config)
    ttft, queue, load = np.zeros(len(requests)), np.zeros(len(requests)), np.zeros(len(requests))
    served = np.zeros(len(requests))  # each TTFT's part after a server took the request up
    itl = np.zeros(len(requests))
    servers = [0.0] * setup.instances
    links = _Links()
    events: list[tuple[float, int, int]] = []  # (time, kind, request); kind 0: prefilled, 1: finished

    def apply_events(until: float) -> None:
        while events and events[0][0] <= until:
            when, kind, i = heapq.heappop(events)
            now[0] = when
            full = _full_blocks(requests[i])
            if kind == 0:
                engine.insert(requests[i].blocks[:full], held=held_blocks(requests[i]))
                if control is not None:
                    control.observe(sources_of[i], when, ttft_s=ttft[i], served_s=served[i])
                continue
            if control is not None:
                _finished(control, keys[i][:full], requests[i], sources_of[i], when, itl[i])

    for i, request in enumerate(requests):
        arrived = arrivals.arrive(i, request.timestamp)
        free = heapq.heappop(servers)
        start = max(arrived, free)
        apply_events(start)
        now[0] = start
        blocks, bt = request.blocks, request.block_tokens
        in_engine = engine.hit_prefix(blocks)
        sources: list[str] = [ENGINE] * in_engine
        if control is not None and in_engine < len(blocks):
            sources += _load_plan(control, keys[i], request, in_engine, start, cost, links)
        loaded_at, took = _load(sources[in_engine:], directory, cost, block_bytes, links, start)
        cached_tokens = max(0, min(len(sources) * bt, request.input_tokens - 1))  # the last token is computed
        prefill = cost.prefill_seconds(request.input_tokens - cached_tokens, cached_tokens)
        done = loaded_at + prefill
        if control is not None:
            _measured(control.decider, sources[in_engine:], took, block_bytes, start)
            control.decider.prefill.add(request.input_tokens - cached_tokens, prefill)
        sources_of[i] = request_source(sources, tier_order, in_engine > 0, took)
        heapq.heappush(servers, done)
        ttft[i], queue[i], load[i] = done - arrived, start - arrived, loaded_at - start
        served[i] = done - start
        result.busy_s += done - start
        heapq.heappush(events, (done, 0, i))
        itl[i] = cost.itl_at(1 + _decoding(events, done)) if cost.decode_fit is not None else cost.itl_s
        end = done + max(0, request.output_tokens - 1) * itl[i]
        heapq.heappush(events, (end, 1, i))
        arrivals.ended(i, end)
        _count(result, request, sources, block_bytes)
        if on_request is not None:
            on_request()
    apply_events(math.inf)
    result.ttft_s, result.queue_s, result.load_s = ttft, queue, load
    result.end_s = now[0]
    if control is not None:
        _tiers_figures(result, control, now[0], block_bytes)
    return result


def _finished(control: Control, keys: list[bytes], request: TraceRequest, source: str, when: float,
              itl_s: float) -> None:
    """A request's last token: its token gaps to the guard, its full blocks stored."""
    if request.output_tokens > 1:
        control.observe(source, when, itl_s=[itl_s])
    if keys:
        complete_instantly(control.directory, control.directory.plan_store(keys, priority=_priority(request)))


def _load_plan(control: Control, keys: list[bytes], request: TraceRequest, in_engine: int, start: float,
               cost: CostModel, links: _Links) -> list[str]:
    """The request's blocks after the engine's hit that kvtier loads (the decision's share of what it found):
    the tier of each, as the runtime plans them."""
    directory, decider, bt = control.directory, control.decider, request.block_tokens
    skip = control.route(start)
    found = directory.lookup(keys[in_engine:], skip)
    tokens = [min(bt, request.input_tokens - j * bt) for j in range(in_engine, in_engine + len(found))]
    _queue(decider, directory, cost, links, start)
    take = decider.blocks_to_load(found, tokens, start, count_as=control.source_of(found, engine_hit=False))
    plan = directory.plan_load(keys[in_engine : in_engine + take], skip=skip)
    complete_instantly(directory, plan)
    directory.finish_load(plan)
    directory.record_lookup(plan.sources, len(request.blocks) - in_engine)
    return plan.sources


def _tiers_figures(result: SimResult, control: Control, end: float, block_bytes: int) -> None:
    """The guard's transitions, the decisions and the directory's counters, into `result`."""
    control.tick(end)
    result.guard = list(control.guard.history) if control.guard is not None else []
    result.load_decisions = control.decider.decisions
    stats = control.directory.stats
    for (src, dst), n in stats.planned_moves.items():
        result.moved_bytes[f"{ENGINE if src == CALLER else src}->{dst}"] += n * block_bytes
    result.evictions, result.admission_rejects = stats.evictions, stats.admission_rejects
    result.stores_dropped = stats.stores_dropped


def _decoding(events: list[tuple[float, int, int]], at: float) -> int:
    """Requests still decoding at `at`: their last token is an event after it."""
    return sum(1 for when, kind, _ in events if kind == 1 and when > at)


def _full_blocks(request: TraceRequest) -> int:
    """Blocks the engine caches and kvtier stores: full ones only (a trace's last block may be partial)."""
    return min(len(request.blocks), request.input_tokens // request.block_tokens)


def held_blocks(request: TraceRequest) -> int:
    """Blocks the request holds in the engine at its longest: its prompt and its output but the last token."""
    return -(-(request.input_tokens + request.output_tokens - 1) // request.block_tokens)


def _priority(request: TraceRequest) -> int:
    return DEFAULT_PRIORITY if request.priority is None else request.priority


def _load(sources: Sequence[str], directory: Directory | None, cost: CostModel, block_bytes: int, links: _Links,
          start: float) -> tuple[float, dict[str, float]]:
    """When the blocks from kvtier tiers are in the engine (cold reads pass through host memory, pipelined), and
    each tier's part of that, from `start` (what the runtime's workers time)."""
    if not sources or directory is None:
        return start, {}
    took: dict[str, float] = {}
    cold = Counter(s for s in sources if directory.kind(s) is not TierKind.HOST)
    hot = Counter(s for s in sources if directory.kind(s) is TierKind.HOST)
    done = links.transfer("pcie", cost.pcie.seconds(len(sources) * block_bytes), start)
    crossing = done - cost.pcie.seconds(len(sources) * block_bytes)  # when the PCIe link took them
    for tier, n in hot.items():
        took[tier] = crossing + cost.pcie.seconds(n * block_bytes) - start
    for tier, n in cold.items():
        first_link = cost.tier_path(directory.kind(tier))[0]
        read = links.transfer(first_link.name, first_link.seconds(n * block_bytes), start)
        took[tier] = read + cost.pcie.seconds(block_bytes) - start  # the last block still crosses PCIe
        done = max(done, start + took[tier])
    return done, took


def _queue(decider: Decider, directory: Directory, cost: CostModel, links: _Links, at: float) -> None:
    """Bytes waiting on each tier's first link at `at`: what a load from it queues behind."""
    for tier in directory.tiers:
        link = cost.tier_path(tier.spec.kind)[0]
        decider.queued[tier.name] = max(0.0, links.free_at[link.name] - at) * link.bytes_per_s


def _measured(decider: Decider, loaded: Sequence[str], took: dict[str, float], block_bytes: int, at: float) -> None:
    """What the runtime measures of a load: each tier's part, its bytes and how long it took."""
    for tier, seconds in took.items():
        decider.transferred(tier, loaded.count(tier) * block_bytes, seconds, at)


def _count(result: SimResult, request: TraceRequest, sources: Sequence[str], block_bytes: int) -> None:
    result.requests += 1
    result.total_tokens += request.input_tokens
    bt, n = request.block_tokens, len(request.blocks)
    for j, source in enumerate(sources):
        result.hit_blocks[source] += 1
        result.hit_tokens[source] += min(bt, request.input_tokens - j * bt)
        if source != ENGINE:
            result.moved_bytes[f"{source}->{ENGINE}"] += block_bytes
    result.hit_blocks["miss"] += n - len(sources)
    result.hit_tokens["miss"] += request.input_tokens - sum(
        min(bt, request.input_tokens - j * bt) for j in range(len(sources)))


def recommend(results: Sequence[SimResult]) -> tuple[SimResult, list[str]]:
    """The configuration to deploy, and why: the smallest one near the best p99 TTFT, unless a tier does not
    pay for itself against the engine alone."""
    best = min(results, key=lambda r: r.ttft(99))
    choice = min((r for r in results if r.ttft(99) <= best.ttft(99) * (1 + NEAR_BEST)), key=_footprint)
    reasons = [f"lowest p99 TTFT: {best.name} ({fmt_ms(best.ttft(99))})"]
    if choice is not best:
        reasons.append(f"{choice.name} is within {NEAR_BEST:.0%} of it with fewer resources")
    baseline = next((r for r in results if r.config.extra is None), None)
    if baseline is None:
        return choice, reasons
    gain = 1 - choice.ttft(99) / baseline.ttft(99) if baseline.ttft(99) else 0.0
    if choice is baseline or gain < WORTH_IT:
        top = 1 - best.ttft(99) / baseline.ttft(99) if baseline.ttft(99) else 0.0
        reasons.append(f"no configuration cuts p99 TTFT by {WORTH_IT:.0%} or more against engine only (best: "
                       f"{top:.1%}): not worth a tier")
        return baseline, reasons
    reasons.append(f"p99 TTFT {gain:.0%} lower than engine only; prompt tokens not recomputed "
                   f"{baseline.hit_ratio:.0%} -> {choice.hit_ratio:.0%}")
    return choice, reasons


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


def _footprint(result: SimResult) -> tuple[int, int]:
    extra = result.config.extra
    if extra is None:
        return (0, 0)
    tiers = extra.get("secondary_tiers") or []
    return (1 + len(tiers), int(extra.get("cpu_bytes_to_use", 0)) + sum(int(t.get("max_bytes", 0)) for t in tiers))
