"""The host DRAM tier: one preallocated slab of fixed-size slots.

Why one slab: per-block allocation fragments memory and makes pinning expensive; a slab is allocated and
pinned once, and a block lives in a slot the directory chose. Every slot starts on a 4096-byte boundary so
the disk store can do O_DIRECT I/O straight from and into it, with no bounce copy.

The slab is dumb: it copies bytes in and out of slots it is told to use. Which slot is free, pinned or
evictable is the directory's business.
"""

from __future__ import annotations

import errno
import mmap
import warnings
from collections.abc import Sequence

import torch

from kvtier.layout import round_up  # every slot (and disk block) starts on layout.ALIGN

_HOST_REGISTER_PORTABLE = 1  # pinned for every device's context, as torch's own _pin_memory_utils does
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # the constant is in Python 3.13's mmap
PAGE = mmap.PAGESIZE


def _as_blocks(t: torch.Tensor, n: int, payload_nbytes: int, what: str) -> torch.Tensor:
    """Reinterpret `t` (any dtype, contiguous) as uint8 rows `(n, payload_nbytes)`; never converts dtype."""
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    nbytes = t.numel() * t.element_size()
    if nbytes != n * payload_nbytes:
        raise ValueError(
            f"{what} holds {nbytes} bytes, expected {n} blocks x {payload_nbytes} bytes = {n * payload_nbytes}"
        )
    return t.reshape(-1).view(torch.uint8).view(n, payload_nbytes)


def _no_memory(nbytes: int, error: OSError) -> MemoryError:
    return MemoryError(f"host tier: this machine cannot give {nbytes / 2**30:.2f} GiB of memory to the host slab"
                       f" ({error.strerror}); lower cpu_bytes_to_use")


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group slots into runs of consecutive ids: (index in `slots`, first slot, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((i, s, 1))
    return runs


class HostSlab:
    """`num_slots` slots of `payload_nbytes` each, in one page-aligned (optionally pinned) buffer.

    Thread-safe for concurrent calls on distinct slots: no per-call state is shared.
    """

    def __init__(self, num_slots: int, payload_nbytes: int, pin: bool | None = None) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        if payload_nbytes <= 0:
            raise ValueError(f"payload_nbytes must be > 0, got {payload_nbytes}")
        self.num_slots = num_slots
        self.payload_nbytes = payload_nbytes
        self.slot_nbytes = round_up(payload_nbytes)
        # An anonymous mmap is page-aligned, so slot i starts at i * slot_nbytes from an aligned base. Private, not
        # mmap's default shared mapping: most kernels give shared memory no huge pages (shmem_enabled "never")
        # however it is advised, and private anonymous memory gets them where THP is "madvise" or "always".
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as e:
            raise _no_memory(self.nbytes, e) from None
        if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MiB pages where the kernel allows: fewer TLB misses per copy
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self._buf = torch.frombuffer(self._mmap, dtype=torch.uint8).view(num_slots, self.slot_nbytes)
        self._rows = self._buf[:, :payload_nbytes]  # strided when slots carry padding
        self._typed: tuple[tuple[torch.dtype, torch.Size], SlotViews] | None = None  # see `slots_as`
        self._labels: list[tuple[bytes, bytes | None] | None] = [None] * num_slots  # see `label`
        self.pinned = False
        self._closed = False
        self._pin(torch.cuda.is_available() if pin is None else pin, explicit=pin is not None)
        if not self.pinned:  # pinning faults every page in itself
            self._commit()

    def _commit(self) -> None:
        """Fault every page in now, as pinning does and as vLLM's own KV cache is: memory the tier was given is
        taken at startup (a host too small shows then, not mid-traffic), and no store pays the kernel's
        first-touch faults. What this costs at startup and saves per store: benchmarks/README.md."""
        assert self._mmap is not None
        try:
            self._mmap.madvise(MADV_POPULATE_WRITE)  # Linux >= 5.14: faults the pages in, writes nothing
        except OSError as e:
            if e.errno == errno.ENOMEM:
                raise _no_memory(self.nbytes, e) from None
            self._buf.view(-1)[::PAGE].zero_()  # an older kernel: one byte per page (the slab is new, nothing to lose)

    # -- pinning ----------------------------------------------------------------------------------------

    def _pin(self, want: bool, explicit: bool) -> None:
        """Page-lock the existing buffer with cudaHostRegister.

        Not `torch.empty(pin_memory=True)`: torch's pinned caching allocator rounds each allocation up to a
        power of two, which can waste almost half of a large slab.
        """
        if not want:
            return
        if not torch.cuda.is_available():
            raise ValueError("pin=True needs CUDA, and torch.cuda.is_available() is False")
        try:
            cudart = torch.cuda.cudart()
            err = int(cudart.cudaHostRegister(self._buf.data_ptr(), self.nbytes, _HOST_REGISTER_PORTABLE))
            if err != 0:
                raise RuntimeError(f"cudaError {err}")
        except Exception as e:  # a driver refusing to lock this much memory, a CUDA-less build, ...
            if explicit:
                raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed: {e}") from e
            warnings.warn(f"HostSlab: pinning failed ({e}); host<->GPU copies will be synchronous", stacklevel=3)
            return
        self.pinned = True

    def close(self) -> None:
        """Unpin and release the slab. No copy into or out of it may still be in flight."""
        if self._closed:
            return
        self._closed = True
        if self.pinned:
            self.pinned = False
            try:
                err = int(torch.cuda.cudart().cudaHostUnregister(self._buf.data_ptr()))
                if err != 0:
                    raise RuntimeError(f"cudaError {err}")
            except Exception as e:
                warnings.warn(f"HostSlab: cudaHostUnregister failed: {e}", stacklevel=2)
        # Never mmap.close(): torch.frombuffer does not lock the export, so closing under a live slot view
        # would leave it dangling (a segfault). The tensors keep the mmap alive; it unmaps with the last one.
        self._mmap = None
        self._typed = None
        del self._buf, self._rows

    def __enter__(self) -> HostSlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- what the slots hold -----------------------------------------------------------------------------

    def label(self, i: int, block: tuple[bytes, bytes | None] | None) -> None:
        """Record the block (key, parent) slot i now holds, or None where its bytes are no block (a write that
        failed). As a disk file's header names its block, so that the slab can be written out without asking
        the directory, which may live in another process: a graceful stop's flush."""
        self._labels[i] = block

    def forget_labels(self) -> None:
        """No slot holds a block any more (the cache was reset: what they hold must never be written out)."""
        self._labels = [None] * self.num_slots

    def labelled(self) -> list[tuple[int, bytes, bytes | None]]:
        """(slot, key, parent) of every slot a block was last written to; the slot may have been freed since."""
        return [(i, *block) for i, block in enumerate(self._labels) if block is not None]

    # -- access -----------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Total bytes of the buffer (slots x padded slot size)."""
        return self.num_slots * self.slot_nbytes

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("HostSlab is closed")

    def _check_slots(self, slots: Sequence[int]) -> None:
        for s in slots:
            if not 0 <= s < self.num_slots:
                raise ValueError(f"slot {s} out of range [0, {self.num_slots})")

    def slot(self, i: int) -> torch.Tensor:
        """A uint8 view (no copy) of slot i's payload bytes; 4096-aligned, contiguous."""
        self._check_open()
        self._check_slots((i,))
        return self._rows[i]

    def slots_as(self, dtype: torch.dtype, shape: Sequence[int]) -> SlotViews:
        """Every slot's payload bytes shaped `shape` of `dtype` (no copy): `[i]` is slot i already shaped like a
        caller's block, made once and kept, so that a batch copy makes no view per block: a view costs more
        than copying a small block (benchmarks/README.md). The last kind asked for is kept."""
        self._check_open()
        kind = (dtype, torch.Size(shape))
        typed = self._typed
        if typed is None or typed[0] != kind:
            if kind[1].numel() * dtype.itemsize != self.payload_nbytes:
                raise ValueError(f"{tuple(shape)} {dtype} is not a slot's {self.payload_nbytes} bytes")
            tensor = self._buf.view(dtype)[:, : kind[1].numel()].view(self.num_slots, *kind[1])
            typed = self._typed = kind, SlotViews(tensor)
        return typed[1]

    def view(self, i: int) -> memoryview:
        """Slot i's payload bytes as a memoryview (no copy): what the disk and shared stores read and write, with
        no torch call in the mover's threads (`kvtier.stores.buffers`)."""
        self._check_open()
        self._check_slots((i,))
        assert self._mmap is not None
        start = i * self.slot_nbytes
        return memoryview(self._mmap)[start : start + self.payload_nbytes]

    def write(self, slots: Sequence[int], src: torch.Tensor, wait: bool = True) -> None:
        """Copy len(slots) blocks from `src` (any dtype/device, contiguous) into `slots`, bit for bit.

        From a CUDA tensor into a pinned slab the copies are asynchronous on the current stream; with
        `wait=False` the caller must synchronize that stream before the slots are read on the CPU.
        """
        self._check_open()
        slots = [int(s) for s in slots]
        self._check_slots(slots)
        if len(set(slots)) != len(slots):
            raise ValueError(f"duplicate slots in write: {slots}")
        rows = _as_blocks(src, len(slots), self.payload_nbytes, "src")
        if slots:  # per-run copy_ rather than index_copy_: faster at every block size (benchmarks/README.md)
            self._copy_runs(slots, rows, to_slab=True, device=src.device, wait=wait)

    def read(self, slots: Sequence[int], out: torch.Tensor, wait: bool = True) -> None:
        """Copy the blocks in `slots` into `out` (any dtype/device, contiguous, len(slots) blocks).

        Into a CUDA tensor from a pinned slab the copies are asynchronous; with `wait=False` the caller must
        keep the slots unchanged until the current stream has passed them.
        """
        self._check_open()
        slots = [int(s) for s in slots]
        self._check_slots(slots)
        rows = _as_blocks(out, len(slots), self.payload_nbytes, "out")
        if not slots:
            return
        if out.device.type == "cpu" and len(_runs(slots)) > 1:  # one gather beats many small copies
            torch.index_select(self._rows, 0, torch.tensor(slots, dtype=torch.long), out=rows)
            return
        self._copy_runs(slots, rows, to_slab=False, device=out.device, wait=wait)

    def _copy_runs(
        self, slots: list[int], rows: torch.Tensor, to_slab: bool, device: torch.device, wait: bool
    ) -> None:
        """One copy per run of consecutive slots (per slot when slots carry padding, to stay contiguous)."""
        non_blocking = device.type == "cuda" and self.pinned
        dense = self.slot_nbytes == self.payload_nbytes
        for start, first, length in _runs(slots):
            pieces = [(start, first, length)] if dense else [(start + k, first + k, 1) for k in range(length)]
            for i, s, n in pieces:
                slab_part = self._rows[s : s + n]
                if to_slab:
                    slab_part.copy_(rows[i : i + n], non_blocking=non_blocking)
                else:
                    rows[i : i + n].copy_(slab_part, non_blocking=non_blocking)
        if non_blocking and wait:
            torch.cuda.current_stream(device).synchronize()


class SlotViews(Sequence[torch.Tensor]):
    """A slab's slots as tensors of one shape, each view made on first use and kept: the views of the slots a
    cache uses, not one per slot of a large slab at startup."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # (num_slots, *shape)
        self._views: list[torch.Tensor | None] = [None] * tensor.shape[0]

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]  # no slices
        view = self._views[i]
        if view is None:
            view = self._views[i] = self.tensor[i]
        return view
