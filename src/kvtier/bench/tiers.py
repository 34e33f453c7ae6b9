"""`kvtier bench`: every figure is a ratio against a baseline measured in the same run, on the same machine.

- host_vs_copy      TieredCache with only the host tier (store all, flush, load all into preallocated tensors)
                    against a plain per-block torch `copy_` into a preallocated buffer and back: the same
                    blocks, the same bytes twice.
- disk_*_vs_raw     the disk tier, driven through a Mover wired as TieredCache wires it (host slab, DiskStore,
                    the fs tier's configured thread counts), against one file written and read sequentially
                    with O_DIRECT in large chunks (fsync after the write) on the same file system.
- engine_pages_vs_copy  the connector's copies between an engine's KV pages and host slots (store, then load,
                    through the mover's batch handlers) against a plain `copy_` of the same bytes into a
                    preallocated buffer and back; the tiny model's pages and Llama-3.1-8B's (`kvtier.bench.pages`).
- lookup_keys_per_s Directory.lookup of a fully cached 128k-token prompt (16- and 256-token blocks) in a
                    warm directory of 1M blocks; a Python loop of dict.get over the same keys is the baseline.
- scheduler_vs_vllm_hashing  what one long request's lookup, load or store plan and completions cost vLLM's
                    scheduler thread in the directory, against vLLM's own hashing of the same prompt
                    (`kvtier.bench.scheduler`; lower is better); `large_blocks_vs_vllm_hashing` the same in
                    256-token kvtier blocks.

Ours and the baseline alternate (ABBA) so that they share the machine's noise (`kvtier.timing`);
figures are medians of the paired ratios, and both sides' raw throughputs are reported too. Then the
simulator (`kvtier.bench.simulator`) and the Redis tier (`kvtier.bench.redis_tier`). benchmarks/README.md
says more.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtier.bench import connector, redis_cluster_tier, redis_tier, scheduler, simulator
from kvtier.bench.disk import disk_case
from kvtier.bench.host import host_case
from kvtier.bench.lookup import lookup_case
from kvtier.bench.pages import GEOMETRIES, pages_case
from kvtier.bench.tables import (
    print_redis,
    print_redis_cluster,
    print_scheduler,
    print_simulator,
    print_tiers,
    size_name,
)
from kvtier.timing import cpu_busy, machine, others_load

KiB, MiB = 1 << 10, 1 << 20
TARGETS = {"host_vs_copy": 0.9, "disk_write_vs_raw": 0.9, "disk_write_full_vs_raw": 0.9, "disk_read_vs_raw": 0.9,
           "lookup_keys_per_s": 1_000_000}


@dataclass(frozen=True)
class Sizes:
    host_total: int
    host_blocks: tuple[int, ...]
    disk_total: int
    disk_block: int
    disk_more_blocks: tuple[int, ...]  # the disk figures again in these block sizes (reported, no target)
    page_blocks: tuple[int, ...]  # kvtier blocks per batch, for each of `kvtier.bench.pages.GEOMETRIES`
    directory_blocks: int
    prompt_tokens: int
    repetitions: int


# the disk's other sizes: Llama-3.1-8B's block of 16 tokens (2 MiB) and of 256 (32 MiB), what README recommends
# for long prompts
FULL = Sizes(256 * MiB, (256 * KiB, MiB, 4 * MiB), 512 * MiB, MiB, (2 * MiB, 32 * MiB), (32, 16), 1 << 20,
             128 * 1024, 9)
QUICK = Sizes(16 * MiB, (256 * KiB, MiB, 4 * MiB), 16 * MiB, MiB, (2 * MiB, 8 * MiB), (8, 1), 16 * 1024, 128 * 1024,
              5)


def redis_figures(console: Console, result: dict, quick: bool) -> None:
    """The shared tier's figures into `result`: one node (`redis_vs_raw`) and a cluster (`redis_cluster_vs_raw`,
    the spread over primaries on the Mooncake conversation trace, a lookup against one node's)."""
    result.setdefault("targets", {})
    with console.status("redis tier vs raw redis-py on a local redis-server"):
        result["redis"] = redis_tier.run(quick=quick)
    result["redis_vs_raw"] = result["redis"]["min_ratio"]
    result["targets"]["redis_vs_raw"] = {"target": result["redis"]["target"], "value": result["redis_vs_raw"],
                                         "met": result["redis_vs_raw"] >= result["redis"]["target"]}
    print_redis(console, result["redis"])
    try:
        trace: Path | None = simulator.default_trace()
    except FileNotFoundError:
        trace = None
    with console.status("redis cluster tier vs raw RedisCluster pipelines on a local 6-node cluster"):
        result["redis_cluster"] = redis_cluster_tier.run(trace if trace is not None and trace.exists() else None,
                                                         quick=quick)
    result["redis_cluster_vs_raw"] = result["redis_cluster"]["min_ratio"]
    result["targets"]["redis_cluster_vs_raw"] = {"target": 0.9, "value": result["redis_cluster_vs_raw"],
                                                 "met": result["redis_cluster_vs_raw"] >= 0.9}
    print_redis_cluster(console, result["redis_cluster"])


def run_redis(json_path: str | None, quick: bool = False) -> dict:
    """`kvtier bench --redis`: only the shared tier's figures."""
    result: dict = {"quick": quick, "machine": machine()}
    redis_figures(Console(), result, quick)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def disk_in(workdir: Path, block_bytes: int, total: int, reps: int, tick: Callable[[], None]) -> dict:
    """`disk_case` in a folder of its own, removed after it: one case's files (GiBs) are gone before the next."""
    where = workdir / f"disk-{size_name(block_bytes)}"
    where.mkdir()
    try:
        return disk_case(where, block_bytes, total, reps, tick)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def run(json_path: str | None, quick: bool = False, root: str | None = None) -> dict:
    """Run every benchmark, print a table, write `json_path` (if given) and return the figures."""
    sizes = QUICK if quick else FULL
    console = Console()
    result: dict = {"quick": quick, "machine": machine(), "repetitions": sizes.repetitions}
    cpu_start = cpu_busy()
    if root is not None:
        Path(root).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=root))
    reps = sizes.repetitions
    try:
        with Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            tasks = {f"host {size_name(b)}": 2 * (reps + 1) for b in sizes.host_blocks}
            tasks |= {f"pages, {name}": 2 * (reps + 1) for name in GEOMETRIES}
            tasks |= {"disk write+read": reps + 1}
            tasks |= {f"disk {size_name(b)}": reps + 1 for b in sizes.disk_more_blocks}
            tasks |= {"directory build": 1, "lookup": 2 * (reps + 1),
                      "scheduler": scheduler.ticks(quick), "connector": connector.connector_ticks(quick)}
            ids = {name: progress.add_task(name, total=total) for name, total in tasks.items()}

            def tick(name: str) -> Callable[[], None]:
                return lambda: progress.advance(ids[name])

            source = torch.randint(0, 256, (sizes.host_total,), dtype=torch.uint8)
            by_size = {size_name(b): host_case(source, b, reps, tick(f"host {size_name(b)}"))
                       for b in sizes.host_blocks}
            del source
            result["host_vs_copy"] = min(case["ratio"] for case in by_size.values())
            result["host_vs_copy_overall"] = "minimum over block sizes"
            result["host_vs_copy_median"] = statistics.median(case["ratio"] for case in by_size.values())
            result["host_vs_copy_by_size"] = by_size
            paged = [pages_case(name, blocks, reps, tick(f"pages, {name}"))
                     for name, blocks in zip(GEOMETRIES, sizes.page_blocks)]
            result["engine_pages_vs_copy"] = min(case["ratio"] for case in paged)
            result["engine_pages_vs_copy_overall"] = "minimum over geometries"
            result["engine_pages"] = paged
            disk = disk_in(workdir, sizes.disk_block, sizes.disk_total, reps, tick("disk write+read"))
            result["disk_write_vs_raw"] = disk["write"]["ratio"]
            result["disk_read_vs_raw"] = disk["read"]["ratio"]
            result["disk_write_full_vs_raw"] = disk["write_full"]["ratio"]
            result["disk"] = disk
            result["disk_by_size"] = {
                size_name(b): disk_in(workdir, b, sizes.disk_total, reps, tick(f"disk {size_name(b)}"))
                for b in sizes.disk_more_blocks}
            lookup = lookup_case(sizes.directory_blocks, sizes.prompt_tokens, reps, tick("directory build"),
                                  tick("lookup"))
            result["lookup_keys_per_s"] = min(case["keys_per_s"] for case in lookup["by_block_tokens"].values())
            result["lookup_keys_per_s_overall"] = "minimum over block sizes"
            result["lookup"] = lookup
            result["scheduler"] = scheduler.run(quick, tick("scheduler"))
            result["scheduler"] |= connector.connector_rows(quick, tick("connector"))
            for name in ("scheduler_vs_vllm_hashing", "large_blocks_vs_vllm_hashing"):
                result[name] = result["scheduler"][name]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["machine"]["loadavg_end"] = os.getloadavg()
    others = others_load(cpu_start)
    result["machine"]["other_processes_cpus"] = others
    result["noisy"] = others is not None and others > 0.3  # see the warning printed with the table
    result["targets"] = {name: {"target": target, "value": result[name], "met": result[name] >= target}
                         for name, target in TARGETS.items()}
    print_tiers(console, result)
    print_scheduler(console, result["scheduler"])
    try:
        trace = simulator.default_trace()
    except FileNotFoundError as missing:  # the public trace is not shipped: its figures need it downloaded
        result["sim"] = {"skipped": str(missing)}
        console.print(f"[yellow]simulator figures skipped: {missing}[/]")
    else:
        with console.status("simulator vs libcachesim on the Mooncake conversation trace"):
            result["sim"] = simulator.run(quick=quick, trace=trace)
        print_simulator(console, result["sim"])
    redis_figures(console, result, quick)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result
