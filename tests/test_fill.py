"""Fills alone: read units cover every block once, buffers are handed over safely."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from asyncflat import FlatTokensParams, ShufflePlan, TokenBatchParams
from asyncflat.engine.fill import BufferPair, Fill, FillWriter, pad_rows, plan_units
from asyncflat.engine.stats import FillProgress
from asyncflat.plan.shuffle import block_deadlines

SEQ_LEN = 8


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), timeout=10))


def make_plan(packing: bool = True) -> ShufflePlan:
    params = FlatTokensParams("fake://", 2, 4, 8, seed=1, sequence_packing=packing)
    return ShufflePlan.create(
        params,
        TokenBatchParams(len=SEQ_LEN, batch=8),
        token_count=640 * SEQ_LEN,
        sequence_count=640,
    )


def make_fill(plan: ShufflePlan, buffer: np.ndarray, index: int = 0, minipoch: int = 1) -> Fill:
    perm = plan.row_permutation(0, minipoch)
    blocks = plan.buffer_blocks(0, minipoch)
    fill = Fill(
        stream=0,
        minipoch=minipoch,
        buffer_index=index,
        buffer=buffer,
        perm=perm,
        blocks=blocks,
        deadlines=block_deadlines(plan, perm, minipoch, plan.first_step(minipoch)),
        reason="prefetch",
        needed_from=plan.first_step(minipoch),
        pending=np.zeros(len(blocks), np.int64),
        ready=[asyncio.Event() for _ in blocks],
        started=0.0,
        progress=FillProgress(0.0, len(blocks)),
    )
    fill.drained.set()
    return fill


@pytest.mark.parametrize("chunk", [SEQ_LEN * 3, SEQ_LEN * 8, SEQ_LEN * 20, 7])
def test_packed_units_cover_each_block_token_once_within_one_chunk(chunk: int) -> None:
    plan = make_plan()
    fill = make_fill(plan, np.empty((plan.seqs_per_buffer, SEQ_LEN), np.uint32))
    units = plan_units(plan, fill, chunk)
    block_tokens = plan.sequences_per_read_block * SEQ_LEN
    covered = np.zeros(len(fill.blocks) * block_tokens, np.int64)
    for unit in units:
        assert unit.start // chunk == (unit.stop - 1) // chunk  # one chunk per read
        for slot, offset, src, length in unit.pieces:
            covered[slot * block_tokens + offset :][:length] += 1
            first_token = int(fill.blocks[slot]) * block_tokens + offset
            assert first_token == unit.start + src  # the piece's data is where the read has it
        assert unit.priority == min(int(fill.deadlines[p[0]]) for p in unit.pieces)
    assert (covered == 1).all()
    assert [u.priority for u in units] == sorted(u.priority for u in units)


def test_unpacked_units_are_one_block_each() -> None:
    plan = make_plan(packing=False)
    fill = make_fill(plan, np.empty((plan.seqs_per_buffer, SEQ_LEN), np.uint32))
    units = plan_units(plan, fill, 1)
    spb = plan.sequences_per_read_block
    assert sorted(u.start // spb for u in units) == sorted(fill.blocks.tolist())
    assert all(u.stop - u.start == spb and len(u.pieces) == 1 for u in units)


def test_pad_rows_truncates_and_pads_with_token_zero_at_a_start() -> None:
    tokens = np.arange(10, dtype=np.uint32)
    rows = pad_rows(tokens, np.array([0, 3, 10]), np.array([3, 4]), 4)
    assert rows.tolist() == [[0, 1, 2, 1], [3, 4, 5, 6]]


def test_buffers_are_allocated_once_and_reused() -> None:
    pair = BufferPair(4, SEQ_LEN)
    first, _ = pair.take(0)
    again, _ = pair.take(0)
    pair.take(1)
    assert first is again and pair.allocations == 2
    pair.drop()
    pair.take(0)
    assert pair.allocations == 3


def test_a_dropped_fills_writes_land_before_the_next_fill_writes() -> None:
    async def main() -> None:
        plan = make_plan()
        pair = BufferPair(plan.seqs_per_buffer, SEQ_LEN)
        buffer, after = pair.take(0)
        assert after is None
        old = make_fill(plan, buffer)
        slow_write_started, release_slow_write = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        order: list[str] = []

        def slow_old_write() -> None:
            loop.call_soon_threadsafe(slow_write_started.set)
            asyncio.run_coroutine_threadsafe(release_slow_write.wait(), loop).result(5)
            order.append("old")

        old_write = asyncio.ensure_future(
            FillWriter(old, asyncio.Semaphore(1)).write(slow_old_write)
        )
        await asyncio.wait_for(slow_write_started.wait(), 5)
        pair.release(old)  # dropped while its decode is still writing
        assert old.cancelled
        buffer, after = pair.take(0)
        assert after is old.drained and not after.is_set()
        new = make_fill(plan, buffer, minipoch=2)
        new.write_after = after
        new_write = asyncio.ensure_future(
            FillWriter(new, asyncio.Semaphore(1)).write(lambda: order.append("new"))
        )
        await asyncio.sleep(0.02)
        assert order == []  # the new fill waits for the old decode
        release_slow_write.set()
        assert await asyncio.wait_for(old_write, 5) is True
        assert await asyncio.wait_for(new_write, 5) is True
        assert order == ["old", "new"]
        # and a dropped fill never starts another write
        assert await FillWriter(old, asyncio.Semaphore(1)).write(lambda: order.append("x")) is False
        assert order == ["old", "new"]

    run(main)


def test_a_fill_dropped_before_its_buffers_pages_are_written_hands_that_wait_on() -> None:
    """A buffer faulted in ahead (``fault_in``) is taken by a fill that must not write before
    the page writes end; dropped before they do, it hands the same wait to the next fill."""

    async def main() -> None:
        plan = make_plan()
        pair = BufferPair(plan.seqs_per_buffer, SEQ_LEN)
        fresh = pair.fault_in(0)
        assert fresh is not None
        buffer, pages_done = fresh
        assert pair.fault_in(0) is None  # allocated once
        taken, after = pair.take(0)
        assert taken is buffer and after is pages_done
        first = make_fill(plan, buffer)
        first.write_after = after
        pair.release(first)  # a resume cancels it: no write of its ever started
        taken, after = pair.take(0)
        assert taken is buffer and after is pages_done and not after.is_set()
        pages_done.set()
        taken, after = pair.take(0)
        assert after is None  # handed once

    run(main)


def test_page_writes_let_go_of_their_array_once_written() -> None:
    """A block order's array (written ahead, then computed in) may be kept only as a copy of
    some columns: the writer, kept until closing, must not keep the whole array alive."""
    import weakref

    from asyncflat.engine.fill import PageWriter

    async def main() -> None:
        array = np.full(1000, 7, np.uint32)
        alive = weakref.ref(array)
        writer = PageWriter(array, asyncio.Event(), piece_bytes=512)
        writer.start()
        await asyncio.get_running_loop().run_in_executor(None, writer.finished.wait)
        assert not array.any()  # every page written (zeroed) before ``finished``
        del array
        assert alive() is None

    run(main)
