"""The engines of a mixture's sources, one per source and pass, on the loader's event loop.

A source's pass ``e`` is its epoch ``e`` (:func:`asyncflat.plan.shuffle.epoch_seed`); each open pass is
an :class:`~asyncflat.engine.Engine` over this host's streams. :class:`Passes` opens a pass on
first use (one open however many loads ask at once), opens the next pass of a source in the
background while the source serves the last minipoch of the current one, and closes passes
more than one away from the newest (never one a gather is reading).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from asyncflat.config import EngineOptions
from asyncflat.engine import Engine, IntervalStats
from asyncflat.engine.waiting import raise_with_context
from asyncflat.errors import AsyncflatError, LoaderClosedError
from asyncflat.loader.shared.open import fills_on_open
from asyncflat.plan.shuffle import ShufflePlan

__all__ = ["Passes", "RowGroup", "SourceState", "sum_intervals"]

log = logging.getLogger("asyncflat.loader.mixture.loader")


@dataclasses.dataclass
class SourceState:
    """One source on this host: its open passes and the figures ``stats()`` reports."""

    index: int
    where: str
    engines: dict[int, Engine] = dataclasses.field(default_factory=dict)  # pass -> engine
    opening: dict[int, asyncio.Future[Engine]] = dataclasses.field(default_factory=dict)
    step_count: int = 0
    last_minipoch_step: int = 0
    buffer_bytes: int = 0  # this host's shuffle buffers of one pass
    #: its rows never served were warned of (every pass drops the same: said once)
    sizes_warned: bool = False
    rows: int = 0
    passes: int = 1


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """Rows of one source pass and step that one mixture step needs on this host."""

    source: int
    epoch: int
    step: int
    rows: np.ndarray  # sorted source batch rows
    out: np.ndarray  # host row positions they go to
    take: np.ndarray  # index into ``rows`` for each of ``out``


def sum_intervals(intervals: list[IntervalStats]) -> IntervalStats | None:
    """One interval of several engines (None for none): counts summed, ``seconds`` and
    ``wait_max_s`` the largest, ``wait_median_s`` the largest of the engines' medians (a mixture
    step waits for its slowest source)."""
    if not intervals:
        return None

    def largest(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    counts = {
        name: sum(getattr(i, name) for i in intervals)
        for name in (
            "steps_loaded",
            "fills_completed",
            "fills_late",
            "bytes_read",
            "bytes_useful",
            "requests",
            "retries",
        )
    }
    return IntervalStats(
        seconds=max(i.seconds for i in intervals),
        wait_median_s=largest([i.wait_median_s for i in intervals]),
        wait_max_s=largest([i.wait_max_s for i in intervals]),
        **counts,
    )


class Passes:
    """Opens, serves from and closes the sources' passes (call on the loop, except
    :meth:`engine_now`, :meth:`next_pass_due` and :meth:`try_gather`, which only read)."""

    def __init__(
        self,
        sources: list[SourceState],
        open_pass: Callable[[int, int], Awaitable[Engine]],
        first_rows: np.ndarray,
    ) -> None:
        self.sources = sources
        self._open_pass = open_pass
        self._first_rows = first_rows  # one row of each of this host's streams
        self._tasks: set[asyncio.Task[Any]] = set()
        self._users: collections.Counter[tuple[int, int]] = collections.Counter()
        #: the last interval figures of the passes closed since :meth:`interval_stats`
        self._closed_interval: IntervalStats | None = None
        self.closed = False

    def engine_now(self, index: int, epoch: int) -> Engine | None:
        return self.sources[index].engines.get(epoch)

    async def open_first(self, streams: int) -> list[ShufflePlan]:
        """Open every source's first pass, note its shape in its state (``buffer_bytes`` for
        this host's ``streams``) and return the sources' plans."""
        engines = await asyncio.gather(
            *(self.engine(s.index, 0) for s in self.sources), return_exceptions=True
        )
        for source, engine in zip(self.sources, engines):
            if isinstance(engine, AsyncflatError) and source.where not in str(engine):
                # "the split yields 176 rows" says nothing of which store is too small
                raise_with_context(
                    engine, f"MixtureParams.sources[{source.index}] ({source.where})"
                )
            if isinstance(engine, BaseException):
                raise engine
        plans = []
        for source, engine in zip(self.sources, engines):
            assert isinstance(engine, Engine)
            plan = engine.plan
            plans.append(plan)
            source.step_count = plan.step_count
            source.last_minipoch_step = plan.last_minipoch_step
            source.buffer_bytes = plan.buffers_per_stream * streams * plan.buffer_bytes
        return plans

    def fill_on_open(self, options: EngineOptions, unread: frozenset[int] = frozenset()) -> None:
        """Start step 0's fills of every source's first pass, as ``options`` say (on the loop,
        before any load), but those of the sources in ``unread`` (no step reads them)."""
        for source in self.sources:
            if source.index in unread:
                continue
            engine = source.engines.get(0)
            if engine is not None and fills_on_open(options, engine.source):
                engine.opening.start(fill=True)

    def stop_opening(self, keep: set[tuple[int, int]]) -> None:
        """The mixture's first load is not its first step (a resume): the passes not in
        ``keep`` ((source, pass) that a load may still read from its step 0) cancel what is
        not done of step 0's fills (on the loop)."""
        for source in self.sources:
            for epoch, engine in source.engines.items():
                if (source.index, epoch) not in keep:
                    engine.opening.stop()

    def try_gather(self, groups: list[RowGroup]) -> list[np.ndarray] | None:
        """The rows of every group without the loop when all are ready in open passes and no
        next pass is due, else None (the caller then runs :meth:`gather` on the loop)."""
        results = []
        served: list[tuple[Engine, int, float]] = []
        for group in groups:
            engine = self.engine_now(group.source, group.epoch)
            if engine is None or self.next_pass_due(group):
                return None
            t0 = time.perf_counter()
            try:
                # Not recorded yet: if a later group is not ready, the loop path gathers (and
                # records) every group again.
                rows = engine.try_gather(group.step, group.rows, record=False)
            except LoaderClosedError:  # this pass was just evicted: the loop path reopens it
                return None
            if rows is None:
                return None
            served.append((engine, group.step, time.perf_counter() - t0))
            results.append(rows)
        for engine, step, wait in served:
            engine.record_step(step, wait)
        return results

    async def engine(self, index: int, epoch: int) -> Engine:
        source = self.sources[index]
        engine = source.engines.get(epoch)
        if engine is not None:
            return engine
        future = source.opening.get(epoch)
        if future is None:
            future = asyncio.ensure_future(self._open(index, epoch))
            source.opening[epoch] = future
        return await asyncio.shield(future)

    async def _open(self, index: int, epoch: int) -> Engine:
        source = self.sources[index]
        try:
            engine = await self._open_pass(index, epoch)
        finally:
            source.opening.pop(epoch, None)
        if self.closed:
            await engine.aclose()
            raise LoaderClosedError("this MixtureLoader is closed")
        source.engines[epoch] = engine
        for old in [e for e in source.engines if abs(e - epoch) > 1]:
            if not self._users[(index, old)]:  # one a gather is reading goes at a later open
                closing = source.engines.pop(old)
                last = [closing.interval_stats(), self._closed_interval]
                self._closed_interval = sum_intervals([i for i in last if i is not None])
                self._spawn(closing.aclose())
        return engine

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not self.closed:
            # A load that needs this pass opens it again and raises the error itself.
            log.warning("mixture: a background open or fill failed: %r", task.exception())

    async def _start_next_pass(self, index: int, epoch: int) -> None:
        """Open pass ``epoch`` of a source and fill its first minipoch (in the background)."""
        engine = await self.engine(index, epoch)
        try:
            await engine.gather(0, self._first_rows)
        except LoaderClosedError:
            if self.sources[index].engines.get(epoch) is engine:
                raise
            # A load two passes further closed this pass while it filled: nobody needs it now.

    def next_pass_due(self, group: RowGroup) -> bool:
        source = self.sources[group.source]
        nxt = group.epoch + 1
        return (
            group.step >= source.last_minipoch_step
            and nxt not in source.engines
            and nxt not in source.opening
        )

    async def gather(self, groups: list[RowGroup]) -> list[np.ndarray]:
        """The rows of every group, the sources read concurrently."""
        for group in groups:
            if self.next_pass_due(group):
                log.debug("opening pass %d of source %d ahead", group.epoch + 1, group.source)
                self._spawn(self._start_next_pass(group.source, group.epoch + 1))

        async def one(group: RowGroup) -> np.ndarray:
            key = (group.source, group.epoch)
            self._users[key] += 1  # not closed while this gather reads it
            try:
                engine = await self.engine(group.source, group.epoch)
                return await engine.gather(group.step, group.rows)
            finally:
                self._users[key] -= 1

        return list(await asyncio.gather(*(one(g) for g in groups)))

    def interval_stats(self) -> IntervalStats | None:
        """The figures of every pass since the previous call (those of the passes closed
        meanwhile included), summed; None before any pass is open (call on the loop)."""
        engines = [e for s in self.sources for e in s.engines.values()]
        intervals = [e.interval_stats() for e in engines]
        if self._closed_interval is not None:
            intervals.append(self._closed_interval)
            self._closed_interval = None
        return sum_intervals(intervals)

    async def aclose(self) -> None:
        self.closed = True
        for source in self.sources:
            for future in source.opening.values():
                future.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        engines = [e for s in self.sources for e in s.engines.values()]
        await asyncio.gather(*(e.aclose() for e in engines), return_exceptions=True)

    def release(self) -> None:
        """Drop the buffers of every pass (once the loop has stopped)."""
        self.closed = True
        for source in self.sources:
            for engine in source.engines.values():
                engine.release()
