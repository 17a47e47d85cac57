"""The :class:`Engine`: serves any step's rows from per-stream buffer pairs, filling ahead.

It composes the pieces of this package: the fill table and its buffers (:mod:`.table`,
:mod:`.fill`), the unit scheduler (:mod:`.scheduler`) and the reads its workers run
(:mod:`.units`), what a load does about each fill it reads (:mod:`.waiting`), row reads for
loads ahead of their blocks (:mod:`.rows`) and the figures (:mod:`.recorder`, :mod:`.stats`),
over a :class:`~asyncflat.source.protocol.TokenSource`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncflat.config import EngineOptions
from asyncflat.engine.fill import Unit
from asyncflat.engine.lock import OwnedLock
from asyncflat.engine.opening import Opening
from asyncflat.engine.recorder import Recorder
from asyncflat.engine.rows import RowReader
from asyncflat.engine.scheduler import UnitScheduler
from asyncflat.engine.stats import EngineStats, IntervalStats
from asyncflat.engine.table import FillTable, Groups
from asyncflat.engine.units import UnitReader, inflight_budget
from asyncflat.engine.waiting import FillWaiter
from asyncflat.errors import LoaderClosedError
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.source.protocol import TokenSource

__all__ = ["Engine"]


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
        self._lock = OwnedLock()
        # On a local store (reads are CPU there) a prefetch nobody waits for runs one unit at a
        # time, none while a load waits; behind a network latency, not CPU, bounds its reads.
        packed = plan.sequence_packing
        unit_tokens = source.token_chunk if packed else plan.sequences_per_read_block * plan.seq_len
        reads = options.reads_in_flight(token_chunk=source.token_chunk, remote=source.remote)
        self._recorder = Recorder()
        self._units = UnitReader(plan, source, self._recorder, options.decode_threads)
        self._scheduler: UnitScheduler[Unit] = UnitScheduler(
            self._units.run,
            workers=reads,
            reserve=4 * unit_tokens,  # decoded bytes of the largest unit
            budget=inflight_budget(plan, source, options),
            background_limit=reads if source.remote else 1,
            hold_background=None if source.remote else lambda: self._units.waiting_step is not None,
        )
        self._fills = FillTable(
            plan,
            self.streams,
            source.token_chunk,
            queue=self._scheduler.put,
            ended=self._recorder.fill_ended,
            on_permutation_ready=self._prefetch_deferred,
            order_wanted=lambda: self.opening.want_whole_order(),
            prefetch=options.prefetch,
        )
        self._rows = (
            RowReader(plan, source, self._scheduler, local=not source.remote)
            if plan.sequence_packing and source.partial_reads and options.prefetch
            else None
        )
        self._waiter = FillWaiter(
            plan,
            options,
            lock=self._lock,
            fills=self._fills,
            scheduler=self._scheduler,
            rows=self._rows,
            recorder=self._recorder,
            closed=lambda: self._closed,
            local=not source.remote,
        )
        #: unpin() calls waiting for the lock (see unpin)
        self._unpins: collections.deque[list[tuple[int, int]]] = collections.deque()
        self._closed = False  # no load is served any more
        self._aclosed = False  # workers, row reads and the source closed
        self.opening = Opening(  # public: a mixture starts and stops its sources' fills
            plan,
            self.streams,
            lock=self._lock,
            fills=self._fills,
            start_reads=self._scheduler.start,
            requeue=self._scheduler.requeue,
            closed=lambda: self._closed,
            prefetch_deferred=self._prefetch_deferred,
        )

    def open(self, *, fill: bool, write_pages: bool = False) -> None:
        """Start, on the loop, what the first load waits for: the plan's block order and, with
        ``fill``, step 0's fills (:meth:`~asyncflat.engine.opening.Opening.start`)."""
        self._loop = asyncio.get_running_loop()  # try_gather hands prefetches to it
        self.opening.start(fill=fill, write_pages=write_pages)

    async def planned(self) -> None:
        """Wait until the plan's block order is computed (raises what computing it raised)."""
        await self.opening.planned()

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
        loc = self.plan.locate(step, batch_indices)
        await self.opening.planned(np.unique(loc.minipoch).tolist())
        async with self._gather_lock:
            self._check_open()  # closed while this gather queued behind another
            groups = self._groups(loc)
            with self._lock:
                self._apply_unpins()
                self.opening.claim(step)
                fills = self._fills.own(groups, step)  # never dropped while this load reads
            self._units.waiting_step = step
            try:
                out = np.empty((len(loc.batch_index), self.plan.seq_len), np.uint32)
                for fill, rows in zip(fills, groups.values()):
                    buffer_rows = fill.perm[loc.position[rows]]
                    await self._waiter.serve(fill, step, batch_indices, buffer_rows, out[rows])
            finally:
                self._units.waiting_step = None
                self._scheduler.poke()  # background units held while it waited may start
                with self._lock:
                    self._fills.disown(fills)
        self.record_step(step, time.perf_counter() - t0)
        self.opening.want_whole_order()  # its rows are served: the whole order's turn
        return out

    def try_gather(
        self, step: int, batch_indices: np.ndarray, *, record: bool = True
    ) -> np.ndarray | None:
        """:meth:`gather` from the caller's thread, when nothing needs the loop; else None.

        The steady state (every row already in a finished buffer) skips the round trip to the
        loop thread; at the first step of a minipoch the prefetch of the next one is handed to
        the loop without waiting for it. A missing block or an error returns None: use
        :meth:`gather`, which waits.

        ``record`` False leaves the step out of the figures: a caller that may still fall back
        to :meth:`gather` for the same load (a mixture step whose other sources are not ready)
        records it with :meth:`record_step` once it knows, so a load is never counted twice.
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
            if record:
                self._recorder.step(step, time.perf_counter() - t0)
        return out

    def record_step(self, step: int, wait: float) -> None:
        """Count a load of ``step`` served in ``wait`` seconds (after ``try_gather(...,
        record=False)``). Any thread."""
        with self._lock:
            self._recorder.step(step, wait)

    async def aclose(self, *, close_source: bool = True) -> None:
        """Cancel every fill and worker, free the buffers now (not at the next garbage
        collection) and close the source (unless ``close_source`` is False). Idempotent."""
        if self._aclosed:
            return
        self._aclosed = self._closed = True
        self.opening.cancel()
        self._fills.fail_all()
        rows = self._rows.aclose() if self._rows is not None else asyncio.sleep(0)
        try:
            await asyncio.gather(self._scheduler.aclose(), rows, return_exceptions=True)
        finally:
            self.release()
        try:
            if close_source:
                await self.source.aclose()
        finally:
            await self.opening.aclose()

    def release(self) -> None:
        """Drop every reference to the buffers (fills, queued units). Idempotent; for closing,
        once nothing runs on the loop any more (:meth:`aclose` calls it)."""
        self._closed = True
        self.opening.cancel()
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
            self._apply_unpins()
            if not self._closed:
                self._fills.pin(keys, 1)

    def unpin(self, keys: list[tuple[int, int]]) -> None:
        """Drop a pin of ``keys``. Any thread: under the engine's lock, so that the pin state
        is exact once this returns, except on a thread that holds the lock itself (a garbage
        collection having run a finalizer in the middle of its critical section), where the
        release is queued and applied by the next holder of the lock before it reads a pin."""
        if self._closed:
            return  # a closed engine holds no pins (nor buffers) any more
        self._unpins.append(keys)  # a deque: appends are atomic
        if self._lock.held_here():
            return
        with self._lock:
            self._apply_unpins()

    def _apply_unpins(self) -> None:
        """Apply the queued :meth:`unpin` calls (under the lock)."""
        while self._unpins:
            keys = self._unpins.popleft()
            if not self._closed:
                self._fills.pin(keys, -1)

    def stats(self) -> EngineStats:
        """A snapshot of the figures (see :class:`~asyncflat.engine.stats.EngineStats`)."""
        with self._lock:
            self._apply_unpins()
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

    def _prefetch_deferred(self, *key: int) -> None:
        """Start the deferred prefetch of ``key`` (stream, minipoch), or every one now due."""
        if self._closed:
            return
        with self._lock:
            self._apply_unpins()
            if key:
                self._fills.start_deferred_prefetch(*key)
            else:
                self._fills.start_deferred_prefetches()

    def _start_prefetches(self, groups: Groups) -> None:
        if self._closed:
            return
        with self._lock:
            self._apply_unpins()
            self._fills.prefetch_after(groups)
