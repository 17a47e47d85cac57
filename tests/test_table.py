"""The fill table alone: which fill holds which buffer, what is dropped, what is prefetched."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncflat import FlatTokensParams, LoaderClosedError, ShufflePlan, TokenBatchParams
from asyncflat.engine.fill import Fill, Unit
from asyncflat.engine.table import FillTable

SEQ_LEN = 8


def make_table() -> tuple[FillTable, list[Unit], list[tuple[Fill, dict[str, Any]]]]:
    params = FlatTokensParams("fake://", 1, 4, 8, seed=2, sequence_packing=True)
    plan = ShufflePlan.create(
        params,
        TokenBatchParams(len=SEQ_LEN, batch=8),
        token_count=640 * SEQ_LEN,
        sequence_count=640,
    )
    queued: list[Unit] = []
    ended: list[tuple[Fill, dict[str, Any]]] = []
    table = FillTable(
        plan,
        (0,),
        SEQ_LEN * 8,
        queue=queued.append,
        ended=lambda fill, **how: ended.append((fill, how)),
    )
    return table, queued, ended


def test_a_fill_is_started_once_and_its_units_queued() -> None:
    table, queued, _ = make_table()
    fill = table.ensure(0, 0, 0, keep={0})
    assert table.ensure(0, 0, 3, keep={0}) is fill and table.get(0, 0) is fill
    assert {u.fill for u in queued} == {fill}
    covered = sorted({p[0] for u in queued for p in u.pieces})
    assert covered == list(range(len(fill.blocks)))
    assert table.allocations == 1


async def permutations_computed(table: FillTable) -> None:
    """Let the permutations under way on the CPU pool finish and land (their callbacks)."""
    await asyncio.gather(*table.permutations._pending.values())
    await asyncio.sleep(0)


def test_a_third_minipoch_takes_the_buffer_of_one_the_step_does_not_read() -> None:
    async def main() -> None:
        table, _, ended = make_table()
        first = table.ensure(0, 0, 0, keep={0})
        await permutations_computed(table)
        table.prefetch_after({(0, 0): slice(0, 8)})  # minipoch 1 into the other buffer
        second = table.get(0, 1)
        assert second is not None and second.reason == "prefetch"
        assert second.buffer_index != first.buffer_index and table.allocations == 2
        waiter = asyncio.ensure_future(second.ready[0].wait())
        third = table.ensure(0, 3, 3 * 4, keep={3})  # a jump: minipoch 1's prefetch goes
        assert third.buffer_index == second.buffer_index and table.get(0, 1) is None
        await asyncio.wait_for(waiter, 5)  # its waiters are woken ...
        assert isinstance(second.error, LoaderClosedError)  # ... and told why
        assert ended == [(second, {"cancelled": True})] and second.cancelled
        assert table.allocations == 2  # buffers reused

    asyncio.run(main())


def test_a_failed_fill_is_replaced_by_the_next_load() -> None:
    table, _, ended = make_table()
    fill = table.ensure(0, 0, 0, keep={0})
    fill.fail(OSError("store down"))
    again = table.ensure(0, 0, 0, keep={0})
    assert again is not fill and again.error is None and fill.cancelled
    assert ended == [(fill, {"failed": True})]


def test_prefetch_is_due_once_per_minipoch_and_never_past_the_end() -> None:
    table, _, _ = make_table()
    plan = table.plan
    table.ensure(0, 0, 0, keep={0})
    assert table.prefetches_due({(0, 0): slice(0, 8)}) == [(0, 1, {0})]
    table.prefetch_after({(0, 0): slice(0, 8)})
    assert table.prefetches_due({(0, 0): slice(0, 8)}) == []
    last = plan.minipoch_count - 1
    assert table.prefetches_due({(0, last): slice(0, 8)}) == []
    with pytest.raises(KeyError):
        table.prefetches_due({(1, 0): slice(0, 8)})  # not a stream of this table


def test_fail_all_then_clear_drops_everything() -> None:
    table, _, _ = make_table()
    fill = table.ensure(0, 0, 0, keep={0})
    table.fail_all()
    assert fill.cancelled and isinstance(fill.error, LoaderClosedError)
    table.clear()
    assert list(table) == []


def test_a_prefetch_starts_with_its_permutation_computed_off_the_loop() -> None:
    """A fill's start computes the next minipoch's permutation on the CPU pool (the Python path
    holds the GIL ~1 ms per 4,096 rows: on the loop it delayed the trainer's next load). The
    prefetch waits for it, starts when it lands and uses it; a load never waits for it."""

    async def main() -> None:
        table, _, _ = make_table()
        plan = table.plan
        table.ensure(0, 0, 0, keep={0})  # a load's fill: computed at once
        assert table.permutations.inline == 1 and (0, 1) in table.permutations._pending
        groups = {(0, 0): slice(0, 8)}
        table.prefetch_after(groups)  # this step: still computing, so not started ...
        assert table.get(0, 1) is None and table.prefetches_due(groups)
        await permutations_computed(table)
        second = table.get(0, 1)  # ... but as soon as it lands
        assert second is not None and second.reason == "prefetch"
        assert (second.perm == plan.row_permutation(0, 1)).all()
        assert table.permutations.ahead == 1 and table.permutations.inline == 1
        # the fill of minipoch 1 started the computation of minipoch 2's
        assert (0, 2) in table.permutations._pending
        # a load of minipoch 2 does not wait for it: computed at once, the late one dropped
        third = table.ensure(0, 2, 2 * 4, keep={2})
        assert (third.perm == plan.row_permutation(0, 2)).all()
        assert table.permutations.inline == 2
        await permutations_computed(table)
        assert (0, 2) not in table.permutations._ready

    asyncio.run(main())


def test_without_a_running_loop_a_prefetch_computes_its_permutation_itself() -> None:
    table, _, _ = make_table()
    table.ensure(0, 0, 0, keep={0})
    table.prefetch_after({(0, 0): slice(0, 8)})
    second = table.get(0, 1)
    assert second is not None and (second.perm == table.plan.row_permutation(0, 1)).all()
    assert table.permutations.ahead == 0 and table.permutations.inline == 2
