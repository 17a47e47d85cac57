"""The :class:`Engine`: serves any step's rows from per-stream buffer pairs, filling ahead.

It composes the pieces of this package: fills and their buffers (:mod:`.fill`), the unit
scheduler (:mod:`.scheduler`) and the figures (:mod:`.stats`), over a
:class:`~asyncflat.source.TokenSource`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from ..config import EngineOptions
from ..errors import AsyncflatError, LoaderClosedError, StorageError
from ..plan import NEVER, ShufflePlan
from ..source import TokenSource
from .fill import BufferPair, Fill, FillWriter, Unit, plan_units, read_unpacked_rows
from .scheduler import UnitScheduler
from .stats import (
    ActiveFill,
    EngineStats,
    FillHistory,
    FillProgress,
    FillRecord,
    IntervalStats,
    LatenessMonitor,
    RateLimitedLog,
    StepLog,
    StepRate,
)

__all__ = ["Engine"]

log = logging.getLogger("asyncflat.engine")

Groups = dict[tuple[int, int], slice]


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
        self._buffers = {s: BufferPair(plan.seqs_per_buffer, plan.seq_len) for s in self.streams}
        self._fills: dict[int, dict[int, Fill]] = {s: {} for s in self.streams}
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
        # Prefetch fills decode on all but one CPU thread, leaving a core to the trainer; a fill
        # that a load is waiting for (urgent) uses them all.
        self._background_decodes = asyncio.Semaphore(max(1, options.decode_threads - 1))
        # A load ahead of its blocks reads just its rows when the source can do that cheaply.
        self._direct = plan.sequence_packing and source.partial_reads and options.prefetch
        self._row_reads: set[asyncio.Future[Any]] = set()
        self._closed = False
        # figures
        self._steps = StepLog()
        self._rate = StepRate()
        self._history = FillHistory()
        self._lateness = LatenessMonitor(self._rate, RateLimitedLog(log))
        self._rows_read_directly = 0
        self._useful_bytes = 0
        self._started_at = time.perf_counter()
        self._last_interval: tuple[float, EngineStats, int] | None = None

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
            with self._lock:
                for stream, minipoch in groups:
                    keep = {m for s, m in groups if s == stream}
                    self._ensure_fill(stream, minipoch, step, keep=keep)
                if self.options.prefetch:
                    self._prefetch_after(groups)
            out = np.empty((len(loc.batch_index), self.plan.seq_len), np.uint32)
            for (stream, minipoch), rows in groups.items():
                fill = self._fills[stream][minipoch]
                buffer_rows = fill.perm[loc.position[rows]]
                if not fill.done:
                    await self._make_urgent(fill)
                if not fill.done and self._direct:
                    await self._serve_early(fill, step, buffer_rows, out[rows])
                    continue
                if not fill.done:
                    await self._wait_ready(fill, step, buffer_rows)
                elif fill.error is not None:
                    self._raise_fill_error(fill, step)
                np.take(fill.buffer, buffer_rows, axis=0, out=out[rows])
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
                fill = self._fills[stream].get(minipoch)
                if fill is None or not fill.done or fill.error is not None:
                    return None
                fills.append(fill)
            out = np.empty((len(loc.batch_index), self.plan.seq_len), np.uint32)
            for fill, rows in zip(fills, groups.values()):
                np.take(fill.buffer, fill.perm[loc.position[rows]], axis=0, out=out[rows])
            if self.options.prefetch and self._prefetches_due(groups) and self._loop is not None:
                # Fire and forget: the loop re-checks, so a request sent twice starts one fill.
                self._loop.call_soon_threadsafe(self._start_prefetches, groups)
            self._record_step_locked(step, time.perf_counter() - t0)
        return out

    async def aclose(self) -> None:
        """Cancel every fill and worker, drop the buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fills in self._fills.values():
            for fill in fills.values():
                fill.cancelled = True
                fill.fail(LoaderClosedError("the engine was closed"))
        reads = list(self._row_reads)
        for task in reads:
            task.cancel()
        await asyncio.gather(self._scheduler.aclose(), *reads, return_exceptions=True)
        with self._lock:
            self._fills = {s: {} for s in self.streams}
            for pair in self._buffers.values():
                pair.drop()
        await self.source.aclose()

    def stats(self) -> EngineStats:
        """A snapshot of the figures (see :class:`~asyncflat.engine.stats.EngineStats`)."""
        with self._lock:
            steps, waits = self._steps.since(0)
            active = tuple(
                ActiveFill(
                    f.stream, f.minipoch, f.reason, f.blocks_done, len(f.blocks), f.needed_from
                )
                for fills in self._fills.values()
                for f in fills.values()
                if not f.done and f.error is None
            )
            io, history, scheduler = self.source.io, self._history, self._scheduler
            return EngineStats(
                steps_loaded=self._steps.count,
                wait_median_s=float(np.median(waits)) if len(waits) else None,
                wait_max_s=float(waits.max()) if len(waits) else None,
                step_rate_per_s=self._rate.per_second(),
                fills_completed=history.completed,
                fills_cancelled=history.cancelled,
                fills_failed=history.failed,
                fills_late=history.late,
                fills_predicted_late=self._lateness.predicted_late,
                buffer_allocations=sum(p.allocations for p in self._buffers.values()),
                rows_read_directly=self._rows_read_directly,
                units_in_flight=scheduler.running,
                peak_units_in_flight=scheduler.peak_running,
                bytes_read=io.bytes_read,
                bytes_decoded=io.bytes_decoded,
                bytes_useful=self._useful_bytes,
                read_amplification=(
                    io.bytes_decoded / self._useful_bytes if self._useful_bytes else None
                ),
                requests=io.requests,
                retries=io.retries,
                peak_requests_in_flight=io.peak_in_flight,
                throttled=io.throttled,
                concurrency_limit=io.concurrency_limit,
                streams=self.streams,
                step_waits_s=tuple(zip(steps.tolist(), waits.tolist())),
                fills=tuple(history.records),
                active_fills=active,
            )

    def interval_stats(self) -> IntervalStats:
        """What happened since the previous call (the first call: since the start)."""
        now, current = time.perf_counter(), self.stats()
        since, before, first = self._last_interval or (self._started_at, None, 0)
        self._last_interval = (now, current, current.steps_loaded)
        with self._lock:
            _, waits = self._steps.since(first)

        def delta(name: str) -> int:
            return int(current[name] - (before[name] if before is not None else 0))

        return IntervalStats(
            seconds=now - since,
            steps_loaded=delta("steps_loaded"),
            wait_median_s=float(np.median(waits)) if len(waits) else None,
            wait_max_s=float(waits.max()) if len(waits) else None,
            fills_completed=delta("fills_completed"),
            fills_late=delta("fills_late"),
            bytes_read=delta("bytes_read"),
            bytes_useful=delta("bytes_useful"),
            requests=delta("requests"),
            retries=delta("retries"),
        )

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
            if stream not in self._fills:
                raise ValueError(
                    f"batch index {int(loc.batch_index[lo])} belongs to stream {stream}, "
                    f"which this engine does not serve (it serves {list(self.streams)})"
                )
            if (stream, minipoch) in groups:
                raise ValueError("batch_indices must be sorted")
            groups[(stream, minipoch)] = slice(lo, hi)
        return groups

    def _prefetches_due(self, groups: Groups) -> list[tuple[int, int, set[int]]]:
        """(stream, next minipoch, minipochs this step reads) for each prefetch not started yet."""
        due = []
        for stream in {s for s, _ in groups}:
            needed = {m for s, m in groups if s == stream}
            nxt = max(needed) + 1
            if (
                nxt < self.plan.minipoch_count
                and self.plan.served_rows(nxt) > 0
                and nxt not in self._fills[stream]
                and len(needed) < 2
            ):  # a step reading two minipochs occupies both buffers
                due.append((stream, nxt, needed))
        return due

    def _start_prefetches(self, groups: Groups) -> None:
        if self._closed:
            return
        with self._lock:
            self._prefetch_after(groups)

    def _prefetch_after(self, groups: Groups) -> None:
        for stream, nxt, needed in self._prefetches_due(groups):
            self._ensure_fill(
                stream, nxt, self.plan.first_step(nxt), keep=needed, reason="prefetch"
            )

    def _ensure_fill(
        self, stream: int, minipoch: int, from_step: int, *, keep: set[int], reason: str = "demand"
    ) -> Fill:
        fills = self._fills[stream]
        fill = fills.get(minipoch)
        if fill is not None:
            if fill.error is None:
                return fill
            self._drop(fill)  # a failed fill is retried by the next load
        used = {f.buffer_index for f in fills.values()}
        free = [i for i in (0, 1) if i not in used]
        if not free:
            # A step spans at most two minipochs of one stream (its rows of one stream are
            # consecutive q's), so keep has at most two entries, one of them ``minipoch``.
            victims = [f for m, f in fills.items() if m not in keep]
            assert victims, "a step cannot need more than two minipochs of one stream"
            victim = max(victims, key=lambda f: f.minipoch)
            self._drop(victim, cancelled=True)
            free = [victim.buffer_index]
        fill = self._start_fill(stream, minipoch, free[0], from_step, reason)
        fills[minipoch] = fill
        return fill

    def _drop(self, fill: Fill, *, cancelled: bool = False) -> None:
        """Take ``fill`` out of service; a cancelled one wakes its waiters with an error."""
        if self._fills[fill.stream].get(fill.minipoch) is fill:
            del self._fills[fill.stream][fill.minipoch]
        self._buffers[fill.stream].release(fill)
        if cancelled:
            if not fill.done:
                log.debug(
                    "cancelled fill stream %d minipoch %d (%d/%d blocks)",
                    fill.stream,
                    fill.minipoch,
                    fill.blocks_done,
                    len(fill.blocks),
                )
                self._record_fill(fill, cancelled=True)
            fill.fail(LoaderClosedError("fill cancelled"))
        elif fill.error is not None:
            self._record_fill(fill, failed=True)

    def _start_fill(
        self, stream: int, minipoch: int, index: int, from_step: int, reason: str
    ) -> Fill:
        plan = self.plan
        perm = plan.row_permutation(stream, minipoch)
        blocks = plan.buffer_blocks(stream, minipoch)
        buffer, write_after = self._buffers[stream].take(index)
        now = time.perf_counter()
        fill = Fill(
            stream=stream,
            minipoch=minipoch,
            buffer_index=index,
            buffer=buffer[: plan.rows_in_buffer(minipoch)],
            perm=perm,
            blocks=blocks,
            deadlines=plan.block_deadlines(perm, minipoch, from_step),
            reason=reason,
            needed_from=max(from_step, plan.first_step(minipoch)),
            pending=np.zeros(len(blocks), np.int64),
            ready=[asyncio.Event() for _ in blocks],
            started=now,
            progress=FillProgress(now, len(blocks)),
            write_after=write_after,
        )
        fill.drained.set()
        fill.units = plan_units(plan, fill, self.source.token_chunk)
        for unit in fill.units:
            for slot, *_ in unit.pieces:
                fill.pending[slot] += 1
            self._scheduler.put(unit)
        log.debug(
            "%s fill of stream %d minipoch %d from step %d: %d blocks, %d reads",
            reason,
            stream,
            minipoch,
            from_step,
            len(blocks),
            len(fill.units),
        )
        return fill

    # -- reading ------------------------------------------------------------------------------

    async def _run_unit(self, unit: Unit) -> None:
        fill = unit.fill
        try:
            await self._read_unit(unit)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surfaces from the load that needs this fill
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
        if fill.cancelled:
            return
        fill.unit_done(unit)
        self._useful_bytes += sum(piece[3] for piece in unit.pieces) * 4
        if fill.done:
            self._record_fill(fill)
        else:
            self._check_late(fill)

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
        """Rows of a fill still in progress: those in finished blocks from the buffer, the others
        read one by one from storage (only the bytes that hold them) while the fill goes on.

        A step's rows are scattered over most of a buffer's blocks (the in-buffer permutation),
        so waiting for whole blocks after a resume or behind a late fill would cost most of a
        fill; a few rows cost a few small reads.
        """
        if fill.error is not None:
            self._raise_fill_error(fill, step)
        spb = self.plan.sequences_per_read_block
        ready = np.fromiter((event.is_set() for event in fill.ready), bool, len(fill.ready))
        have = ready[buffer_rows // spb]
        out[have] = fill.buffer[buffer_rows[have]]
        missing = np.flatnonzero(~have)
        async with self._scheduler.paused():  # fills take no new unit meanwhile
            reads = asyncio.gather(
                *(self._read_row(fill, int(buffer_rows[i]), out[i]) for i in missing)
            )
            self._row_reads.add(reads)
            try:
                await reads
            except asyncio.CancelledError:
                if self._closed:  # aclose() cancelled the reads: the load learns why
                    raise LoaderClosedError("the engine was closed") from None
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised with the step and stream named
                _raise_with_context(
                    exc,
                    f"step {step}: reading rows of stream {fill.stream} "
                    f"minipoch {fill.minipoch} failed",
                )
            finally:
                self._row_reads.discard(reads)
        self._rows_read_directly += len(missing)

    async def _read_row(self, fill: Fill, buffer_row: int, out: np.ndarray) -> None:
        spb, seq_len = self.plan.sequences_per_read_block, self.plan.seq_len
        chunk = self.source.token_chunk
        slot, row = divmod(buffer_row, spb)
        start = (int(fill.blocks[slot]) * spb + row) * seq_len  # packed: row r is tokens r*len...
        done = 0
        while done < seq_len:  # a row may cross a chunk boundary
            chunk_id, offset = divmod(start + done, chunk)
            n = min(seq_len - done, chunk - offset)
            await self.source.read_items(chunk_id, offset, out[done : done + n])
            done += n

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
            if self._fills[fill.stream].get(fill.minipoch) is fill:
                self._drop(fill)  # the next load retries this minipoch
        _raise_with_context(
            exc, f"step {step}: filling stream {fill.stream} minipoch {fill.minipoch} failed"
        )

    # -- figures ------------------------------------------------------------------------------

    def _record_step(self, step: int, wait: float) -> None:
        with self._lock:
            self._record_step_locked(step, wait)

    def _record_step_locked(self, step: int, wait: float) -> None:
        self._steps.add(step, wait)
        self._rate.add(step)

    def _record_fill(self, fill: Fill, *, cancelled: bool = False, failed: bool = False) -> None:
        end = fill.finished or time.perf_counter()
        duration = end - fill.started
        self._history.add(
            FillRecord(
                stream=fill.stream,
                minipoch=fill.minipoch,
                reason=fill.reason,
                blocks=len(fill.blocks),
                blocks_done=fill.blocks_done,
                cancelled=cancelled,
                failed=failed,
                duration_s=duration,
                useful_bytes=fill.useful_bytes,
                throughput_bytes_per_s=fill.useful_bytes / duration if duration > 0 else None,
                must_finish_by_step=fill.needed_from,
                finished_at_step=self._rate.last_step,
                waited_on=fill.waited_on,
                late=fill.reason == "prefetch" and fill.waited_on,
            )
        )

    def _check_late(self, fill: Fill) -> None:
        """Warn once when a prefetch is predicted to finish after the step that needs it."""
        if fill.reason != "prefetch" or fill.urgent:
            return
        now = time.perf_counter()
        verdict = self._lateness.check(fill.progress, now, fill.needed_from)
        if verdict is None:
            return
        finish, needed = verdict
        elapsed = now - fill.started
        rate = fill.useful_bytes / elapsed / 2**20 if elapsed > 0 else 0.0
        self._lateness.warn(
            f"fill of stream {fill.stream} minipoch {fill.minipoch}",
            fill.needed_from,
            finish - needed,
            f"{fill.blocks_done}/{len(fill.blocks)} blocks after {elapsed:.2f} s at "
            f"{rate:.0f} MiB/s; the trainer loads {self._rate.per_second() or 0:.1f} steps/s",
        )


def _raise_with_context(exc: BaseException, context: str) -> NoReturn:
    """Re-raise ``exc`` (same library class, else StorageError) with ``context`` prefixed."""
    message = f"{context}: {exc}"
    if isinstance(exc, AsyncflatError):
        raise type(exc)(message) from exc
    raise StorageError(message) from exc
