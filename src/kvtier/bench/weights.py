"""`weights_identity` at startup: what identifying a checkpoint by every byte costs an engine's start.

    python -m kvtier.bench.weights [--gib 16] [--root DIR] [--threads 1 4 8] [--reps 3] [--json FILE]

One weight file of `--gib` GiB (a 16 GB-class checkpoint, as one file: shards only split the same reads) is
written under `--root`, flushed and dropped from the page cache (`posix_fadvise(DONTNEED)`), then:

- `cold`: the first start after the checkpoint changed, its bytes on disk only: `FileDigests` reading it whole
  with each `--threads`, against `raw_read`, the same file read sequentially in 8 MiB `preadv`s and not hashed
  (what the disk gives). Each run is preceded by a drop from the page cache; the two alternate.
- `page_cache`: the same first start with the file in the page cache, as it is after vLLM has just loaded the
  weights on a host with the memory for them (as far as this machine's RAM holds the file: `fits_in_ram`).
- `cached_start`: a restart over the unchanged file: its digest is in the cache file, nothing is read.

Seconds are medians of `--reps` runs; GB/s = 10^9 bytes per second. The file is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.config import finite_float
from kvtier.digests import FileDigests
from kvtier.timing import cpu_busy, others_load

GiB = 1 << 30
MiB = 1 << 20
WRITE_BYTES = 64 * MiB
RAW_READ_BYTES = 8 * MiB


def run(gib: float = 16.0, root: Path | None = None, threads: Sequence[int] = (1, 4, 8), reps: int = 3) -> dict:
    """Every figure as a dict (see the module's docstring)."""
    size = int(gib * GiB) // WRITE_BYTES * WRITE_BYTES or WRITE_BYTES
    folder = Path(tempfile.mkdtemp(prefix="kvtier-bench-weights-", dir=root))
    try:
        free = shutil.disk_usage(folder).free
        if free < size + GiB:
            raise ValueError(f"the weights bench needs {(size + GiB) / GiB:.1f} GiB free under {folder}, "
                             f"has {free / GiB:.1f} GiB")
        path = folder / "model.safetensors"
        started = time.perf_counter()
        _write(path, size)
        written_s = time.perf_counter() - started
        busy = cpu_busy()
        result = {"bytes": size, "write_s": written_s, "fits_in_ram": size < _available_ram(),
                  "cold": _cold(path, size, threads, reps), "page_cache": _page_cache(path, size, threads, reps),
                  "cached_start": _cached_start(path, folder / "cache", max(threads))}
        result["other_processes_cpus"] = others_load(busy)
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _write(path: Path, size: int) -> None:
    """`size` bytes of a random 64 MiB pattern (xxh3's speed does not depend on the bytes), fsync'ed."""
    pattern = os.urandom(WRITE_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size // WRITE_BYTES):
            os.write(fd, pattern)
        os.fsync(fd)
    finally:
        os.close(fd)


def _evict(path: Path) -> None:
    """Drop the file's pages from the page cache: the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_read(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    buf = memoryview(bytearray(RAW_READ_BYTES))
    try:
        offset = 0
        while n := os.preadv(fd, [buf], offset):
            offset += n
    finally:
        os.close(fd)


def _hash(path: Path, threads: int) -> Callable[[], object]:
    return lambda: FileDigests(threads=threads, remember=False).digests([path])


def _timed(fn: Callable[[], object], before: Callable[[], None] | None = None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _figures(seconds: list[float], size: int) -> dict:
    median = statistics.median(seconds)
    return {"s": median, "gbps": size / median / 1e9, "runs_s": [round(s, 3) for s in seconds]}


def _cold(path: Path, size: int, threads: Sequence[int], reps: int) -> dict:
    """Each thread count's hash from the disk against the raw read, alternated (ABBA), each run after an eviction."""
    evict = lambda: _evict(path)  # noqa: E731
    runs: dict[str, list[float]] = {"raw_read": [], **{f"threads_{t}": [] for t in threads}}
    sides = [("raw_read", lambda: _raw_read(path)), *((f"threads_{t}", _hash(path, t)) for t in threads)]
    for rep in range(reps):
        for name, fn in sides if rep % 2 == 0 else reversed(sides):
            runs[name].append(_timed(fn, evict))
    out = {name: _figures(seconds, size) for name, seconds in runs.items()}
    for t in threads:
        out[f"threads_{t}"]["vs_raw_read"] = out["raw_read"]["s"] / out[f"threads_{t}"]["s"]
    return out


def _page_cache(path: Path, size: int, threads: Sequence[int], reps: int) -> dict:
    _raw_read(path)  # into the page cache, as far as it fits
    return {f"threads_{t}": _figures([_timed(_hash(path, t)) for _ in range(reps)], size) for t in threads}


def _cached_start(path: Path, cache: Path, threads: int) -> dict:
    """A first start that remembers the digest, then a restart over the unchanged file."""
    first = FileDigests(cache, threads=threads)
    first.racy_s = 0  # the bench's file was written seconds ago: remembered at once
    digest = first.digests([path])
    again = FileDigests(cache, threads=threads)
    seconds = _timed(lambda: again.digests([path]))
    assert again.digests([path]) == digest
    return {"s": seconds, "bytes_read": again.hashed_bytes, "first_start_bytes_read": first.hashed_bytes}


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def _table(result: dict) -> str:
    size = result["bytes"] / 1e9
    lines = [f"one weight file of {size:.1f} GB ({result['bytes'] / GiB:.1f} GiB); fits in RAM: "
             f"{result['fits_in_ram']}; other processes kept {result['other_processes_cpus'] or 0:.2f} CPUs busy",
             "| start | what | seconds | GB/s |", "|---|---|---|---|"]
    for phase in ("cold", "page_cache"):
        for name, f in result[phase].items():
            lines.append(f"| {phase} | {name} | {f['s']:.2f} | {f['gbps']:.2f} |")
    c = result["cached_start"]
    lines.append(f"| cached | digest remembered, {c['bytes_read']} bytes read | {c['s']:.4f} | - |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench.weights", description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=finite_float, default=16.0, help="the weight file's size (default 16)")
    ap.add_argument("--root", type=Path, help="the folder to write it in (default: the system temp folder)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8], help="hashing threads (default 1 4 8)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each figure (default 3)")
    ap.add_argument("--json", type=Path, help="write every figure to this file")
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.reps <= 0 or min(args.threads) <= 0:
        ap.error("--gib, --reps and --threads must be > 0")
    result = run(args.gib, args.root, args.threads, args.reps)
    print(_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
