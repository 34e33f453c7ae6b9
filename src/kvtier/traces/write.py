"""Write requests as kvtier JSONL, the format `kvtier.traces.request` documents and the readers read back.

Blocks are written as their interned ints under `keys`: prefix-chained by construction, so a reader that
interns them again in order of first use gets the same requests back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from kvtier.traces.request import TraceRequest


def request_record(request: TraceRequest) -> dict:
    record: dict = {
        "timestamp": request.timestamp, "keys": list(request.blocks), "block_tokens": request.block_tokens,
        "input_length": request.input_tokens, "output_length": request.output_tokens,
    }
    for name in ("session", "tenant", "priority"):
        if (value := getattr(request, name)) is not None:
            record[name] = value
    return record


def write_kvtier_jsonl(requests: Iterable[TraceRequest], path: str | os.PathLike[str]) -> int:
    """One JSON object per line; returns how many requests were written."""
    n = 0
    with open(path, "w") as f:
        for request in requests:
            f.write(json.dumps(request_record(request), separators=(",", ":")) + "\n")
            n += 1
    return n
