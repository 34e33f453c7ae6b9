"""Where the disk tier's blocks live and how their bytes move: file names, our own directories, vectored I/O.

Nothing here follows a symlink: paths are opened relative to a directory fd with O_NOFOLLOW. A directory of
ours that another user owns, or that others may write, is refused: whoever can write it can plant blocks.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

_LONG_KEY = 96  # longer keys get a hashed file name: 2 * 128 hex chars would pass NAME_MAX (255)
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
RD = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a planted FIFO cannot hang us
WR = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
REUSE = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # over a spare: no create, no truncate
DIRECT = getattr(os, "O_DIRECT", 0)


def file_name(key: bytes) -> str:
    """`<key hex>.kv`, or `h<xxh3_128 hex>.kv` for keys too long for a file name (the header holds the key)."""
    stem = key.hex() if len(key) <= _LONG_KEY else "h" + xxhash.xxh3_128_hexdigest(key)
    return stem + ".kv"


def subdir(name: str) -> str:
    return name[:2] if name[0] != "h" else name[1:3]


def transfer(fn: Callable[[int, list[memoryview], int], int], fd: int, bufs: list[memoryview], offset: int = 0) -> int:
    """pwritev/preadv until every byte moved or EOF (a call moving 0); returns the count moved.

    Loops because one call moves at most ~2 GiB; callers know the file size, so O_DIRECT never reads past EOF.
    """
    done, bufs = 0, [b for b in bufs if len(b)]
    while bufs:
        n = fn(fd, bufs, offset + done)
        if n == 0:
            break
        done += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs.pop(0))
        if n:
            bufs[0] = bufs[0][n:]
    return done


class UnsafeDirectory(ValueError):
    """A directory of the tier that someone else could write."""


def open_private_dir(root: Path, parts: Sequence[str]) -> int:
    """The fd of `root/parts...`, each part created mode 0700 if missing, and each refused if it is a link,
    belongs to another user, or can be written by group or others (a pre-existing one may have been planted)."""
    fd = os.open(root, DIR)
    path = root
    for part in parts:
        path = path / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, 0o700, dir_fd=fd)
        try:
            part_fd = os.open(part, DIR, dir_fd=fd)
        finally:
            os.close(fd)
        fd = part_fd
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.close(fd)
            raise UnsafeDirectory(f"kvtier: {path} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}:"
                                  " anyone who can write it can plant blocks; remove it, or make it yours and 0700")
    return fd
