"""One engine per disk tier root: a claim on `root_dir`, held for the life of the engine's stores.

Two engines writing one `root_dir` would each bound only their own files, and each one's restart scan would
delete the other's temp files. So the first store of an engine takes an exclusive `flock` on
`root_dir/.kvtier.lock` and writes its owner token there; another engine's store is refused with a message that
names the holder. The stores of one engine share the claim: in one process by reference count (the lock is
released with the last of them), across its processes (the scheduler's restart scan, tensor-parallel workers)
by the owner token, which every process of one engine knows.

Each store also holds a shared lock in its rank's folder while it is open, so that the scheduler's restart scan
can tell that every rank's worker has its files where the scan looks (`rank_served`): with tensor parallelism
across machines, a rank's folder on the scheduler's machine is not the one its worker writes.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

LOCK_NAME = ".kvtier.lock"
RANK_LOCK = ".lock"  # in each rank's folder: held (shared) by every store open on it
_guard = threading.Lock()
_claims: dict[tuple[Path, str], list[int]] = {}  # (root, owner) -> [lock fd, stores holding it]


class RootInUse(ValueError):
    """Another engine holds this root_dir."""


def claim(root: Path, owner: str) -> None:
    """Claim `root` for `owner`, or raise RootInUse naming the engine that holds it."""
    with _guard:
        held = _claims.get((root, owner))
        if held is not None:
            held[1] += 1
            return
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _lock_or_share(fd, root, owner)
        except BaseException:
            os.close(fd)
            raise
        _claims[(root, owner)] = [fd, 1]


def release(root: Path, owner: str) -> None:
    with _guard:
        held = _claims.get((root, owner))
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _claims[(root, owner)]
            os.close(held[0])  # releases the flock


def _lock_or_share(fd: int, root: Path, owner: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        if holder.split(" ")[0] != owner:
            raise RootInUse(f"root_dir {root} is in use by another kvtier engine ({holder or 'starting'}): "
                            "give each engine a root_dir of its own") from None
        return  # another process of this engine holds it
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{owner} pid {os.getpid()}".encode(), 0)


def _holder(fd: int) -> str:
    """The holder's token and pid, as it wrote them (it may be a moment away from writing them)."""
    for _ in range(50):
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.01)
    return ""


def hold_rank(dir_fd: int) -> int:
    """A shared lock on the rank folder `dir_fd` for as long as the returned fd is open: this rank's files are
    served from this file system (`rank_served`)."""
    fd = os.open(RANK_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def rank_served(dir_fd: int) -> bool:
    """Whether a process on this file system holds the rank folder `dir_fd` open (`hold_rank`): its worker runs
    where this process can see its files."""
    fd = os.open(RANK_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock
    return False
