"""`disk_write_vs_raw` / `disk_read_vs_raw` / `disk_write_full_vs_raw`: the disk tier, driven through a Mover
wired as TieredCache wires it (host slab, DiskStore, the fs tier's configured thread counts), against one file
written and read sequentially with O_DIRECT in large chunks (fsync after the write) on the same file system.
The full tier's write is the steady state of a serving disk tier: every block written evicts one.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvtier.config import FsTierConfig, parse_config
from kvtier.directory import CALLER, Op, Plan, Status, Step
from kvtier.keys import Namespace
from kvtier.layout import ALIGN, round_up
from kvtier.metrics import Metrics
from kvtier.sizing import HOST
from kvtier.stores.base import Stores
from kvtier.stores.disk import DiskStore
from kvtier.stores.host import HostSlab
from kvtier.timing import BUDGET_S, alternate, fresh_keys, summary
from kvtier.wiring import build_mover

GiB = 1 << 30
MiB = 1 << 20
RAW_CHUNK = 8 * MiB  # the raw baseline's I/O size


def disk_case(workdir: Path, block_bytes: int, total: int, reps: int, tick: Callable[[], None]) -> dict:
    """Host->disk and disk->host COPY steps through the Mover, against one raw O_DIRECT file; then, as a full
    tier stores, each block's COPY after the DELETE of one read before, against a second raw file.

    Every round writes new files (new keys, new raw files); nothing is unlinked until the end, so that no
    round pays for an earlier round's deletes (see benchmarks/README.md: on ext4 without a journal, every
    create steps over the inodes deleted in the last minute or more).
    """
    n = max(1, total // block_bytes)
    nbytes = n * block_bytes
    need = 3 * (reps + 1) * n * (block_bytes + 2 * ALIGN)
    free = shutil.disk_usage(workdir).free
    if free < need + GiB:
        raise ValueError(f"disk bench needs {need / GiB:.1f} GiB free under {workdir}, has {free / GiB:.1f} GiB")
    tier_dir, raw_dir = workdir / "tier", workdir / "raw"
    raw_dir.mkdir()
    config = parse_config({"cpu_bytes_to_use": 2 * n * round_up(block_bytes), "block_size": 16,
                           "secondary_tiers": [{"type": "fs", "root_dir": str(tier_dir), "max_bytes": 2 * need}]})
    fs = config.secondary_tiers[0]
    assert isinstance(fs, FsTierConfig)
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

    mover = build_mover(config, Stores(HOST, slab, {"disk": disk}), report, Metrics(None, 16))
    baseline = _RawFiles(raw_dir, data)
    written: list[list[bytes]] = []

    def expect_ok(what: str, steps: int) -> None:
        if statuses[Status.OK] != steps or len(statuses) != 1:
            raise RuntimeError(f"disk bench {what}: {dict(statuses)} of {steps} steps")
        statuses.clear()

    def ours_write(evicting: Sequence[bytes] = ()) -> float:
        """New blocks; each after the DELETE of the block of `evicting` at its index, where given."""
        keys = fresh_keys(n)
        chains = [[Step(Op.COPY, key, HOST, "disk", src_slot=i, parent=keys[i - 1] if i else None)]
                  for i, key in enumerate(keys)]
        for chain, victim in zip(chains, evicting):
            chain.insert(0, Step(Op.DELETE, victim, "disk", CALLER))
        if not mover.reserve_store():
            raise RuntimeError("disk bench: the mover's store queue is full")
        os.sync()  # every timed phase starts with nothing of the other side's left to write back
        start = time.perf_counter()
        mover.store(Plan(chains=chains), [])
        mover.flush()
        elapsed = time.perf_counter() - start
        expect_ok("write", n + len(evicting))
        written.append(keys)
        return elapsed

    def ours_read() -> float:
        keys = written[-1]
        slab.write(range(n, 2 * n), zeros)  # so that the check below sees what this round read
        chains = [[Step(Op.COPY, key, "disk", HOST, dst_slot=n + i)] for i, key in enumerate(keys)]
        os.sync()
        start = time.perf_counter()
        mover.load(Plan(chains=chains), [])
        elapsed = time.perf_counter() - start
        expect_ok("read", n)
        back = torch.empty_like(data)
        slab.read(range(n, 2 * n), back)
        if not torch.equal(back, data):
            raise RuntimeError("disk bench: a block read back differs from the one written")
        return elapsed

    def ours() -> tuple[float, float, float]:
        fresh, read = ours_write(), ours_read()
        return fresh, read, ours_write(evicting=written[-1])

    def raw() -> tuple[float, float, float]:
        return baseline.write(), baseline.read(), baseline.write()

    try:
        times = alternate(ours, raw, reps, tick, budget_s=2 * BUDGET_S)  # (write, read, full write) s per side
    finally:
        mover.close()
        disk.close()
        slab.close()
    write, read, full = ({side: [t[i] for t in times[side]] for side in times} for i in (0, 1, 2))
    return {
        "block_bytes": block_bytes, "blocks": n,
        "write": summary(write, nbytes), "read": summary(read, nbytes), "write_full": summary(full, nbytes),
        "files_reused": disk.files_reused,
        "n_write_threads": fs.n_write_threads, "n_read_threads": fs.n_read_threads,
        "tier_o_direct": disk.direct, "raw_o_direct": baseline.direct, "raw_chunk_bytes": RAW_CHUNK,
        "file_system_dir": str(workdir),
        "notes": "reads are cold: O_DIRECT bypasses the page cache (when tier_o_direct and raw_o_direct are "
                 "true). The tier writes one file per block (temp file + rename, no fsync, as DiskStore does); "
                 "the raw baseline writes one file and fsyncs it. write_full: a full tier, each block written "
                 "after the delete of one read before, whose file it takes (DiskStore.reusing).",
    }


class _RawFiles:
    """The baseline: the same bytes as one file per round, written with O_DIRECT in RAW_CHUNK `pwrite`s and
    fsynced, then read back in RAW_CHUNK `preadv`s."""

    def __init__(self, folder: Path, data: torch.Tensor) -> None:
        self.folder = folder
        self.nbytes = data.numel()
        self.buffer = mmap.mmap(-1, self.nbytes)  # page-aligned, as O_DIRECT wants
        torch.frombuffer(self.buffer, dtype=torch.uint8).copy_(data.view(-1))
        self.files: list[Path] = []
        self.direct = True

    def write(self) -> float:
        path = self.folder / f"raw-{len(self.files)}.bin"
        self.files.append(path)
        os.sync()
        start = time.perf_counter()
        fd, self.direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            view = memoryview(self.buffer)
            for offset in range(0, self.nbytes, RAW_CHUNK):
                _whole(os.pwrite(fd, view[offset : offset + RAW_CHUNK], offset), min(RAW_CHUNK, self.nbytes - offset))
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def read(self) -> float:
        os.sync()
        start = time.perf_counter()
        fd, _ = _open_direct(self.files[-1], os.O_RDONLY)
        try:
            view = memoryview(self.buffer)
            for offset in range(0, self.nbytes, RAW_CHUNK):
                _whole(os.preadv(fd, [view[offset : offset + RAW_CHUNK]], offset), min(RAW_CHUNK, self.nbytes - offset))
        finally:
            os.close(fd)
        return time.perf_counter() - start


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
