"""What an engine does between its construction and its first load: :class:`Opening`.

Two things a first load would otherwise wait for start here, off the trainer's thread: the
plan's block order of this host's streams (computed on a thread of its own: ~10 ns a read block
of the whole split) and, with ``EngineOptions.fill_on_open``, step 0's fills, whose buffers are
faulted in on the CPU pool meanwhile (:class:`~.fill.PageWriter`), and the buffers the first
prefetches will take, beside them on the loop's one background thread (the first steps' loads
do not need those: on the pool they delayed step 0's decodes, a first load of 256 MiB 161-171
-> 212-218 ms on a 13-core TPU host). Left to the prefetch, their first writes (a page fault
each) land in the trainer's first steps, where on a 2-core VM a thread slows 15-60x while
another core first-writes fresh memory (``bench/noise.py``): 9 runs in 46 of a 256 MiB buffer
had a 20-55 ms load, none in 46 with it written ahead. The trainer's own set-up between
constructing a loader and its first load (a model's initialisation, its compile: seconds) then
hides them. A first load of step 0 takes those fills over, one later in minipoch 0 takes them
over re-planned from its step; a first load anywhere else (a resume) cancels what is not done
of them before its own fills are queued, so that they never compete with its reads (only reads
already in flight finish; page writes are never cut short, and its decodes wait for those of
step 0's buffers queued before them; a resume into the last minipoch has the first prefetch's
buffer written for nothing, off the pool).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from asyncflat.engine.fill import Fill, PageWriter, Unit, first_need
from asyncflat.engine.lock import OwnedLock
from asyncflat.engine.loop import background_executor, thread_adopter
from asyncflat.engine.permutations import block_order_off_loop, on_own_thread
from asyncflat.engine.table import FillTable
from asyncflat.errors import LoaderClosedError
from asyncflat.plan.entries import ENTRIES_COMPILE_MIN
from asyncflat.plan.permutation import Stop, warm_up, whole_permutation_size
from asyncflat.plan.shuffle import NEVER, ShufflePlan, block_deadlines

__all__ = ["EARLY_REQUESTS_MAX", "ORDER_PAGES_MIN", "ORDER_PAGES_PIECE_BYTES", "Opening"]

log = logging.getLogger("asyncflat.engine")

#: whole permutations from this many entries (4 MiB) have their pages written ahead
ORDER_PAGES_MIN = 1 << 20
#: bytes one job writes of the block order's array
ORDER_PAGES_PIECE_BYTES = 32 << 20
#: walks of the whole split's draws that a load starts at most: early requests that loads wait
#: for, and the whole order's computation once wanted (two first loads at once before it: two
#: threads resuming, say; one jump beside it). A load beyond them wants the whole order (a
#: third walk beside two first loads' at most) and waits for it, which serves every load at
#: once: loads jumping to many minipochs slowed each other and the order (8 jumps from 8
#: threads at 62.5M read blocks on two cores, unbounded: the order 2.5-3.6 s against 1.5-2.7
#: s, each load 6.5-7.8 s against 4.9-6.7 s; at 95M, median load 4.1-4.5 s with two requests
#: beside the order, 3.6-4.0 s with one, 3.5-3.6 s waiting for the order; one jump: 1.5-2.0 s
#: against 2.4-3.0 s)
EARLY_REQUESTS_MAX = 2


class Opening:
    """The block order and the fills on opening of one engine (on its loop).

    Shares the engine's lock and fill table; ``start_reads`` starts the engine's workers,
    ``requeue`` moves a queued unit to another priority, ``closed`` says whether the engine
    has been closed, ``prefetch_deferred`` starts the prefetches that waited for the whole
    block order (the engine's rule: under its lock, its queued unpins applied first).
    """

    def __init__(
        self,
        plan: ShufflePlan,
        streams: tuple[int, ...],
        *,
        lock: OwnedLock,
        fills: FillTable,
        start_reads: Callable[[], None],
        requeue: Callable[[Unit, int], None],
        closed: Callable[[], bool],
        prefetch_deferred: Callable[[], None],
    ) -> None:
        self._plan, self._streams = plan, streams
        self._lock, self._fills = lock, fills
        self._start_reads, self._requeue, self._closed = start_reads, requeue, closed
        self._prefetch_deferred = prefetch_deferred
        #: blocks of some minipochs computed ahead of the whole order (see :meth:`_early_order`)
        self._earlies: dict[tuple[int, ...], tuple[asyncio.Future[None], Stop]] = {}
        #: loads waiting for each of them: a newer request never stops one a load waits for
        self._early_waits: collections.Counter[asyncio.Future[None]] = collections.Counter()
        self._order: asyncio.Future[np.ndarray] | None = None
        #: the threads computing the block order: the whole order's, and early blocks'
        self._threads: list[threading.Thread] = []
        self._stop_planning = Stop()
        #: set once something needs the whole block order (see :meth:`want_whole_order`)
        self._whole_wanted = threading.Event()
        self._order_writer: PageWriter | None = None  # started with the whole order
        self._task: asyncio.Task[None] | None = None
        #: step 0's fills started here; None until started, [] once a load has claimed them
        self._opened: list[Fill] | None = None
        self._page_writers: list[PageWriter] = []

    def start_planning(self, *, write_pages: bool = False) -> None:
        """Start computing the block order (idempotent): the blocks of minipoch 0 and the next
        alone where the plan computes them early (:meth:`_early_order`), and the whole order
        on a thread of its own once wanted (:meth:`want_whole_order`). Not on the loop's
        pools: a load waits for it, and its decodes must not queue behind it. With
        ``write_pages`` (a loader's opening), a large order's array has its pages written once
        the order is wanted, while the kernel compiles (:meth:`_order_pages`)."""
        if self._order is not None:
            return
        pages = self._order_pages() if write_pages else None
        self._order, planner = block_order_off_loop(
            self._plan, self._stop_planning, pages, self._whole_wanted
        )
        self._threads.append(planner)
        self._order.add_done_callback(self._order_landed)
        early = self._plan.early_minipochs(0)
        if early:
            _compile_for_early_draws(self._plan)
            self._early_order(early)
        else:
            self.want_whole_order()

    def _early_order(
        self, minipochs: tuple[int, ...], needed: Iterable[int] = (), *, start: bool = True
    ) -> asyncio.Future[None] | None:
        """Compute the blocks of ``minipochs`` alone (``plan.compute_early_order``: for a
        load there, without the kernel) on a thread of its own (0.2 s at 14.3M read blocks,
        seconds at 10^8: not on the loop's background thread, whose jobs must each be short);
        a future settled once done. One under way that covers ``needed`` serves instead;
        others still computing that no load waits for are stopped: a load elsewhere (a
        resume, a jump) waits for its own only, and never makes another wait for more. None
        where :data:`EARLY_REQUESTS_MAX` walks of the split are under way, or where none
        under way serves and ``start`` is false."""
        for covered, (future, stop) in self._earlies.items():
            if set(needed or minipochs) <= set(covered) and not stop.is_set():
                return future
        if not start:
            return None
        waited = [f for f, _ in self._earlies.values() if not f.done() and self._early_waits[f]]
        if len(waited) + self._whole_wanted.is_set() >= EARLY_REQUESTS_MAX:
            return None
        for future, stop in self._earlies.values():
            if not future.done() and not self._early_waits[future]:
                stop.set()
        stop = Stop()
        compute = self._plan.compute_early_order
        # its draws' pool threads are the loop's own too: a close() a garbage collection runs
        # there must not wait for the loop, which waits for them (it stalled 15 s)
        args = (minipochs, stop, thread_adopter())
        future, thread = on_own_thread("asyncflat-early-blocks", compute, *args)
        self._threads = [*(t for t in self._threads if t.is_alive()), thread]
        self._earlies[minipochs] = (future, stop)
        future.add_done_callback(_log_failure)
        return future

    def _order_landed(self, order: asyncio.Future[np.ndarray]) -> None:
        """The whole order is computed (or failed): start the prefetches that waited for it
        (one that still cannot start waits again, or fails at its own load)."""
        if not self._closed() and _succeeded(order):
            for _, stop in self._earlies.values():  # moot now: their loads woke with it
                stop.set()
            self._earlies.clear()
            self._prefetch_deferred()

    def want_whole_order(self) -> None:
        """Let the whole block order be computed (on the loop; idempotent): at once where the
        plan has no early blocks; else once a load or a prefetch needs a minipoch whose
        blocks it cannot get alone, a load returned, or the fills started on opening are
        done. The trainer cannot need it sooner (minipoch 2's prefetch, at the earliest), and
        beside a first fill its kernel's import (holding the GIL), compile and draws delay
        that fill by about their time on two cores. Until it lands, a load of a minipoch
        whose blocks are not known (a jump to the end of the split) computes them alone
        (:meth:`_early_known`)."""
        if self._whole_wanted.is_set():
            return
        self._whole_wanted.set()
        if self._order_writer is not None:
            self._order_writer.start()

    def _order_pages(self) -> tuple[np.ndarray, threading.Event] | None:
        """The array of a whole permutation of at least :data:`ORDER_PAGES_MIN` entries, its
        pages to be written (:class:`~.fill.PageWriter`) once the order is wanted, while the
        kernel compiles: left to the kernel, their first writes cost it 0.9 s of 2.4 s at 95M
        read blocks (10^14 tokens) on two cores. None when the order needs no such array."""
        plan = self._plan
        size = whole_permutation_size(plan.read_block_count, plan.streams, len(plan.served))
        if size < ORDER_PAGES_MIN:
            return None
        try:
            out = np.empty(size, np.uint32)
        except MemoryError:  # computing the order allocates it again, and fails there
            return None
        # In pieces larger than a buffer's: 91 jobs of 4 MiB slowed the construction of a loader
        # of 10^14 tokens from 30 to 90 ms on two cores, 12 of 32 MiB did not. On the CPU pool
        # where a first load waits for the order; after a first load's early blocks, on the
        # loop's background thread, one piece at a time: the next loads' decodes must not queue
        # behind them.
        executor = background_executor() if plan.early_minipochs(0) else None
        writer = PageWriter(out, asyncio.Event(), ORDER_PAGES_PIECE_BYTES, executor=executor)
        self._order_writer = writer
        self._page_writers.append(writer)
        return out, writer.finished

    async def planned(self, minipochs: Iterable[int] | None = None) -> None:
        """Wait until the blocks of ``minipochs`` are known (None: the whole order); raises
        what computing the whole order raised."""
        self.start_planning()
        assert self._order is not None
        if minipochs is not None and await self._early_known(sorted(set(minipochs))):
            return
        self.want_whole_order()
        await asyncio.shield(self._order)

    async def _early_known(self, needed: list[int], *, load: bool = True) -> bool:
        """Whether the blocks of ``needed`` are known, after waiting for them computed alone
        (where the plan computes them early) or for the whole order, whichever lands first
        (if the whole order fails, for them still). ``load``: a load waits for them (no later
        request stops them); else the opening's fills, which hold none and start none (a first
        load elsewhere stopped theirs, perhaps before they first asked). A jump to the end of
        10^14 tokens right after the first load took 1.5-2.0 s on two cores, against 2.4-3.0 s
        waiting for the whole order."""
        known = self._plan.block_order_known
        if all(map(known, needed)):
            return True
        early = self._plan.early_minipochs(needed[0]) if needed else ()
        assert self._order is not None
        if not set(needed) <= set(early) or self._order.done():
            return False
        future = self._early_order(early, needed, start=load)
        if future is None:
            return False  # enough others under way: the whole order serves it
        self._early_waits[future] += load
        try:  # neither is cancelled with this task, nor raises here
            await asyncio.wait((future, self._order), return_when=asyncio.FIRST_COMPLETED)
            if not future.done() and not _succeeded(self._order):  # failed: they may still come
                await asyncio.wait((future,))
        finally:
            self._early_waits[future] -= load
            if self._early_waits[future] <= 0:
                del self._early_waits[future]
        return all(map(known, needed))  # else stopped or failed: the whole order serves them

    def start(self, *, fill: bool, write_pages: bool = False) -> None:
        """Start computing the block order (``write_pages``: see :meth:`start_planning`) and,
        with ``fill``, step 0's fills of every stream once it is known, unless a load came
        first (idempotent); meanwhile the pages of the buffers those fills will take are
        written (:class:`~.fill.PageWriter`), and those of the first prefetches' beside them."""
        self.start_planning(write_pages=write_pages)
        if not fill or self._task is not None or self._opened is not None or self._closed():
            return
        self._task = asyncio.get_running_loop().create_task(self._fill())
        # Step 0's buffers on the pool, the first prefetch's where there is one on the
        # background thread (see the module's docstring).
        buffers = range(2 if self._fills.prefetched(1) else 1)
        for index, stream in itertools.product(buffers, self._streams):
            try:
                fresh = self._fills.fault_in(stream, index)  # None once allocated
            except MemoryError:  # the fill that needs it allocates it again, and fails there
                log.debug("stream %d: no memory to fault buffer %d in ahead", stream, index)
                continue
            if fresh is not None:
                writer = PageWriter(*fresh, executor=background_executor() if index else None)
                writer.start()
                self._page_writers.append(writer)

    async def _fill(self) -> None:
        try:
            if not await self._early_known([0], load=False):
                if self._plan.early_minipochs(0):
                    return  # stopped for a first load elsewhere, or failed: it starts its own
                await self.planned()
        except Exception:  # noqa: BLE001 - the first load raises it (it waits for it too)
            return
        with self._lock:
            if self._closed() or self._opened is not None:
                return  # a load came first: it started what it needs
            self._start_reads()
            self._opened = opened = [
                self._fills.ensure(stream, 0, 0, keep={0}, reason="open")
                for stream in self._streams
                if self._fills.get(stream, 0) is None
            ]
        # done, failed or cancelled (each sets every event): the whole order's turn. One
        # event at a time, and none once it is wanted: a task for each of a buffer's
        # thousands of blocks cost the loop (and a first load) more than the fills' reads.
        for event in (event for fill in opened for event in fill.ready):
            if self._whole_wanted.is_set():
                return
            await event.wait()
        self.want_whole_order()

    def claim(self, step: int | None) -> None:
        """A load of ``step`` is about to start its fills (under the engine's lock; None: no
        load will read them). Step 0's fills were planned for step 0: a first load there takes
        them over (whatever streams it reads: a mixture's source may read some of them later).
        A first load later in minipoch 0 takes them over re-planned from its step: the blocks
        no step from there reads go last, and it waits for none of them (blocks already read
        are kept). Any other cancels what is not done of them before its own fills are
        queued, so that they never compete with its reads; a failed one is dropped as failed
        (its record says so)."""
        if self._opened == []:
            return
        opened, self._opened = self._opened or [], []
        if step == 0:
            return
        for fill in opened:
            if fill.done or fill.owners or self._fills.get(fill.stream, fill.minipoch) is not fill:
                continue
            if fill.error is None and step is not None and self._replan(fill, step):
                continue
            self._fills.drop(fill, cancelled=fill.error is None)

    def stop(self) -> None:
        """No load will read step 0's fills (a mixture's pass its resume does not read):
        cancel what is not done of them (on the loop)."""
        with self._lock:
            self.claim(None)

    def _replan(self, fill: Fill, step: int) -> bool:
        """Plan ``fill`` from ``step`` on (its units requeued by their new first step); False
        when no step from there reads it."""
        deadlines = block_deadlines(self._plan, fill.perm, fill.minipoch, step)
        if bool((deadlines == NEVER).all()):
            return False
        fill.deadlines = deadlines
        fill.needed_from = max(step, self._plan.first_step(fill.minipoch))
        for unit in fill.units:
            self._requeue(unit, first_need(deadlines, unit.pieces))
        return True

    def cancel(self) -> None:
        """Closing: stop computing the block order, start no fill (one already started is the
        fill table's to cancel) and write no more pages."""
        self._stop_planning.set()
        self._whole_wanted.set()  # the thread waiting for it sees the stop
        for _, stop in self._earlies.values():
            stop.set()
        if self._task is not None:
            self._task.cancel()
        for writer in self._page_writers:
            writer.stop()
        self._page_writers = []

    async def aclose(self) -> None:
        """Closing: as :meth:`cancel`, then wait for the block order's threads (stopped within
        milliseconds; they must not outlive the loader)."""
        self.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        for thread in self._threads:
            await asyncio.get_running_loop().run_in_executor(None, thread.join)


def _compile_for_early_draws(plan: ShufflePlan) -> None:
    """From :data:`~asyncflat.plan.entries.ENTRIES_COMPILE_MIN` read blocks, start compiling
    the permutation kernel at once, beside the early blocks' first numpy draws, whose later
    pieces draw with it (a 10^14-token split's first batch 0.93-0.95 -> 0.60 s on a 13-core
    host). On the process's warm-up thread (:func:`~asyncflat.plan.permutation.warm_up`): the
    compile cannot be stopped, and a loader closed meanwhile must not wait for it (0.17 s, and
    seconds on a loaded machine); it serves the process's later loaders too. Not in the
    entries: a stopped walk would wait for it. The whole order needs the kernel later anyway
    (or the columns kernel, beside which this one costs ~0.05 s)."""
    if plan.read_block_count >= ENTRIES_COMPILE_MIN:
        warm_up(plan.read_block_count)


def _log_failure(early: asyncio.Future[None]) -> None:
    """An early request failed (not stopped): its loads fall back to the whole order, which
    raises the same error if it has one; a warning says why they waited for it."""
    error = None if early.cancelled() else early.exception()
    if error is not None and not isinstance(error, LoaderClosedError):
        log.warning("computing early read blocks failed, waiting for the whole order: %r", error)


def _succeeded(future: asyncio.Future[Any]) -> bool:
    """Whether ``future`` is done with a result (neither cancelled nor failed)."""
    return future.done() and not future.cancelled() and future.exception() is None
