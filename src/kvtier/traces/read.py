"""One entry point for every trace format: the format is recognised from the file, not from flags.

A `.csv` (or `.csv.gz`) file is an Azure 2023 length-only trace and gets the synthetic reuse model; a folder, a
`.json` file or a JSONL file whose first object has `requests` and `block_size` is a kv-cache-tester agentic
trace; a JSONL file whose first request has `hash_ids` is a Mooncake trace; one with `tokens` or `keys` is a
kvtier trace.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path as FsPath

from kvtier.traces.agentic import is_agentic, read_agentic
from kvtier.traces.azure import SyntheticReuse, read_azure
from kvtier.traces.fields import Path, json_lines
from kvtier.traces.kvtier_jsonl import DEFAULT_BLOCK_TOKENS, read_kvtier_jsonl
from kvtier.traces.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake
from kvtier.traces.request import TraceError, TraceRequest


def trace_format(path: Path) -> str:
    """'azure', 'agentic', 'mooncake' or 'kvtier'; TraceError if the first request fits none of them."""
    name = str(path).lower().removesuffix(".gz")
    if name.endswith(".csv"):
        return "azure"
    if FsPath(path).is_dir() or name.endswith(".json"):
        return "agentic"
    for line, obj in json_lines(path):
        if is_agentic(obj):
            return "agentic"
        if "hash_ids" in obj:
            return "mooncake"
        if "tokens" in obj or "keys" in obj:
            return "kvtier"
        raise TraceError(path, line, "hash_ids", "no 'hash_ids' (Mooncake), 'tokens' or 'keys' (kvtier) field")
    raise TraceError(path, 1, "<file>", "no requests in the file")


def read_trace(
    path: Path, block_tokens: int | None = None, reuse: SyntheticReuse | None = None
) -> Iterator[TraceRequest]:
    """Stream the requests of a trace in any supported format.

    `block_tokens` sets the block size where the format leaves it open (kvtier `tokens` lines, the synthetic
    reuse model of a CSV); a Mooncake trace is fixed at 512 tokens per id and an agentic trace at its
    `block_size`: they refuse any other size.
    """
    kind = trace_format(path)
    if kind == "azure":
        reuse = reuse or SyntheticReuse()
        if block_tokens is not None and block_tokens != reuse.block_tokens:
            reuse = SyntheticReuse(**{**reuse.__dict__, "block_tokens": block_tokens})
        return read_azure(path, reuse)
    if reuse is not None:
        raise ValueError(f"{path}: a synthetic reuse model applies to length-only (CSV) traces, not {kind} ones")
    if kind == "agentic":
        requests = read_agentic(path)
        first = next(requests, None)
        if first is None:
            raise TraceError(path, 1, "requests", "no requests in the trace")
        if block_tokens not in (None, first.block_tokens):
            raise ValueError(f"{path}: its hash ids cover {first.block_tokens} tokens (block_size), not {block_tokens}")
        return itertools.chain([first], requests)
    if kind == "mooncake":
        if block_tokens not in (None, MOONCAKE_BLOCK_TOKENS):
            raise ValueError(f"{path}: Mooncake hash ids cover {MOONCAKE_BLOCK_TOKENS} tokens, not {block_tokens}")
        return read_mooncake(path)
    return read_kvtier_jsonl(path, block_tokens or DEFAULT_BLOCK_TOKENS)
