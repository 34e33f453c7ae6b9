"""The kv-cache-tester agentic-trace format (Weka's coding-agent traces): one JSON object per conversation.

    {"id": "trace-7", "block_size": 64, "hash_id_scope": "local",
     "requests": [{"t": 0.0, "type": "n", "in": 9000, "out": 310, "hash_ids": [1, 2, ...]},
                  {"t": 4.2, "type": "subagent", "agent_id": "a", "requests": [{"t": 4.3, ...}]}, ...]}

A file holds one conversation (`.json`), one per line (`.jsonl`), or a folder holds one per `.json` file.
`t` is seconds from the conversation's start; `hash_ids` name the input's blocks of `block_size` tokens. With
`hash_id_scope` "local" an id means the same tokens only within its conversation (its sub-agents included),
with "global" across conversations. An id names a block's content, not its prefix, so blocks are interned by
(parent, id): two requests share a block only when they share everything before it, as a KV cache does.
Sub-agents' requests are requests of their own, in the session `id::agent_id`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path as FsPath
from typing import Any

from kvtier.traces.fields import Path, count, is_int, json_lines, number
from kvtier.traces.request import TraceError, TraceRequest


def is_agentic(obj: dict[str, Any]) -> bool:
    return "requests" in obj and "block_size" in obj


def conversations(path: Path) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(file, line, conversation) of a folder of `.json` files, a `.json` file or a JSONL file."""
    p = FsPath(path)
    if p.is_dir():
        files = sorted(p.glob("*.json"))
        if not files:
            raise TraceError(path, 1, "<file>", "a trace folder needs .json files, one conversation each")
        for f in files:
            yield from conversations(f)
        return
    if p.suffix == ".json":
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise TraceError(path, e.lineno, "<file>", f"not valid JSON ({e.msg})") from None
        for one in obj if isinstance(obj, list) else [obj]:
            if not isinstance(one, dict):
                raise TraceError(path, 1, "<file>", f"expected a conversation object, got {type(one).__name__}")
            yield path, 1, one
        return
    for line, obj in json_lines(path):
        yield path, line, obj


def read_agentic(path: Path) -> Iterator[TraceRequest]:
    """Every request of every conversation (sub-agents included), in order of `t` across conversations."""
    table: dict[tuple[Any, ...], int] = {}
    out: list[tuple[float, int, TraceRequest]] = []
    for number_, (where, line, conv) in enumerate(conversations(path)):
        block = count(conv, "block_size", where, line, minimum=1)
        scope = conv.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            raise TraceError(where, line, "hash_id_scope", f"expected 'local' or 'global', got {scope!r}")
        name = str(conv.get("id", number_))
        namespace = None if scope == "global" else number_
        for field, session, obj in _flatten(conv, "", name, where, line):
            hash_ids = obj.get("hash_ids", [])
            if not isinstance(hash_ids, list) or not all(is_int(h) for h in hash_ids):
                raise TraceError(where, line, f"{field}.hash_ids", f"expected a list of ints, got {hash_ids!r:.60}")
            blocks, parent = [], -1
            for h in hash_ids:
                parent = table.setdefault((namespace, parent, h), len(table))
                blocks.append(parent)
            request = TraceRequest(timestamp=_number(obj, "t", field, where, line), blocks=tuple(blocks),
                                   input_tokens=_count(obj, "in", field, where, line),
                                   output_tokens=_count(obj, "out", field, where, line, default=0),
                                   block_tokens=block, session=session)
            out.append((request.timestamp, len(out), request))
    out.sort(key=lambda item: item[:2])
    return (request for _, _, request in out)


def _flatten(obj: dict[str, Any], prefix: str, session: str, path: Path, line: int
             ) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(field path, session, request) of `obj["requests"]`, sub-agents' requests included."""
    entries = obj.get("requests")
    if not isinstance(entries, list):
        raise TraceError(path, line, f"{prefix}requests", f"expected a list of requests, got {entries!r:.40}")
    for i, entry in enumerate(entries):
        where = f"{prefix}requests[{i}]"
        if not isinstance(entry, dict):
            raise TraceError(path, line, where, f"expected an object, got {type(entry).__name__}")
        if entry.get("type") == "subagent":
            agent = str(entry.get("agent_id", i))
            yield from _flatten(entry, f"{where}.", f"{session}::{agent}", path, line)
        else:
            yield where, session, entry


def _number(obj: dict[str, Any], name: str, field: str, path: Path, line: int) -> float:
    try:
        return number(obj, name, path, line)
    except TraceError as e:  # name the request, not only its field
        raise TraceError(path, line, f"{field}.{name}", str(e).rsplit(": ", 1)[-1]) from None


def _count(obj: dict[str, Any], name: str, field: str, path: Path, line: int, default: int | None = None) -> int:
    try:
        return count(obj, name, path, line, default=default)
    except TraceError as e:
        raise TraceError(path, line, f"{field}.{name}", str(e).rsplit(": ", 1)[-1]) from None
