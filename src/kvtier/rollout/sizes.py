"""Tiers sized by the method: what the host can give, and what the workload about to be sent reuses.

The host tier sits at the elbow of the workload's LRU reuse curve (`kvtier analyze`'s own curve, in the served
model's bytes per kvtier block): the capacity past which more bytes buy little, the hot set; at least 1.5 times the
engine's own KV where that is known (a smaller one holds little the engine does not). It is capped by the
host's headroom (the memory available now, less a tenth of the host kept for the OS, other services and the disk
tier's page cache). The disk tier takes the rest of what the workload reuses: what an unbounded cache would need
beyond the host tier, at least `MIN_DISK_BLOCKS`. Flags override both (`Options.check` refuses a host size over
the headroom before any server starts).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.rollout.client import Prompt

BLOCK_TOKENS = 256  # kvtier's block in the rollout's steps
MIN_DISK_BLOCKS = 64  # the drills need room for the prefixes they put on disk
ENGINE_FLOOR = 1.5  # a host tier at least this many times the engine's own KV, where that is known
RESERVE_SHARE = 0.10  # of the host's memory, for the OS, other services and the disk tier's page cache


@dataclass(frozen=True)
class RolloutSizes:
    host_bytes: int
    disk_bytes: int
    block_bytes: int  # one kvtier block of the served model
    elbow_bytes: int | None  # None: not sized from the workload
    reused_bytes: int | None  # what an unbounded LRU cache needs for every reuse of the workload
    headroom_bytes: int
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def memory() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        info[name] = int(value.split()[0]) * 1024
    return info


def headroom_now(server_rss: int = 0) -> int:
    """What the host can give a host tier now, beside a server of `server_rss` bytes."""
    info = memory()
    return info["MemAvailable"] - server_rss - int(info["MemTotal"] * RESERVE_SHARE)


def bytes_per_token(model: str) -> int:
    """The served model's KV bytes per token (every layer, K and V): from a preset, a config.json, or a folder
    holding one (`kvtier plan`'s reader). ValueError naming `--model` when it cannot be read."""
    from kvtier.plan.model import load_model

    try:
        return load_model(model).layout.bytes_per_token
    except (ValueError, OSError) as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("--model") else f"--model {model}: {message}") from None


def size_tiers(levels: Sequence[Sequence[Prompt]], token_bytes: int, host_bytes: int | None,
               disk_bytes: int | None, headroom: int, engine_bytes: int | None = None) -> RolloutSizes:
    """Sizes for a workload sent level after level (`levels`), unless given. `engine_bytes`: the engine's own KV,
    when known: a host tier holds what the engine computed, so one no larger than ENGINE_FLOOR times it would
    hold little the engine does not (`kvtier plan`'s host check)."""
    block = BLOCK_TOKENS * token_bytes
    elbow = reused = None
    reason = []
    if host_bytes is None or disk_bytes is None:
        elbow, reused = _reuse_curve(levels, block)
    if host_bytes is None:
        assert elbow is not None
        floor = int(ENGINE_FLOOR * engine_bytes) if engine_bytes else block
        host_bytes = min(max(elbow, floor), headroom)
        capped = " (capped by the host's headroom)" if max(elbow, floor) > headroom else ""
        if floor > elbow:
            reason.append(f"host at {ENGINE_FLOOR}x the engine's KV, above the workload's elbow{capped}")
        else:
            reason.append(f"host at the elbow of the workload's reuse curve{capped}")
    else:
        reason.append("host as --host-bytes")
    if disk_bytes is None:
        assert reused is not None
        disk_bytes = max(MIN_DISK_BLOCKS * block, reused - host_bytes)
        reason.append("disk for the rest of what it reuses")
    else:
        reason.append("disk as --disk-bytes")
    return RolloutSizes(host_bytes, disk_bytes, block, elbow, reused, headroom, "; ".join(reason))


def _reuse_curve(levels: Sequence[Sequence[Prompt]], block_bytes: int) -> tuple[int, int]:
    """(elbow, every reuse) in bytes of the LRU curve `analyze` draws for these prompts, sent in this order."""
    from kvtier.analyze.questions import Deployment, analyze
    from kvtier.sim.cost import cost_model

    requests = _as_trace([p for level in levels for p in level])
    analysis = analyze(requests, Deployment(cost_model()), "the rollout's workload")  # blocks: any model's
    return analysis.elbow_blocks() * block_bytes, analysis.blocks_for(1.0) * block_bytes


def _as_trace(prompts: Sequence[Prompt]) -> list:
    """The prompts as a trace of prefix-chained blocks of BLOCK_TOKENS tokens (a partial last block kept)."""
    from kvtier.traces.request import TraceRequest

    ids: dict[bytes, int] = {}
    out = []
    for i, prompt in enumerate(prompts):
        key, blocks = b"", []
        for start in range(0, len(prompt.tokens), BLOCK_TOKENS):
            chunk = prompt.tokens[start : start + BLOCK_TOKENS]
            key = hashlib.blake2b(key + repr(chunk).encode(), digest_size=16).digest()
            blocks.append(ids.setdefault(key, len(ids)))
        out.append(TraceRequest(float(i), tuple(blocks), len(prompt.tokens), prompt.max_tokens, BLOCK_TOKENS))
    return out
