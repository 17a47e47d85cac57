"""The :class:`Engine`: serves any step's rows from per-stream buffer pairs, filling ahead.

It composes the pieces of this package: the fill table and its buffers (:mod:`.table`,
:mod:`.fill`), the unit scheduler (:mod:`.scheduler`), row reads for loads ahead of their
blocks (:mod:`.rows`) and the figures (:mod:`.recorder`, :mod:`.stats`), over a
:class:`~asyncflat.source.TokenSource`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from .._heap import trim_later
from ..config import EngineOptions
from ..errors import AsyncflatError, LoaderClosedError, StorageError
from ..plan import NEVER, ShufflePlan
from ..source import TokenSource
from ..storage.limiter import DEMAND
from .fill import Fill, FillWriter, Unit, read_unpacked_rows
from .recorder import Recorder, log
from .rows import RowReader
from .scheduler import UnitScheduler
from .stats import EngineStats, IntervalStats
from .table import FillTable, Groups

__all__ = ["Engine"]

#: Steps whose rows a load served by row reads starts reading ahead (a fill in progress).
ROWS_AHEAD_STEPS = 8


class Engine:
    """Serves rows of any step for the streams of this host; runs on one event loop.

    Construct it and call :meth:`gather`/:meth:`aclose` on that loop (its asyncio objects bind
    there); only :meth:`try_gather` may be called from other threads.
    """

    def __init__(
        self,
        plan: ShufflePlan,
        source: TokenSource,
        streams: Sequence[int],
        options: EngineOptions,
    ) -> None:
        self.plan = plan
        self.source = source
        self.streams = tuple(sorted({int(s) for s in streams}))
        self.options = options
        self._loop: asyncio.AbstractEventLoop | None = None  # set by the first gather
        self._gather_lock = asyncio.Lock()
        # Guards the state other threads touch: which fill owns which buffer, and the step
        # records. The loop takes it briefly (never across an await) to start or drop fills;
        # try_gather takes it to read finished buffers from the caller's thread, so a buffer is
        # never handed to a new fill mid-read.
        self._lock = threading.Lock()
        # A prefetch fill nobody waits for yet runs one unit at a time on a local store (reads
        # are CPU copies there), so it takes at most about one core from the trainer; behind a
        # network its reads still overlap, since latency, not CPU, bounds them.
        unit_tokens = (
            source.token_chunk
            if plan.sequence_packing
            else plan.sequences_per_read_block * plan.seq_len
        )
        self._scheduler: UnitScheduler[Unit] = UnitScheduler(
            self._run_unit,
            workers=options.max_concurrent_reads,
            reserve=4 * unit_tokens,  # decoded bytes of the largest unit
            budget=self._inflight_budget(),
            background_limit=options.max_concurrent_reads if source.remote else 1,
        )
        self._recorder = Recorder()
        self._fills = FillTable(
            plan,
            self.streams,
            source.token_chunk,
            queue=self._scheduler.put,
            ended=self._recorder.fill_ended,
        )
        # Prefetch fills decode on all but one CPU thread, leaving a core to the trainer; a fill
        # that a load is waiting for (urgent) uses them all.
        self._background_decodes = asyncio.Semaphore(max(1, options.decode_threads - 1))
        # A load ahead of its blocks reads just its rows when the source can do that cheaply.
        self._rows = (
            RowReader(plan, source, self._scheduler, pause=not source.remote)
            if plan.sequence_packing and source.partial_reads and options.prefetch
            else None
        )
        #: the step of the load waiting right now, if any: the units it needs are demand reads
        self._waiting_step: int | None = None
        self._closed = False  # no load is served any more
        self._aclosed = False  # workers, row reads and the source closed

    def _inflight_budget(self) -> int:
        # Decoded bytes of reads in flight. An eighth of a buffer keeps peak memory near two
        # buffers per stream; a few whole chunks keep the read window open on small buffers.
        # Behind a network, latency is hidden only by keeping the whole read window busy.
        if self.options.max_inflight_bytes is not None:
            return self.options.max_inflight_bytes
        chunk_bytes = self.source.token_chunk * 4
        window = self.options.max_concurrent_reads if self.source.remote else 4
        return max(
            self.plan.buffer_bytes // 8,
            min(self.options.max_concurrent_reads, window) * chunk_bytes,
        )

    # -- public -------------------------------------------------------------------------------

    async def gather(self, step: int, batch_indices: np.ndarray) -> np.ndarray:
        """The encoded rows (uint32[len(batch_indices), len]) of ``step`` at ``batch_indices``.

        ``batch_indices`` must be sorted; the loader passes this host's rows.
        """
        self._check_open()
        self.plan.check_step(step)
        self._loop = asyncio.get_running_loop()
        self._scheduler.start()
        t0 = time.perf_counter()
        async with self._gather_lock:
            self._check_open()  # closed while this gather queued behind another
            loc = self.plan.locate(step, batch_indices)
            groups = self._groups(loc)
            fills: list[Fill] = []
            with self._lock:
                for stream, minipoch in groups:
                    keep = {m for s, m in groups if s == stream}
                    fill = self._fills.ensure(stream, minipoch, step, keep=keep)
                    fill.owners += 1  # never dropped nor cancelled while this load reads it
                    fills.append(fill)
                if self.options.prefetch:
                    self._fills.prefetch_after(groups)
            self._waiting_step = step
            try:
                out = np.empty((len(loc.batch_index), self.plan.seq_len), np.uint32)
                for fill, rows in zip(fills, groups.values()):
                    buffer_rows = fill.perm[loc.position[rows]]
                    if not fill.done:
                        await self._make_urgent(fill)
                    if not fill.done and self._rows is not None:
                        await self._serve_early(fill, step, buffer_rows, out[rows])
                        if not fill.done:  # after this load's rows: they must not wait
                            self._rows.read_ahead(fill, self._rows_ahead(fill, step, batch_indices))
                        continue
                    if not fill.done:
                        await self._wait_ready(fill, step, buffer_rows)
                    elif fill.error is not None:
                        self._raise_fill_error(fill, step)
                    np.take(fill.buffer, buffer_rows, axis=0, out=out[rows])
            finally:
                self._waiting_step = None
                with self._lock:
                    for fill in fills:
                        fill.owners -= 1
        self._record_step(step, time.perf_counter() - t0)
        return out

    def try_gather(self, step: int, batch_indices: np.ndarray) -> np.ndarray | None:
        """:meth:`gather` from the caller's thread, when nothing needs the loop; else None.

        The steady state (every row already in a finished buffer) skips the round trip to the
        loop thread; at the first step of a minipoch the prefetch of the next one is handed to
        the loop without waiting for it. A missing block or an error returns None: use
        :meth:`gather`, which waits.
        """
        self._check_open()
        self.plan.check_step(step)
        t0 = time.perf_counter()
        loc = self.plan.locate(step, batch_indices)
        groups = self._groups(loc)
        with self._lock:
            fills = []
            for stream, minipoch in groups:
                fill = self._fills.get(stream, minipoch)
                if fill is None or not fill.done or fill.error is not None:
                    return None
                fills.append(fill)
            out = np.empty((len(loc.batch_index), self.plan.seq_len), np.uint32)
            for fill, rows in zip(fills, groups.values()):
                np.take(fill.buffer, fill.perm[loc.position[rows]], axis=0, out=out[rows])
            due = self.options.prefetch and self._fills.prefetches_due(groups)
            if due and self._loop is not None:
                # Fire and forget: the loop re-checks, so a request sent twice starts one fill.
                self._loop.call_soon_threadsafe(self._start_prefetches, groups)
            self._recorder.step(step, time.perf_counter() - t0)
        return out

    async def aclose(self) -> None:
        """Cancel every fill and worker, free the buffers now (not at the next garbage
        collection). Idempotent."""
        if self._aclosed:
            return
        self._aclosed = self._closed = True
        self._fills.fail_all()
        rows = self._rows.aclose() if self._rows is not None else asyncio.sleep(0)
        try:
            await asyncio.gather(self._scheduler.aclose(), rows, return_exceptions=True)
        finally:
            self.release()
        await self.source.aclose()

    def release(self) -> None:
        """Drop every reference to the buffers (fills, queued units). Idempotent; for closing,
        once nothing runs on the loop any more (:meth:`aclose` calls it)."""
        self._closed = True
        with self._lock:
            self._fills.fail_all()
            self._scheduler.clear()
            self._fills.clear()

    def pin_keys(self, step: int, batch_indices: np.ndarray) -> list[tuple[int, int]]:
        """The (stream, minipoch) keys an iterator positioned at ``step`` pins: the minipochs
        the step reads and the next ones. Equal for every step of a minipoch, so an iterator
        pins once per minipoch (see :meth:`pin`). Any thread; no lock."""
        loc = self.plan.locate(step, batch_indices)
        keys = {(s, m) for s, m in zip(loc.stream.tolist(), loc.minipoch.tolist())}
        keys |= {(s, m + 1) for s, m in keys if m + 1 < self.plan.minipoch_count}
        return sorted(keys)

    def pin(self, keys: list[tuple[int, int]]) -> None:
        """Pin ``keys`` (from :meth:`pin_keys`) for an iterator: a prefetch never evicts their
        fills, a load of another minipoch takes an extra buffer first. Any thread."""
        with self._lock:
            if not self._closed:
                self._fills.pin(keys, 1)

    def unpin(self, keys: list[tuple[int, int]]) -> None:
        with self._lock:
            if not self._closed:
                self._fills.pin(keys, -1)

    def stats(self) -> EngineStats:
        """A snapshot of the figures (see :class:`~asyncflat.engine.stats.EngineStats`)."""
        with self._lock:
            return self._recorder.snapshot(
                fills=self._fills,
                allocations=self._fills.allocations,
                workers=self._scheduler,
                io=self.source.io,
                streams=self.streams,
            )

    def interval_stats(self) -> IntervalStats:
        """What happened since the previous call (the first call: since the start)."""
        current = self.stats()
        with self._lock:
            return self._recorder.interval(current)

    # -- fills --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderClosedError("the engine is closed")

    def _groups(self, loc: Any) -> Groups:
        """The (stream, minipoch) buffers a step reads, each with its run of output rows.

        Sorted batch indices give non-decreasing streams, and within a stream the minipoch
        only grows, so every buffer's rows form one contiguous run.
        """
        keys = loc.stream * self.plan.minipoch_count + loc.minipoch
        edges = [0, *(np.flatnonzero(np.diff(keys)) + 1).tolist(), len(keys)]
        groups = {}
        for lo, hi in itertools.pairwise(edges):
            stream, minipoch = divmod(int(keys[lo]), self.plan.minipoch_count)
            if not self._fills.serves(stream):
                raise ValueError(
                    f"batch index {int(loc.batch_index[lo])} belongs to stream {stream}, "
                    f"which this engine does not serve (it serves {list(self.streams)})"
                )
            if (stream, minipoch) in groups:
                raise ValueError("batch_indices must be sorted")
            groups[(stream, minipoch)] = slice(lo, hi)
        return groups

    def _start_prefetches(self, groups: Groups) -> None:
        if self._closed:
            return
        with self._lock:
            self._fills.prefetch_after(groups)

    # -- reading ------------------------------------------------------------------------------

    async def _run_unit(self, unit: Unit) -> None:
        fill = unit.fill
        waiting = self._waiting_step
        # A unit the waiting load needs goes ahead of every other request at the store.
        demand = DEMAND.set(waiting is not None and unit.priority <= waiting)
        try:
            await self._read_unit(unit)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - kept by the fill, raised by the load needing it
            log.debug(
                "read %d:%d of stream %d minipoch %d failed",
                unit.start,
                unit.stop,
                fill.stream,
                fill.minipoch,
                exc_info=True,
            )
            fill.fail(exc)
            return
        finally:
            DEMAND.reset(demand)
        if fill.cancelled:
            return
        fill.unit_done(unit)
        self._recorder.unit_done(fill, sum(piece[3] for piece in unit.pieces) * 4)
        if fill.done:
            trim_later(asyncio.get_running_loop())  # the fill's transient reads, freed

    async def _read_unit(self, unit: Unit) -> None:
        fill = unit.fill
        flat = fill.buffer.reshape(-1)
        slot_tokens = self.plan.sequences_per_read_block * self.plan.seq_len
        writer = FillWriter(fill, self._background_decodes)
        if self.plan.sequence_packing:
            lo = unit.start // self.source.token_chunk * self.source.token_chunk
            targets = [
                (unit.start - lo + src, flat[slot * slot_tokens + offset :][:length])
                for slot, offset, src, length in unit.pieces
            ]
            await self.source.read_into(unit.start, unit.stop, targets, writer)
            return
        rows = await read_unpacked_rows(self.source, unit.start, unit.stop, self.plan.seq_len)
        ((slot, _, _, length),) = unit.pieces
        view = flat[slot * slot_tokens :][:length]

        def copy() -> None:
            view[:] = rows.reshape(-1)

        await writer.write(copy)

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
            if self._closed:  # aclose() cancelled the reads: the load learns why
                raise LoaderClosedError("the engine was closed") from None
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with the step and stream named
            _raise_with_context(
                exc,
                f"step {step}: reading rows of stream {fill.stream} minipoch {fill.minipoch} failed",
            )

    def _rows_ahead(self, fill: Fill, step: int, batch_indices: np.ndarray) -> np.ndarray:
        """Buffer rows of ``fill`` that the next steps' loads of the same batch rows will read
        (up to ``ROWS_AHEAD_STEPS`` steps, as long as they stay in this fill)."""
        rows = []
        for ahead in range(step + 1, min(step + 1 + ROWS_AHEAD_STEPS, self.plan.step_count)):
            loc = self.plan.locate(ahead, batch_indices)
            mine = (loc.stream == fill.stream) & (loc.minipoch == fill.minipoch)
            if not mine.any():
                break
            rows.append(fill.perm[loc.position[mine]])
        return np.concatenate(rows) if rows else np.empty(0, np.int64)

    async def _wait_ready(self, fill: Fill, step: int, buffer_rows: np.ndarray) -> None:
        if self.options.prefetch:
            slots = np.unique(buffer_rows // self.plan.sequences_per_read_block)
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
        _raise_with_context(
            exc, f"step {step}: filling stream {fill.stream} minipoch {fill.minipoch} failed"
        )

    def _record_step(self, step: int, wait: float) -> None:
        with self._lock:
            self._recorder.step(step, wait)


def _raise_with_context(exc: BaseException, context: str) -> NoReturn:
    """Re-raise ``exc`` (same library class, else StorageError) with ``context`` prefixed."""
    message = f"{context}: {exc}"
    if isinstance(exc, AsyncflatError):
        raise type(exc)(message) from exc
    raise StorageError(message) from exc
