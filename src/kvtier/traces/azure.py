"""Length-only traces (Azure LLM inference 2023, Splitwise) made replayable by a stated synthetic reuse model.

The CSVs (`TIMESTAMP,ContextTokens,GeneratedTokens`) carry arrivals and lengths but no block hashes, so they
cannot say which prefixes repeat: any hit rate computed from them is a property of the reuse model, not of
the traffic. The model is therefore explicit, seeded and part of every result that uses it.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from kvtier.traces.fields import Path, open_text
from kvtier.traces.request import TraceError, TraceRequest

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class SyntheticReuse:
    """Shared prefixes laid over a length-only trace.

    There are `prefixes` shared prefixes (system prompts, RAG scaffolds) of `prefix_tokens` tokens each;
    prefix k is chosen with Zipf popularity, weight 1 / (k + 1) ** `zipf_alpha`. Each request, independently
    with probability `share`, starts with one of them: its first min(prefix_tokens, context) // block_tokens
    full blocks are that prefix's blocks (the same ids in every request that carries it, chained, so a
    shorter request shares a leading part of the prefix); every other block of the request (the rest of the
    context, the last block partial) is unique to it. Draws come from `random.Random(seed)`, one or two per
    row in file order, so the same file and model give the same blocks.
    """

    prefixes: int = 20
    prefix_tokens: int = 2048
    share: float = 0.6
    zipf_alpha: float = 1.0
    block_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prefixes < 1:
            raise ValueError(f"prefixes must be >= 1, got {self.prefixes}")
        if self.prefix_tokens < 0:
            raise ValueError(f"prefix_tokens must be >= 0, got {self.prefix_tokens}")
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {self.share}")
        if self.zipf_alpha < 0:
            raise ValueError(f"zipf_alpha must be >= 0, got {self.zipf_alpha}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")

    def describe(self) -> str:
        """The model in one sentence, for reports: a hit rate on such a trace is this model's, not the trace's."""
        return (
            f"synthetic reuse: {self.share:.0%} of requests start with one of {self.prefixes} shared prefixes of "
            f"{self.prefix_tokens} tokens (Zipf alpha {self.zipf_alpha}), everything else unique; "
            f"{self.block_tokens}-token blocks, seed {self.seed}"
        )


def read_azure(path: Path, reuse: SyntheticReuse | None = None) -> Iterator[TraceRequest]:
    """Stream an Azure 2023 CSV as requests whose blocks follow `reuse` (default `SyntheticReuse()`).

    Timestamps become seconds after the first row. A malformed row raises TraceError (file, line, column).
    """
    reuse = reuse or SyntheticReuse()
    rng = random.Random(reuse.seed)
    cumulative = list(itertools.accumulate(1.0 / (k + 1) ** reuse.zipf_alpha for k in range(reuse.prefixes)))
    bt = reuse.block_tokens
    shared_ids: dict[tuple[int, int], int] = {}
    next_id = 0
    start: datetime | None = None
    with open_text(path) as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None:
            raise TraceError(path, 1, "<header>", f"empty file; expected the header {','.join(COLUMNS)}")
        names = [h.strip() for h in header]
        for column in COLUMNS:
            if column not in names:
                raise TraceError(path, 1, column, f"missing from the header {header}")
        at = {column: names.index(column) for column in COLUMNS}
        for row in rows:
            line = rows.line_num
            if not row or not any(cell.strip() for cell in row):
                continue
            if len(row) != len(names):
                raise TraceError(path, line, "<row>", f"expected {len(names)} fields, got {len(row)}")
            when = _timestamp(row[at["TIMESTAMP"]], path, line)
            start = start or when
            seconds = (when - start).total_seconds()
            if seconds < 0:
                raise TraceError(path, line, "TIMESTAMP", f"{row[at['TIMESTAMP']]!r} is earlier than the first row")
            context = _tokens(row[at["ContextTokens"]], "ContextTokens", path, line)
            generated = _tokens(row[at["GeneratedTokens"]], "GeneratedTokens", path, line)
            blocks: list[int] = []
            if rng.random() < reuse.share:
                prefix = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
                for j in range(min(reuse.prefix_tokens, context) // bt):
                    block = shared_ids.get((prefix, j))
                    if block is None:
                        block = shared_ids[(prefix, j)] = next_id
                        next_id += 1
                    blocks.append(block)
            unique = -(-context // bt) - len(blocks)
            blocks.extend(range(next_id, next_id + unique))
            next_id += unique
            yield TraceRequest(seconds, tuple(blocks), context, generated, bt)


def _timestamp(text: str, path: Path, line: int) -> datetime:
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise TraceError(path, line, "TIMESTAMP", f"not a date and time: {text!r}") from None


def _tokens(text: str, column: str, path: Path, line: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceError(path, line, column, f"not an int: {text!r}") from None
    if value < 0:
        raise TraceError(path, line, column, f"must be >= 0, got {value}")
    return value
