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
    await asyncio.gather(*table.permutations.computing().values())
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
        assert table.permutations.inline == 1 and (0, 1) in table.permutations.computing()
        groups = {(0, 0): slice(0, 8)}
        table.prefetch_after(groups)  # this step: still computing, so not started ...
        assert table.get(0, 1) is None and table.prefetches_due(groups)
        await permutations_computed(table)
        second = table.get(0, 1)  # ... but as soon as it lands
        assert second is not None and second.reason == "prefetch"
        assert (second.perm == plan.row_permutation(0, 1)).all()
        assert table.permutations.ahead == 1 and table.permutations.inline == 1
        # the fill of minipoch 1 started the computation of minipoch 2's
        assert (0, 2) in table.permutations.computing()
        # a load of minipoch 2 does not wait for it: computed at once, the late one dropped
        third = table.ensure(0, 2, 2 * 4, keep={2})
        assert (third.perm == plan.row_permutation(0, 2)).all()
        assert table.permutations.inline == 2
        await permutations_computed(table)
        assert (0, 2) not in table.permutations.computed()

    asyncio.run(main())


def test_without_a_running_loop_a_prefetch_computes_its_permutation_itself() -> None:
    table, _, _ = make_table()
    table.ensure(0, 0, 0, keep={0})
    table.prefetch_after({(0, 0): slice(0, 8)})
    second = table.get(0, 1)
    assert second is not None and (second.perm == table.plan.row_permutation(0, 1)).all()
    assert table.permutations.ahead == 0 and table.permutations.inline == 2


def test_a_deferred_prefetch_is_dropped_when_the_trainer_jumps_away() -> None:
    """A prefetch waiting for its permutation belongs to the step that asked for it: after a
    jump to another minipoch it never starts, so it cannot evict the fill the trainer reads."""

    async def main() -> None:
        table, _, ended = make_table()
        table.ensure(0, 0, 0, keep={0})
        table.prefetch_after({(0, 0): slice(0, 8)})  # minipoch 1: deferred, computing
        assert table.get(0, 1) is None and (0, 1) in table.permutations.computing()
        fifth = table.ensure(0, 5, 5 * 4, keep={5})  # the jump, before it lands
        table.prefetch_after({(0, 5): slice(0, 8)})
        await permutations_computed(table)
        await permutations_computed(table)  # minipoch 6's, started by the fill of 5
        assert table.get(0, 1) is None  # never started
        assert table.get(0, 5) is fifth and not fifth.cancelled
        assert all(fill is not fifth for fill, _ in ended)
        assert {f.minipoch for f in table} == {5, 6}  # 6 took the buffer nobody needs

    asyncio.run(main())


def test_a_load_that_starts_a_deferred_minipoch_ends_the_deferral() -> None:
    """A load that starts minipoch m itself (before m's permutation landed) ends m's deferred
    prefetch: it neither lingers until a later computation of m lands, nor starts then."""

    async def main() -> None:
        table, _, ended = make_table()
        table.ensure(0, 3, 3 * 4, keep={3})
        table.prefetch_after({(0, 3): slice(0, 8)})  # 4: deferred
        table.ensure(0, 4, 4 * 4, keep={4})  # the trainer reaches 4 first
        table.prefetch_after({(0, 4): slice(0, 8)})  # 5: deferred
        second = table.ensure(0, 2, 2 * 4, keep={2})  # and goes back to 2
        table.prefetch_after({(0, 2): slice(0, 8)})  # 3 is there: nothing is due
        assert not table.deferred()
        for _ in range(3):
            await permutations_computed(table)
        assert {f.minipoch for f in table} == {2, 3} and not second.cancelled
        assert all(fill is not second for fill, _ in ended)

    asyncio.run(main())


def test_without_prefetch_no_permutation_is_computed_ahead() -> None:
    async def main() -> None:
        params = FlatTokensParams("fake://", 1, 4, 8, seed=2, sequence_packing=True)
        plan = ShufflePlan.create(
            params,
            TokenBatchParams(len=SEQ_LEN, batch=8),
            token_count=640 * SEQ_LEN,
            sequence_count=640,
        )
        table = FillTable(
            plan, (0,), SEQ_LEN * 8, queue=lambda u: None, ended=lambda f, **h: None, prefetch=False
        )
        table.ensure(0, 0, 0, keep={0})
        assert not table.permutations.computing() and not table.permutations.computed()

    asyncio.run(main())


def test_a_failed_permutation_nobody_takes_is_not_reported_unretrieved(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A computation ahead that fails after its fill computed the permutation itself is
    dropped quietly (the fill's own computation reports what fails), never logged by asyncio
    as an exception nobody retrieved."""
    import gc
    import threading

    release = threading.Event()

    async def main() -> None:
        table, _, _ = make_table()
        real = ShufflePlan.row_permutation

        def failing(plan: Any, stream: int, minipoch: int, *, yield_gil: bool = False) -> Any:
            if yield_gil:
                release.wait(5)
                raise MemoryError("injected")
            return real(plan, stream, minipoch)

        monkeypatch.setattr(ShufflePlan, "row_permutation", failing)
        table.ensure(0, 0, 0, keep={0})
        future = table.permutations.computing()[(0, 1)]
        table.ensure(0, 1, 4, keep={1})  # computes its own: the pending one is dropped
        release.set()
        with pytest.raises(MemoryError):
            await future
        table.clear()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_permutations_ahead_run_on_the_loops_background_thread_not_its_cpu_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop's CPU pool decodes what a waiting load needs; a permutation computed ahead
    (tens of ms at 2**16 rows, one per stream) must never queue there before them."""
    import threading

    from asyncflat.engine.loop import LoopThread

    names: list[str] = []

    async def main() -> None:
        table, _, _ = make_table()
        real = ShufflePlan.row_permutation

        def recording(plan: Any, stream: int, minipoch: int, *, yield_gil: bool = False) -> Any:
            if yield_gil:
                names.append(threading.current_thread().name)
            return real(plan, stream, minipoch, yield_gil=yield_gil)

        monkeypatch.setattr(ShufflePlan, "row_permutation", recording)
        table.ensure(0, 0, 0, keep={0})
        await permutations_computed(table)
        assert table.permutations.computed()

    runner = LoopThread(name="asyncflat-test")
    try:
        runner.run(main())
    finally:
        runner.close()
    assert len(names) == 1 and names[0].startswith("asyncflat-test-loop-")
    assert "-background" in names[0]
