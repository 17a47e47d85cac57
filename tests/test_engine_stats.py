"""The engine's figures alone, on a fake clock: step rate, lateness, rate-limited warnings."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from asyncflat.engine.stats import (
    FillHistory,
    FillProgress,
    FillRecord,
    LatenessMonitor,
    RateLimitedLog,
    StepLog,
    StepRate,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def async_dispatch(rate: StepRate, clock: Clock, steps: range, burst: int, step_s: float) -> None:
    """Loads in bursts of ``burst`` (no time between them), then the device's time for them."""
    for step in steps:
        rate.add(step)
        if step % burst == burst - 1:
            clock.now += burst * step_s


def test_step_rate_is_the_sustained_rate_not_the_last_gaps() -> None:
    clock = Clock()
    rate = StepRate(window_s=5.0, min_span_s=1.0, clock=clock)
    async_dispatch(rate, clock, range(16), burst=16, step_s=0.05)  # 0.8 s so far
    assert rate.per_second() is None  # too short a span to tell
    async_dispatch(rate, clock, range(16, 200), burst=16, step_s=0.05)
    assert rate.per_second() == pytest.approx(20.0, rel=0.1)  # 1 / 50 ms, bursts or not


def test_step_rate_forgets_what_is_older_than_its_window_and_restarts_on_a_jump() -> None:
    clock = Clock()
    rate = StepRate(window_s=2.0, min_span_s=0.5, clock=clock)
    for step in range(100):  # 10 steps/s for 10 s
        rate.add(step)
        clock.now += 0.1
    for step in range(100, 250):  # then 50 steps/s for 3 s
        rate.add(step)
        clock.now += 0.02
    assert rate.per_second() == pytest.approx(50.0, rel=0.1)
    assert rate.pace() == pytest.approx(0.02, rel=0.1)
    rate.add(5000)  # a jump (resume, random access): the rate is unknown again
    assert rate.per_second() is None and rate.last_step == 5000
    # ... but the trainer's pace is the one before the jump until the rate is known again
    assert rate.pace() == pytest.approx(0.02, rel=0.1)
    for step in range(5001, 5100):
        clock.now += 0.1
        rate.add(step)
    assert rate.pace() == pytest.approx(0.1, rel=0.1)


def test_a_second_jump_forgets_the_pace_before_the_first() -> None:
    clock = Clock()
    rate = StepRate(window_s=2.0, min_span_s=0.5, clock=clock)
    for step in range(100):
        rate.add(step)
        clock.now += 0.01
    assert rate.pace(5000) == pytest.approx(0.01, rel=0.1)  # a resume: the trainer's pace
    rate.add(5000)
    assert rate.pace(5001) == pytest.approx(0.01, rel=0.1)  # kept for the loads after it
    clock.now += 0.01
    assert rate.pace(77) is None  # another jump before a new rate: random access, no pace
    rate.add(77)
    assert rate.pace() is None


def test_a_step_loaded_again_is_neither_a_jump_nor_a_step_of_the_pace() -> None:
    # A mixture's source of weight 1/2 is asked for each of its steps twice in a row.
    clock = Clock()
    rate = StepRate(window_s=5.0, min_span_s=1.0, clock=clock)
    for step in range(100):
        for _ in range(2):
            rate.add(step)
            clock.now += 0.01
    assert rate.per_second() == pytest.approx(50.0, rel=0.05)  # its steps, one per 20 ms
    assert rate.pace(100) == pytest.approx(0.02, rel=0.05)


def test_the_pace_is_unknown_before_any_sustained_run_of_loads() -> None:
    clock = Clock()
    rate = StepRate(window_s=2.0, min_span_s=0.5, clock=clock)
    for step in (7, 300, 12, 900):  # random access only
        rate.add(step)
        clock.now += 0.1
    assert rate.pace() is None


def monitor(clock: Clock, per_second: float) -> tuple[LatenessMonitor, StepRate]:
    rate = StepRate(window_s=10.0, min_span_s=1.0, clock=clock)
    for step in range(int(per_second * 2)):  # two seconds at the given pace, up to "now"
        rate.add(step)
        clock.now += 1 / per_second
    return LatenessMonitor(rate, RateLimitedLog(logging.getLogger("test"))), rate


def test_lateness_needs_a_stable_prediction_and_warns_once() -> None:
    clock = Clock()
    lateness, _ = monitor(clock, per_second=10.0)  # at step 19 of a minipoch ending at 40
    progress = FillProgress(started=clock.now, blocks=100)
    verdicts = []
    for done in range(5, 60, 5):  # 5 blocks per 0.5 s: 10 s for the fill, 2 s until step 40
        clock.now += 0.5
        progress.blocks_done = done
        verdicts.append(lateness.check(progress, clock.now, deadline_step=40))
    late = [v for v in verdicts if v is not None]
    assert len(late) == 1 and verdicts.index(late[0]) == 2  # the third consecutive verdict
    finish, needed = late[0]
    assert finish > needed
    assert progress.warned and lateness.predicted_late == 1


def test_lateness_resets_when_the_fill_catches_up() -> None:
    clock = Clock()
    lateness, _ = monitor(clock, per_second=10.0)
    progress = FillProgress(started=clock.now, blocks=100)
    for done, dt in ((10, 1.0), (20, 1.0), (95, 0.1), (96, 0.0), (97, 0.0)):
        clock.now += dt
        progress.blocks_done = done
        assert lateness.check(progress, clock.now, deadline_step=60) is None
    assert progress.late_checks == 0 and not progress.warned


def test_no_prediction_without_a_known_step_rate() -> None:
    clock = Clock()
    rate = StepRate(clock=clock)
    lateness = LatenessMonitor(rate, RateLimitedLog(logging.getLogger("test")), stable=1)
    progress = FillProgress(started=clock.now, blocks=100)
    clock.now += 10
    progress.blocks_done = 1
    assert lateness.check(progress, clock.now, deadline_step=5) is None


def test_rate_limited_log_summarises_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("test.ratelimit"), interval_s=60, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        for i in range(100):
            log.warning("fill %d is late", i)
            clock.now += 1  # 100 occurrences over 100 s
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "fill 0 is late"
    assert len(messages) == 2 and messages[1].startswith("60 more like this in the last 60 s")
    assert messages[1].endswith("fill 60 is late") and log.count == 100


def test_step_log_keeps_the_last_records_and_counts_all() -> None:
    steps = StepLog(size=8)
    for i in range(20):
        steps.add(i, i / 10)
    kept, waits = steps.since(0)
    assert steps.count == 20 and kept.tolist() == list(range(12, 20))
    np.testing.assert_allclose(waits, np.arange(12, 20) / 10)
    assert steps.since(18)[0].tolist() == [18, 19]


def record(**changes: object) -> FillRecord:
    base: dict[str, object] = dict(
        stream=0,
        minipoch=1,
        reason="prefetch",
        blocks=4,
        blocks_done=4,
        cancelled=False,
        failed=False,
        duration_s=1.0,
        useful_bytes=10,
        throughput_bytes_per_s=10.0,
        must_finish_by_step=8,
        finished_at_step=3,
        waited_on=False,
        late=False,
    )
    base.update(changes)
    return FillRecord(**base)  # type: ignore[arg-type]


def test_fill_history_is_bounded_and_keeps_totals() -> None:
    history = FillHistory(size=3)
    for i in range(5):
        history.add(record(minipoch=i))
    history.add(record(cancelled=True))
    history.add(record(failed=True))
    history.add(record(late=True, waited_on=True))
    assert len(history.records) == 3
    assert (history.completed, history.cancelled, history.failed, history.late) == (6, 1, 1, 1)
    assert record()["minipoch"] == 1 and record().as_dict()["reason"] == "prefetch"
