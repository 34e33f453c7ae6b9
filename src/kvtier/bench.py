"""`kvtier bench`: every figure is a ratio against a baseline measured in the same run, on the same machine.

- host_vs_copy      TieredCache with only the host tier (store all, flush, load all into preallocated tensors)
                    against a plain per-block torch `copy_` into a preallocated buffer and back: the same
                    blocks, the same bytes twice.
- disk_*_vs_raw     the disk tier, driven through a Mover wired as TieredCache wires it (host slab, DiskStore,
                    the fs tier's configured thread counts), against one file written and read sequentially
                    with O_DIRECT in large chunks (fsync after the write) on the same file system.
- lookup_keys_per_s Directory.lookup of a fully cached 128k-token prompt (16- and 256-token blocks) in a
                    warm directory of 1M blocks; a Python loop of dict.get over the same keys is the baseline.

Ours and the baseline alternate (ABBA) so that they share the machine's noise; figures are medians of the
paired ratios, and both sides' raw throughputs are reported too. benchmarks/README.md says more.
"""

from __future__ import annotations

import errno
import gc
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier import bench_redis, bench_sim
from kvtier.cache import TieredCache
from kvtier.config import parse_config
from kvtier.directory import Directory, Op, Plan, Status, Step, TierSpec
from kvtier.keys import Namespace, chain_keys
from kvtier.metrics import Metrics
from kvtier.mover import Mover
from kvtier.sim.replay import complete_instantly
from kvtier.stores.base import Stores, TierKind
from kvtier.stores.disk import DiskStore
from kvtier.stores.host import ALIGN, HostSlab, round_up

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
TARGETS = {"host_vs_copy": 0.9, "disk_write_vs_raw": 0.8, "disk_read_vs_raw": 0.8, "lookup_keys_per_s": 1_000_000}
RAW_CHUNK = 8 * MiB  # the raw baseline's I/O size
MIN_REPS = 5  # pairs per figure, at least
BUDGET_S = 30.0  # seconds per figure after which no pair beyond MIN_REPS is started
TOKEN_BYTES = 2 * 8 * 128 * 2  # K and V, 8 heads of 128, bf16: one token of one layer


@dataclass(frozen=True)
class Sizes:
    host_total: int
    host_blocks: tuple[int, ...]
    disk_total: int
    disk_block: int
    directory_blocks: int
    prompt_tokens: int
    repetitions: int


FULL = Sizes(256 * MiB, (256 * KiB, MiB, 4 * MiB), 512 * MiB, MiB, 1 << 20, 128 * 1024, 9)
QUICK = Sizes(16 * MiB, (256 * KiB, MiB, 4 * MiB), 16 * MiB, MiB, 16 * 1024, 128 * 1024, 5)


def run(json_path: str | None, quick: bool = False, root: str | None = None) -> dict:
    """Run every benchmark, print a table, write `json_path` (if given) and return the figures."""
    sizes = QUICK if quick else FULL
    console = Console()
    result: dict = {"quick": quick, "machine": _machine(), "repetitions": sizes.repetitions}
    cpu_start = _cpu_busy()
    if root is not None:
        Path(root).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=root))
    reps = sizes.repetitions
    try:
        with Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            tasks = {f"host {_size(b)}": 2 * (reps + 1) for b in sizes.host_blocks}
            tasks |= {"disk write+read": reps + 1, "directory build": 1, "lookup": 2 * (reps + 1)}
            ids = {name: progress.add_task(name, total=total) for name, total in tasks.items()}

            def tick(name: str) -> Callable[[], None]:
                return lambda: progress.advance(ids[name])

            source = torch.randint(0, 256, (sizes.host_total,), dtype=torch.uint8)
            by_size = {_size(b): _host_case(source, b, reps, tick(f"host {_size(b)}")) for b in sizes.host_blocks}
            del source
            result["host_vs_copy"] = min(case["ratio"] for case in by_size.values())
            result["host_vs_copy_overall"] = "minimum over block sizes"
            result["host_vs_copy_median"] = statistics.median(case["ratio"] for case in by_size.values())
            result["host_vs_copy_by_size"] = by_size
            disk = _disk_case(workdir, sizes.disk_block, sizes.disk_total, reps, tick("disk write+read"))
            result["disk_write_vs_raw"] = disk["write"]["ratio"]
            result["disk_read_vs_raw"] = disk["read"]["ratio"]
            result["disk"] = disk
            lookup = _lookup_case(sizes.directory_blocks, sizes.prompt_tokens, reps, tick("directory build"),
                                  tick("lookup"))
            result["lookup_keys_per_s"] = min(case["keys_per_s"] for case in lookup["by_block_tokens"].values())
            result["lookup_keys_per_s_overall"] = "minimum over block sizes"
            result["lookup"] = lookup
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["machine"]["loadavg_end"] = os.getloadavg()
    others = _others_load(cpu_start)
    result["machine"]["other_processes_cpus"] = others
    result["noisy"] = others is not None and others > 0.3  # see the warning printed with the table
    result["targets"] = {name: {"target": target, "value": result[name], "met": result[name] >= target}
                         for name, target in TARGETS.items()}
    _print_table(console, result)
    with console.status("simulator vs libcachesim on the Mooncake conversation trace"):
        result["sim"] = bench_sim.run(quick=quick)
    _print_sim_table(console, result["sim"])
    with console.status("redis tier vs raw redis-py on a local redis-server"):
        result["redis"] = bench_redis.run(quick=quick)
    _print_redis_table(console, result["redis"])
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


# ---------------------------------------------------------------- measuring


def _alternate(
    ours: Callable[[], Any], base: Callable[[], Any], reps: int, tick: Callable[[], None],
    budget_s: float = BUDGET_S,
) -> dict:
    """One untimed warm-up of each side, then `reps` pairs in ABBA order; each callable returns its seconds.

    Past `budget_s` (a machine so loaded that copies crawl) it stops after MIN_REPS pairs.
    """
    start = time.monotonic()
    ours(), base()
    tick()
    pairs = []
    for rep in range(reps):
        if rep % 2 == 0:
            o, b = ours(), base()
        else:
            b, o = base(), ours()
        pairs.append((o, b))
        tick()
        if len(pairs) >= MIN_REPS and time.monotonic() - start > budget_s:
            for _ in range(reps - len(pairs)):
                tick()
            break
    return {"ours_s": [o for o, _ in pairs], "baseline_s": [b for _, b in pairs]}


def _summary(times: dict, nbytes: int) -> dict:
    """Throughputs of both sides (GB/s = 1e9 B/s) and the median of the paired ratios."""
    ours = [nbytes / s / 1e9 for s in times["ours_s"]]
    base = [nbytes / s / 1e9 for s in times["baseline_s"]]
    return {
        "ratio": statistics.median(o / b for o, b in zip(ours, base)),
        "ratio_of_medians": statistics.median(ours) / statistics.median(base),
        "ours_gbps": statistics.median(ours),
        "baseline_gbps": statistics.median(base),
        "ours_gbps_runs": [round(x, 3) for x in ours],
        "baseline_gbps_runs": [round(x, 3) for x in base],
        "bytes": nbytes,
    }


def _keys(n: int) -> list[bytes]:
    raw = os.urandom(32 * n)
    return [raw[i : i + 32] for i in range(0, 32 * n, 32)]


# ---------------------------------------------------------------- host tier vs copy_


def _host_case(source: torch.Tensor, block_bytes: int, reps: int, tick: Callable[[], None]) -> dict:
    """Store n blocks, flush, load them back, against copy_ into a preallocated buffer and back.

    The headline loads into preallocated tensors (`load(keys, out=...)`), as the baseline copies into
    preallocated ones; `new_tensors` is the same run with `load(keys)` allocating its result.
    """
    n = max(1, source.numel() // block_bytes)
    shape = (2, 8, block_bytes // TOKEN_BYTES, 128)
    blocks_t = source[: n * block_bytes].view(torch.bfloat16).view(n, *shape)
    blocks = list(blocks_t)
    config = parse_config({"cpu_bytes_to_use": n * round_up(block_bytes), "block_size": shape[2]})
    cache = TieredCache(config, shape, torch.bfloat16)  # room for exactly n: each round evicts the last one's
    buf, out, ours_out = (torch.empty_like(blocks_t) for _ in range(3))
    buf_rows, out_rows, ours_rows = list(buf), list(out), list(ours_out)
    checked: list[bool] = []

    def ours(into: list[torch.Tensor] | None) -> float:
        keys = _keys(n)
        start = time.perf_counter()
        accepted = cache.store(keys, blocks)
        cache.flush()
        got = cache.load(keys, out=into)
        elapsed = time.perf_counter() - start
        if accepted != n or len(got) != n:
            raise RuntimeError(f"host bench: stored {accepted}, loaded {len(got)} of {n} blocks")
        if len(checked) < 2:
            checked.append(all(_same_bits(a, b) for a, b in zip(got, blocks)))
            ours_out.zero_()
        return elapsed

    def base() -> float:
        start = time.perf_counter()
        for dst, src in zip(buf_rows, blocks):
            dst.copy_(src)
        for dst, src in zip(out_rows, buf_rows):
            dst.copy_(src)
        return time.perf_counter() - start

    try:
        times = _alternate(lambda: ours(ours_rows), base, reps, tick)
        new_tensors = _alternate(lambda: ours(None), base, reps, tick)
    finally:
        cache.close()
    if not all(checked):
        raise RuntimeError("host bench: a loaded block differs from the stored one")
    nbytes = 2 * n * block_bytes
    return {"block_bytes": block_bytes, "blocks": n, **_summary(times, nbytes),
            "new_tensors": _summary(new_tensors, nbytes)}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------- disk tier vs raw O_DIRECT


def _disk_case(workdir: Path, block_bytes: int, total: int, reps: int, tick: Callable[[], None]) -> dict:
    """Host->disk and disk->host COPY steps through the Mover, against one raw O_DIRECT file.

    Every round writes new files (new keys, a new raw file); nothing is deleted until the end, so that no
    round pays for an earlier round's deletes (see benchmarks/README.md: on ext4 without a journal, every
    create steps over the inodes deleted in the last minute or more).
    """
    n = max(1, total // block_bytes)
    nbytes = n * block_bytes
    need = 2 * (reps + 1) * n * (block_bytes + 2 * ALIGN)
    free = shutil.disk_usage(workdir).free
    if free < need + GiB:
        raise ValueError(f"disk bench needs {need / GiB:.1f} GiB free under {workdir}, has {free / GiB:.1f} GiB")
    tier_dir, raw_dir = workdir / "tier", workdir / "raw"
    raw_dir.mkdir()
    config = parse_config({"cpu_bytes_to_use": 2 * n * round_up(block_bytes), "block_size": 16,
                           "secondary_tiers": [{"type": "fs", "root_dir": str(tier_dir), "max_bytes": 2 * need}]})
    fs = config.secondary_tiers[0]
    namespace = Namespace(model="bench", dtype="uint8", block_size=16, kv_layout=str(block_bytes)).digest()
    slab = HostSlab(2 * n, block_bytes)  # slots [0, n) are written out, slots [n, 2n) are read into
    disk = DiskStore(fs.root_dir, namespace, 0, block_bytes, o_direct=fs.o_direct)
    data = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8)
    zeros = torch.zeros_like(data)
    slab.write(range(n), data)
    statuses: Counter = Counter()
    lock = threading.Lock()

    def report(steps: Sequence[Step], status: Status) -> None:
        with lock:
            statuses[status] += len(steps)

    directory = Directory([TierSpec("host", slab.nbytes, slab.slot_nbytes, kind=TierKind.HOST)])
    mover = Mover(Stores("host", slab, {"disk": disk}), report, Metrics(directory, 16),
                  n_read_threads=fs.n_read_threads, n_write_threads=fs.n_write_threads, queue_depth=config.queue_depth)
    raw_buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT wants
    torch.frombuffer(raw_buf, dtype=torch.uint8).copy_(data.view(-1))
    written: list[list[bytes]] = []
    raw_files: list[Path] = []
    raw_direct = [True]

    def expect_ok(what: str) -> None:
        if statuses[Status.OK] != n or len(statuses) != 1:
            raise RuntimeError(f"disk bench {what}: {dict(statuses)} of {n} steps")
        statuses.clear()

    def ours_write() -> float:
        keys = _keys(n)
        chains = [[Step(Op.COPY, key, "host", "disk", src_slot=i, parent=keys[i - 1] if i else None)]
                  for i, key in enumerate(keys)]
        if not mover.reserve_store():
            raise RuntimeError("disk bench: the mover's store queue is full")
        os.sync()  # every timed phase starts with nothing of the other side's left to write back
        start = time.perf_counter()
        mover.store(Plan(chains=chains), [])
        mover.flush()
        elapsed = time.perf_counter() - start
        expect_ok("write")
        written.append(keys)
        return elapsed

    def ours_read() -> float:
        keys = written[-1]
        slab.write(range(n, 2 * n), zeros)  # so that the check below sees what this round read
        chains = [[Step(Op.COPY, key, "disk", "host", dst_slot=n + i)] for i, key in enumerate(keys)]
        os.sync()
        start = time.perf_counter()
        mover.load(Plan(chains=chains), [])
        elapsed = time.perf_counter() - start
        expect_ok("read")
        back = torch.empty_like(data)
        slab.read(range(n, 2 * n), back)
        if not torch.equal(back, data):
            raise RuntimeError("disk bench: a block read back differs from the one written")
        return elapsed

    def raw_write() -> float:
        path = raw_dir / f"raw-{len(raw_files)}.bin"
        raw_files.append(path)
        os.sync()
        start = time.perf_counter()
        fd, raw_direct[0] = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            view = memoryview(raw_buf)
            for offset in range(0, nbytes, RAW_CHUNK):
                _whole(os.pwrite(fd, view[offset : offset + RAW_CHUNK], offset), min(RAW_CHUNK, nbytes - offset))
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def raw_read() -> float:
        os.sync()
        start = time.perf_counter()
        fd, _ = _open_direct(raw_files[-1], os.O_RDONLY)
        try:
            view = memoryview(raw_buf)
            for offset in range(0, nbytes, RAW_CHUNK):
                _whole(os.preadv(fd, [view[offset : offset + RAW_CHUNK]], offset), min(RAW_CHUNK, nbytes - offset))
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def ours() -> tuple[float, float]:
        return ours_write(), ours_read()

    def raw() -> tuple[float, float]:
        return raw_write(), raw_read()

    try:
        times = _alternate(ours, raw, reps, tick, budget_s=2 * BUDGET_S)  # (write, read) seconds per side
    finally:
        mover.close()
        disk.close()
        slab.close()
    write, read = ({side: [t[i] for t in times[side]] for side in times} for i in (0, 1))
    return {
        "block_bytes": block_bytes, "blocks": n,
        "write": _summary(write, nbytes), "read": _summary(read, nbytes),
        "n_write_threads": fs.n_write_threads, "n_read_threads": fs.n_read_threads,
        "tier_o_direct": disk.direct, "raw_o_direct": raw_direct[0], "raw_chunk_bytes": RAW_CHUNK,
        "file_system_dir": str(workdir),
        "notes": "reads are cold: O_DIRECT bypasses the page cache (when tier_o_direct and raw_o_direct are "
                 "true). The tier writes one file per block (temp file + rename, no fsync, as DiskStore does); "
                 "the raw baseline writes one file and fsyncs it.",
    }


def _whole(moved: int, wanted: int) -> None:
    if moved != wanted:
        raise OSError(f"raw disk bench: moved {moved} of {wanted} bytes in one call")


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT where the file system allows it (tmpfs does not), else buffered."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:  # O_DIRECT not supported here
                raise
    return os.open(path, flags, 0o600), False


# ---------------------------------------------------------------- directory lookups


def _lookup_case(
    n_blocks: int, prompt_tokens: int, reps: int, built: Callable[[], None], tick: Callable[[], None]
) -> dict:
    """A directory of `n_blocks` that holds the prompt's chains at both block sizes; time lookups of them."""
    tokens = list(range(prompt_tokens))
    prompts = {16: chain_keys(tokens, 16), 256: chain_keys(tokens, 256)}
    directory = Directory([TierSpec("host", n_blocks * ALIGN, ALIGN, kind=TierKind.HOST)])
    was_enabled = gc.isenabled()
    gc.disable()  # as timeit does; a build of a million objects otherwise spends most of its time in gc
    try:
        start = time.perf_counter()
        for keys in prompts.values():
            complete_instantly(directory, directory.plan_store(keys))
        chain = 8192
        while (missing := n_blocks - len(directory)) > 0:
            complete_instantly(directory, directory.plan_store(_keys(min(chain, missing))))
        build_s = time.perf_counter() - start
        built()
        if len(directory) != n_blocks or any(len(directory.lookup(k)) != len(k) for k in prompts.values()):
            raise RuntimeError("lookup bench: the directory does not hold the prompt's whole chain")
        table = directory._blocks  # the baseline: dict.get over the same keys in the same dict

        def timed(fn: Callable[[list[bytes]], object], keys: list[bytes]) -> float:
            rounds = max(1, math.ceil(65536 / len(keys)))
            start = time.perf_counter()
            for _ in range(rounds):
                fn(keys)
            return (time.perf_counter() - start) / rounds

        def dict_loop(keys: list[bytes]) -> None:
            get = table.get
            for key in keys:
                get(key)

        by_size = {}
        for block_tokens, keys in prompts.items():
            times = _alternate(lambda k=keys: timed(directory.lookup, k), lambda k=keys: timed(dict_loop, k),
                               reps, tick)
            summary = _summary(times, len(keys))  # "GB/s" here is 1e9 keys/s; renamed below
            by_size[str(block_tokens)] = {
                "keys": len(keys), "keys_per_s": summary["ours_gbps"] * 1e9,
                "dict_get_keys_per_s": summary["baseline_gbps"] * 1e9, "vs_dict_get": summary["ratio"],
                "keys_per_s_runs": [round(len(keys) / s) for s in times["ours_s"]],
            }
    finally:
        if was_enabled:
            gc.enable()
    return {
        "directory_blocks": n_blocks, "prompt_tokens": prompt_tokens, "by_block_tokens": by_size,
        "build_s": build_s,
        "build": "plan_store + kvtier.sim.replay.complete_instantly, chains of 8192 random keys, gc disabled",
    }


# ---------------------------------------------------------------- report


def _machine() -> dict:
    return {
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "loadavg_start": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _cpu_busy() -> tuple[float, float, float] | None:
    """(CPU-seconds busy on the whole machine, CPU-seconds of this process, wall time), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), time.process_time(), time.monotonic()


def _others_load(start: tuple[float, float, float] | None) -> float | None:
    """CPUs kept busy by other processes since `start`, on average: above ~0.3 the figures are noisy."""
    end = _cpu_busy()
    if start is None or end is None or end[2] <= start[2]:
        return None
    return max(0.0, ((end[0] - start[0]) - (end[1] - start[1])) / (end[2] - start[2]))


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB}MiB" if nbytes % MiB == 0 else f"{nbytes // KiB}KiB"


def _print_table(console: Console, result: dict) -> None:
    table = Table(title="kvtier bench: ours vs baseline, medians of paired runs")
    for column in ("figure", "ours", "baseline", "ratio", "target", ""):
        table.add_column(column, justify="left" if column == "figure" else "right")

    def row(name: str, ours: str, base: str, ratio: float, target: str, met: bool | None) -> None:
        mark = "" if met is None else ("[green]ok[/]" if met else "[red]MISSED[/]")
        table.add_row(name, ours, base, f"{ratio:.3f}", target, mark)

    for size, case in result["host_vs_copy_by_size"].items():
        row(f"host {size}", f"{case['ours_gbps']:.2f} GB/s", f"{case['baseline_gbps']:.2f} GB/s",
            case["ratio"], "", None)
    t = result["targets"]
    row("host_vs_copy (min)", "", "copy_", t["host_vs_copy"]["value"], "≥ 0.9", t["host_vs_copy"]["met"])
    for side in ("write", "read"):
        case, name = result["disk"][side], f"disk_{side}_vs_raw"
        row(name, f"{case['ours_gbps']:.2f} GB/s", f"{case['baseline_gbps']:.2f} GB/s", case["ratio"], "≥ 0.8",
            t[name]["met"])
    for tokens, case in result["lookup"]["by_block_tokens"].items():
        table.add_row(f"lookup {case['keys']} keys ({tokens} tok)", f"{case['keys_per_s'] / 1e6:.2f} M/s",
                      f"{case['dict_get_keys_per_s'] / 1e6:.2f} M/s", f"{case['vs_dict_get']:.3f}", "", "")
    value = t["lookup_keys_per_s"]["value"]
    table.add_row("lookup_keys_per_s (min)", f"{value / 1e6:.2f} M/s", "dict.get", "", "≥ 1.00 M/s",
                  "[green]ok[/]" if t["lookup_keys_per_s"]["met"] else "[red]MISSED[/]")
    console.print(table)
    others = result["machine"]["other_processes_cpus"]
    if result["noisy"]:
        console.print(f"[yellow]warning: other processes kept {others:.1f} of {result['machine']['cpus']} CPUs busy "
                      "during the run; torch's threads then stall on each other and the figures are noisy[/]")
    console.print(f"directory of {result['lookup']['directory_blocks']:,} blocks built in "
                  f"{result['lookup']['build_s']:.1f} s; disk benchmark ran in {result['disk']['file_system_dir']} "
                  f"(O_DIRECT tier={result['disk']['tier_o_direct']}, raw={result['disk']['raw_o_direct']})")


def _print_sim_table(console: Console, sim: dict) -> None:
    table = Table(title=f"simulator vs libcachesim: {sim['accesses']:,} block accesses of the Mooncake conversation "
                  "trace, medians")
    for column in ("figure", "ours", "libcachesim", "ratio", "target", ""):
        table.add_column(column, justify="left" if column == "figure" else "right")
    met = sim.get("targets_met", {})

    def mark(name: str) -> str:
        return "" if name not in met else ("[green]ok[/]" if met[name] else "[red]MISSED[/]")

    if "libcachesim_lru_points_s" in sim:
        table.add_row("mrc_vs_libcachesim", f"{sim['mrc_s'] * 1e3:.0f} ms (every capacity)",
                      f"{sim['libcachesim_lru_points_s'] * 1e3:.0f} ms (10 capacities)",
                      f"{sim['mrc_vs_libcachesim']:.3f}", "< 1", mark("mrc_vs_libcachesim"))
    for policy in ("lru", "arc", "s3fifo"):
        ours = sim.get(f"replay_{policy}_accesses_per_s")
        theirs = sim.get(f"libcachesim_{policy}_accesses_per_s")
        if ours is None:
            continue
        name = f"replay_{policy}_accesses_per_s"
        table.add_row(name, f"{ours / 1e6:.2f} M/s", f"{theirs / 1e6:.2f} M/s (C loop)" if theirs else "",
                      f"{ours / theirs:.3f}" if theirs else "", "≥ 1.00 M/s" if policy == "lru" else "",
                      mark(name) if policy == "lru" else "")
    console.print(table)


def _print_redis_table(console: Console, redis: dict) -> None:
    table = Table(title=f"redis tier vs raw redis-py pipelined SET/GET, same server ({redis['parser']} parser)")
    for column in ("block", "put ours", "put raw", "put ratio", "get ours", "get raw", "get ratio"):
        table.add_column(column, justify="left" if column == "block" else "right")
    for size, case in redis["redis_vs_raw"].items():
        table.add_row(size, f"{case['tier_put_GBps']:.2f} GB/s", f"{case['raw_put_GBps']:.2f} GB/s",
                      f"{case['put_ratio']:.3f}", f"{case['tier_get_GBps']:.2f} GB/s", f"{case['raw_get_GBps']:.2f} GB/s",
                      f"{case['get_ratio']:.3f}")
    console.print(table)
    ok = redis["min_ratio"] >= redis["target"]
    console.print(f"redis_vs_raw (min) {redis['min_ratio']:.3f}, target ≥ {redis['target']}: "
                  + ("[green]ok[/]" if ok else "[red]MISSED[/]"))
