"""Row reads alone: a load ahead of its blocks gets exactly its rows, fills paused meanwhile."""

from __future__ import annotations

import asyncio

import numpy as np
from helpers.fake_source import SEQ_LEN, FakeSource, make_data

from asyncflat import FlatTokensParams, ShufflePlan, TokenBatchParams
from asyncflat.engine.fill import Unit
from asyncflat.engine.rows import RowReader
from asyncflat.engine.scheduler import UnitScheduler
from asyncflat.engine.table import FillTable


def source_and_plan() -> tuple[np.ndarray, FakeSource, ShufflePlan]:
    """640 rows of tokens, a fake source of them that reads partial chunks, and a plan."""
    tokens, starts = make_data(rows=640)
    source = FakeSource(tokens, starts, chunk=SEQ_LEN * 8, partial_reads=True)
    params = FlatTokensParams("fake://", 1, 4, 8, seed=4, sequence_packing=True)
    plan = ShufflePlan.create(
        params, TokenBatchParams(len=SEQ_LEN, batch=8), token_count=len(tokens), sequence_count=640
    )
    return tokens, source, plan


def test_rows_come_from_finished_blocks_or_are_read_alone() -> None:
    async def main() -> None:
        tokens, source, plan = source_and_plan()
        ran: list[Unit] = []

        async def run(unit: Unit) -> None:
            ran.append(unit)

        scheduler: UnitScheduler[Unit] = UnitScheduler(
            run, workers=1, reserve=1, budget=10, background_limit=1
        )
        table = FillTable(plan, (0,), SEQ_LEN * 8, queue=scheduler.put, ended=lambda *a, **k: None)
        fill = table.ensure(0, 1, plan.first_step(1), keep={1})
        fill.buffer[:8] = 7  # block slot 0 "finished" with a marker
        fill.ready[0].set()
        rows = RowReader(plan, source, scheduler)
        buffer_rows = np.array([0, 3, 9, 30])  # two in slot 0, two in blocks still missing
        out = np.zeros((4, SEQ_LEN), np.uint32)
        scheduler.start()
        read = await rows.serve(fill, buffer_rows, out)
        assert read == 2 and source.item_reads == 2
        assert source.item_demands == [True, True]  # the load waits on them: first at the store
        assert (out[:2] == 7).all()  # from the buffer, not storage
        spb = plan.sequences_per_read_block
        for i, row in ((2, 9), (3, 30)):
            block = int(fill.blocks[row // spb])
            start = (block * spb + row % spb) * SEQ_LEN
            np.testing.assert_array_equal(out[i], tokens[start : start + SEQ_LEN])
        await rows.aclose()
        await scheduler.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_rows_read_ahead_are_demand_reads_and_the_mark_ends_with_the_call() -> None:
    async def main() -> None:
        _, source, plan = source_and_plan()

        async def run(unit: Unit) -> None:
            pass

        scheduler: UnitScheduler[Unit] = UnitScheduler(
            run, workers=1, reserve=1, budget=10, background_limit=1
        )
        table = FillTable(plan, (0,), SEQ_LEN * 8, queue=scheduler.put, ended=lambda *a, **k: None)
        fill = table.ensure(0, 1, plan.first_step(1), keep={1})
        rows = RowReader(plan, source, scheduler, local=False)
        rows.read_ahead(fill, np.array([3, 9, 30]))
        plain = asyncio.ensure_future(source.read_items(0, 0, np.empty(SEQ_LEN, np.uint32)))
        await plain  # started after read_ahead returned: not a demand read
        for _ in range(5):  # the rows read ahead yield once before they read
            await asyncio.sleep(0)
        assert sorted(source.item_demands) == [False, True, True, True]
        assert source.item_demands[0] is False
        await rows.aclose()
        await scheduler.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))
