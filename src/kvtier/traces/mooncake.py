"""The Mooncake FAST'25 trace format (kvcache-ai/Mooncake, FAST25-release/traces/*.jsonl).

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

`timestamp` is in milliseconds from the trace start; `hash_ids` are prefix-chained block hashes of 512 tokens
each, covering the input only (the last block is partial). Ids are re-interned to dense ints in order of
first appearance, so a trace with sparse ids costs no more memory than a dense one.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.traces.fields import Path, count, int_list, interned, json_lines, number, optional_name, priority
from kvtier.traces.request import TraceRequest

MOONCAKE_BLOCK_TOKENS = 512


def read_mooncake(path: Path) -> Iterator[TraceRequest]:
    """Stream the requests of a Mooncake trace; a malformed line raises TraceError (file, line, field)."""
    table: dict[int, int] = {}
    for line, obj in json_lines(path):
        timestamp_ms = number(obj, "timestamp", path, line)
        input_tokens = count(obj, "input_length", path, line)
        output_tokens = count(obj, "output_length", path, line, default=0)
        hash_ids = int_list(obj, "hash_ids", path, line)
        yield TraceRequest(
            timestamp=timestamp_ms / 1000.0,
            blocks=interned(table, hash_ids),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            block_tokens=MOONCAKE_BLOCK_TOKENS,
            session=optional_name(obj, "session", path, line),
            tenant=optional_name(obj, "tenant", path, line),
            priority=priority(obj, path, line),
        )
