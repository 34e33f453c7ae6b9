"""The kvtier JSONL trace format (defined in `kvtier.traces.request`): what our generators write.

A `tokens` line is cut into blocks of the reader's `block_tokens` and named with the same chained sha256 keys
the runtime uses (`kvtier.keys.chain_keys`), so two requests share a block exactly when they share the whole
prefix up to it; a trailing partial block gets a key too (chained the same way), as in the Mooncake traces.
A `keys` line brings its own prefix-chained keys (hex strings of whole bytes, or ints) and must say its
`block_tokens`. Lines come in arrival order: a timestamp earlier than the line before it is refused (a replay in
file order would run it late), as is a hex key of an odd length (a byte string cut short).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from kvtier.keys import chain_keys
from kvtier.traces.fields import Path, count, interned, is_int, json_lines, number, optional_name, priority
from kvtier.traces.request import TraceError, TraceRequest

DEFAULT_BLOCK_TOKENS = 256
_HEX = re.compile(r"[0-9a-fA-F]+")  # int(_, 16) alone would also take "0x..", "-1", "f_f" and spaces


def read_kvtier_jsonl(path: Path, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Iterator[TraceRequest]:
    """Stream the requests of a kvtier JSONL trace; a malformed line raises TraceError (file, line, field)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    table: dict[Any, int] = {}
    last: tuple[int, float] | None = None  # the line before, and its timestamp
    for line, obj in json_lines(path):
        timestamp = number(obj, "timestamp", path, line)
        if last is not None and timestamp < last[1]:
            raise TraceError(path, line, "timestamp", f"{timestamp!r} is earlier than line {last[0]}'s {last[1]!r}: "
                             "requests must come in arrival order (sort the file by timestamp)")
        last = (line, timestamp)
        has_tokens, has_keys = "tokens" in obj, "keys" in obj
        if has_tokens == has_keys:
            problem = "a line needs exactly one of 'tokens' and 'keys'"
            raise TraceError(path, line, "tokens" if not has_tokens else "keys", problem)
        keys: list[bytes] | list[int]
        if has_tokens:
            keys = _token_keys(obj["tokens"], block_tokens, path, line)
            size = block_tokens
            default_input = len(obj["tokens"])
        else:
            keys = _given_keys(obj["keys"], path, line)
            size = count(obj, "block_tokens", path, line, minimum=1)
            default_input = len(keys) * size
        yield TraceRequest(
            timestamp=float(timestamp),
            blocks=interned(table, keys),
            input_tokens=count(obj, "input_length", path, line, default=default_input),
            output_tokens=count(obj, "output_length", path, line, default=0),
            block_tokens=size,
            session=optional_name(obj, "session", path, line),
            tenant=optional_name(obj, "tenant", path, line),
            priority=priority(obj, path, line),
        )


def _token_keys(tokens: object, block_tokens: int, path: Path, line: int) -> list[bytes]:
    if not isinstance(tokens, list):
        raise TraceError(path, line, "tokens", f"expected a list of token ids, got {type(tokens).__name__}")
    if not tokens:
        raise TraceError(path, line, "tokens", "empty")
    try:
        keys = chain_keys(tokens, block_tokens)
        tail = len(tokens) % block_tokens
        if tail:  # the partial last block, chained after the full ones
            keys += chain_keys(tokens[-tail:], tail, parent=keys[-1]) if keys else chain_keys(tokens, tail)
    except (TypeError, OverflowError):
        bad = next((t for t in tokens if not is_int(t) or not 0 <= t < 2**32), None)
        raise TraceError(path, line, "tokens", f"token ids must be ints in [0, 2**32), got {bad!r}") from None
    return keys


def _given_keys(keys: object, path: Path, line: int) -> list[int]:
    """Keys as ints, whether written as ints or hex strings ("ff" and 255 are the same key)."""
    if not isinstance(keys, list):
        raise TraceError(path, line, "keys", f"expected a list of keys, got {type(keys).__name__}")
    if not keys:
        raise TraceError(path, line, "keys", "empty")
    out: list[int] = []
    for i, key in enumerate(keys):
        if is_int(key) and key >= 0:
            out.append(key)
            continue
        if isinstance(key, str) and _HEX.fullmatch(key):
            if len(key) % 2:
                raise TraceError(path, line, "keys", f"item {i} has an odd number of hex digits (a byte cut short): "
                                 f"{key!r}")
            out.append(int(key, 16))
            continue
        raise TraceError(path, line, "keys", f"item {i} is not a hex string or an int >= 0: {key!r}")
    return out
