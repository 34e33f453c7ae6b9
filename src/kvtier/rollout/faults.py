"""Faults the rollout's drills cannot make for real on demand, injected into the server it starts (never into
production): the secondary tier's file system full (every disk write fails with ENOSPC where a real one would,
in the write of the block file) and a slow disk (every block read sleeps first). Python runs the hook at
startup in every process of the server, through a `sitecustomize` on PYTHONPATH; the drill turns a fault on
and off by writing files in a control folder, while the server runs.

The slow disk is also a hook of its own, for the guard's and the decision's engine tests and benchmarks, which
start the engine in their own process: every block read sleeps for the seconds written in a file first, so a
running engine's disk can be slowed and healed by rewriting the file (0 or a missing file: full speed).

    slow_reads(Path("/tmp/delay"))   # in the engine's process, before the engine starts
    Path("/tmp/delay").write_text("0.4")
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

HOOK = """import os
if os.environ.get("KVTIER_DRILL_DIR"):
    from kvtier.rollout.faults import install
    install(os.environ["KVTIER_DRILL_DIR"])
"""


def server_env(root: Path) -> dict[str, str]:
    """The environment that arms the hook for a server's processes; faults start off."""
    (root / "site").mkdir(parents=True, exist_ok=True)
    (root / "site" / "sitecustomize.py").write_text(HOOK)
    (root / "control").mkdir(exist_ok=True)
    path = os.pathsep.join(filter(None, [str(root / "site"), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "KVTIER_DRILL_DIR": str(root / "control")}


def set_full(root: Path, full: bool) -> None:
    flag = root / "control" / "full"
    flag.touch() if full else flag.unlink(missing_ok=True)


def set_read_delay(root: Path, seconds: float) -> None:
    (root / "control" / "read_delay_s").write_text(str(seconds))


def install(control: str) -> None:
    import kvtier.stores.disk as disk

    slow_reads(Path(control) / "read_delay_s")
    full, transfer = Path(control) / "full", disk.transfer

    def maybe_full(fn: Any, fd: int, bufs: Any, offset: int = 0) -> int:
        if fn is os.pwritev and full.exists():
            raise OSError(errno.ENOSPC, "No space left on device (rollout drill)")
        return transfer(fn, fd, bufs, offset)

    disk.transfer = maybe_full


def slow_reads(delay_file: Path) -> None:
    from kvtier.stores.base import ReadStatus
    from kvtier.stores.buffers import Buffer
    from kvtier.stores.disk import DiskStore

    read = DiskStore.read

    def slow_read(self: DiskStore, key: bytes, into: Buffer) -> ReadStatus:
        try:
            delay = float(delay_file.read_text() or 0)
        except (OSError, ValueError):
            delay = 0.0
        if delay > 0:
            time.sleep(delay)
        return read(self, key, into)

    DiskStore.read = slow_read  # type: ignore[method-assign]
