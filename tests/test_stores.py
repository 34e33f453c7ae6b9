"""HostSlab and DiskStore on real memory and real files: bit-exact round trips, and every fault detected.

A fault must be caught (never served), must remove only the bad file, and must leave the rest readable.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvtier.keys import Namespace, chain_keys
from kvtier.layout import ALIGN
from kvtier.stores.base import ReadStatus
from kvtier.stores.disk import DiskStore, file_name
from kvtier.stores.host import HostSlab

SHAPE = (2, 4, 16, 64)  # (k/v, heads, tokens, head dim): one block of one layer
NS = Namespace(model="tiny", dtype="bfloat16", block_size=16).digest()
OTHER_NS = Namespace(model="other", dtype="bfloat16", block_size=16).digest()


def kv_blocks(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SHAPE), generator=g, dtype=torch.float32).to(dtype)


def nbytes_of(dtype: torch.dtype) -> int:
    return torch.empty(SHAPE, dtype=dtype).nbytes


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def keys(n: int) -> list[bytes]:
    return chain_keys(list(range(n * 16)), 16)


def parents(ks: list[bytes]) -> list[bytes | None]:
    return [None, *ks[:-1]]


def block_path(store: DiskStore, key: bytes) -> Path:
    name = file_name(key)
    return store.dir / name[:2] / name


@pytest.fixture(params=[True, False], ids=["o_direct", "buffered"])
def o_direct(request: pytest.FixtureRequest) -> bool:
    return request.param


def filled(tmp_path: Path, o_direct: bool, n: int = 5, ns: str = NS, root: str = "root"):
    """A DiskStore holding n chained fp32 blocks, written from HostSlab slots; returns (store, keys, data)."""
    data = kv_blocks(n, torch.float32, seed=1)
    slab = HostSlab(n, nbytes_of(torch.float32), pin=False)
    slab.write(range(n), data)
    store = DiskStore(tmp_path / root, ns, 0, slab.payload_nbytes, o_direct=o_direct)
    ks = keys(n)
    for i, (k, p) in enumerate(zip(ks, parents(ks))):
        store.write(k, p, slab.slot(i))
    slab.close()
    return store, ks, data


def read_all(store: DiskStore, ks: list[bytes]) -> tuple[list[ReadStatus], list[torch.Tensor]]:
    outs = [torch.empty(store.payload_nbytes, dtype=torch.uint8) for _ in ks]
    return [store.read(k, o) for k, o in zip(ks, outs)], outs


# -- HostSlab -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slab_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    data = kv_blocks(6, dtype)
    with HostSlab(10, nbytes_of(dtype), pin=False) as slab:
        slots = [7, 2, 3, 9, 0, 4]  # scattered and consecutive
        slab.write(slots, data)
        out = torch.empty_like(data)
        slab.read(slots, out)
        assert same_bits(out, data)
        one = torch.empty((1, *SHAPE), dtype=dtype)
        slab.read([9], one)
        assert same_bits(one[0], data[3])
        assert same_bits(slab.slot(2).view(dtype).view(SHAPE), data[1])


def test_slab_slots_are_aligned_and_views() -> None:
    with HostSlab(4, 5000, pin=False) as slab:  # payload not a multiple of 4096: slots are padded
        assert slab.slot_nbytes == 8192 and slab.nbytes == 4 * 8192 and not slab.pinned
        for i in range(4):
            assert slab.slot(i).data_ptr() % ALIGN == 0 and slab.slot(i).numel() == 5000
        slab.slot(1)[:] = 7
        out = torch.empty(5000, dtype=torch.uint8)
        slab.read([1], out)
        assert bool((out == 7).all())


def resident_pages(address: int, nbytes: int) -> int:
    """How many pages of [address, address + nbytes) are in memory now (mincore(2))."""
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


def test_slab_memory_is_committed_at_startup() -> None:
    """A store must not pay the kernel's first-touch faults mid-traffic: every page is in before the first."""
    with HostSlab(64, 65536, pin=False) as slab:
        assert resident_pages(slab.slot(0).data_ptr(), slab.nbytes) == slab.nbytes // mmap.PAGESIZE
        assert int(slab.slot(63).sum()) == 0  # committing wrote nothing a caller could see


def huge_page_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_slab_is_on_huge_pages_where_the_kernel_gives_them() -> None:
    """The slab asks for 2 MiB pages (fewer TLB misses per copy). A shared mapping got none on kernels whose
    shared memory has no huge pages (the usual default) however it was advised: it must be private."""
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp = setting.read_text() if setting.exists() else "[never] (no THP in this kernel)"
    with HostSlab(32, 1 << 20, pin=False) as slab:
        huge = huge_page_kib(slab.slot(0).data_ptr())
        if "[never]" in thp:
            assert huge == 0
        else:
            assert huge >= 2048, f"THP {thp.strip()!r}, but the slab has {huge} KiB on huge pages"


def test_slab_larger_than_the_memory_it_may_have_fails_at_once_naming_the_key() -> None:
    """A host tier the machine cannot hold is refused when the slab is made, with the key to lower, not by the
    kernel's OOM killer mid-traffic. The process gets 1 GiB of address space beyond what it has and asks for 4."""
    code = """
import resource
import torch
from kvtier.stores.host import HostSlab
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
try:
    HostSlab(4 * 4096, 1 << 18, pin=False)
except MemoryError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "4.00 GiB" in out.stdout and "cpu_bytes_to_use" in out.stdout, out.stdout


def test_slot_view_outlives_close() -> None:
    slab = HostSlab(2, 4096, pin=False)
    view = slab.slot(1)
    view[:] = 3
    slab.close()  # must not unmap memory a caller still sees
    assert int(view.sum()) == 3 * 4096
    with pytest.raises(ValueError, match="closed"):
        slab.slot(0)


def test_slab_rejects_bad_sizes_and_slots() -> None:
    with HostSlab(3, 1024, pin=False) as slab:
        with pytest.raises(ValueError, match="out of range"):
            slab.write([3], torch.zeros(1024, dtype=torch.uint8))
        with pytest.raises(ValueError, match="bytes"):
            slab.write([0, 1], torch.zeros(1024, dtype=torch.uint8))
        with pytest.raises(ValueError, match="duplicate"):
            slab.write([1, 1], torch.zeros(2048, dtype=torch.uint8))
        with pytest.raises(ValueError, match="out of range"):
            slab.read([-1], torch.zeros(1024, dtype=torch.uint8))
        with pytest.raises(ValueError, match="contiguous"):
            slab.read([0], torch.zeros(2048, dtype=torch.uint8)[::2])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            HostSlab(1, 1024, pin=True)


# -- DiskStore round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slab_disk_slab_is_bit_exact(tmp_path: Path, dtype: torch.dtype, o_direct: bool) -> None:
    data = kv_blocks(4, dtype, seed=3)
    ks = keys(4)
    with HostSlab(4, nbytes_of(dtype), pin=False) as a, HostSlab(4, nbytes_of(dtype), pin=False) as b:
        store = DiskStore(tmp_path, NS, 0, a.payload_nbytes, o_direct=o_direct)
        a.write(range(4), data)
        for i, k in enumerate(ks):
            store.write(k, None if i == 0 else ks[i - 1], a.slot(i))
        for i, k in enumerate(reversed(ks)):
            assert store.read(k, b.slot(i)) is ReadStatus.OK
        out = torch.empty_like(data)
        b.read([3, 2, 1, 0], out)
        assert same_bits(out, data)
        assert store.used_bytes() == 4 * store.footprint
        assert all(block_path(store, k).stat().st_size == store.footprint for k in ks)


def test_unaligned_buffers_use_the_bounce_path(tmp_path: Path, o_direct: bool) -> None:
    payload = 5000  # neither the size nor (below) the address is 4096-aligned
    store = DiskStore(tmp_path, NS, 1, payload, o_direct=o_direct)
    assert store.footprint == 4096 + 8192
    src = torch.randint(0, 256, (payload + 1,), dtype=torch.uint8)[1:]
    store.write(b"k" * 32, None, src)
    into = torch.empty(payload + 3, dtype=torch.uint8)[3:]
    assert store.read(b"k" * 32, into) is ReadStatus.OK
    assert torch.equal(into, src)


def test_missing_delete_and_long_keys(tmp_path: Path, o_direct: bool) -> None:
    store, ks, _ = filled(tmp_path, o_direct, n=2)
    buf = torch.empty(store.payload_nbytes, dtype=torch.uint8)
    assert store.read(b"\x01" * 32, buf) is ReadStatus.MISSING
    assert store.delete(ks[0]) and not store.delete(ks[0])
    assert store.read(ks[0], buf) is ReadStatus.MISSING
    long_key = bytes(range(128))  # too long for a hex file name: hashed name, full key in the header
    store.write(long_key, ks[1], buf)
    assert store.read(long_key, torch.empty_like(buf)) is ReadStatus.OK
    with pytest.raises(ValueError):
        store.write(b"x" * 129, None, buf)
    with pytest.raises(ValueError):
        store.write(b"x", None, buf[1:])


def o_direct_works(where: Path) -> bool:
    try:
        os.close(os.open(where / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        (where / "probe").unlink(missing_ok=True)


def test_direct_flag_tells_the_mode(tmp_path: Path, o_direct: bool) -> None:
    store, ks, _ = filled(tmp_path, o_direct, n=2)
    assert store.direct is (o_direct and o_direct_works(tmp_path))  # falls back on EINVAL (old tmpfs...)
    assert read_all(store, ks)[0] == [ReadStatus.OK] * 2


def test_failed_write_leaves_no_temp_file(tmp_path: Path, o_direct: bool) -> None:
    store, ks, _ = filled(tmp_path, o_direct, n=1)
    key = b"\x07" * 32
    block_path(store, key).mkdir(parents=True)  # the final rename cannot replace a directory
    with pytest.raises(OSError):
        store.write(key, None, torch.zeros(store.payload_nbytes, dtype=torch.uint8))
    assert not list(store.dir.rglob("*.tmp"))
    assert read_all(store, ks)[0] == [ReadStatus.OK]


def files_of(store: DiskStore) -> list[Path]:
    return sorted(p for p in store.dir.rglob("*") if p.is_file() and p.name != ".lock")


def test_a_full_tiers_write_takes_the_file_of_the_block_it_deleted(tmp_path: Path, o_direct: bool) -> None:
    store, ks, data = filled(tmp_path, o_direct, n=3)
    inode = block_path(store, ks[2]).stat().st_ino
    fresh = kv_blocks(2, torch.float32, seed=9).view(2, -1).view(torch.uint8)
    new = [b"\x31" * 32, b"\x32" * 32]
    with store.reusing():
        assert store.delete(ks[2])
        assert [p.suffix for p in files_of(store)].count(".spare") == 1  # set aside, not removed
        store.write(new[0], ks[1], fresh[0])  # takes the spare: renamed into place, overwritten whole
        assert store.delete(ks[1]) and not store.delete(ks[1])
    assert store.files_reused == 1
    assert block_path(store, new[0]).stat().st_ino == inode
    assert len(files_of(store)) == 2 and store.used_bytes() == 2 * store.footprint, "the unused spare is removed"
    statuses, outs = read_all(store, [ks[0], ks[1], ks[2], new[0]])
    assert statuses == [ReadStatus.OK, ReadStatus.MISSING, ReadStatus.MISSING, ReadStatus.OK]
    assert torch.equal(outs[3], fresh[0]) and same_bits(outs[0].view(torch.float32).view(SHAPE), data[0])
    store.delete(new[0])  # outside `reusing`: removed at once, and a write makes a new file
    store.write(new[1], ks[0], fresh[1])
    assert store.files_reused == 1 and not [p for p in files_of(store) if p.suffix == ".spare"]
    assert store.scan()[0] and len(files_of(store)) == 2


def test_a_failed_write_over_a_spare_leaves_neither(tmp_path: Path, o_direct: bool) -> None:
    store, ks, _ = filled(tmp_path, o_direct, n=2)
    key = b"\x07" * 32
    block_path(store, key).mkdir(parents=True)  # the final rename cannot replace a directory
    with store.reusing():
        assert store.delete(ks[1])
        with pytest.raises(OSError):
            store.write(key, ks[0], torch.zeros(store.payload_nbytes, dtype=torch.uint8))
        assert not [p for p in files_of(store) if p.suffix in (".spare", ".tmp")]
    assert store.files_reused == 0 and [p.name for p in files_of(store)] == [file_name(ks[0])]
    assert read_all(store, ks[:1])[0] == [ReadStatus.OK]


def test_a_spare_left_by_a_crash_is_removed_at_restart(tmp_path: Path, o_direct: bool) -> None:
    store, ks, _ = filled(tmp_path, o_direct, n=2)
    spares = store.reusing()
    spares.__enter__()
    assert store.delete(ks[1])  # the process dies here, its spare on disk
    store.close()
    restarted = DiskStore(tmp_path / "root", NS, 0, store.payload_nbytes, o_direct=o_direct)
    assert restarted.used_bytes() == 2 * store.footprint, "a spare counts against the tier"
    blocks, removed = restarted.scan()
    assert [b.key for b in blocks] == ks[:1] and removed["temp"] == 1
    assert restarted.used_bytes() == restarted.footprint


@pytest.mark.parametrize("payload", [4 * 4096, 5000])  # straight from slots, and through bounce buffers
def test_many_threads_share_one_store(tmp_path: Path, o_direct: bool, payload: int) -> None:
    n = 64
    data = torch.randint(0, 256, (n, payload), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    ks = [i.to_bytes(4, "big") * 8 for i in range(n)]
    with HostSlab(n, payload, pin=False) as src, HostSlab(n, payload, pin=False) as dst:
        src.write(range(n), data)
        store = DiskStore(tmp_path, NS, 0, payload, o_direct=o_direct)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: store.write(ks[i], None, src.slot(i)), range(n)))
            statuses = list(pool.map(lambda i: store.read(ks[i], dst.slot(i)), range(n)))
        assert statuses == [ReadStatus.OK] * n
        out = torch.empty_like(data)
        dst.read(range(n), out)
        assert torch.equal(out, data)


# -- faults ---------------------------------------------------------------------------------------------


def assert_others_ok(store: DiskStore, ks: list[bytes], data: torch.Tensor, bad: set[int]) -> None:
    statuses, outs = read_all(store, [k for i, k in enumerate(ks) if i not in bad])
    assert statuses == [ReadStatus.OK] * len(statuses)
    expected = [data[i] for i in range(len(ks)) if i not in bad]
    assert all(same_bits(o.view(torch.float32).view(SHAPE), e) for o, e in zip(outs, expected))


def test_flipped_payload_byte_is_corrupt(tmp_path: Path, o_direct: bool) -> None:
    store, ks, data = filled(tmp_path, o_direct)
    path = block_path(store, ks[2])
    raw = bytearray(path.read_bytes())
    raw[4096 + 1234] ^= 0x01
    path.write_bytes(raw)
    assert store.read(ks[2], torch.empty(store.payload_nbytes, dtype=torch.uint8)) is ReadStatus.CORRUPT
    assert not path.exists()
    assert_others_ok(store, ks, data, {2})


def test_flipped_header_byte_is_corrupt(tmp_path: Path, o_direct: bool) -> None:
    store, ks, data = filled(tmp_path, o_direct)
    path = block_path(store, ks[1])
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0x80  # inside the key
    path.write_bytes(raw)
    assert store.read(ks[1], torch.empty(store.payload_nbytes, dtype=torch.uint8)) is ReadStatus.CORRUPT
    assert not path.exists()
    assert_others_ok(store, ks, data, {1})


@pytest.mark.parametrize("size", [0, 100, 4096, 4096 + 1000, -1])
def test_truncated_file_is_corrupt(tmp_path: Path, o_direct: bool, size: int) -> None:
    store, ks, data = filled(tmp_path, o_direct)
    path = block_path(store, ks[3])
    os.truncate(path, store.footprint + size if size < 0 else size)
    assert store.read(ks[3], torch.empty(store.payload_nbytes, dtype=torch.uint8)) is ReadStatus.CORRUPT
    assert not path.exists()
    assert_others_ok(store, ks, data, {3})


def test_file_of_another_namespace_is_foreign(tmp_path: Path, o_direct: bool) -> None:
    store, ks, data = filled(tmp_path, o_direct)
    other, oks, _ = filled(tmp_path, o_direct, ns=OTHER_NS)  # same root, same keys, other model
    shutil.copyfile(block_path(other, oks[0]), block_path(store, ks[0]))
    assert store.read(ks[0], torch.empty(store.payload_nbytes, dtype=torch.uint8)) is ReadStatus.FOREIGN
    assert not block_path(store, ks[0]).exists()
    assert block_path(other, oks[0]).exists()  # the other namespace's own file is untouched
    assert_others_ok(store, ks, data, {0})


def test_block_renamed_to_another_key_is_foreign(tmp_path: Path, o_direct: bool) -> None:
    store, ks, data = filled(tmp_path, o_direct)
    os.replace(block_path(store, ks[4]), block_path(store, ks[1]))  # ks[4]'s bytes under ks[1]'s name
    assert store.read(ks[1], torch.empty(store.payload_nbytes, dtype=torch.uint8)) is ReadStatus.FOREIGN
    assert store.read(ks[4], torch.empty(store.payload_nbytes, dtype=torch.uint8)) is ReadStatus.MISSING
    assert_others_ok(store, ks, data, {1, 4})


def test_symlinked_block_is_foreign_and_target_untouched(tmp_path: Path, o_direct: bool) -> None:
    store, ks, data = filled(tmp_path, o_direct)
    outside = tmp_path / "outside.bin"
    shutil.copyfile(block_path(store, ks[0]), outside)  # a valid block of ours, but reached via a link
    before = outside.read_bytes()
    block_path(store, ks[0]).unlink()
    block_path(store, ks[0]).symlink_to(outside)
    assert store.read(ks[0], torch.empty(store.payload_nbytes, dtype=torch.uint8)) is ReadStatus.FOREIGN
    assert not block_path(store, ks[0]).is_symlink() and outside.read_bytes() == before
    assert_others_ok(store, ks, data, {0})


# -- restart --------------------------------------------------------------------------------------------


def test_scan_recovers_valid_blocks_and_removes_junk(tmp_path: Path, o_direct: bool) -> None:
    store, ks, data = filled(tmp_path, o_direct, n=6)
    other, oks, _ = filled(tmp_path, o_direct, n=2, ns=OTHER_NS)
    other_files = sorted(p for p in other.dir.rglob("*"))
    victim = tmp_path / "victim.txt"
    victim.write_text("not a block")
    # junk: a stray temp file, a corrupt block, a foreign file, two links (one at a block's name, one
    # dangling beside), a link where a subdirectory belongs, and a link to a valid block elsewhere
    (block_path(store, ks[0]).parent / "deadbeef.0123.tmp").write_bytes(b"half a block")
    os.truncate(block_path(store, ks[1]), 5000)
    shutil.copyfile(block_path(other, oks[0]), block_path(store, ks[2]))
    block_path(store, ks[3]).unlink()
    block_path(store, ks[3]).symlink_to(victim)
    (block_path(store, ks[4]).parent / ("ab" * 32 + ".kv")).symlink_to(block_path(other, oks[1]))
    (store.dir / "zz").symlink_to(tmp_path)
    store.close()

    restarted = DiskStore(tmp_path / "root", NS, 0, store.payload_nbytes, o_direct=o_direct)
    blocks, removed = restarted.scan()
    assert removed == {"temp": 1, "symlink": 3, "corrupt": 1, "foreign": 1}
    assert [(b.key, b.parent) for b in sorted(blocks, key=lambda b: ks.index(b.key))] == [
        (ks[0], None), (ks[4], ks[3]), (ks[5], ks[4])
    ]
    assert [b.mtime_ns for b in blocks] == sorted(b.mtime_ns for b in blocks)
    assert victim.read_text() == "not a block" and sorted(other.dir.rglob("*")) == other_files
    assert not (store.dir / "zz").exists() and tmp_path.exists()
    assert restarted.used_bytes() == 3 * restarted.footprint
    assert_others_ok(restarted, ks, data, {1, 2, 3})
    assert restarted.scan() == (blocks, dict.fromkeys(removed, 0))  # a second scan finds nothing to do


def test_restart_recovers_every_block_and_chain(tmp_path: Path, o_direct: bool) -> None:
    store, ks, data = filled(tmp_path, o_direct, n=8)
    filled(tmp_path, o_direct, n=3, ns=OTHER_NS)
    store.close()
    again = DiskStore(tmp_path / "root", NS, 0, store.payload_nbytes, o_direct=o_direct)
    blocks, removed = again.scan()
    assert sum(removed.values()) == 0
    assert {(b.key, b.parent) for b in blocks} == set(zip(ks, parents(ks)))
    assert len(list((tmp_path / "root" / OTHER_NS / "0").rglob("*.kv"))) == 3
    assert_others_ok(again, ks, data, set())


def test_holds_says_whether_a_block_file_is_there(tmp_path: Path, o_direct: bool) -> None:
    store, ks, _ = filled(tmp_path, o_direct, n=3)
    assert all(store.holds(k) for k in ks) and not store.holds(b"z" * 32)
    assert store.delete(ks[1]) and not store.holds(ks[1]) and store.holds(ks[2])
    block_path(store, ks[2]).unlink()  # removed behind its back
    assert not store.holds(ks[2])
    store.close()
