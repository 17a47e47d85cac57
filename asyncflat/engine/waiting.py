"""What a load does about each fill it reads: serve a finished buffer, wait for the blocks it
needs of a fill in progress, or read its rows on their own when the fill is behind (and start
reading the next steps' rows too); a failed fill is dropped and its error raised with the step.
"""

from __future__ import annotations

import asyncio
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

__all__ = ["ROWS_AHEAD_STEPS", "FillWaiter", "raise_with_context"]

#: Steps whose rows a load served by row reads starts reading ahead (a fill in progress).
ROWS_AHEAD_STEPS = 8


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
    ) -> None:
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
            reads_rows = self._reads_rows(fill)
            await self._make_urgent(fill)
        if not fill.done and reads_rows:
            assert self._rows is not None
            await self._serve_early(fill, step, buffer_rows, out)
            if not fill.done and self._rows.reads_ahead:  # after this load's rows
                self._rows.read_ahead(fill, self._rows_ahead(fill, step, batch_indices))
            return
        if not fill.done:
            await self._wait_ready(fill, step, buffer_rows)
        elif fill.error is not None:
            self._raise_fill_error(fill, step)
        np.take(fill.buffer, buffer_rows, axis=0, out=out)

    def _reads_rows(self, fill: Fill) -> bool:
        """Whether a load reads its missing rows on their own rather than wait for the fill.

        Behind a network, always: a few demand requests beat the rest of a fill. On a local
        store, only while none of the fill's units has started (the first load after a start or
        a resume: its rows first, then the fill). Once the fill decodes, a row read there is a
        whole Blosc block decoded for one row (64x the bytes on seqax's layout), on the same
        cores as the fill: at start-up the first 8 loads read their rows in 0.3-0.55 s and the
        first minipoch took 0.77-1.06 s, against 0.44 s when they wait for the fill at full
        speed (every decode thread: the load made it urgent).
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

    def _rows_ahead(self, fill: Fill, step: int, batch_indices: np.ndarray) -> np.ndarray:
        """Buffer rows of ``fill`` that the next steps' loads of the same batch rows will read
        (up to ``ROWS_AHEAD_STEPS`` steps, as long as they stay in this fill)."""
        rows = []
        for ahead in range(step + 1, min(step + 1 + ROWS_AHEAD_STEPS, self._plan.step_count)):
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
            if fill.deadlines[slot] > step and fill.deadlines[slot] != NEVER:
                # Filled in order of need, except when a load jumps backwards: bump its units.
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
