"""A disk tier slowed on purpose, for the guard's and the decision's tests and benchmarks (never for production):
every block read sleeps for the seconds written in a file first, so a running engine's disk can be slowed and
healed by rewriting the file (0 or a missing file: full speed).

    install(Path("/tmp/delay"))   # in the engine's process, before the engine starts
    Path("/tmp/delay").write_text("0.4")
"""

from __future__ import annotations

import time
from pathlib import Path


def install(delay_file: Path) -> None:
    from kvtier.stores.disk import DiskStore

    read = DiskStore.read

    def slow_read(self, key, into):  # type: ignore[no-untyped-def]
        try:
            delay = float(delay_file.read_text() or 0)
        except (OSError, ValueError):
            delay = 0.0
        if delay > 0:
            time.sleep(delay)
        return read(self, key, into)

    DiskStore.read = slow_read  # type: ignore[method-assign]
