"""Seeded synthetic workloads with the reuse patterns tiering is for.

Shared system prompts, RAG documents reused across requests, multi-turn sessions that come back after
other traffic, and unique prompts (the control: no tier can help them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


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
