"""The local disk tier: one file per block, `root/<namespace>/<rank>/<xx>/<key hex>.kv`.

A file is blockformat's header (magic, format version, namespace, key, parent, payload length and checksum,
header checksum) zero-padded to 4096 bytes, then the payload padded to 4096, so O_DIRECT can move it
straight from and into a HostSlab slot. Writes go to a temp file that is renamed into place, so readers
never see half a block; a torn, flipped or foreign file is detected (and removed) instead of served. No
fsync: after a crash a torn file is just a miss.

A full tier deletes a block for each one it writes. Inside `reusing()`, the deleted block's file becomes the
written block's (renamed aside as a `.spare`, overwritten, renamed into place): no inode to create and no
extent to allocate, and on ext4 no create stepping over the inodes deleted in the last minute.

We never follow a symlink under the root: every path is opened relative to a directory fd with O_NOFOLLOW,
and a link found anywhere is foreign junk: the link itself is removed, never its target.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from kvtier.layout import DISK_HEADER_NBYTES, disk_footprint, round_up
from kvtier.stores import blockformat
from kvtier.stores.base import ReadStatus, RecoveredBlock
from kvtier.stores.blockformat import Header, check_key, parse_header
from kvtier.stores.buffers import Buffer, aligned, byte_view
from kvtier.stores.claim import RANK_LOCK, claim, hold_rank, rank_served, release
from kvtier.stores.files import DIR, DIRECT, RD, REUSE, WR, file_name, open_private_dir, subdir, transfer

HEADER_NBYTES = DISK_HEADER_NBYTES  # blockformat's header, zero-padded to the O_DIRECT alignment
SPARE = ".spare"  # a deleted block's file, kept for the next write inside `reusing()`
log = logging.getLogger(__name__)


def rank_visible(root_dir: str | Path, namespace: str, rank: int) -> bool:
    """Whether a store of this rank is open on this file system (`kvtier.stores.claim.rank_served`): false
    when the rank's worker runs on another machine, whose files this process cannot see."""
    fd = open_private_dir(Path(root_dir).resolve(), (namespace, str(rank)))
    try:
        return rank_served(fd)
    finally:
        os.close(fd)


class DiskStore:
    """Blocks of one namespace and rank as files under `root_dir`; safe to drive from many threads."""

    def __init__(
        self, root_dir: str | Path, namespace: str, rank: int, payload_nbytes: int, o_direct: bool = True,
        owner: str | None = None, auth_key: bytes | None = None, max_bytes: int | None = None,
    ) -> None:
        """`owner`: the engine this store works for; given, the store claims `root_dir` for it (one engine per
        root: `kvtier.stores.claim`) until `close`. `auth_key`: blocks are signed with it, and served only if
        signed with it (`blockformat.mac_of`). `max_bytes`: the tier's bound on this rank's files, which the
        directory keeps; the store only tells it (`capacity_blocks`) to whoever writes without the directory."""
        if not re.fullmatch(r"[0-9a-f]{32}", namespace):
            raise ValueError(f"namespace must be 32 lowercase hex chars (Namespace.digest()), got {namespace!r}")
        if rank < 0 or payload_nbytes <= 0:
            raise ValueError(f"need rank >= 0 and payload_nbytes > 0, got {rank}, {payload_nbytes}")
        self.root = Path(root_dir).resolve()  # resolved once; nothing below it is followed
        self.namespace, self.rank, self.payload_nbytes = namespace, rank, payload_nbytes
        self.max_bytes = max_bytes
        self._auth = auth_key
        self._ns = bytes.fromhex(namespace)
        self.padded_nbytes = round_up(payload_nbytes)
        self.direct = bool(o_direct and DIRECT)  # becomes False if the file system refuses O_DIRECT
        self._local = threading.local()
        self._reused = threading.Lock()
        self.files_reused = 0  # writes that took a deleted block's file (`reusing`)
        self.dir = self.root / namespace / str(rank)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._owner = owner
        if owner is not None:
            claim(self.root, owner)  # before touching anything below the root
        self._dir_fd: int | None = None
        self._rank_fd: int | None = None  # the shared lock that tells this rank is served here (claim.hold_rank)
        try:
            self._dir_fd = open_private_dir(self.root, (namespace, str(rank)))
            if owner is not None:
                self._rank_fd = hold_rank(self._dir_fd)
        except BaseException:
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None
            if owner is not None:
                release(self.root, owner)
            raise

    @property
    def footprint(self) -> int:
        """Bytes one block occupies on disk: header + payload padded to 4096 (what the directory counts)."""
        return disk_footprint(self.payload_nbytes)

    @property
    def capacity_blocks(self) -> int | None:
        """How many block files `max_bytes` allows (None: no bound given)."""
        return None if self.max_bytes is None else self.max_bytes // self.footprint

    def close(self) -> None:
        """Release the directory fd and the claim; the files stay for the next start's scan()."""
        fd, self._dir_fd = self._dir_fd, None
        if fd is not None:
            os.close(fd)
            if self._rank_fd is not None:
                os.close(self._rank_fd)
            if self._owner is not None:
                release(self.root, self._owner)

    # -- per-thread aligned buffers (mmap is page-aligned) -----------------------------------------------

    def _tls(self, name: str, nbytes: int) -> memoryview:
        buf = getattr(self._local, name, None)
        if buf is None:
            buf = memoryview(mmap.mmap(-1, nbytes))
            setattr(self._local, name, buf)
        return buf

    def _header_buf(self) -> memoryview:
        return self._tls("header", HEADER_NBYTES)

    def _bounce(self) -> memoryview:
        """Header + padded payload, contiguous, for O_DIRECT when the caller's buffer is not aligned."""
        return self._tls("bounce", self.footprint)

    # -- paths ------------------------------------------------------------------------------------------

    def _opensubdir(self, name: str, create: bool) -> int | None:
        """fd of the block's subdirectory (None if missing); a symlink there is removed, never followed."""
        if self._dir_fd is None:
            raise ValueError("DiskStore is closed")
        sub = subdir(name)
        try:
            return os.open(sub, DIR, dir_fd=self._dir_fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                os.unlink(sub, dir_fd=self._dir_fd)  # a link or a stray file where our directory belongs
            elif e.errno != errno.ENOENT:
                raise
        if not create:
            return None
        with contextlib.suppress(FileExistsError):
            os.mkdir(sub, 0o700, dir_fd=self._dir_fd)
        return os.open(sub, DIR, dir_fd=self._dir_fd)

    # -- header -----------------------------------------------------------------------------------------

    def _pack_header(self, buf: memoryview, key: bytes, parent: bytes | None, payload: memoryview) -> None:
        mac = blockformat.mac_of(self._auth, self._ns, key, parent, payload) if self._auth else blockformat.NO_MAC
        blockformat.pack_header(buf, self._ns, key, parent, self.payload_nbytes, xxhash.xxh3_64_intdigest(payload), mac)
        buf[blockformat.HEADER_NBYTES :] = bytes(HEADER_NBYTES - blockformat.HEADER_NBYTES)

    _parse_header = staticmethod(parse_header)

    def _classify(self, header: Header | None, name: str, size: int) -> ReadStatus:
        """OK when the header is ours, names this file and matches the file's size; headers only."""
        return blockformat.classify(
            header, self._ns, lambda key: file_name(key) == name, self.payload_nbytes, size == self.footprint
        )

    # -- I/O ----------------------------------------------------------------------------------------------

    def _open_file(self, name: str, flags: int, dir_fd: int) -> tuple[int, bool]:
        """(fd, opened with O_DIRECT); on EINVAL for O_DIRECT drop to buffered I/O for the store's life."""
        if self.direct:
            try:
                return os.open(name, flags | DIRECT, 0o600, dir_fd=dir_fd), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        return os.open(name, flags, 0o600, dir_fd=dir_fd), False

    def write(self, key: bytes, parent: bytes | None, src: Buffer) -> None:
        """Store `src` (payload_nbytes: a slot's memoryview, or a CPU uint8 tensor) as block `key`; atomic: a
        temp file (or a spare, inside `reusing()`), then a rename."""
        check_key(key)
        if parent is not None:
            check_key(parent, "parent")
        payload = byte_view(src, self.payload_nbytes, "src")
        name = file_name(key)
        sub = self._opensubdir(name, create=True)
        assert sub is not None
        try:
            spares = getattr(self._local, "spares", None)
            if spares and self._write_spare(spares.pop(), name, sub, key, parent, payload):
                return
            tmp = f"{name[:-3]}.{secrets.token_hex(8)}.tmp"
            self._write_as(tmp, WR, sub, name, sub, key, parent, payload)
        finally:
            os.close(sub)

    def _write_spare(self, spare: tuple[str, str], name: str, sub: int, key: bytes, parent: bytes | None,
                     payload: memoryview) -> bool:
        """Write the block over a spare (a deleted block's whole file) and rename it into place; False if the
        spare is gone (then a new file is written). A failure removes the spare."""
        spare_dir, spare_name = spare
        try:
            dir_fd = os.open(spare_dir, DIR, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return False
        try:
            self._write_as(spare_name, REUSE, dir_fd, name, sub, key, parent, payload)
        except FileNotFoundError:
            return False
        finally:
            os.close(dir_fd)
        with self._reused:
            self.files_reused += 1
        return True

    def _write_as(self, file: str, flags: int, file_dir: int, name: str, sub: int, key: bytes, parent: bytes | None,
                  payload: memoryview) -> None:
        """The block written into `file` (opened with `flags` in `file_dir`), then renamed to `name` in `sub`: whole
        or not at all. A failure removes `file`."""
        try:
            fd, direct = self._open_file(file, flags, file_dir)
            try:
                self._fill(fd, direct, file, key, parent, payload)
            finally:
                os.close(fd)
            os.replace(file, name, src_dir_fd=file_dir, dst_dir_fd=sub)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(file, dir_fd=file_dir)
            raise

    def _fill(self, fd: int, direct: bool, file: str, key: bytes, parent: bytes | None, payload: memoryview) -> None:
        """Header, payload and padding from offset 0: the whole footprint, so nothing of a spare's old block is left."""
        header = self._header_buf()
        self._pack_header(header, key, parent, payload)
        pad = memoryview(bytes(self.padded_nbytes - self.payload_nbytes))
        if not direct or aligned(payload):
            bufs = [header, payload, pad]  # O_DIRECT straight from the caller's (slot) buffer
        else:
            bounce = self._bounce()
            bounce[:HEADER_NBYTES] = header
            bounce[HEADER_NBYTES : HEADER_NBYTES + self.payload_nbytes] = payload
            bounce[HEADER_NBYTES + self.payload_nbytes :] = pad
            bufs = [bounce]
        written = transfer(os.pwritev, fd, bufs)
        if written != self.footprint:
            raise OSError(errno.EIO, f"short write of {file}: {written} of {self.footprint} bytes")

    def read(self, key: bytes, into: Buffer) -> ReadStatus:
        """Read block `key` into `into` (writable, payload_nbytes). Anything but OK leaves `into` undefined.

        A CORRUPT or FOREIGN file is removed: it can never be served.
        """
        check_key(key)
        out = byte_view(into, self.payload_nbytes, "into", writable=True)
        name = file_name(key)
        sub = self._opensubdir(name, create=False)
        if sub is None:
            return ReadStatus.MISSING
        try:
            try:
                fd, direct = self._open_file(name, RD, sub)
            except FileNotFoundError:
                return ReadStatus.MISSING
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                self._remove(name, sub, None)  # a symlink where our block belongs: drop the link only
                return ReadStatus.FOREIGN
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    status = ReadStatus.FOREIGN
                elif st.st_size != self.footprint:  # header only, to tell foreign from torn
                    status = self._classify(self._parse_header(self._read_header(fd, direct)), name, st.st_size)
                else:
                    status = self._read_verified(fd, direct, name, out)
            finally:
                os.close(fd)
            if status.is_integrity_failure:
                self._remove(name, sub, st)
            return status
        finally:
            os.close(sub)

    def _read_header(self, fd: int, direct: bool) -> memoryview:
        """The first 4096 bytes (fewer if the file is shorter); one call, as O_DIRECT cannot resume past EOF."""
        header = self._header_buf()
        return header[: os.preadv(fd, [header], 0)] if direct else memoryview(os.pread(fd, HEADER_NBYTES, 0))

    def _read_verified(self, fd: int, direct: bool, name: str, out: memoryview) -> ReadStatus:
        """Read a file of the right size: header, then payload checksum; straight into `out` when we can."""
        if direct and not aligned(out):
            bounce = self._bounce()
            got, want = transfer(os.preadv, fd, [bounce]), self.footprint
            header, payload = bounce[:HEADER_NBYTES], bounce[HEADER_NBYTES : HEADER_NBYTES + self.payload_nbytes]
        else:  # O_DIRECT into an aligned slot, or buffered (the padding is not read)
            header, payload = self._header_buf(), out
            got, want = transfer(os.preadv, fd, [header, out]), HEADER_NBYTES + self.payload_nbytes
        parsed = self._parse_header(header[: min(got, HEADER_NBYTES)])
        status = self._classify(parsed, name, self.footprint)
        if status is not ReadStatus.OK or parsed is None:
            return status if status is not ReadStatus.OK else ReadStatus.CORRUPT
        if got != want or xxhash.xxh3_64_intdigest(payload) != parsed.payload_xxh3:
            return ReadStatus.CORRUPT
        if not blockformat.authentic(parsed, payload, self._auth):
            return ReadStatus.UNAUTHENTICATED
        if payload is not out:
            out[:] = payload
        return ReadStatus.OK

    def _remove(self, name: str, dir_fd: int, expect: os.stat_result | None) -> bool:
        """Unlink `name` itself (never a link's target); with `expect`, only if it is still that file."""
        try:
            if expect is not None:
                now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if (now.st_dev, now.st_ino) != (expect.st_dev, expect.st_ino):
                    return False  # replaced by a fresh write meanwhile: not ours to drop
            os.unlink(name, dir_fd=dir_fd)
            return True
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            return False

    def holds(self, key: bytes) -> bool:
        """Whether a file of block `key` is there (not whether it is whole: `read` checks that)."""

        def regular(name: str, sub: int) -> bool:
            return stat.S_ISREG(os.stat(name, dir_fd=sub, follow_symlinks=False).st_mode)

        return self._in_subdir(key, regular)

    def delete(self, key: bytes) -> bool:
        """Remove block `key`; True if a file was removed, False if there was none. Inside `reusing()`, a whole
        block file is kept as a spare for this thread's next write instead."""
        spares = getattr(self._local, "spares", None)
        if spares is None:
            return self._in_subdir(key, lambda name, sub: self._remove(name, sub, None))
        return self._in_subdir(key, lambda name, sub: self._retire(name, sub, spares))

    def _retire(self, name: str, sub: int, spares: list[tuple[str, str]]) -> bool:
        st = os.stat(name, dir_fd=sub, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_size == self.footprint:
            spare = f"{secrets.token_hex(8)}{SPARE}"
            with contextlib.suppress(OSError):
                os.rename(name, spare, src_dir_fd=sub, dst_dir_fd=sub)
                spares.append((subdir(name), spare))
                return True
        return self._remove(name, sub, None)

    @contextmanager
    def reusing(self) -> Iterator[None]:
        """Within it, a file this thread deletes goes to the next block this thread writes: the directory gave
        the deleted block's bytes to that block (a full tier evicts to make room for a store). One left over at
        the end is removed, so files never outnumber the blocks the directory counts."""
        outer = getattr(self._local, "spares", None)
        spares: list[tuple[str, str]] = []
        self._local.spares = spares
        try:
            yield
        finally:
            self._local.spares = outer
            self._drop_spares(spares)

    def _drop_spares(self, spares: list[tuple[str, str]]) -> None:
        """Unlink spares no write took; a closed store leaves them to the restart scan."""
        if self._dir_fd is None:
            return
        for spare_dir, spare in spares:
            with contextlib.suppress(OSError):
                dir_fd = os.open(spare_dir, DIR, dir_fd=self._dir_fd)
                try:
                    os.unlink(spare, dir_fd=dir_fd)
                finally:
                    os.close(dir_fd)

    def _in_subdir(self, key: bytes, do: Callable[[str, int], bool]) -> bool:
        """`do(file name, its subdirectory's fd)` for block `key`; False when there is no such file."""
        check_key(key)
        name = file_name(key)
        sub = self._opensubdir(name, create=False)
        if sub is None:
            return False
        try:
            return do(name, sub)
        except FileNotFoundError:
            return False
        finally:
            os.close(sub)

    # -- restart ------------------------------------------------------------------------------------------

    def _entries(self) -> Iterator[tuple[str | None, int, str, os.stat_result]]:
        """(subdir, its fd, name, lstat) of every entry below our dir; top-level non-directories get subdir None."""
        if self._dir_fd is None:
            raise ValueError("DiskStore is closed")
        with os.scandir(self._dir_fd) as it:
            top = [(e.name, e.stat(follow_symlinks=False)) for e in it]
        for sub_name, st in top:
            if not stat.S_ISDIR(st.st_mode):
                yield None, self._dir_fd, sub_name, st
            elif re.fullmatch(r"[0-9a-f]{2}", sub_name):  # other directories are not ours to judge: left alone
                sub = os.open(sub_name, DIR, dir_fd=self._dir_fd)
                try:
                    with os.scandir(sub) as it:
                        entries = [(e.name, e.stat(follow_symlinks=False)) for e in it]
                    for name, est in entries:
                        yield sub_name, sub, name, est
                finally:
                    os.close(sub)

    def scan(self) -> tuple[list[RecoveredBlock], dict[str, int]]:
        """Restart recovery: the valid blocks oldest first, and how many files were removed, by reason.

        Removes temp files, symlinks (never their targets), and files whose header is torn or foreign or
        disagrees with the file's size or name. Headers only: payloads are checked at read time, so a restart
        over hundreds of GB stays fast. Run it before the first write: an in-flight temp file looks stray.
        """
        removed = {"temp": 0, "symlink": 0, "corrupt": 0, "foreign": 0}
        blocks: list[RecoveredBlock] = []
        for sub_name, sub, name, st in self._entries():
            if stat.S_ISDIR(st.st_mode) or (sub_name is None and name == RANK_LOCK and stat.S_ISREG(st.st_mode)):
                continue
            if stat.S_ISLNK(st.st_mode):
                reason: str | None = "symlink"
            elif sub_name is not None and stat.S_ISREG(st.st_mode) and name.endswith((".tmp", SPARE)):
                reason = "temp"
            elif sub_name is None or not stat.S_ISREG(st.st_mode) or subdir(name) != sub_name:
                reason = "foreign"  # not a file, or not where its name would put it
            else:
                reason = self._scan_file(sub, name, st, blocks)
            if reason and self._remove(name, sub, None):
                removed[reason] += 1
        blocks.sort(key=lambda b: (b.mtime_ns, b.key))
        return blocks, removed

    def _scan_file(self, sub: int, name: str, st: os.stat_result, out: list[RecoveredBlock]) -> str | None:
        """Check one file's header and size: append it to `out` if valid, else return why it goes."""
        try:
            fd = os.open(name, RD, dir_fd=sub)
        except OSError as e:
            return "symlink" if e.errno == errno.ELOOP else None
        try:
            header = self._parse_header(os.pread(fd, HEADER_NBYTES, 0))
        finally:
            os.close(fd)
        status = self._classify(header, name, st.st_size)
        if status is ReadStatus.OK and header is not None:
            out.append(RecoveredBlock(key=header.key, parent=header.parent, mtime_ns=st.st_mtime_ns))
            return None
        return "foreign" if status is ReadStatus.FOREIGN else "corrupt"

    def remove_other_namespaces(self, keep: Collection[str]) -> list[str]:
        """Remove the folders of namespaces other than `keep` under the root; the names of those removed.

        The root is one engine's (`kvtier.stores.claim`), so no one else reads them, and this engine never will:
        a namespace changes with the weights, dtype, layout, world size, salt or signing key. Left there, they
        would lie outside any bound, one tier's worth per change. Only folders named like a namespace go; links
        are removed, never followed. Run it at startup, while this store holds the root's claim."""
        if self._dir_fd is None:
            raise ValueError("DiskStore is closed")
        removed: list[str] = []
        root_fd = os.open(self.root, DIR)
        try:
            with os.scandir(root_fd) as it:
                found = [e.name for e in it if re.fullmatch(r"[0-9a-f]{32}", e.name) and e.name not in keep
                         and e.is_dir(follow_symlinks=False)]
            for name in found:
                try:
                    shutil.rmtree(name, dir_fd=root_fd)  # fd-based: a link inside is unlinked, never followed
                    removed.append(name)
                except OSError as exc:
                    log.warning("kvtier: could not remove the old namespace folder %s: %s", self.root / name, exc)
        finally:
            os.close(root_fd)
        return removed

    def used_bytes(self) -> int:
        """Our block, temp and spare files x footprint: what the directory's capacity accounting should see."""
        files = sum(
            1 for sub_name, _, name, st in self._entries()
            if sub_name is not None and stat.S_ISREG(st.st_mode) and name.endswith((".kv", ".tmp", SPARE))
        )
        return files * self.footprint
