"""What the rollout sends: the built-in mix, or any trace `analyze` reads, as token-id prompts.

The built-in mix gives each tier its reason to exist. A hot set (system prompts, and RAG documents over them)
comes back every few requests: more than the engine's cache holds, what a host tier is for. Sessions come back
after a longer gap, each turn with the whole history before it: by then a host tier sized for the hot set has
let them go, what a disk tier is for. Unique prompts on top, which no tier can help. The order is fixed, not
drawn, so that every level and every run holds the same counts of each.

A trace's blocks become tokens: each (prefix-chained) block id is drawn into `block_tokens` token ids by a
generator seeded with the id, so two requests share tokens exactly where the trace says they share a prefix; a
request longer than its blocks gets a unique tail.

`salt` gives the same structure with other tokens: each level gets a workload of its own, so no level is served
from what an earlier level left in a cache. A prompt is *reused* when it starts with at least `REUSE_TOKENS`
tokens that an earlier prompt of its workload started with: only those can be served from a cache.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvtier.rollout.client import Prompt

VOCAB = 32000  # token ids are drawn from [3, VOCAB): Llama-family vocabularies and the tiny model
REUSE_TOKENS = 128  # one engine block of the embedded server: the least a cache can serve
SYSTEM_PROMPTS, SYSTEM_TOKENS = 3, 1024
DOCUMENTS, DOCUMENT_TOKENS = 4, 1024  # each over one of the system prompts
QUESTION_TOKENS = 128  # the request's own text after a shared prefix
SESSIONS, TURN_TOKENS = 3, 256  # a session's turn adds a user message to its history
UNIQUE_TOKENS = 1536
# One round of the mix: 6 of 10 from the hot set, 2 session turns, 2 unique prompts.
ROUND = ("system", "rag", "session", "system", "unique", "rag", "system", "session", "rag", "unique")


def fresh_tokens(rng: random.Random, n: int) -> list[int]:
    """`n` token ids drawn at random: a prompt no cache has seen."""
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def builtin(n_requests: int, salt: int, max_tokens: int, max_prompt: int) -> list[Prompt]:
    rng = random.Random(f"builtin/{salt}")

    def tokens(n: int) -> list[int]:
        return fresh_tokens(rng, n)

    systems = [tokens(SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
    documents = [systems[d % SYSTEM_PROMPTS] + tokens(DOCUMENT_TOKENS) for d in range(DOCUMENTS)]
    histories = [systems[s % SYSTEM_PROMPTS] for s in range(SESSIONS)]
    prompts, sessions_seen = [], 0
    for i in range(n_requests):
        kind = ROUND[i % len(ROUND)]
        if kind == "system":
            text = systems[rng.randrange(SYSTEM_PROMPTS)] + tokens(QUESTION_TOKENS)
        elif kind == "rag":
            text = documents[rng.randrange(DOCUMENTS)] + tokens(QUESTION_TOKENS)
        elif kind == "session":  # the sessions take turns: each comes back after every other one's turn
            s = sessions_seen % SESSIONS
            sessions_seen += 1
            histories[s] = histories[s] + tokens(TURN_TOKENS)
            text = histories[s]
        else:
            text = tokens(UNIQUE_TOKENS)
        prompts.append(Prompt(text[:max_prompt], kind, max_tokens))
    return mark_reuse(prompts)


def from_trace(path: Path, n_requests: int | None, salt: int, max_tokens: int, max_prompt: int) -> list[Prompt]:
    """The first `n_requests` of the trace (all when None); outputs capped at `max_tokens`, prompts at
    `max_prompt` tokens (their prefix kept, so their reuse is kept)."""
    from kvtier.traces.read import read_trace

    prompts: list[Prompt] = []
    for i, request in enumerate(read_trace(path)):
        if n_requests is not None and i >= n_requests:
            break
        tokens: list[int] = []
        for block in request.blocks:
            tokens += _block_tokens(block, request.block_tokens, salt)
            if len(tokens) >= request.input_tokens:
                break
        tail = random.Random(f"{salt}/tail/{i}")
        tokens += fresh_tokens(tail, request.input_tokens - len(tokens))
        tokens = tokens[: min(request.input_tokens, max_prompt)] or [3]
        prompts.append(Prompt(tokens, "trace", max(1, min(request.output_tokens, max_tokens))))
    if not prompts:
        raise ValueError(f"{path}: no requests in the trace")
    return mark_reuse(prompts)


def mark_reuse(prompts: list[Prompt]) -> list[Prompt]:
    """Set each prompt's `reused`: its first REUSE_TOKENS tokens begin an earlier prompt too."""
    seen: set[tuple[int, ...]] = set()
    for prompt in prompts:
        head = tuple(prompt.tokens[:REUSE_TOKENS])
        prompt.reused = len(head) == REUSE_TOKENS and head in seen
        seen.add(head)
    return prompts


def _block_tokens(block: int, n: int, salt: int) -> list[int]:
    return fresh_tokens(random.Random(block * 1_000_003 + salt), n)
