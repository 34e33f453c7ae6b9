"""`kvtier demo`, in-process: a shared-prefix workload through TieredCache behind a small engine cache.

The "engine" here is an LRU of device blocks with a deliberately small budget (as vLLM's prefix cache under
memory pressure). Every block's KV is a deterministic function of its key, so each block that comes back
from a tier is checked against a recomputation: the demo proves exactness while it measures.
Three configurations, one change at a time: engine only -> + host tier -> + host and disk tiers.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvtier.cache import TieredCache
from kvtier.config import KVTierConfig, parse_config
from kvtier.keys import chain_keys
from kvtier.layout import KVLayout
from kvtier.report import readable_console
from kvtier.traces.workloads import Request, shared_prefix_workload

# A tiny Llama-shaped model: 4 layers, 2 KV heads of 64, bf16 -> 2 KiB per token, 128 KiB per 64-token block.
DEMO_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", name="tiny-llama")
BLOCK_TOKENS = 64
ENGINE_BLOCKS = 48


def block_shape(layout: KVLayout, tokens: int) -> tuple[int, ...]:
    return (layout.num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim)


def compute_kv(key: bytes, shape: Sequence[int]) -> torch.Tensor:
    """The 'prefill' of one block: deterministic in its key, so recomputation is the exactness oracle."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


class DemoEngineCache:
    """The demo's engine stand-in, its own prefix cache (tier 0): an LRU of blocks' KV, longest-prefix hits."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def hit_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            self.blocks.move_to_end(keys[n])
            n += 1
        return n

    def insert(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        for key, block in zip(keys, blocks):
            self.blocks[key] = block
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


@dataclass
class RunResult:
    name: str
    tokens: Counter = field(default_factory=Counter)  # engine / host / disk / recomputed
    load_seconds: list[float] = field(default_factory=list)
    exact: bool = True
    mismatches: int = 0
    snapshot: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        loads = sorted(self.load_seconds) or [0.0]
        return {
            "name": self.name,
            "tokens": dict(self.tokens),
            "load_ms_p50": 1e3 * statistics.median(loads),
            "load_ms_p99": 1e3 * loads[min(len(loads) - 1, int(0.99 * len(loads)))],
            "exact": self.exact,
            "mismatches": self.mismatches,
            "kvtier": self.snapshot,
        }


def run_one(name: str, requests: Sequence[Request], config: KVTierConfig | None,
            progress: Progress | None) -> RunResult:
    shape = block_shape(DEMO_LAYOUT, BLOCK_TOKENS)
    engine = DemoEngineCache(ENGINE_BLOCKS)
    model = "demo: the KV is a function of its key"
    cache = TieredCache(config, shape, torch.bfloat16, model=model) if config else None
    result = RunResult(name)
    task = progress.add_task(name, total=len(requests)) if progress else None
    try:
        for request in requests:
            keys = chain_keys(request.tokens, BLOCK_TOKENS)
            n_engine = engine.hit_prefix(keys)
            result.tokens["engine"] += n_engine * BLOCK_TOKENS
            loaded: list[torch.Tensor] = []
            if cache is not None and n_engine < len(keys):
                before = cache.directory.lookup(keys[n_engine:])
                start = time.perf_counter()
                loaded = cache.load(keys[n_engine:])
                result.load_seconds.append(time.perf_counter() - start)
                for key, block, source in zip(keys[n_engine:], loaded, before):
                    result.tokens[source] += BLOCK_TOKENS
                    if not torch.equal(block.view(torch.uint8), compute_kv(key, shape).view(torch.uint8)):
                        result.exact = False
                        result.mismatches += 1
            first_new = n_engine + len(loaded)
            computed = [compute_kv(key, shape) for key in keys[first_new:]]
            result.tokens["recomputed"] += len(request.tokens) - first_new * BLOCK_TOKENS
            if cache is not None and computed:
                cache.store(keys[first_new:], computed, parent=keys[first_new - 1] if first_new else None)
            engine.insert(keys[n_engine:], loaded + computed)
            if progress is not None and task is not None:
                progress.advance(task)
        if cache is not None:
            cache.flush()
            result.snapshot = cache.snapshot()
    finally:
        if cache is not None:
            cache.close()
    return result


def default_configs(root: Path) -> list[tuple[str, KVTierConfig | None]]:
    block_bytes = DEMO_LAYOUT.bytes_per_block(BLOCK_TOKENS)
    host = {"cpu_bytes_to_use": 96 * block_bytes, "block_size": BLOCK_TOKENS}
    disk = {"type": "fs", "root_dir": str(root / "kv"), "max_bytes": 1024 * (block_bytes + 8192)}
    return [
        ("engine only", None),
        ("+ host", parse_config(host)),
        ("+ host + disk", parse_config({**host, "secondary_tiers": [disk]})),
    ]


def run_demo(n_requests: int = 160, seed: int = 0, config: KVTierConfig | None = None,
             console: Console | None = None) -> list[RunResult]:
    console = readable_console(console)
    requests = shared_prefix_workload(n_requests, seed=seed)
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        configs = default_configs(Path(tmp)) if config is None else [("engine only", None), ("your config", config)]
        with Progress(console=console, transient=True) as progress:
            results = [run_one(name, requests, cfg, progress) for name, cfg in configs]
    console.print(render(results, sum(len(r.tokens) for r in requests)))
    return results


def render(results: Sequence[RunResult], total_tokens: int) -> Table:
    table = Table(title=f"kvtier demo — {total_tokens:,} prompt tokens, engine cache {ENGINE_BLOCKS} blocks")
    for col in ("configuration", "engine", "host", "disk", "recomputed", "saved", "moved", "load p50 / p99", "exact"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for r in results:
        d = r.as_dict()
        moved = sum(r.snapshot.get("move_bytes", {}).values()) if r.snapshot else 0
        saved = 1 - r.tokens["recomputed"] / total_tokens if total_tokens else 0.0
        table.add_row(
            r.name, f"{r.tokens['engine']:,}", f"{r.tokens['host']:,}", f"{r.tokens['disk']:,}",
            f"{r.tokens['recomputed']:,}", f"{saved:.0%}", f"{moved / 2**20:,.0f} MiB",
            f"{d['load_ms_p50']:.2f} / {d['load_ms_p99']:.2f} ms", "yes" if r.exact else f"NO ({r.mismatches})",
        )
    return table
