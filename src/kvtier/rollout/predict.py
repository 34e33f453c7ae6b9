"""The rollout predicts, then measures: what `simulate` says a level will do, beside what it did.

Before a level, the simulator runs the exact prompts the level is about to send: the same arrival process and
seeds (closed-loop clients with their think times, or Poisson arrivals), the step's kvtier config with its guard,
the engine's cache of the server's size, one server whose prefills queue behind each other, and the costs the
rollout measured on its first server (`kvtier.calibrate`). After the level, TTFT p50/p95/p99 and the prompt
tokens by source stand beside the measured ones. At one client the prediction must hold within `TOLERANCE`; a
miss, at any level, is a finding that names its largest contributor: the kind of prompt whose TTFT it missed by
the most, and the server's queue when that is off.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvtier.rollout.client import Load, Prompt
from kvtier.rollout.figures import quantiles
from kvtier.sim.arrivals import ClosedLoop
from kvtier.sim.configs import SimConfig
from kvtier.sim.cost import CostModel
from kvtier.sim.simulate import ENGINE, ServingSetup, SimResult, simulate
from kvtier.traces.request import TraceRequest

TOLERANCE = {"ttft_p50": 0.15, "ttft_p99": 0.25, "tokens_points": 5.0}  # judged at one client
DRAWS = 8  # other draws of the think times (or arrivals) beside the level's own, where requests can overlap
SOURCES = ("engine", "host", "disk", "recomputed")


def as_trace(prompts: Sequence[Prompt], block_tokens: int, arrivals: Sequence[float] | None = None
             ) -> list[TraceRequest]:
    """The prompts as trace requests: prefix-chained block ids, one per `block_tokens` tokens (a partial last block
    kept), so two prompts share blocks exactly where they share tokens."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    out = []
    for i, prompt in enumerate(prompts):
        parent, blocks = -1, []
        for start in range(0, len(prompt.tokens), block_tokens):
            parent = ids.setdefault((parent, tuple(prompt.tokens[start:start + block_tokens])), len(ids))
            blocks.append(parent)
        out.append(TraceRequest(arrivals[i] if arrivals is not None else 0.0, tuple(blocks), len(prompt.tokens),
                                prompt.max_tokens, block_tokens))
    return out


def poisson(n: int, rate: float, seed: int) -> list[float]:
    """The open-loop arrivals the rollout's client draws (`client._send`), from the same seed."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(at)
        at += rng.expovariate(rate)
    return out


def predict(cost: CostModel, prompts: Sequence[Prompt], load: Load, kvtier: dict | None, engine_blocks: int,
            block_tokens: int, seed: int) -> SimResult:
    """What the level will do: one simulation of its prompts, sent as the rollout's client sends them.
    `engine_blocks`: vLLM's `num_gpu_blocks`."""
    arrivals = None if load.closed else poisson(len(prompts), load.rate or 1.0, seed)
    requests = as_trace(prompts, block_tokens, arrivals)
    extra = None if kvtier is None else {**kvtier, "block_size": block_tokens, "engine_block_size": block_tokens}
    usable = engine_blocks - 1  # vLLM keeps one of its blocks as the null block: it never caches
    setup = ServingSetup(cost, block_tokens, usable * cost.block_bytes(block_tokens), instances=1)
    clients = ClosedLoop(load.clients, load.think_s, seed) if load.closed else None
    config = SimConfig("predicted", extra)
    return simulate(requests, [config], setup, workers=1, clients=clients)[0]


def other_draws(cost: CostModel, prompts: Sequence[Prompt], load: Load, kvtier: dict | None, engine_blocks: int,
                block_tokens: int, seed: int) -> list[SimResult]:
    """The level with `DRAWS` other seeds of its think times (or arrivals). Where requests overlap, which one waits
    behind which turns on milliseconds, so one draw's quantiles are one sample of many: these give their range.
    None at one client: its requests never overlap."""
    if load.closed and load.clients == 1:
        return []
    return [predict(cost, prompts, load, kvtier, engine_blocks, block_tokens, 1_000_003 * (k + 1) + seed)
            for k in range(DRAWS)]


def simulated_tokens(result: SimResult) -> dict[str, int]:
    """The simulation's prompt tokens by source, named as the rollout names the measured ones."""
    out = {"prompt": result.total_tokens, "engine": 0, "host": 0, "disk": 0, "recomputed": 0}
    for source, tokens in result.hit_tokens.items():
        name = "engine" if source == ENGINE else "recomputed" if source == "miss" else \
            "host" if source == "host" else "disk"
        out[name] += int(tokens)
    return out


def compare(result: SimResult, prompts: Sequence[Prompt], level: dict, judged: bool,
            others: Sequence[SimResult] = ()) -> dict:
    """The prediction beside `level`'s measurement: TTFT quantiles and tokens by source of both, the errors,
    whether they are within `TOLERANCE` (`judged`: at one client), the range of the quantiles over the `others`
    draws, and the largest contributor to a miss."""
    ok = [i for i, r in enumerate(level["results"]) if r["error"] is None]
    predicted = quantiles([float(result.ttft_s[i]) for i in ok])
    measured = level["ttft_ms"]
    tokens = simulated_tokens(result)
    share = {s: 100 * tokens[s] / max(1, tokens["prompt"]) for s in SOURCES}
    seen = level["tokens"]
    seen_share = {s: 100 * seen.get(s, 0) / max(1, seen["prompt"]) for s in SOURCES}
    ttft = {f"ttft_{q}": _relative(predicted[q], measured[q]) for q in ("p50", "p95", "p99")}
    points = {s: share[s] - seen_share[s] for s in SOURCES}
    within = (abs(ttft["ttft_p50"]) <= TOLERANCE["ttft_p50"] and abs(ttft["ttft_p99"]) <= TOLERANCE["ttft_p99"]
              and all(abs(v) <= TOLERANCE["tokens_points"] for v in points.values()))
    errors = {**ttft, "tokens_points": points}
    out = {"ttft_ms": predicted, "tokens": tokens, "errors": errors, "judged": judged, "within_tolerance": within,
           "queue_ms_mean": 1e3 * float(result.queue_s[ok].mean()) if ok else None,
           "load_ms_mean": 1e3 * float(result.load_s[ok].mean()) if ok else None}
    if others:
        draws = [predicted] + [quantiles([float(o.ttft_s[i]) for i in ok]) for o in others]
        out["ttft_ms_range"] = {q: [min(d[q] for d in draws), max(d[q] for d in draws)] for q in ("p50", "p95", "p99")}
        out["draws"] = len(draws)
    out["largest_contributor"] = None if within else contributor(result, prompts, level, out)
    return out


def contributor(result: SimResult, prompts: Sequence[Prompt], level: dict, predicted: dict) -> str:
    """What the prediction missed most: the kind of prompt whose summed TTFT error is largest, the source whose
    token share is furthest off, and the server's queue when the measured one is known."""
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for i, r in enumerate(level["results"]):
        if r["error"] is None:
            by_kind.setdefault(prompts[i].kind, []).append((float(result.ttft_s[i]), r["ttft"]))
    kind, pairs = max(by_kind.items(), key=lambda kv: abs(sum(p - m for p, m in kv[1])))
    mean_p, mean_m = (1e3 * sum(x[k] for x in pairs) / len(pairs) for k in (0, 1))
    words = [f"{kind} prompts' TTFT: predicted {mean_p:,.0f} ms mean, measured {mean_m:,.0f} ms "
             f"(n={len(pairs)}, {_relative(mean_p, mean_m):+.0%})"]
    points = predicted["errors"]["tokens_points"]
    source = max(points, key=lambda s: abs(points[s]))
    if abs(points[source]) > TOLERANCE["tokens_points"]:
        words.append(f"{source} tokens {points[source]:+.1f} points off")
    spread = predicted.get("ttft_ms_range")
    if spread:
        inside = [q for q in ("p50", "p99") if spread[q][0] <= level["ttft_ms"][q] <= spread[q][1]]
        words.append(f"over {predicted['draws']} draws of the arrivals, which request waits behind which moves "
                     f"the predicted p50 over {spread['p50'][0]:,.0f}-{spread['p50'][1]:,.0f} ms and p99 over "
                     f"{spread['p99'][0]:,.0f}-{spread['p99'][1]:,.0f} ms; measured "
                     + (f"{' and '.join(inside)} inside" if inside else "outside both"))
    queue = level["load"].get("queue_ms_mean")
    if queue is not None and predicted["queue_ms_mean"] is not None:
        words.append(f"queue: predicted {predicted['queue_ms_mean']:,.0f} ms mean, vLLM measured {queue:,.0f} ms")
    return "; ".join(words)


def _relative(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else 0.0
