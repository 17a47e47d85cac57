"""The unit scheduler alone: admission, priority order, the window, background limits, pauses."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from asyncflat.engine.scheduler import UnitScheduler, admits


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), timeout=20))


@dataclasses.dataclass(eq=False)
class Job:
    priority: int
    name: str = ""
    taken: bool = False
    is_background: bool = False
    is_dropped: bool = False
    gate: asyncio.Event | None = None

    def dropped(self) -> bool:
        return self.is_dropped

    def background(self) -> bool:
        return self.is_background


class Recorder:
    """The ``run`` callable: logs starts and ends, optionally waits on each job's gate."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: list[str] = []
        self.running = self.peak = 0
        self.all_done = asyncio.Event()
        self.expected = 0

    async def __call__(self, job: Job) -> None:
        self.started.append(job.name)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if job.gate is not None:
                await job.gate.wait()
            else:
                await asyncio.sleep(0.001)
        finally:
            self.running -= 1
            self.finished.append(job.name)
            if len(self.finished) == self.expected:
                self.all_done.set()


async def until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Poll ``predicate`` on the loop until true; fail naming ``what`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.001)


@pytest.mark.parametrize(
    ("in_flight", "reserve", "budget", "expected"),
    [(0, 10, 5, True), (5, 5, 10, True), (6, 5, 10, False), (0, 0, 0, True)],
)
def test_the_admission_rule(in_flight: int, reserve: int, budget: int, expected: bool) -> None:
    # A unit bigger than the whole budget still runs, alone; otherwise it must fit.
    assert admits(in_flight, reserve, budget) is expected


def test_units_run_most_urgent_first_and_never_more_than_the_window() -> None:
    async def main() -> None:
        rec = Recorder()
        sched: UnitScheduler[Job] = UnitScheduler(
            rec, workers=3, reserve=1, budget=100, background_limit=3
        )
        jobs = [Job(priority=p, name=f"p{p}") for p in (5, 1, 4, 2, 3, 0, 9, 7, 8, 6)]
        rec.expected = len(jobs)
        for job in jobs:
            sched.put(job)
        sched.start()
        await asyncio.wait_for(rec.all_done.wait(), 5)
        assert rec.started[:3] == ["p0", "p1", "p2"]  # all queued before the workers started
        assert sorted(rec.started) == sorted(j.name for j in jobs)
        assert rec.peak == 3 and sched.peak_running == 3
        await sched.aclose()

    run(main)


def test_the_byte_budget_bounds_units_in_flight() -> None:
    async def main() -> None:
        rec = Recorder()
        sched: UnitScheduler[Job] = UnitScheduler(
            rec, workers=8, reserve=10, budget=25, background_limit=8
        )
        gates = [asyncio.Event() for _ in range(6)]
        for i, gate in enumerate(gates):
            sched.put(Job(priority=i, name=str(i), gate=gate))
        rec.expected = len(gates)
        sched.start()
        await until(lambda: rec.running == 2, "two units running")
        await asyncio.sleep(0.02)
        assert rec.running == 2  # 2 x 10 bytes fit in 25, a third does not
        for gate in gates:
            gate.set()
        await asyncio.wait_for(rec.all_done.wait(), 5)
        assert rec.peak == 2
        await sched.aclose()

    run(main)


def test_dropped_and_taken_units_are_skipped_and_reprioritised_ones_run_once() -> None:
    async def main() -> None:
        rec = Recorder()
        sched: UnitScheduler[Job] = UnitScheduler(
            rec, workers=1, reserve=1, budget=10, background_limit=1
        )
        dropped = Job(priority=0, name="dropped", is_dropped=True)
        late = Job(priority=50, name="late")
        others = [Job(priority=10 + i, name=f"o{i}") for i in range(3)]
        for job in (dropped, late, *others):
            sched.put(job)
        sched.reprioritise(late, 1)  # a load jumped to it: it goes first now
        sched.reprioritise(late, 99)  # less urgent: ignored
        rec.expected = 4
        sched.start()
        await asyncio.wait_for(rec.all_done.wait(), 5)
        await asyncio.sleep(0.01)
        assert rec.started == ["late", "o0", "o1", "o2"]  # once each, the stale entry skipped
        await sched.aclose()

    run(main)


def test_background_units_run_one_at_a_time_until_someone_waits() -> None:
    async def main() -> None:
        rec = Recorder()
        sched: UnitScheduler[Job] = UnitScheduler(
            rec, workers=4, reserve=1, budget=100, background_limit=1
        )
        jobs = [
            Job(priority=i, name=str(i), is_background=True, gate=asyncio.Event()) for i in range(4)
        ]
        for job in jobs:
            sched.put(job)
        rec.expected = 4
        sched.start()
        await until(lambda: rec.running == 1, "the first background unit")
        await asyncio.sleep(0.02)
        assert rec.running == 1 and sched.background_active == 1
        for job in jobs:
            job.is_background = False  # a load now waits on this fill
        await sched.wake_background()
        await until(lambda: rec.running == 4, "all four units running")
        for job in jobs:
            assert job.gate is not None
            job.gate.set()
        await asyncio.wait_for(rec.all_done.wait(), 5)
        await sched.aclose()

    run(main)


def test_paused_workers_take_no_new_unit() -> None:
    async def main() -> None:
        rec = Recorder()
        sched: UnitScheduler[Job] = UnitScheduler(
            rec, workers=2, reserve=1, budget=100, background_limit=2
        )
        sched.start()
        async with sched.paused():
            sched.put(Job(priority=0, name="a"))
            await asyncio.sleep(0.02)
            assert rec.started == []
        rec.expected = 1
        await asyncio.wait_for(rec.all_done.wait(), 5)
        assert rec.started == ["a"]
        await sched.aclose()

    run(main)


def test_a_failing_unit_does_not_kill_its_worker(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        done = asyncio.Event()

        async def flaky(job: Job) -> None:
            if job.name == "bad":
                raise RuntimeError("boom")
            done.set()

        sched: UnitScheduler[Job] = UnitScheduler(
            flaky, workers=1, reserve=1, budget=10, background_limit=1
        )
        sched.put(Job(priority=0, name="bad"))
        sched.put(Job(priority=1, name="good"))
        sched.start()
        await asyncio.wait_for(done.wait(), 5)
        await sched.aclose()

    run(main)
    assert any("boom" in (r.exc_text or "") or r.exc_info for r in caplog.records)


def test_a_demand_unit_queued_behind_many_prefetch_units_is_taken_next() -> None:
    # A remote store: background units may use every worker. A load's unit put behind 16 queued
    # prefetch units (and with a later step than all of them) is the next one a worker takes.
    async def main() -> None:
        rec = Recorder()
        sched: UnitScheduler[Job] = UnitScheduler(
            rec, workers=4, reserve=1, budget=100, background_limit=4
        )
        prefetch = [
            Job(priority=i, name=f"bg{i}", is_background=True, gate=asyncio.Event())
            for i in range(20)
        ]
        for job in prefetch:
            sched.put(job)
        sched.start()
        await until(lambda: rec.running == 4, "four prefetch units running")
        demand = Job(priority=1000, name="demand", gate=asyncio.Event())
        sched.put(demand)
        assert prefetch[0].gate is not None
        prefetch[0].gate.set()  # a worker frees up
        await until(lambda: len(rec.started) == 5, "a fifth unit started")
        assert rec.started[4] == "demand"
        rec.expected = len(rec.started)
        for job in [*prefetch, demand]:
            assert job.gate is not None
            job.gate.set()
        await sched.aclose()

    run(main)


def test_workers_never_sit_on_prefetch_units_they_may_not_run() -> None:
    # A local store: one background unit at a time. The other workers leave the queued
    # prefetch units alone, so a load's unit starts at once instead of after a prefetch read.
    async def main() -> None:
        rec = Recorder()
        sched: UnitScheduler[Job] = UnitScheduler(
            rec, workers=4, reserve=1, budget=100, background_limit=1
        )
        prefetch = [
            Job(priority=i, name=f"bg{i}", is_background=True, gate=asyncio.Event())
            for i in range(8)
        ]
        for job in prefetch:
            sched.put(job)
        sched.start()
        await until(lambda: rec.running == 1, "one prefetch unit running")
        demand = Job(priority=50, name="demand", gate=asyncio.Event())
        sched.put(demand)
        await until(lambda: "demand" in rec.started, "the demand unit started")
        assert rec.started == ["bg0", "demand"] and rec.running == 2
        assert sched.background_active == 1
        for job in [*prefetch, demand]:
            assert job.gate is not None
            job.gate.set()
        await sched.aclose()

    run(main)


def test_units_of_a_fill_turned_urgent_go_ahead_of_background_units() -> None:
    async def main() -> None:
        rec = Recorder()
        sched: UnitScheduler[Job] = UnitScheduler(
            rec, workers=1, reserve=1, budget=100, background_limit=1
        )
        blocker = Job(priority=0, name="blocker", gate=asyncio.Event())
        sched.put(blocker)
        sched.start()
        await until(lambda: rec.running == 1, "the blocker running")
        others = [Job(priority=i, name=f"other{i}", is_background=True) for i in range(1, 4)]
        late = [Job(priority=100 + i, name=f"late{i}", is_background=True) for i in range(2)]
        for job in [*others, *late]:
            sched.put(job)
        for job in late:
            job.is_background = False  # a load now waits on this fill
        await sched.wake_background()
        rec.expected = 6
        assert blocker.gate is not None
        blocker.gate.set()
        await asyncio.wait_for(rec.all_done.wait(), 5)
        assert rec.started == ["blocker", "late0", "late1", "other1", "other2", "other3"]
        await sched.aclose()

    run(main)


def test_background_units_wait_while_held_and_start_once_poked() -> None:
    """A local store's engine holds background units while a load waits (they would take CPU
    from the units it waits for); demand units still run, and a poke lets the held ones go."""

    async def main() -> None:
        rec = Recorder()
        holding = [True]
        sched: UnitScheduler[Job] = UnitScheduler(
            rec,
            workers=4,
            reserve=1,
            budget=100,
            background_limit=1,
            hold_background=lambda: holding[0],
        )
        background = Job(priority=0, name="bg", is_background=True)
        demand = Job(priority=5, name="demand")
        sched.put(background)
        sched.put(demand)
        sched.start()
        await until(lambda: "demand" in rec.started, "the demand unit started")
        await asyncio.sleep(0.05)  # a bounded look for the held unit starting
        assert rec.started == ["demand"]
        holding[0] = False
        sched.poke()
        await until(lambda: "bg" in rec.started, "the held background unit started")
        await sched.aclose()

    run(main)
