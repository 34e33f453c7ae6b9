"""An engine's KV pages <-> host slots: the compiled batch copy against the per-part copies it replaces; and a
caller's whole tensors <-> host slots, the batch copy TieredCache uses."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvtier.directory import CALLER, Op, Step
from kvtier.mover.copy import copy_blocks, copy_into_slot, on_cpu, ready_event
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


@pytest.mark.parametrize("page_sizes", [[4096, 12288, 8192], [4100, 7]])  # gathered as 8-byte words, as bytes
@pytest.mark.parametrize("chunk_blocks", [1, 4, 100])
def test_a_staged_batch_lands_where_memory_copies_put_it_and_comes_back_bit_exact(chunk_blocks, page_sizes):
    """The path for pages on a device, run on the CPU: gathered through a staging buffer a chunk at a time (a
    chunk smaller than a slot's engine blocks, one that ends mid-slot, one that holds the whole batch), the slots
    are byte for byte what `move`'s memory copies make, and the load scatters every block back, leaving the
    left-out engine block and the blocks outside the batch untouched."""
    pages = engine(page_sizes, 40)
    runs, slots, slab = batch(pages, 3, 9)
    pairs = list(zip(runs, slots))
    expected = HostSlab(slab.num_slots, slab.payload_nbytes)
    pages.move(expected, pairs, to_slab=True)
    pages.move_staged(slab, pairs, to_slab=True, chunk_bytes=chunk_blocks * pages.engine_block_nbytes)
    for slot in range(slab.num_slots):
        assert torch.equal(slab.slot(slot), expected.slot(slot)), slot

    before = [p.clone() for p in pages.tensors]
    for p in pages.tensors:
        p.fill_(7)
    pages.move_staged(slab, pairs, to_slab=False, chunk_bytes=chunk_blocks * pages.engine_block_nbytes)
    loaded = {b for run in runs for b in run if b is not None}
    for old, new in zip(before, pages.tensors):
        for row in range(pages.num_blocks):
            assert torch.equal(new[row], old[row]) if row in loaded else bool((new[row] == 7).all()), row


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


# -- whole tensors <-> slots (TieredCache's blocks) -------------------------------------------------------


def test_whole_tensors_and_parts_in_one_batch_land_where_single_copies_put_them_and_come_back_bit_exact():
    """Whole contiguous tensors are paired with their slots shaped like them (`slots_as`, no view per block), of
    two kinds in one batch; a block of parts (bytes the caller keeps included) goes part by part. Every slot
    matches the per-block copies, and every block comes back bit for bit."""
    gen = torch.Generator().manual_seed(3)
    payload = 2 * 4 * 64 * 2  # a (2, 4, 64) bf16 block; slots padded to 4096 bytes
    bf16 = [torch.randint(-999, 999, (2, 4, 64), generator=gen).to(torch.bfloat16) for _ in range(3)]
    f32 = [torch.randn(4, 64, generator=gen) for _ in range(2)]  # another kind: the shaped slots are remade
    parts = [torch.randint(0, 256, (512,), dtype=torch.uint8, generator=gen), 256, f32[0][0].clone()]
    blocks = [bf16[0], f32[0], bf16[1], parts, f32[1], bf16[2]]
    slots = [5, 0, 7, 2, 3, 1]
    slab, expected = HostSlab(8, payload), HostSlab(8, payload)
    copy_blocks(slab, blocks, list(enumerate(slots)), to_slab=True)
    for block, slot in zip(blocks, slots):
        copy_into_slot(expected.slot(slot), block)
        assert torch.equal(slab.slot(slot), expected.slot(slot)), slot
    shaped = slab.slots_as(torch.bfloat16, (2, 4, 64))
    assert shaped[7].equal(bf16[1]) and len(shaped) == 8
    assert shaped[7] is slab.slots_as(torch.bfloat16, (2, 4, 64))[7], "a slot's view is made once, then kept"

    out = [torch.full_like(b, 7) if isinstance(b, torch.Tensor) else b for b in blocks]
    out[3] = [torch.zeros(512, dtype=torch.uint8), 256, torch.zeros(64)]
    copy_blocks(slab, out, list(enumerate(slots)), to_slab=False)
    for i in (0, 1, 2, 4, 5):
        assert same_bits(out[i], blocks[i]), i
    assert same_bits(out[3][0], parts[0]) and same_bits(out[3][2], parts[2])


def test_a_bad_whole_tensor_is_refused_before_anything_is_copied():
    blocks = [torch.ones(1024, dtype=torch.int32) for _ in range(2)]
    slab = HostSlab(3, 4096)
    with pytest.raises(ValueError, match="out of range"):
        copy_blocks(slab, blocks, [(0, 1), (1, 3)], to_slab=True)
    with pytest.raises(ValueError, match="out of range"):
        copy_blocks(slab, blocks, [(0, -1)], to_slab=True)
    with pytest.raises(ValueError, match="not contiguous"):  # a strided block is never copied as if it were not
        copy_blocks(slab, [blocks[0], torch.ones(2048, dtype=torch.int32)[::2]], [(0, 0), (1, 1)], to_slab=True)
    assert not any(slab.slot(i).any() for i in range(slab.num_slots)), "nothing was written"
    with pytest.raises(ValueError, match="4096 bytes"):
        slab.slots_as(torch.int32, (1023,))
    slab.close()
    with pytest.raises(ValueError, match="closed"):
        slab.slots_as(torch.int32, (1024,))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
