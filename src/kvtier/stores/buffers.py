"""The bytes a store reads and writes: a CPU uint8 tensor or any buffer, always as a zero-copy memoryview.

The mover hands stores memoryviews of host slots, so that host<->disk and host<->shared moves never call
into torch: a torch op in a mover thread starts an OpenMP team of its own, and more OpenMP threads than
cores stalls the engine's team too (benchmarks/README.md). Tensors are still taken, for callers that have
one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union, cast

import numpy as np

from kvtier.layout import ALIGN

if TYPE_CHECKING:
    import torch

Buffer = Union["torch.Tensor", memoryview, bytes, bytearray]


def byte_view(buf: Buffer, nbytes: int, what: str, writable: bool = False) -> memoryview:
    """Exactly `nbytes` of `buf` as a flat byte view (no copy)."""
    if hasattr(buf, "data_ptr"):  # a tensor: checked without importing torch here
        t = cast("torch.Tensor", buf)
        if t.device.type != "cpu" or str(t.dtype) != "torch.uint8" or not t.is_contiguous() or t.numel() != nbytes:
            raise ValueError(f"{what} must be a contiguous CPU uint8 tensor of {nbytes} bytes, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        return t.numpy().data.cast("B")
    view = memoryview(buf).cast("B")
    if view.nbytes != nbytes or (writable and view.readonly):
        raise ValueError(f"{what} must be a {'writable ' if writable else ''}buffer of {nbytes} bytes, "
                         f"got {'a read-only ' if view.readonly else ''}{view.nbytes} bytes")
    return view


def aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can move `view` as it is: its address and length on the I/O alignment."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN == 0 and view.nbytes % ALIGN == 0
