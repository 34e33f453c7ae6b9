"""Seeded synthetic workloads with the reuse patterns tiering is for.

Shared system prompts, RAG documents reused across requests, multi-turn sessions that come back after
other traffic, and unique prompts (the control: no tier can help them).

`shared_prefix_workload` gives token-level requests for the demo, which computes real KV for them.
`generate_trace` gives block-level requests with arrival times, tenants and priorities, for the analyzer and
the simulator; `kvtier.traces.write` saves them as kvtier JSONL.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from kvtier.traces.request import TraceRequest


@dataclass(frozen=True)
class Request:
    tokens: tuple[int, ...]
    kind: str  # "system" | "rag" | "session" | "unique"
    session: int | None = None


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab) for _ in range(n))


def shared_prefix_workload(
    n_requests: int = 120,
    seed: int = 0,
    vocab: int = 32000,
    system_prompts: int = 3,
    system_tokens: int = 1024,
    documents: int = 6,
    document_tokens: int = 1536,
    sessions: int = 8,
    turn_tokens: int = 256,
    unique_tokens: int = 768,
    mix: tuple[float, float, float, float] = (0.3, 0.3, 0.25, 0.15),
) -> list[Request]:
    """A mix of the four kinds in `mix` order (system, rag, session, unique); the same seed gives the same list."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, system_tokens, vocab) for _ in range(system_prompts)]
    docs = [_tokens(rng, document_tokens, vocab) for _ in range(documents)]
    histories = {s: prompts[s % system_prompts] for s in range(sessions)}
    out: list[Request] = []
    for _ in range(n_requests):
        kind = rng.choices(("system", "rag", "session", "unique"), weights=mix)[0]
        if kind == "system":
            tokens = rng.choice(prompts) + _tokens(rng, turn_tokens, vocab)
            out.append(Request(tokens, kind))
        elif kind == "rag":
            tokens = rng.choice(prompts) + rng.choice(docs) + _tokens(rng, turn_tokens, vocab)
            out.append(Request(tokens, kind))
        elif kind == "session":
            s = rng.randrange(sessions)
            histories[s] = histories[s] + _tokens(rng, turn_tokens, vocab)
            out.append(Request(histories[s], kind, session=s))
        else:
            out.append(Request(_tokens(rng, unique_tokens, vocab), kind))
    return out


# ---------------------------------------------------------------- traces with arrival times (block level)

KINDS = ("system", "rag", "session", "unique")
PRIORITY = {"system": 80, "rag": 70, "session": 50, "unique": 20}  # what a retention policy should keep longest


@dataclass(frozen=True)
class TraceWorkload:
    """The parameters of a generated trace. Each is a figure `kvtier analyze` should recover from the trace.

    New conversations and single requests arrive as a Poisson process of `rate_per_s`; a session's later
    turns follow its previous turn after an exponential think time of mean `think_time_s` (arrival to
    arrival). Every tenant has its own fleet of system prompts and documents: tenants never share a block.
    """

    requests: int = 2000
    seed: int = 0
    rate_per_s: float = 2.0
    mix: tuple[float, float, float, float] = (0.3, 0.3, 0.25, 0.15)  # of arrivals: system, rag, session, unique
    block_tokens: int = 256
    tenants: int = 2
    system_prompts: int = 4  # per tenant
    system_blocks: int = 8
    documents: int = 40  # per tenant, picked with Zipf(1) popularity
    document_blocks: int = 12
    question_blocks: int = 1  # the request's own text after a shared prefix
    turns_mean: float = 4.0  # turns per session (geometric)
    think_time_s: float = 30.0
    turn_blocks: int = 2  # a user message
    answer_blocks: int = 1  # the model's answer, part of the next turn's history
    unique_blocks: int = 12
    output_tokens: int = 200

    def __post_init__(self) -> None:
        if self.requests <= 0 or self.rate_per_s <= 0 or self.block_tokens <= 0 or self.tenants <= 0:
            raise ValueError("requests, rate_per_s, block_tokens and tenants must be > 0")
        if len(self.mix) != len(KINDS) or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise ValueError(f"mix needs {len(KINDS)} weights >= 0 ({', '.join(KINDS)}), not all 0")
        if self.think_time_s <= 0 or self.turns_mean < 1:
            raise ValueError("think_time_s must be > 0 and turns_mean >= 1")


GENERATORS: dict[str, TraceWorkload] = {
    "shared": TraceWorkload(),
    "unique": TraceWorkload(mix=(0, 0, 0, 1)),
    "sessions": TraceWorkload(mix=(0, 0, 1, 0), system_blocks=0),
    "rag": TraceWorkload(mix=(0, 1, 0, 0)),
    "system": TraceWorkload(mix=(1, 0, 0, 0)),
}


def generate_trace(workload: TraceWorkload) -> list[TraceRequest]:
    """`requests` requests in arrival order, blocks interned in order of first use.

    Whole conversations are kept (only the last one may lose its final turns): cutting the trace at a time
    instead would drop the long think times more often than the short ones, and bias every reuse figure.
    """
    rng = random.Random(workload.seed)
    raw: list[tuple[float, int, list[bytes], str, str | None]] = []  # time, sequence, keys, tenant, session
    kinds: list[str] = []
    t, sessions = 0.0, 0
    while len(raw) < workload.requests:
        t += rng.expovariate(workload.rate_per_s)
        kind = rng.choices(KINDS, weights=workload.mix)[0]
        tenant = f"tenant{rng.randrange(workload.tenants)}"
        session = None
        if kind == "session":
            session, sessions = f"s{sessions}", sessions + 1
        for when, keys in _conversation(rng, workload, kind, tenant, t)[: workload.requests - len(raw)]:
            raw.append((when, len(raw), keys, tenant, session))
            kinds.append(kind)
    raw.sort(key=lambda r: (r[0], r[1]))
    ids: dict[bytes, int] = {}
    out = []
    for when, seq, keys, tenant, session in raw:
        blocks = tuple(ids.setdefault(k, len(ids)) for k in keys)
        out.append(TraceRequest(
            timestamp=round(when, 6), blocks=blocks, input_tokens=len(blocks) * workload.block_tokens,
            output_tokens=workload.output_tokens, block_tokens=workload.block_tokens,
            session=session, tenant=tenant, priority=PRIORITY[kinds[seq]],
        ))
    return out


def _conversation(
    rng: random.Random, w: TraceWorkload, kind: str, tenant: str, start: float
) -> list[tuple[float, list[bytes]]]:
    """The requests (time, chained keys) one arrival makes: one request, or every turn of a session."""
    root = _key(b"", "tenant", tenant)
    system = _chain(root, ("system", rng.randrange(w.system_prompts)), w.system_blocks)
    if kind == "system":
        return [(start, system + _chain(system[-1] if system else root, _fresh(rng), w.question_blocks))]
    if kind == "rag":
        prefix = system + _chain(system[-1] if system else root, ("doc", _zipf(rng, w.documents)), w.document_blocks)
        return [(start, prefix + _chain(prefix[-1] if prefix else root, _fresh(rng), w.question_blocks))]
    if kind == "unique":
        return [(start, _chain(root, _fresh(rng), w.unique_blocks))]
    turns = 1
    while rng.random() > 1 / w.turns_mean:
        turns += 1
    history, out, when = system, [], start
    for turn in range(turns):
        if turn:
            when += rng.expovariate(1 / w.think_time_s)
        prompt = history + _chain(history[-1] if history else root, _fresh(rng), w.turn_blocks)
        out.append((when, prompt))
        history = prompt + _chain(prompt[-1], _fresh(rng), w.answer_blocks)
    return out


def _key(parent: bytes, *content: object) -> bytes:
    return hashlib.blake2b(parent + repr(content).encode(), digest_size=16).digest()


def _chain(parent: bytes, content: tuple, n: int) -> list[bytes]:
    """`n` prefix-chained keys of one piece of content after `parent`."""
    keys = []
    for i in range(n):
        parent = _key(parent, *content, i)
        keys.append(parent)
    return keys


def _fresh(rng: random.Random) -> tuple:
    """Content nobody else has: a user's own message, a model's answer, a unique prompt."""
    return ("fresh", rng.getrandbits(64))


def _zipf(rng: random.Random, n: int) -> int:
    """Rank 0 is the most popular of `n`, with weight 1/(rank+1)."""
    return rng.choices(range(n), weights=[1 / (i + 1) for i in range(n)])[0]
