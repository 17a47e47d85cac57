"""The unit scheduler: two priority queues, a fixed set of workers, one admission rule.

Units of every fill wait keyed by the first step that needs them, and a fixed set of workers
pulls from the queues. That bounds the reads in flight (a sliding window, like fsspec's
``_run_coros_in_chunks``) and makes every fill demand-first: a load waits only for the units its
own rows live in, and the next step's units always go first.

Demand before prefetch: units a load needs (those of a fill that is not a background prefetch)
queue apart from background units and are always taken first, whatever their step: a demand
unit queued behind many prefetch units is the next one a worker takes. A background unit is
taken only when a background slot is free (``background_limit`` at a time), so a worker never
sits on a prefetch unit it may not run while demand units wait.

The admission rule (:func:`admits`): a worker first reserves the decoded size of the largest
unit in the byte budget, then takes the most urgent unit queued *at that moment*. Taking a unit
first and waiting for room after would let prefetch units popped early hold the budget while a
load's units queue behind them (a priority inversion that made first fills 8x slower).

:meth:`UnitScheduler.paused` stops workers from taking new units while a load reads its rows
one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

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


_Entry = tuple[int, int, Any]


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
        hold_background: Callable[[], bool] | None = None,
        name: str = "asyncflat-read",
    ) -> None:
        """``hold_background`` (when given) says that no background unit may start now
        (:meth:`poke` once it may again)."""
        self._run, self._name = run, name
        self.workers, self.reserve, self.budget = workers, reserve, budget
        self.background_limit = background_limit
        self._hold_background = hold_background
        self._demand: list[_Entry] = []  # heaps of (priority, order, unit)
        self._background: list[_Entry] = []
        self._order = itertools.count()  # FIFO among equal priorities
        self._tasks: list[asyncio.Task[None]] = []
        self._changed: asyncio.Event | None = None  # set whenever a worker may take a unit
        self._pauses = 0
        self.in_flight_bytes = 0
        self.background_active = 0
        self.running = 0
        self.peak_running = 0

    # asyncio objects are made on first use, on the loop that runs the workers.
    def _ensure(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def poke(self) -> None:
        """Workers look again for a unit they may take (what admits one has changed)."""
        self._ensure().set()

    def start(self) -> None:
        """Start the workers (on the running loop), once."""
        self._ensure()
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._worker(), name=f"{self._name}-{i}")
                for i in range(self.workers)
            ]

    def put(self, unit: U) -> None:
        heap = self._background if unit.background() else self._demand
        heapq.heappush(heap, (unit.priority, next(self._order), unit))
        self.poke()

    def reprioritise(self, unit: U, priority: int) -> None:
        """Run ``unit`` at ``priority`` if it is more urgent and not taken yet; its old queue
        entry no longer matches and is skipped."""
        if not unit.taken and priority < unit.priority:
            unit.priority = priority
            self.put(unit)

    def requeue(self, unit: U, priority: int) -> None:
        """Run ``unit`` at ``priority``, more or less urgent than before, if not taken yet
        (a fill re-planned for a later first step)."""
        if not unit.taken and priority != unit.priority:
            unit.priority = priority
            self.put(unit)

    async def wake_background(self) -> None:
        """A unit's ``background()`` may have turned False: queued ones move to the demand
        queue (ahead of every background unit) and the workers re-check."""
        promoted = [entry for entry in self._background if not entry[2].background()]
        if promoted:
            self._background = [entry for entry in self._background if entry[2].background()]
            heapq.heapify(self._background)
            for entry in promoted:
                heapq.heappush(self._demand, entry)
        self.poke()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Workers take no new unit meanwhile (units already taken finish)."""
        self._ensure()
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1
            if not self._pauses:
                self.poke()

    def clear(self) -> None:
        """Forget every queued unit (closing: they hold their fills, and those the buffers)."""
        self._demand.clear()
        self._background.clear()

    async def aclose(self) -> None:
        """Cancel the workers and wait for them."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def queued(self) -> tuple[int, int]:
        """Entries queued (demand, background), stale ones included: for tests and figures."""
        return len(self._demand), len(self._background)

    # -- workers --------------------------------------------------------------------------------

    async def _worker(self) -> None:
        changed = self._ensure()
        while True:
            taken = self._take()
            if taken is None:
                changed.clear()  # nothing to take now: sleep until the state changes
                await changed.wait()
                continue
            unit, held = taken
            try:
                await self._execute(unit)
            finally:
                self.in_flight_bytes -= self.reserve
                if held:
                    self.background_active -= 1
                self.poke()
            # An idle worker must not keep its last unit (and so that unit's fill, its ready
            # events and a view of its buffer) alive until it takes the next one.
            del unit, taken

    def _take(self) -> tuple[U, bool] | None:
        """The most urgent unit a worker may run now (demand first) and whether it holds a
        background slot; None when paused, over budget, or nothing may run."""
        if self._pauses or not admits(self.in_flight_bytes, self.reserve, self.budget):
            return None
        for heap in (self._demand, self._background):
            while heap:
                priority, _, unit = heap[0]
                if unit.taken or unit.dropped() or unit.priority != priority:
                    heapq.heappop(heap)  # fill gone, or a stale entry of a moved unit
                    continue
                held = unit.background()
                if held and (
                    self.background_active >= self.background_limit
                    or (self._hold_background is not None and self._hold_background())
                ):
                    break  # background units behind it may not run either
                heapq.heappop(heap)
                unit.taken = True
                self.in_flight_bytes += self.reserve
                self.background_active += held
                return unit, held
        return None

    async def _execute(self, unit: U) -> None:
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
