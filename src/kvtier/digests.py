"""Digests of whole files, every byte read, remembered by file identity so that a restart reads nothing again.

What a digest names must be what the file holds: a sample would miss a tensor rewritten in place between its
chunks. A file is cut into CHUNK_BYTES chunks, each hashed (xxh3-128) by a thread of a pool as it is read in
READ_BYTES reads; the file's digest is the xxh3-128 of its size and its chunks' digests, so the reads of one large
file run in parallel. xxh3 hashes faster than a disk or the page cache delivers: reading is the cost.

The digest is remembered in a small JSON file (`cache_dir()`, one entry per file) under the file's identity:
device, inode, size, mtime_ns and ctime_ns. Writing a file in place changes its mtime and ctime (the kernel sets
ctime; no user can set it back), replacing it changes its inode, so a file whose identity is unchanged holds the
bytes that were hashed. Two guards keep that true: a file changed within RACY_S of its hashing (timestamps have a
granularity; a second write in the same tick would leave them alike) or during it is not remembered, and a cache
file or folder that another user owns, or that others can write, is not read (whoever can write it could name new
bytes with an old digest). Processes that start together (an engine's scheduler and workers) take a lock on the
cache folder: one hashes, the others then read its entries.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import xxhash

CHUNK_BYTES = 64 << 20  # a file is hashed as chunks of this size, in parallel
READ_BYTES = 16 << 20  # one read into a thread's buffer
RACY_S = 2.0  # a file changed this recently (or while hashed) is hashed again next time
MAX_ENTRIES = 4096  # entries kept in the cache file, newest first
FORMAT = "kvtier-file-digest-1"  # names the construction above: entries of another are not read
CACHE_ENV = "KVTIER_CACHE_DIR"
CACHE_NAME = "file-digests.json"
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where digests are remembered: $KVTIER_CACHE_DIR, else $XDG_CACHE_HOME/kvtier, else ~/.cache/kvtier."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvtier"


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def identity(st: os.stat_result) -> str:
    """What changes whenever a file's bytes may have: device, inode, size, mtime_ns, ctime_ns."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class FileDigests:
    """Whole-file digests through the cache file in `folder` (default `cache_dir()`; `remember=False`: none)."""

    def __init__(self, folder: Path | None = None, threads: int | None = None, remember: bool = True) -> None:
        self.folder = (Path(folder) if folder is not None else cache_dir()) if remember else None
        self.threads = threads or default_threads()
        self.racy_s = RACY_S
        self.hashed_bytes = 0  # read and hashed by this object (the cache's misses): what a start cost

    def digests(self, paths: Sequence[Path]) -> list[bytes]:
        """One 16-byte digest per file, from the cache where its identity is there, else read in full."""
        stats = [os.stat(p) for p in paths]
        known = self._load()
        if all(identity(st) in known for st in stats):
            return [bytes.fromhex(known[identity(st)]) for st in stats]
        folder = self._usable_folder()
        with _locked(folder):
            known = self._load()  # another process may have hashed them while this one waited
            fresh: dict[str, str] = {}
            out = []
            for path, st in zip(paths, stats):
                key = identity(st)
                if key not in known:
                    digest, stable = self._hash(path, st)
                    if stable:
                        fresh[key] = digest.hex()
                    out.append(digest)
                else:
                    out.append(bytes.fromhex(known[key]))
            if fresh and folder is not None:
                _save(folder, {**fresh, **{k: v for k, v in known.items() if k not in fresh}})
        return out

    def _hash(self, path: Path, before: os.stat_result) -> tuple[bytes, bool]:
        """The file's digest, and whether it may be remembered: unchanged while read, and not changed lately."""
        started = time.time_ns()
        digest = file_digest(path, self.threads)
        self.hashed_bytes += before.st_size
        changed = identity(os.stat(path)) != identity(before)
        if changed:
            log.warning("kvtier: %s changed while it was hashed: its digest is not remembered", path)
        recent = started - max(before.st_mtime_ns, before.st_ctime_ns) < self.racy_s * 1e9
        return digest, not changed and not recent

    def _usable_folder(self) -> Path | None:
        """The cache folder, created 0700; None (every start reads the files) where it cannot be, or is not
        this user's alone."""
        if self.folder is None:
            return None
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            ours = _private(os.stat(self.folder))
        except OSError as exc:
            log.warning("kvtier: no cache of file digests in %s (%s): every start reads the files", self.folder, exc)
            return None
        if not ours:
            log.warning("kvtier: %s is not this user's alone: file digests are not remembered there", self.folder)
            return None
        return self.folder

    def _load(self) -> dict[str, str]:
        """The cache's entries; none from a file or folder that is not this user's alone."""
        if self.folder is None:
            return {}
        try:
            fd = os.open(self.folder / CACHE_NAME, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return {}
        with os.fdopen(fd, "rb") as f:
            if not (_private(os.fstat(f.fileno())) and _private(os.stat(self.folder))):
                return {}
            try:
                data = json.loads(f.read())
            except ValueError:
                return {}
        entries = data.get("entries") if isinstance(data, dict) and data.get("format") == FORMAT else None
        return {k: v for k, v in entries.items() if isinstance(v, str)} if isinstance(entries, dict) else {}


def _save(folder: Path, entries: dict[str, str]) -> None:
    """The newest MAX_ENTRIES entries, written whole and renamed into place (a reader sees the old file or this)."""
    kept = dict(list(entries.items())[:MAX_ENTRIES])
    try:
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".digests-", delete=False) as f:
            json.dump({"format": FORMAT, "entries": kept}, f)
        os.replace(f.name, folder / CACHE_NAME)
    except OSError as exc:
        log.warning("kvtier: could not remember file digests in %s: %s", folder, exc)


@contextmanager
def _locked(folder: Path | None) -> Iterator[None]:
    """The cache folder's lock, held while files are hashed: processes that start together hash each file once."""
    if folder is None:
        yield
        return
    try:
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _private(st: os.stat_result) -> bool:
    """Owned by this user, and no one else can write it."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def file_digest(path: Path, threads: int | None = None) -> bytes:
    """xxh3-128 of the file's size and of the xxh3-128 of each CHUNK_BYTES chunk, chunks read in parallel."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        starts = range(0, size, CHUNK_BYTES)
        local = threading.local()

        def chunk(start: int) -> bytes:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = memoryview(bytearray(READ_BYTES))
            out = xxhash.xxh3_128()
            end = min(start + CHUNK_BYTES, size)
            while start < end:
                n = os.preadv(fd, [buf[: min(READ_BYTES, end - start)]], start)
                if n == 0:  # the file shrank while read: what is there is hashed (the caller sees the change)
                    break
                out.update(buf[:n])
                start += n
            return out.digest()

        if len(starts) <= 1 or (threads or default_threads()) == 1:
            parts = [chunk(s) for s in starts]
        else:
            with ThreadPoolExecutor(min(threads or default_threads(), len(starts)),
                                    thread_name_prefix="kvtier-digest") as pool:
                parts = list(pool.map(chunk, starts))
    finally:
        os.close(fd)
    whole = xxhash.xxh3_128(FORMAT.encode() + size.to_bytes(8, "little"))
    for part in parts:
        whole.update(part)
    return whole.digest()
