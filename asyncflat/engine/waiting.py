"""What a load does about each fill it reads: serve a finished buffer, wait for the blocks it
needs of a fill in progress, or read its rows on their own when the fill is behind (and start
reading the next steps' rows too); a failed fill is dropped and its error raised with the step.

A *cold* load (the first of a fill none of whose reads has started, or of the fill started
when the loader opened: a start or a resume) may
instead wait until the fill is predicted to stay ahead of the trainer (:func:`stays_ahead`), so
that the loads after it never wait: on a local store at start-up (the trainer's pace unknown, a
fill costs a fraction of the reference's first load), and wherever the trainer's pace is known
(a resume inside a running job) and rows are not read one by one.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from asyncflat.config import EngineOptions
from asyncflat.engine.fill import Fill, Unit
from asyncflat.engine.lock import OwnedLock
from asyncflat.engine.recorder import Recorder
from asyncflat.engine.rows import RowReader
from asyncflat.engine.scheduler import UnitScheduler
from asyncflat.engine.table import FillTable
from asyncflat.errors import AsyncflatError, LoaderClosedError, StorageError
from asyncflat.plan.shuffle import NEVER, ShufflePlan

__all__ = [
    "MAX_ROWS_AHEAD_STEPS",
    "ROWS_AHEAD_STEPS",
    "FillWaiter",
    "raise_with_context",
    "rows_ahead_steps",
    "stays_ahead",
]

#: Steps whose rows a load served by row reads starts reading ahead while the trainer's pace or
#: the row reads' latency is not known yet; then :func:`rows_ahead_steps` sizes the window.
ROWS_AHEAD_STEPS = 8
MAX_ROWS_AHEAD_STEPS = 64
#: the fill's rate seen so far is discounted by this much when predicting it stays ahead
AHEAD_MARGIN = 1.25


def rows_ahead_steps(pace_s: float | None, latency_s: float | None) -> int:
    """Steps to read rows ahead: enough that a row read started now lands before its step,
    twice over (``latency_s`` of a row read, ``pace_s`` seconds per step), at least 2."""
    if not pace_s or latency_s is None:
        return ROWS_AHEAD_STEPS
    return min(MAX_ROWS_AHEAD_STEPS, max(2, math.ceil(2 * latency_s / pace_s) + 1))


def stays_ahead(deadlines: np.ndarray, step: int, pace_s: float, slot_s: float | None) -> bool:
    """Whether a fill whose pending slots are needed first at steps ``deadlines`` (sorted) lands
    each of them before its step, when slots land in that order every ``slot_s`` seconds and
    the trainer asks for step ``k`` in ``(k - step) * pace_s`` seconds. ``pace_s`` 0 (the
    trainer's pace unknown: assume it never waits) or an unknown rate: only when none is
    pending."""
    if not len(deadlines):
        return True
    if pace_s <= 0 or slot_s is None:
        return False
    lands = slot_s * AHEAD_MARGIN * np.arange(1, len(deadlines) + 1)
    return bool(np.all(lands <= (deadlines - step) * pace_s))


class FillWaiter:
    """Serves a load's rows of one fill (:meth:`serve`), on the engine's loop.

    Shares the engine's lock, fill table, scheduler, row reader and recorder; ``closed`` says
    whether the engine has been closed.
    """

    def __init__(
        self,
        plan: ShufflePlan,
        options: EngineOptions,
        *,
        lock: OwnedLock,
        fills: FillTable,
        scheduler: UnitScheduler[Unit],
        rows: RowReader | None,
        recorder: Recorder,
        closed: Callable[[], bool],
        local: bool,
    ) -> None:
        """``local``: the store is on this machine (a fill costs CPU, not round trips)."""
        self._local = local
        self._plan = plan
        self._options = options
        self._lock = lock
        self._fills = fills
        self._scheduler = scheduler
        self._rows = rows
        self._recorder = recorder
        self._closed = closed

    async def serve(
        self,
        fill: Fill,
        step: int,
        batch_indices: np.ndarray,
        buffer_rows: np.ndarray,
        out: np.ndarray,
    ) -> None:
        """Write the rows ``buffer_rows`` of ``fill`` (a load of ``step`` at ``batch_indices``)
        into ``out``, waiting for them or reading them alone if the fill is not done."""
        reads_rows = False
        if not fill.done:
            pace = self._cold_pace(fill, step)
            reads_rows = pace is None and self._reads_rows(fill)
            await self._make_urgent(fill)
            if pace is not None:
                await self._wait_until_ahead(fill, step, pace)
        if not fill.done and reads_rows:
            assert self._rows is not None
            await self._serve_early(fill, step, buffer_rows, out)
            if not fill.done and self._rows.reads_ahead:  # after this load's rows
                steps = rows_ahead_steps(self._recorder.rate.pace(step), self._rows.latency_s)
                self._rows.read_ahead(fill, self._rows_ahead(fill, step, batch_indices, steps))
            return
        if not fill.done:
            await self._wait_ready(fill, step, buffer_rows)
        elif fill.error is not None:
            self._raise_fill_error(fill, step)
        np.take(fill.buffer, buffer_rows, axis=0, out=out)

    def _cold_pace(self, fill: Fill, step: int) -> float | None:
        """The trainer's seconds per step to plan a cold load's wait with (0: unknown), or None
        when the load does not wait for the fill to stay ahead.

        At start-up on a local store the whole first fill costs a fraction of the reference's
        first load, while any step after the first that waits for it is a stall: the first
        load waits (the trainer's pace is not known yet). Behind a network a fill costs seconds
        and arrives in the order of need: the first load waits only for its own rows. Once the
        pace is known (a resume in a running job) a cold load waits just long enough, unless
        rows are read one by one from a remote store (they are read ahead instead)."""
        if not self._options.prefetch or not fill.cold:
            return None
        pace = self._recorder.rate.pace(step)
        if pace is not None:
            return pace if self._local or self._rows is None else None
        return 0.0 if self._local and self._recorder.steps.count == 0 else None

    async def _wait_until_ahead(self, fill: Fill, step: int, pace: float) -> None:
        """Wait until the rest of ``fill`` is predicted to land before the steps needing it
        (:func:`stays_ahead`, at the rate of its slots so far), or it is done or failed."""
        while not fill.done and fill.error is None:
            left = np.flatnonzero((fill.pending > 0) & (fill.deadlines != NEVER))
            deadlines = fill.deadlines[left]
            order = np.argsort(deadlines, kind="stable")
            elapsed = time.perf_counter() - fill.started
            slot_s = elapsed / fill.blocks_done if fill.blocks_done else None
            if stays_ahead(deadlines[order], step, pace, slot_s):
                return
            await fill.ready[int(left[order[0]])].wait()

    def _reads_rows(self, fill: Fill) -> bool:
        """Whether a load reads its missing rows on their own rather than wait for the fill.

        Asked only when the load does not wait for the fill to stay ahead (:meth:`_cold_pace`).
        Behind a network, always: a few demand requests beat the rest of a fill. On a local
        store, only while none of the fill's units has started (a jump with no trainer pace to
        plan with: random access; its rows first, then the fill). Once the fill decodes, a row
        read there is a whole Blosc block decoded for one row (64x the bytes on seqax's layout),
        on the same cores as the fill: at start-up the first 8 loads read their rows in
        0.3-0.55 s and the first minipoch took 0.77-1.06 s, against 0.44 s when they wait for
        the fill at full speed (every decode thread: the load made it urgent).
        """
        if self._rows is None:
            return False
        return self._rows.reads_ahead or not fill.reads_started

    async def _make_urgent(self, fill: Fill) -> None:
        fill.waited_on = True
        if not fill.urgent:
            fill.urgent = True  # a load waits on it: full speed from now on
            await self._scheduler.wake_background()

    async def _serve_early(
        self, fill: Fill, step: int, buffer_rows: np.ndarray, out: np.ndarray
    ) -> None:
        """A fill still in progress: its finished rows from the buffer, the others read alone."""
        assert self._rows is not None
        if fill.error is not None:
            self._raise_fill_error(fill, step)
        try:
            self._recorder.rows_read_directly += await self._rows.serve(fill, buffer_rows, out)
        except asyncio.CancelledError:
            # aclose() cancelled the reads: the load learns why. A load its caller cancelled
            # (a timeout, Ctrl-C) ends cancelled, closed or not: nobody would retrieve an error.
            task = asyncio.current_task()
            if self._closed() and not (task is not None and task.cancelling()):
                raise LoaderClosedError("the engine was closed") from None
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with the step and stream named
            raise_with_context(
                exc,
                f"step {step}: reading rows of stream {fill.stream} minipoch {fill.minipoch} failed",
            )

    def _rows_ahead(
        self, fill: Fill, step: int, batch_indices: np.ndarray, steps: int
    ) -> np.ndarray:
        """Buffer rows of ``fill`` that the next ``steps`` steps' loads of the same batch rows
        will read (as long as they stay in this fill)."""
        rows = []
        for ahead in range(step + 1, min(step + 1 + steps, self._plan.step_count)):
            loc = self._plan.locate(ahead, batch_indices)
            mine = (loc.stream == fill.stream) & (loc.minipoch == fill.minipoch)
            if not mine.any():
                break
            rows.append(fill.perm[loc.position[mine]])
        return np.concatenate(rows) if rows else np.empty(0, np.int64)

    async def _wait_ready(self, fill: Fill, step: int, buffer_rows: np.ndarray) -> None:
        if self._options.prefetch:
            slots = np.unique(buffer_rows // self._plan.sequences_per_read_block)
        else:  # the reference's behaviour: a load waits for the whole buffer
            slots = np.arange(len(fill.blocks))
        for slot in slots.tolist():
            if fill.deadlines[slot] > step:
                # Filled in order of need, except when a load jumps backwards: bump its units
                # (also those of blocks no step after the fill's start reads: NEVER, last).
                fill.deadlines[slot] = step
                for unit in fill.units:
                    if any(piece[0] == slot for piece in unit.pieces):
                        self._scheduler.reprioritise(unit, step)
            await fill.ready[slot].wait()
            if fill.error is not None:
                self._raise_fill_error(fill, step)

    def _raise_fill_error(self, fill: Fill, step: int) -> NoReturn:
        exc = fill.error
        assert exc is not None
        with self._lock:
            if self._fills.get(fill.stream, fill.minipoch) is fill:
                self._fills.drop(fill)  # the next load retries this minipoch
        raise_with_context(
            exc, f"step {step}: filling stream {fill.stream} minipoch {fill.minipoch} failed"
        )


def raise_with_context(exc: BaseException, context: str) -> NoReturn:
    """Re-raise ``exc`` (same library class, else StorageError) with ``context`` prefixed."""
    message = f"{context}: {exc}"
    if isinstance(exc, AsyncflatError):
        raise type(exc)(message) from exc
    raise StorageError(message) from exc
