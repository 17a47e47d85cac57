"""Memory for object reads is used again, and never while anything still refers to it.

A local store's chunk objects (and ranges of their Blosc blocks) are read into slabs of a
:class:`~asyncflat.storage.recycled.RecycledBytes`: a fresh allocation's page faults were most of
a first fill's reads under a sandboxed kernel. A slab handed out twice while the first read's
bytes are still in use would decode one chunk's bytes as another's, so these tests hold every
kind of reference a reader makes (slices, memoryviews, frames) and check the bytes survive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from conftest import oracle

import asyncflat
from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams
from asyncflat.engine import heap
from asyncflat.source.local_source import LocalTokenSource
from asyncflat.storage.chunks import Frame
from asyncflat.storage.recycled import KEPT_BYTES, KEPT_MAX, SMALL, RecycledBytes, shared

SLAB = 4 * SMALL


def test_a_slab_returns_only_when_every_array_made_from_it_is_gone() -> None:
    memory = RecycledBytes(SLAB)
    data = memory.take(SLAB - 100)
    address = data.ctypes.data
    data[:] = 7
    sliced, viewed = data[10:20], memoryview(data)[5:]
    frame = Frame(data[3:], 0, "c/0")
    del data
    gc.collect()
    for holder in ("sliced", "viewed", "frame"):
        others = [memory.take(SLAB) for _ in range(memory.free + 1)]  # every free slab, and more
        assert address not in {o.ctypes.data for o in others}, f"handed out under {holder}"
        for other in others:
            other[:] = 1
        del others, other
        if holder == "sliced":
            assert (sliced == 7).all()
            del sliced
        elif holder == "viewed":
            assert bytes(viewed[:3]) == b"\x07\x07\x07"
            del viewed
        else:
            assert (frame.data == 7).all()
            del frame
    assert memory.free == 4
    again = [memory.take(SLAB) for _ in range(4)]
    assert address in {a.ctypes.data for a in again}  # used again once nothing refers to it
    assert (memory.fresh, memory.reused) == (4, 3 + 4)


def test_sizes_outside_a_slab_are_ordinary_allocations_never_kept() -> None:
    memory = RecycledBytes(SLAB)
    for nbytes in (0, 1, SMALL - 1, SLAB + 1):
        taken = memory.take(nbytes)
        assert taken.nbytes == nbytes and taken.dtype == np.uint8 and taken.flags.writeable
        del taken
    assert (memory.fresh, memory.reused, memory.free) == (0, 0, 0)
    whole_shards = RecycledBytes(1 << 30)  # slabs this large are never kept
    assert whole_shards.keep == 0
    whole_shards.take(SMALL)[:] = 1
    assert (whole_shards.fresh, whole_shards.free) == (0, 0)


def test_at_most_keep_free_slabs_are_kept() -> None:
    memory = RecycledBytes(SLAB)
    taken = [memory.take(SLAB) for _ in range(memory.keep + 5)]
    del taken
    assert memory.free == memory.keep == KEPT_MAX
    # large slabs (seqax's 4M-token chunks) are kept up to a budget of bytes, not a count
    assert RecycledBytes(16 << 20).keep * (16 << 20) <= KEPT_BYTES < 5 * (16 << 20)


def test_threads_never_share_a_slab_in_use() -> None:
    """Eight threads take, fill with their own byte, wait, check, and drop, many times over."""
    memory = RecycledBytes(SLAB)
    errors: list[str] = []

    def work(mark: int) -> None:
        for _ in range(200):
            data = memory.take(SMALL + mark)
            data[:] = mark
            time.sleep(0)
            if not (data == mark).all():
                errors.append(f"thread {mark}: another thread wrote into its slab")
            del data

    threads = [threading.Thread(target=work, args=(mark,)) for mark in range(1, 9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert memory.fresh <= 8 + memory.keep and memory.reused >= 1500


@pytest.mark.parametrize("checksum", [True, False], ids=["whole-objects", "block-ranges"])
def test_a_local_loader_reads_into_memory_used_again_and_serves_the_oracle(
    tmp_path: Path, checksum: bool
) -> None:
    """Checksummed objects are read whole; without checksums a fill reads just the Blosc
    blocks of its read blocks. Both read into slabs used again within a fill, the batches stay
    exact, and each fill's end frees the slabs kept (with the heap's free pages)."""
    rng = np.random.default_rng(5)
    sequences = [rng.integers(0, 50_000, int(n)) for n in rng.integers(200, 3000, 800)]
    path = tmp_path / "ds.zarr"
    asyncflat.write_flat_tokens(path, {"train": sequences}, chunk_tokens=1 << 18, checksum=checksum)
    params = FlatTokensParams(str(path), 1, 16, 16, seed=1, sequence_packing=True)
    batch = TokenBatchParams(len=256, batch=8)
    reference = oracle(path, params, batch)
    with ShufflingLoader("train", params, batch) as loader:
        assert isinstance(loader.source, LocalTokenSource)
        memory = loader.source.memory
        fresh, reused = memory.fresh, memory.reused  # the process's pool: other tests' too
        for step in range(loader.step_count):
            got = loader.load(step)
            targets, is_seq_start = reference.batch(step)
            np.testing.assert_array_equal(np.asarray(got.targets), targets)
            np.testing.assert_array_equal(np.asarray(got.is_seq_start), is_seq_start)
        fresh, reused = memory.fresh - fresh, memory.reused - reused
        assert reused > 2 * fresh, (fresh, reused)


def test_a_fills_end_frees_the_kept_slabs_with_the_heap() -> None:
    """The engine's trim after each fill frees every pool's free slabs (kept across fills they
    added ~10 MiB to a 64 MiB buffer's peak RSS), even where glibc has no ``malloc_trim``."""
    memory = shared(SLAB + 1)  # a size of its own
    try:
        taken = [memory.take(SLAB) for _ in range(3)]
        del taken
        assert memory.free == 3

        async def trim() -> None:
            heap.trim_later(asyncio.get_running_loop())
            deadline = time.monotonic() + 10
            while memory.free and time.monotonic() < deadline:  # in the loop's executor
                await asyncio.sleep(0.01)

        asyncio.run(trim())
        assert memory.free == 0
    finally:
        memory.leave()


def test_loaders_share_one_pool_which_a_closed_loader_leaves_empty(tmp_path: Path) -> None:
    """Every loader of a process reads chunks of one size into one pool (its bound holds for
    the process; an epoch's next loader uses the slabs of the last). A loader closed in the
    middle of its first fill, its caller still referring to it, leaves no slab kept, not even
    those its reads in flight return after the close; and the pool is gone with its last user."""
    rng = np.random.default_rng(6)
    sequences = [rng.integers(0, 50_000, int(n)) for n in rng.integers(200, 3000, 800)]
    path = tmp_path / "ds.zarr"
    # a chunk size no other test reads: the pool is the process's
    asyncflat.write_flat_tokens(path, {"train": sequences}, chunk_tokens=3 << 16)
    params = FlatTokensParams(str(path), 1, 16, 16, seed=1, sequence_packing=True)
    batch = TokenBatchParams(len=256, batch=8)
    with ShufflingLoader("train", params, batch) as first:
        memory = first.source.memory
        with ShufflingLoader("train", dataclasses.replace(params, seed=2), batch) as second:
            assert second.source.memory is memory
            second.load(0)
            first.load(0)  # its next fill starts; closing comes in the middle of it
    for _ in range(50):  # reads in flight at the close return their slabs later
        assert memory.free == 0
        time.sleep(0.01)
    memory.take(SMALL)  # dropped at once: returned to a pool no open reader uses
    assert memory.free == 0
    pool = weakref.ref(memory)
    del first, second, memory
    gc.collect()
    assert pool() is None
