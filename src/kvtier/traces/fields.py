"""Line-by-line reading and field checks shared by the JSONL readers.

Every check raises `TraceError` naming the file, the 1-based line and the field, so that a bad line in a
million-line trace can be found and fixed without guessing. Lines are read one at a time: a trace never has
to fit in memory.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from os import PathLike
from typing import IO, Any

from kvtier.traces.request import TraceError

Path = str | PathLike[str]


def open_text(path: Path) -> IO[str]:
    """A text stream over `path`; `.gz` files are decompressed on the fly."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; a line that is not a JSON object is a TraceError."""
    with open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip("\r\n"))  # a truncated line: the column is on this line
            except json.JSONDecodeError as e:
                raise TraceError(path, number, "<line>", f"not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise TraceError(path, number, "<line>", f"expected a JSON object, got {type(obj).__name__}")
            yield number, obj


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(obj: dict[str, Any], field: str, path: Path, line: int) -> float:
    """A required finite number >= 0 (timestamps)."""
    if field not in obj:
        raise TraceError(path, line, field, "missing")
    value = obj[field]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(path, line, field, f"expected a number, got {value!r}")
    if value < 0:
        raise TraceError(path, line, field, f"must be >= 0, got {value!r}")
    return value


def count(obj: dict[str, Any], field: str, path: Path, line: int, default: int | None = None, minimum: int = 0) -> int:
    """An int >= `minimum` (lengths, block sizes); required unless a default is given."""
    value = obj.get(field)
    if value is None:
        if default is None:
            raise TraceError(path, line, field, "missing")
        return default
    if not is_int(value):
        raise TraceError(path, line, field, f"expected an int, got {value!r}")
    if value < minimum:
        raise TraceError(path, line, field, f"must be >= {minimum}, got {value}")
    return value


def optional_name(obj: dict[str, Any], field: str, path: Path, line: int) -> str | None:
    """An optional name (session, tenant): a string, or an int taken as its decimal spelling."""
    value = obj.get(field)
    if value is None:
        return None
    if is_int(value):
        return str(value)
    if not isinstance(value, str):
        raise TraceError(path, line, field, f"expected a string, got {value!r}")
    return value


def priority(obj: dict[str, Any], path: Path, line: int) -> int | None:
    """An optional retention priority in TensorRT-LLM's range 0..100."""
    value = obj.get("priority")
    if value is None:
        return None
    if not is_int(value) or not 0 <= value <= 100:
        raise TraceError(path, line, "priority", f"expected an int in 0..100, got {value!r}")
    return value


def int_list(obj: dict[str, Any], field: str, path: Path, line: int) -> list[int]:
    """A required non-empty list of ints."""
    if field not in obj:
        raise TraceError(path, line, field, "missing")
    values = obj[field]
    if not isinstance(values, list):
        raise TraceError(path, line, field, f"expected a list, got {type(values).__name__}")
    if not values:
        raise TraceError(path, line, field, "empty")
    for i, value in enumerate(values):
        if not is_int(value):
            raise TraceError(path, line, field, f"item {i} is not an int: {value!r}")
    return values


def interned(table: dict[Any, int], keys: list[Any]) -> tuple[int, ...]:
    """Dense ids for `keys`: a key seen before keeps its id, a new one gets the next int."""
    setdefault = table.setdefault
    return tuple([setdefault(key, len(table)) for key in keys])
