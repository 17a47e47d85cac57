"""The unit scheduler: one priority queue, a fixed set of workers, one admission rule.

Units of every fill wait in one queue keyed by the first step that needs them, and a fixed set
of workers pulls from it. That bounds the reads in flight (a sliding window, like fsspec's
``_run_coros_in_chunks``) and makes every fill demand-first: a load waits only for the units its
own rows live in, and the next step's units always go first.

The admission rule (:func:`admits`): a worker first reserves the decoded size of the largest
unit in the byte budget, then takes the most urgent unit queued *at that moment*. Taking a unit
first and waiting for room after would let prefetch units popped early hold the budget while a
load's units queue behind them (a priority inversion that made first fills 8x slower).

Two more limits shape what runs: background units (a prefetch nobody waits for yet) run at most
``background_limit`` at a time, and :meth:`UnitScheduler.paused` stops workers from taking new
units while a load reads its rows one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["Schedulable", "UnitScheduler", "admits"]

log = logging.getLogger(__name__)


class Schedulable(Protocol):
    #: lower runs first (the first step that needs it)
    priority: int
    #: set when a worker takes it: a unit runs once, whatever stale queue entries remain
    taken: bool

    def dropped(self) -> bool:
        """Its fill is gone or failed: skip it."""
        ...

    def background(self) -> bool:
        """Nobody waits for it yet: it runs under the background limit."""
        ...


U = TypeVar("U", bound=Schedulable)


def admits(in_flight_bytes: int, reserve: int, budget: int) -> bool:
    """Whether a worker may reserve ``reserve`` more bytes: always when nothing is in flight
    (a unit bigger than the budget still runs, alone), else only within the budget."""
    return in_flight_bytes == 0 or in_flight_bytes + reserve <= budget


class UnitScheduler(Generic[U]):
    """Runs queued units with ``workers`` workers under a byte budget; ``run`` must not raise
    (the engine turns a unit's failure into its fill's error)."""

    def __init__(
        self,
        run: Callable[[U], Awaitable[None]],
        *,
        workers: int,
        reserve: int,
        budget: int,
        background_limit: int,
        name: str = "asyncflat-read",
    ) -> None:
        self._run, self._name = run, name
        self.workers, self.reserve, self.budget = workers, reserve, budget
        self.background_limit = background_limit
        self._queue: asyncio.PriorityQueue[tuple[int, int, U]] | None = None
        self._order = itertools.count()  # FIFO among equal priorities
        self._tasks: list[asyncio.Task[None]] = []
        self._budget: asyncio.Condition | None = None
        self._background: asyncio.Condition | None = None
        self._go: asyncio.Event | None = None
        self._pauses = 0
        self.in_flight_bytes = 0
        self.background_active = 0
        self.running = 0
        self.peak_running = 0

    # asyncio objects are made on first use, on the loop that runs the workers.
    def _ensure(self) -> asyncio.PriorityQueue[tuple[int, int, U]]:
        if self._queue is None:
            self._queue = asyncio.PriorityQueue()
            self._budget, self._background = asyncio.Condition(), asyncio.Condition()
            self._go = asyncio.Event()
            self._go.set()
        return self._queue

    def start(self) -> None:
        """Start the workers (on the running loop), once."""
        self._ensure()
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._worker(), name=f"{self._name}-{i}")
                for i in range(self.workers)
            ]

    def put(self, unit: U) -> None:
        self._ensure().put_nowait((unit.priority, next(self._order), unit))

    def reprioritise(self, unit: U, priority: int) -> None:
        """Run ``unit`` at ``priority`` if it is more urgent and not taken yet; its old queue
        entry no longer matches and is skipped."""
        if not unit.taken and priority < unit.priority:
            unit.priority = priority
            self.put(unit)

    async def wake_background(self) -> None:
        """A unit's ``background()`` may have turned False: re-check the waiting ones."""
        if self._background is not None:
            async with self._background:
                self._background.notify_all()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Workers take no new unit meanwhile (units already taken finish)."""
        self._ensure()
        assert self._go is not None
        self._pauses += 1
        self._go.clear()
        try:
            yield
        finally:
            self._pauses -= 1
            if not self._pauses:
                self._go.set()

    def clear(self) -> None:
        """Forget every queued unit (closing: they hold their fills, and those the buffers)."""
        if self._queue is not None:
            while not self._queue.empty():
                self._queue.get_nowait()

    async def aclose(self) -> None:
        """Cancel the workers and wait for them."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _worker(self) -> None:
        queue, budget, go = self._ensure(), self._budget, self._go
        assert budget is not None and go is not None
        reserve = self.reserve
        while True:
            async with budget:
                await budget.wait_for(lambda: admits(self.in_flight_bytes, reserve, self.budget))
                self.in_flight_bytes += reserve
            try:
                await go.wait()
                unit = await self._next(queue)
                await self._execute(unit)
            finally:
                async with budget:
                    self.in_flight_bytes -= reserve
                    budget.notify_all()

    @staticmethod
    async def _next(queue: asyncio.PriorityQueue[tuple[int, int, U]]) -> U:
        while True:
            priority, _, unit = await queue.get()
            if unit.taken or unit.dropped() or unit.priority != priority:
                continue  # fill gone, or a stale entry of a re-prioritised unit
            unit.taken = True
            return unit

    async def _execute(self, unit: U) -> None:
        background = self._background
        assert background is not None
        held = unit.background()
        if held:
            async with background:
                await background.wait_for(
                    lambda: not unit.background() or self.background_active < self.background_limit
                )
                self.background_active += 1
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            await self._run(unit)
        except asyncio.CancelledError:
            raise
        except Exception:  # run() reports failures itself; never let a worker die
            log.exception("unit %r failed in the scheduler", unit)
        finally:
            self.running -= 1
            if held:
                async with background:
                    self.background_active -= 1
                    background.notify_all()
