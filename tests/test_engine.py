"""The async engine with injected fake sources: concurrency, ordering, cancellation, errors."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
from conftest import oracle, until
from helpers.fake_source import SEQ_LEN, FakeSource, make_data

from asyncflat import (
    EngineOptions,
    FlatTokensParams,
    LoaderClosedError,
    ShufflePlan,
    StorageError,
    TokenBatchParams,
)
from asyncflat.engine import Engine
from asyncflat.engine.fill import Fill
from asyncflat.engine.table import FillTable
from asyncflat.engine.waiting import (
    MAX_ROWS_AHEAD_STEPS,
    ROWS_AHEAD_STEPS,
    rows_ahead_steps,
    stays_ahead,
)


def make(
    source: FakeSource,
    *,
    streams: int = 2,
    rbpsb: int = 4,
    spb: int = 8,
    batch: int = 8,
    packing: bool = True,
    **options: Any,
) -> Engine:
    params = FlatTokensParams(
        "fake://tokens", streams, rbpsb, spb, seed=3, sequence_packing=packing
    )
    plan = ShufflePlan.create(
        params,
        TokenBatchParams(len=SEQ_LEN, batch=batch),
        token_count=source.token_count,
        sequence_count=source.sequence_count,
    )
    return Engine(plan, source, range(streams), EngineOptions(**options))


def oracle_for(engine: Engine, source: FakeSource) -> Any:
    return oracle((source.tokens, source.starts), engine.plan)


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), timeout=60))


ALL = np.arange(8)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("packing", [True, False])
def test_batches_match_the_oracle_in_any_order(prefetch: bool, packing: bool) -> None:
    source = FakeSource(*make_data(), chunk=24, latency_s=0.001)
    engine = make(source, packing=packing, prefetch=prefetch)
    oracle = oracle_for(engine, source)
    order = (
        list(range(engine.plan.step_count))
        + np.random.default_rng(1).permutation(engine.plan.step_count).tolist()
    )

    async def main() -> None:
        for step in order:
            np.testing.assert_array_equal(
                await engine.gather(step, ALL), oracle.encoded_batch(step)
            )
        await engine.aclose()

    run(main)


def test_reads_in_flight_never_exceed_the_limit() -> None:
    source = FakeSource(*make_data(rows=2048), chunk=SEQ_LEN * 8, latency_s=0.003)
    engine = make(source, streams=4, rbpsb=8, spb=8, batch=16, max_concurrent_reads=3)

    async def main() -> None:
        for step in range(0, engine.plan.step_count, 5):
            await engine.gather(step, np.arange(16))
        await engine.aclose()

    run(main)
    assert source.peak_in_flight == 3  # the window is used fully, and never exceeded
    assert engine.stats()["peak_units_in_flight"] <= 3


def test_buffers_are_allocated_once_per_stream_and_reused() -> None:
    source = FakeSource(*make_data(), chunk=SEQ_LEN * 8)
    engine = make(source)

    async def main() -> None:
        for step in range(engine.plan.step_count):
            await engine.gather(step, ALL)
        await engine.aclose()

    run(main)
    assert engine.plan.minipoch_count >= 4
    assert engine.stats()["buffer_allocations"] == 2 * engine.plan.streams


@pytest.mark.parametrize(("rbpsb", "spb", "batch"), [(1, 2, 8), (1, 3, 8), (2, 2, 12), (4, 8, 8)])
def test_a_step_reading_several_minipochs_holds_the_buffers_its_plan_says(
    rbpsb: int, spb: int, batch: int
) -> None:
    """A buffer smaller than a step's rows of a stream: the step reads several minipochs, one
    buffer each. ``buffers_per_stream`` (what the memory figures and the budget count, once
    "2 per stream") is the most minipochs any step reads, and what the engine allocates."""
    source = FakeSource(*make_data(), chunk=SEQ_LEN * 8)
    engine = make(source, streams=1, rbpsb=rbpsb, spb=spb, batch=batch)
    plan = engine.plan
    widest = max(len(plan.minipochs_of_step(s)) for s in range(plan.step_count))
    assert plan.buffers_per_stream == max(2, widest)
    oracle = oracle_for(engine, source)
    rows = np.arange(batch)

    async def main() -> None:
        for step in range(plan.step_count):
            batch_rows = await engine.gather(step, rows)
            np.testing.assert_array_equal(batch_rows, oracle.encoded_batch(step))
        await engine.aclose()

    run(main)
    assert engine.stats()["buffer_allocations"] == plan.buffers_per_stream


def test_the_next_minipoch_fills_as_soon_as_the_current_one_serves() -> None:
    source = FakeSource(*make_data(), chunk=SEQ_LEN * 8, latency_s=0.002)
    engine = make(source)
    plan = engine.plan

    async def main() -> None:
        await engine.gather(plan.first_step(1), ALL)
        active = {(f["stream"], f["minipoch"], f["reason"]) for f in engine.stats()["active_fills"]}
        assert {(0, 2, "prefetch"), (1, 2, "prefetch")} <= active
        await until(lambda: not engine.stats().active_fills, "the prefetch of minipoch 2")
        fills_before = len(engine.stats()["fills"])
        await engine.gather(plan.first_step(2), ALL)  # served from the prefetched buffer
        assert not [f for f in engine.stats()["fills"][fills_before:] if f["minipoch"] == 2]
        fills = [f for f in engine.stats()["fills"] if f["minipoch"] == 2]
        assert len(fills) == 2 and all(
            f["reason"] == "prefetch" and not f["cancelled"] for f in fills
        )
        await engine.aclose()

    run(main)


def test_a_resume_behind_a_network_waits_only_for_the_blocks_its_rows_live_in() -> None:
    # One read at a time, chunks aligned to blocks: the reads done before the first batch
    # returns are exactly the blocks holding that step's rows (fetched first), nothing else.
    source = FakeSource(*make_data(rows=4096), chunk=SEQ_LEN * 16, latency_s=0.002)
    source.remote = True
    engine = make(source, streams=1, rbpsb=32, spb=16, batch=8, max_concurrent_reads=1)
    plan = engine.plan
    step = plan.first_step(1) + 5
    loc = plan.locate(step)
    perm = plan.row_permutation(0, 1)
    needed_blocks = set(plan.buffer_blocks(0, 1)[perm[loc.position] // 16].tolist())
    block_tokens = 16 * SEQ_LEN

    async def main() -> int:
        await engine.gather(step, ALL)
        done_before = len(source.reads)
        await engine.aclose()
        return done_before

    reads_before_first_batch = run(main)
    first_reads = {start // block_tokens for start, _ in source.reads[:reads_before_first_batch]}
    assert first_reads == needed_blocks
    assert reads_before_first_batch == len(needed_blocks) < plan.read_blocks_per_shuffle_buffer


def test_a_backward_load_in_a_resumed_minipoch_waits_only_for_its_own_blocks() -> None:
    # A resume plans its fill from the resumed step: blocks only earlier steps read go last.
    # A load jumping back to such a step must have its blocks fetched next, not wait for the
    # whole rest of the fill (they were never bumped: "needed at no step" looked final).
    source = FakeSource(*make_data(rows=4096), chunk=SEQ_LEN * 16, latency_s=0.002)
    source.remote = True
    engine = make(source, streams=1, rbpsb=32, spb=16, batch=8, max_concurrent_reads=1)
    plan = engine.plan
    first, resume = plan.first_step(1), plan.first_step(2) - 3
    perm = plan.row_permutation(0, 1)
    blocks = plan.buffer_blocks(0, 1)

    def needed(step: int) -> set[int]:
        return set(blocks[perm[plan.locate(step).position] // 16].tolist())

    later = set().union(*map(needed, range(resume, plan.first_step(2))))
    never = set(blocks.tolist()) - later  # no step from the resumed one on reads them
    assert needed(first) & never and len(never - needed(first)) > 4
    block_tokens = 16 * SEQ_LEN
    oracle = oracle_for(engine, source)

    async def main() -> int:
        await engine.gather(resume, ALL)
        batch = await engine.gather(first, ALL)
        np.testing.assert_array_equal(batch, oracle.encoded_batch(first))
        done = len(source.reads)
        await engine.aclose()
        return done

    done = run(main)
    read = [start // block_tokens for start, _ in source.reads[:done]]
    # the resumed step's blocks, then the backward step's: beside them only the read that
    # was in flight as the backward load came, and one started as it was served
    assert len(set(read) - needed(resume) - needed(first)) <= 2, read
    assert needed(first) <= set(read)


def test_random_access_cancels_fills_nobody_needs() -> None:
    source = FakeSource(*make_data(rows=4096), chunk=SEQ_LEN * 8, latency_s=0.02)
    engine = make(source, streams=1, rbpsb=16, spb=8, batch=8, max_concurrent_reads=2)
    plan = engine.plan

    async def main() -> None:
        await engine.gather(0, ALL)  # serves minipoch 0, prefetches 1 (slow)
        far = plan.first_step(plan.minipoch_count - 2)
        await engine.gather(far, ALL)  # jump: minipoch 1's prefetch is abandoned
        fills = engine.stats()["fills"]
        assert any(f["minipoch"] == 1 and f["cancelled"] for f in fills)
        block_tokens = 8 * SEQ_LEN
        m1_blocks = set(plan.buffer_blocks(0, 1).tolist())
        reads_m1 = sum(1 for s, _ in source.reads if s // block_tokens in m1_blocks)
        await until(lambda: not engine.stats().active_fills, "the fills still needed")
        assert sum(1 for s, _ in source.reads if s // block_tokens in m1_blocks) <= reads_m1 + 2
        await engine.aclose()

    run(main)


def test_close_cancels_reads_in_flight_and_wakes_waiters() -> None:
    source = FakeSource(*make_data(), chunk=SEQ_LEN * 8, latency_s=30)
    engine = make(source)

    async def main() -> None:
        waiter = asyncio.ensure_future(engine.gather(0, ALL))
        await until(lambda: source.in_flight > 0, "a read in flight")
        await engine.aclose()
        with pytest.raises(LoaderClosedError):
            await asyncio.wait_for(waiter, 5)
        assert source.in_flight == 0 and source.cancelled_reads > 0 and source.closed
        with pytest.raises(LoaderClosedError):
            await engine.gather(0, ALL)

    run(main)


def test_a_failed_read_surfaces_from_the_load_that_needs_it_and_is_retried_later() -> None:
    tokens, starts = make_data()
    broken = {"on": True}
    bad_chunk = 5

    def fail(start: int, stop: int) -> BaseException | None:
        if broken["on"] and start // (SEQ_LEN * 8) == bad_chunk:
            return StorageError(f"fake://tokens/c/{bad_chunk}: 403 Forbidden")
        return None

    source = FakeSource(tokens, starts, chunk=SEQ_LEN * 8, fail=fail)
    engine = make(source)
    oracle = oracle_for(engine, source)
    plan = engine.plan
    block_tokens = plan.sequences_per_read_block * SEQ_LEN
    # find a step whose rows live in the bad block, and one that does not touch its minipoch
    bad_block = bad_chunk  # chunks are aligned with blocks here
    bad_step = next(
        s
        for s in range(plan.step_count)
        if any(
            plan.buffer_blocks(st, m)[
                plan.row_permutation(st, m)[p] // plan.sequences_per_read_block
            ]
            == bad_block
            for st, m, p in zip(
                *(
                    a.tolist()
                    for a in (
                        plan.locate(s).stream,
                        plan.locate(s).minipoch,
                        plan.locate(s).position,
                    )
                )
            )
        )
    )
    bad_minipochs = set(plan.minipochs_of_step(bad_step))
    good_step = next(
        s for s in range(plan.step_count) if not set(plan.minipochs_of_step(s)) & bad_minipochs
    )
    assert block_tokens == source.token_chunk

    async def main() -> None:
        with pytest.raises(StorageError, match=r"403 Forbidden") as info:
            await engine.gather(bad_step, ALL)
        assert f"step {bad_step}" in str(info.value) and info.value.__cause__ is not None
        np.testing.assert_array_equal(
            await engine.gather(good_step, ALL), oracle.encoded_batch(good_step)
        )
        broken["on"] = False
        np.testing.assert_array_equal(
            await engine.gather(bad_step, ALL), oracle.encoded_batch(bad_step)
        )
        await engine.aclose()

    run(main)


def test_prefetch_off_waits_for_the_whole_buffer_like_the_reference() -> None:
    source = FakeSource(*make_data(), chunk=SEQ_LEN * 8, latency_s=0.001)
    engine = make(source, prefetch=False)

    async def main() -> None:
        await engine.gather(0, ALL)
        blocks = engine.plan.blocks_in_minipoch(0) * engine.plan.streams
        assert len(source.reads) == blocks  # whole buffer of every stream, nothing of minipoch 1
        assert not engine.stats().active_fills  # and nothing started that would read more
        await engine.aclose()

    run(main)


def _late_messages(caplog: pytest.LogCaptureFixture, minipoch: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "predicted to finish" in r.getMessage() and f"minipoch {minipoch} " in r.getMessage()
    ]


def _trainer_run(minipoch_1_block_s: float, burst: int, caplog: pytest.LogCaptureFixture) -> Engine:
    """Minipoch 0 (64 steps, in memory at once) at a sustained ~33 steps/s, loaded in bursts of
    ``burst`` steps (async dispatch: loads return at once, then the device queue is full),
    while minipoch 1 is prefetched one block at a time at ``minipoch_1_block_s`` a block."""
    tokens, starts = make_data(rows=2048)
    probe = make(FakeSource(tokens, starts, chunk=SEQ_LEN * 8), streams=1, rbpsb=64)
    block_tokens = 8 * SEQ_LEN
    slow = set(probe.plan.buffer_blocks(0, 1).tolist())

    def latency_for(start: int, stop: int) -> float:
        return minipoch_1_block_s if start // block_tokens in slow else 0.0

    source = FakeSource(tokens, starts, chunk=SEQ_LEN * 8, latency_for=latency_for)
    engine = make(source, streams=1, rbpsb=64, max_concurrent_reads=1)
    assert engine.plan.first_step(1) == 64

    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="asyncflat.engine"):
            for step in range(engine.plan.first_step(1)):
                await engine.gather(step, ALL)
                if step % burst == burst - 1:
                    await asyncio.sleep(0.03 * burst)
        await engine.aclose()

    run(main)
    return engine


def test_a_prefetch_that_will_be_late_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 64 blocks at 50 ms: 3.2 s of fill; the trainer needs them after ~2 s.
    engine = _trainer_run(0.05, burst=1, caplog=caplog)
    messages = _late_messages(caplog, 1)
    assert len(messages) == 1, messages
    assert "max_concurrent_reads" in messages[0] and "steps/s" in messages[0]  # what to change
    assert engine.stats().fills_predicted_late == 1


def test_async_dispatch_bursts_do_not_make_an_on_time_prefetch_look_late(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Loads come in bursts of 8 with ~0 s gaps (the old predictor took those gaps for the
    # step time); the sustained rate is ~33 steps/s and 64 blocks at 10 ms arrive in time.
    engine = _trainer_run(0.01, burst=8, caplog=caplog)
    assert not _late_messages(caplog, 1)
    assert engine.stats().fills_predicted_late == 0
    assert not [f for f in engine.stats().fills if f.late]


def test_a_resumed_demand_fill_does_not_read_as_late() -> None:
    source = FakeSource(*make_data(), chunk=SEQ_LEN * 8, latency_s=0.001)
    engine = make(source, streams=1, prefetch=False)
    plan = engine.plan
    step = plan.first_step(1) + 3  # a resume in the middle of minipoch 1

    async def main() -> None:
        await engine.gather(step, ALL)
        await engine.aclose()

    run(main)
    (record,) = [f for f in engine.stats().fills if f.minipoch == 1]
    assert record.reason == "demand" and not record.late and record.waited_on
    assert record.must_finish_by_step == step and record.finished_at_step is None


def test_fill_records_are_bounded_and_totals_kept() -> None:
    source = FakeSource(*make_data(), chunk=SEQ_LEN * 8)
    engine = make(source, streams=1, rbpsb=2, spb=4, batch=4)
    plan = engine.plan
    steps = np.random.default_rng(0).integers(0, plan.step_count, 700).tolist()

    async def main() -> None:
        for step in steps:
            await engine.gather(int(step), np.arange(4))
        await engine.aclose()

    run(main)
    stats = engine.stats()
    assert stats.fills_completed + stats.fills_cancelled > len(stats.fills) == 256
    assert stats.steps_loaded == len(steps)


def test_stats_is_a_flat_typed_snapshot_with_an_interval_view() -> None:
    source = FakeSource(*make_data(), chunk=SEQ_LEN * 8)
    engine = make(source)

    async def main() -> None:
        for step in range(5):
            await engine.gather(step, ALL)
        first = engine.interval_stats()
        for step in range(5, 8):
            await engine.gather(step, ALL)
        second = engine.interval_stats()
        assert (first.steps_loaded, second.steps_loaded) == (5, 3)
        assert second.bytes_useful == 0 or first.bytes_useful > 0
        await engine.aclose()

    run(main)
    stats = engine.stats()
    scalars = stats.scalars()
    assert scalars["steps_loaded"] == 8 and "fills" not in scalars
    assert all(v is None or isinstance(v, (int, float)) for v in scalars.values())
    assert stats["retries"] == stats.retries  # reads like the dict of earlier versions
    as_dict = stats.as_dict()
    assert as_dict["fills"][0]["stream"] == stats.fills[0].stream
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.retries = 1  # type: ignore[misc]


def test_try_gather_serves_finished_buffers_without_the_loop() -> None:
    source = FakeSource(*make_data(), chunk=SEQ_LEN * 8, latency_s=0.001)
    engine = make(source)
    oracle = oracle_for(engine, source)
    plan = engine.plan

    async def main() -> None:
        assert engine.try_gather(1, ALL) is None  # nothing filled yet
        await engine.gather(0, ALL)  # fills minipoch 0, starts prefetching 1
        await until(lambda: not engine.stats().active_fills, "the prefetch of minipoch 1")
        for step in range(1, plan.first_step(1)):
            np.testing.assert_array_equal(engine.try_gather(step, ALL), oracle.encoded_batch(step))
        # the first step of minipoch 1 is served at once and hands the prefetch of 2 to the loop
        boundary = plan.first_step(1)
        np.testing.assert_array_equal(
            engine.try_gather(boundary, ALL), oracle.encoded_batch(boundary)
        )
        await asyncio.sleep(0)  # the loop runs the posted request
        assert {(f["minipoch"], f["reason"]) for f in engine.stats()["active_fills"]} == {
            (2, "prefetch")
        }
        # a step whose blocks are not in yet needs the loop (and waits there)
        assert engine.try_gather(plan.first_step(2), ALL) is None
        await engine.aclose()
        with pytest.raises(LoaderClosedError):
            engine.try_gather(1, ALL)

    run(main)


def test_a_load_ahead_of_its_blocks_reads_just_its_rows() -> None:
    # whole chunks take 30 s, rows are read at once; behind a network the next steps' rows are
    # read ahead too
    source = FakeSource(*make_data(rows=4096), chunk=SEQ_LEN * 16, latency_s=30, partial_reads=True)
    source.remote = True
    engine = make(source, streams=1, rbpsb=32, spb=16, batch=8)
    oracle = oracle_for(engine, source)
    step = engine.plan.first_step(1) + 5

    async def main() -> None:
        batch = await asyncio.wait_for(engine.gather(step, ALL), 5)  # the blocks take 30 s
        np.testing.assert_array_equal(batch, oracle.encoded_batch(step))
        assert engine.stats()["rows_read_directly"] == 8
        # One read per row, no whole chunk; the rows of the next steps are read ahead.
        ahead = 8 * (1 + ROWS_AHEAD_STEPS)
        for _ in range(100):
            if source.item_reads >= ahead:
                break
            await asyncio.sleep(0.01)
        assert source.item_reads == ahead and not source.reads
        # fills go on (the prefetch of 2 starts once its permutation, computed off the loop, lands)
        await until(
            lambda: {f["minipoch"] for f in engine.stats()["active_fills"]} == {1, 2},
            "the prefetch of minipoch 2",
        )
        for later in range(step + 1, step + 1 + ROWS_AHEAD_STEPS):  # served by the reads ahead
            batch = await asyncio.wait_for(engine.gather(later, ALL), 5)
            np.testing.assert_array_equal(batch, oracle.encoded_batch(later))
            assert source.item_reads == ahead + 8 * (later - step) and not source.reads
        await engine.aclose()

    run(main)


def test_on_a_local_store_the_first_load_waits_until_the_fill_stays_ahead() -> None:
    # Locally a fill costs CPU, not round trips: the first load of a fresh engine (the
    # trainer's pace unknown) returns once the whole fill is in, so no later step waits for it.
    source = FakeSource(*make_data(rows=4096), chunk=SEQ_LEN * 16, latency_s=0.01)
    engine = make(source, streams=1, rbpsb=32, spb=16, batch=8)
    oracle = oracle_for(engine, source)
    step = engine.plan.first_step(1) + 5

    async def main() -> None:
        np.testing.assert_array_equal(await engine.gather(step, ALL), oracle.encoded_batch(step))
        assert not source.item_reads  # no row read on its own: the fill at full speed
        for later in range(step + 1, engine.plan.first_step(2)):
            batch = engine.try_gather(later, ALL)  # a finished buffer: no wait, no loop
            assert batch is not None, later
            np.testing.assert_array_equal(batch, oracle.encoded_batch(later))
        await engine.aclose()

    run(main)


def test_on_a_local_store_a_jump_reads_its_rows_then_loads_wait_for_blocks() -> None:
    # Random access in a running engine (no trainer pace to plan with): the first load of a
    # fill not started yet reads its own rows, none ahead (a row read decodes a whole Blosc
    # block for one row, on the cores the fill decodes on); once the fill runs, a load waits
    # for its blocks, the fill made urgent.
    source = FakeSource(
        *make_data(rows=4096), chunk=SEQ_LEN * 16, latency_s=0.3, partial_reads=True
    )
    engine = make(source, streams=1, rbpsb=32, spb=16, batch=8)
    oracle = oracle_for(engine, source)
    step = engine.plan.first_step(2) + 5

    async def main() -> None:
        await engine.gather(0, ALL)  # the start: its whole fill
        assert not source.item_reads
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        batch = await asyncio.wait_for(engine.gather(step, ALL), 5)
        assert loop.time() - t0 < 0.25  # its rows, not the fill's 0.3 s chunks
        np.testing.assert_array_equal(batch, oracle.encoded_batch(step))
        assert source.item_reads == 8
        for later in range(step + 1, step + 3):
            batch = await asyncio.wait_for(engine.gather(later, ALL), 5)
            np.testing.assert_array_equal(batch, oracle.encoded_batch(later))
        # No row read beyond the jump's own: the later loads waited for their blocks.
        assert source.item_reads == 8
        assert engine.stats()["rows_read_directly"] == 8
        await engine.aclose()

    run(main)


def test_random_access_after_a_sequential_run_reads_rows_after_the_first_jump() -> None:
    # A sequential run makes the trainer's pace known; the first jump after it is planned with
    # that pace (a resume in a running job), but a second jump is random access: its load
    # reads just its rows instead of waiting for a fill to stay ahead of a pace nobody keeps.
    source = FakeSource(
        *make_data(rows=4096), chunk=SEQ_LEN * 16, latency_s=0.01, partial_reads=True
    )
    engine = make(source, streams=1, rbpsb=32, spb=16, batch=8)
    oracle = oracle_for(engine, source)
    plan = engine.plan

    async def main() -> None:
        loop = asyncio.get_running_loop()
        started, step = loop.time(), 0
        while loop.time() - started < 1.3:  # the rate is known once loads span a second
            await engine.gather(step, ALL)
            step += 1
            await asyncio.sleep(0.004)
        assert step < plan.first_step(6)
        first, second = plan.first_step(7) + 3, plan.first_step(6) + 9
        np.testing.assert_array_equal(await engine.gather(first, ALL), oracle.encoded_batch(first))
        reads = source.item_reads
        np.testing.assert_array_equal(
            await engine.gather(second, ALL), oracle.encoded_batch(second)
        )
        assert source.item_reads == reads + 8  # its own rows, read alone
        await engine.aclose()

    run(main)


def test_stays_ahead_predicts_from_the_rate_of_the_slots_and_the_trainers_pace() -> None:
    deadlines = np.array([10, 10, 11, 14, 20])
    # the trainer's pace unknown (0): only a fill with nothing pending stays ahead
    assert stays_ahead(deadlines[:0], 10, 0.0, None)
    assert not stays_ahead(deadlines[2:], 10, 0.0, 0.001)
    # a slot still needed by the step being loaded never lands in time
    assert not stays_ahead(deadlines, 10, 1.0, 0.001)
    # 1 ms a slot (1.25 ms with the margin), 2 ms a step: slot k lands at 1.25*(k+1) ms
    assert stays_ahead(deadlines[2:], 10, 0.002, 0.001)  # 1.25, 2.5, 3.75 <= 2, 8, 20
    assert not stays_ahead(deadlines[2:], 10, 0.001, 0.001)  # 1.25 > 1: step 11 would wait
    assert not stays_ahead(deadlines[2:], 10, 0.002, None)  # no slot landed yet: no rate


def test_rows_are_read_ahead_over_a_window_sized_from_the_pace_and_the_latency() -> None:
    assert rows_ahead_steps(None, 0.05) == rows_ahead_steps(0.01, None) == ROWS_AHEAD_STEPS
    assert rows_ahead_steps(0.01, 0.05) == 11  # twice the latency, in 10 ms steps, plus one
    assert rows_ahead_steps(0.1, 0.001) == 2
    assert rows_ahead_steps(0.001, 10.0) == MAX_ROWS_AHEAD_STEPS


def _engine_reading_rows_for_30_s() -> tuple[Engine, int]:
    """An engine whose chunks and rows each take 30 s, and a mid-minipoch step to load."""
    source = FakeSource(
        *make_data(rows=4096),
        chunk=SEQ_LEN * 16,
        latency_s=30,
        partial_reads=True,
        item_latency_s=30,
    )
    engine = make(source, streams=1, rbpsb=32, spb=16, batch=8)
    return engine, engine.plan.first_step(1) + 5


def test_a_load_its_caller_cancelled_ends_cancelled_when_the_engine_closes() -> None:
    # A load that timed out is cancelled by its caller; close() then runs aclose() before the
    # load's task has seen the cancellation. The load must end cancelled: raising
    # LoaderClosedError there left an exception nobody retrieves ("Task exception was never
    # retrieved" on stderr after a LoadTimeoutError and close()).
    engine, step = _engine_reading_rows_for_30_s()

    async def main() -> None:
        load = asyncio.ensure_future(engine.gather(step, ALL))
        await asyncio.sleep(0.05)  # reading its rows (they take 30 s)
        load.cancel()
        await engine.aclose()
        await asyncio.gather(load, return_exceptions=True)
        assert load.cancelled(), load.exception()

    run(main)


def test_a_load_whose_rows_aclose_cancelled_learns_the_engine_was_closed() -> None:
    engine, step = _engine_reading_rows_for_30_s()

    async def main() -> None:
        load = asyncio.ensure_future(engine.gather(step, ALL))
        await asyncio.sleep(0.05)
        await engine.aclose()
        with pytest.raises(LoaderClosedError):
            await load

    run(main)


def test_behind_a_network_the_fill_streams_on_while_a_load_reads_its_rows() -> None:
    # Row reads take 2 s, whole chunks 0.1 s. On a remote store a fill that has started is not
    # paused while a load's rows are read (they go first at the store's limiter instead): chunk
    # reads complete meanwhile. A fill not started yet waits for the first load's rows.
    source = FakeSource(
        *make_data(rows=4096),
        chunk=SEQ_LEN * 16,
        latency_s=0.1,
        partial_reads=True,
        item_latency_s=2.0,  # 1.8 s below for the chunks: a busy 2-core CI machine needs it
    )
    source.remote = True
    workers = 16  # given: the default for these 512-byte chunks would be 64
    engine = make(source, streams=1, rbpsb=32, spb=16, batch=8, max_concurrent_reads=workers)
    oracle = oracle_for(engine, source)
    step = engine.plan.first_step(1) + 5

    async def main() -> None:
        first = asyncio.ensure_future(engine.gather(step, ALL))
        await until(lambda: source.item_reads >= 8, "the first load's row reads")
        assert not source.reads  # the fresh fill waits for them
        np.testing.assert_array_equal(await first, oracle.encoded_batch(step))
        later = step + 1 + ROWS_AHEAD_STEPS  # not read ahead
        reads_before = len(source.reads)
        load = asyncio.ensure_future(engine.gather(later, ALL))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.8
        # More chunks than the workers had in flight: the fills went on taking units.
        while len(source.reads) - reads_before <= workers and loop.time() < deadline:
            await asyncio.sleep(0.005)
        assert len(source.reads) - reads_before > workers and not load.done()
        np.testing.assert_array_equal(await load, oracle.encoded_batch(later))
        await engine.aclose()

    run(main)


def test_closing_stops_computing_the_block_order() -> None:
    """The block order of 10^14 tokens (95M read blocks: ~1 s of draws on two cores, for the
    one stream of 1,024 this host serves) is stopped when its engine closes, not waited for."""
    import threading
    import time

    from asyncflat.engine.permutations import block_order_off_loop
    from asyncflat.plan.permutation import Stop, ensure_kernel

    ensure_kernel()  # its one-time compile (0.1-0.2 s) is not the stop's to time

    params = FlatTokensParams("fake://tokens", 1024, 16, 512, seed=0, sequence_packing=True)
    plan = ShufflePlan.create(
        params,
        TokenBatchParams(len=2048, batch=1024),
        token_count=10**14,
        sequence_count=10**14 // 2048,
        served_streams=(512,),
    )
    assert plan.read_block_count > 95_000_000

    async def main() -> tuple[float, BaseException | None, threading.Thread]:
        stop = Stop()
        order, thread = block_order_off_loop(plan, stop)
        await asyncio.sleep(0.05)  # computing
        assert not order.done()
        started = time.perf_counter()
        stop.set()  # what closing the engine does
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        stopped_in = time.perf_counter() - started
        await asyncio.sleep(0)  # the result is handed to the loop
        return stopped_in, order.exception(), thread

    stopped_in, error, thread = run(main)
    assert not thread.is_alive()
    assert stopped_in < 0.25, stopped_in
    assert isinstance(error, LoaderClosedError)
    assert "served_block_order" not in vars(plan)  # nothing half-computed is kept
    assert "early_block_order" not in vars(plan)


def test_a_load_whose_fills_cannot_all_start_holds_none_of_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load owns each fill it reads while it reads it (never dropped nor cancelled meanwhile).
    When one of its fills cannot start (no memory for a buffer), the fills it already owned are
    let go: held forever, they could never be evicted for another minipoch."""
    source = FakeSource(*make_data(rows=2048), chunk=SEQ_LEN * 8)
    engine = make(source, streams=2, rbpsb=2, spb=8, batch=8)
    tables: list[FillTable] = []
    real = FillTable.ensure

    def ensure(self: FillTable, stream: int, minipoch: int, *args: Any, **kwargs: Any) -> Fill:
        tables.append(self)
        if stream == 1:
            raise MemoryError("no memory for a shuffle buffer")
        return real(self, stream, minipoch, *args, **kwargs)

    async def main() -> None:
        with monkeypatch.context() as patch:
            patch.setattr(FillTable, "ensure", ensure)
            with pytest.raises(MemoryError):
                await engine.gather(0, ALL)
        fill = tables[0].get(0, 0)
        assert fill is not None and fill.owners == 0
        np.testing.assert_array_equal(
            await engine.gather(0, ALL), oracle_for(engine, source).encoded_batch(0)
        )
        await engine.aclose()

    run(main)
