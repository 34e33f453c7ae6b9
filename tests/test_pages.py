"""An engine's KV pages <-> host slots: the compiled batch copy against the per-part copies it replaces."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvtier.directory import CALLER, Op, Step
from kvtier.mover.copy import copy_into_slot, on_cpu, ready_event
from kvtier.mover.handlers import CallerIO, CallerToSlot, SlotToCaller
from kvtier.mover.pages import Pages
from kvtier.stores.host import HostSlab
from tests.conftest import native_threads_beyond_python, torch_kernel_in_a_thread


def engine(page_sizes: list[int], num_blocks: int, seed: int = 0) -> Pages:
    gen = torch.Generator().manual_seed(seed)
    return Pages([torch.randint(0, 256, (num_blocks, n), dtype=torch.uint8, generator=gen) for n in page_sizes])


def batch(pages: Pages, per_block: int, n: int, seed: int = 0) -> tuple[list[list[int | None]], list[int], HostSlab]:
    """`n` blocks of `per_block` engine blocks each (one left out: bytes the caller has), in shuffled slots."""
    rng = random.Random(seed)
    ids = rng.sample(range(pages.num_blocks), n * per_block)
    runs: list[list[int | None]] = [list(ids[i * per_block : (i + 1) * per_block]) for i in range(n)]
    runs[0][0] = None  # and the ones after it keep their places in the slot
    slab = HostSlab(n + 3, per_block * pages.engine_block_nbytes)
    return runs, rng.sample(range(n + 3), n), slab


def steps(op: Op, slots: list[int]) -> list[Step]:
    src, dst = (CALLER, "host") if op is Op.PUT else ("host", CALLER)
    return [Step(op, b"k%d" % i, src, dst, None if op is Op.PUT else s, s if op is Op.PUT else None, i, None, False, i)
            for i, s in enumerate(slots)]


@pytest.mark.parametrize("page_sizes,per_block", [([32768] * 8, 2), ([4096, 12288, 8192], 3), ([4100, 7], 1)])
def test_a_batch_lands_where_the_parts_would_and_comes_back_bit_exact(page_sizes, per_block):
    pages = engine(page_sizes, 40)
    runs, slots, slab = batch(pages, per_block, 9)
    assert pages.move(slab, [], to_slab=True), "CPU pages are copied as memory, not as parts"
    CallerToSlot(slab).run_many(steps(Op.PUT, slots), CallerIO(blocks=pages.blocks(runs)))
    expected = HostSlab(slab.num_slots, slab.payload_nbytes)
    for run, slot in zip(runs, slots):
        copy_into_slot(expected.slot(slot), pages.parts(run))
    for slot in slots:
        assert torch.equal(slab.slot(slot), expected.slot(slot)), slot

    before = [p.clone() for p in pages.tensors]
    for p in pages.tensors:
        p.fill_(7)
    SlotToCaller(slab).run_many(steps(Op.GET, slots), CallerIO(out=pages.blocks(runs)))
    loaded = {b for run in runs for b in run if b is not None}
    for old, new in zip(before, pages.tensors):
        for row in range(pages.num_blocks):
            if row in loaded:
                assert torch.equal(new[row], old[row]), row
            else:  # the left-out engine block and every block not in the batch: untouched
                assert bool((new[row] == 7).all()), row


def test_paged_blocks_say_where_they_live_without_making_parts():
    pages = engine([4096] * 2, 8)
    assert on_cpu(pages.blocks([])) and on_cpu(pages.blocks([[None, 3]]))  # the mover's store takes its CPU path
    assert ready_event(pages.blocks([[1]])) is None


def test_pages_off_the_cpu_are_left_to_the_parts():
    pages = Pages([torch.empty(8, 4096, dtype=torch.uint8, device="meta")])
    assert not pages.move(HostSlab(2, 4096), [([1], 0)], to_slab=True)
    row, skipped = pages.parts([1, None])
    assert row.shape == (4096,) and skipped == 4096


@pytest.mark.parametrize("bad", ["engine block", "slot", "too many"])
def test_an_index_out_of_range_is_refused_before_anything_is_copied(bad):
    pages = engine([4096] * 2, 8)
    slab = HostSlab(4, 2 * pages.engine_block_nbytes)
    pairs = {"engine block": [([1, 2], 0), ([3, 8], 1)], "slot": [([1, 2], 0), ([3, 4], 4)],
             "too many": [([1, 2, 3], 0)]}[bad]
    with pytest.raises(ValueError, match="out of range|do not fit"):
        pages.move(slab, pairs, to_slab=True)
    assert not any(slab.slot(i).any() for i in range(slab.num_slots)), "nothing was written"


def test_a_batch_in_a_thread_starts_no_openmp_team():
    """The copies run in the calling thread (an asynchronous load's is one of ours). A torch kernel there would
    start an OpenMP team of its own, which stalls the engine's team on few cores."""
    pages = engine([32768] * 4, 64)
    runs, slots, slab = batch(pages, 2, 20)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 22).add_(1)  # this thread's own team, as the engine's thread has one
        before = native_threads_beyond_python()
        for to_slab in (True, False):
            mover = threading.Thread(target=pages.move, args=(slab, list(zip(runs, slots)), to_slab))
            mover.start()
            mover.join()
        after = native_threads_beyond_python()
        assert after <= before
        with torch_kernel_in_a_thread():
            assert native_threads_beyond_python() > after
    finally:
        torch.set_num_threads(threads)
