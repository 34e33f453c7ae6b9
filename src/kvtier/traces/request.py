"""One request of a trace, as every reader yields it and every analysis consumes it.

Blocks are dense ints interned per trace (the first distinct block is 0, the next 1, ...): prefix-chained, so
the same int always means the same prefix, and memory stays proportional to the distinct blocks, not the
requests. The kvtier JSONL format (one object per line) that generators write and readers read:

    {"timestamp": 12.5, "tokens": [1, 2, 3], "output_length": 80,
     "session": "s7", "tenant": "acme", "priority": 50}
    {"timestamp": 13.0, "keys": ["9f3a...", "01bc..."], "block_tokens": 256, "input_length": 400, ...}

`timestamp` is seconds from the trace start, lines in arrival order. A line has `tokens` (chunked into chained
blocks at the reader's block size; a partial last block is kept) or `keys` (prefix-chained block keys, hex strings
of whole bytes or ints, with `block_tokens`); `input_length` defaults to len(tokens) or len(keys) * block_tokens.
Other fields are optional.
"""

from __future__ import annotations

from dataclasses import dataclass


class TraceError(ValueError):
    """A malformed trace: the message names the file, the line number and the field."""

    def __init__(self, path: object, line: int, field: str, problem: str) -> None:
        super().__init__(f"{path}:{line}: field '{field}': {problem}")
        self.path, self.line, self.field = path, line, field


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float  # seconds from the trace start
    blocks: tuple[int, ...]  # interned, prefix-chained block ids covering the input
    input_tokens: int
    output_tokens: int
    block_tokens: int  # tokens per full block; the last block may be partial
    session: str | None = None
    tenant: str | None = None
    priority: int | None = None
