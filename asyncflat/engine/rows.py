"""Rows read on their own, for a load that arrives before its blocks.

A step's rows are scattered over most of a buffer's blocks (the in-buffer permutation), so
waiting for whole blocks after a resume or behind a late fill would cost most of a fill; a few
rows cost a few small reads (:meth:`~asyncflat.source.protocol.TokenSource.read_items`: for Blosc, the
frame's header and block table, shared, and the compressed blocks holding the row).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np

from asyncflat.engine.fill import Fill
from asyncflat.engine.scheduler import UnitScheduler
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.source.protocol import TokenSource

__all__ = ["RowReader"]


class RowReader:
    """Serves the rows of a fill in progress: those in finished blocks from the buffer, the
    others read from storage while the fill goes on.

    The fill keeps streaming while a load's rows are read: behind a network the row reads are
    demand requests, which the store serves first
    (:meth:`~asyncflat.source.protocol.TokenSource.demand`), so they never queue behind the
    fill's. A fill
    that has not started yet waits for the load's rows (one round trip, or a few hundred
    microseconds of CPU), so that its requests do not reach the store, nor its decodes the CPU,
    ahead of them: the first batch after a resume costs just its rows. On a local store only a
    jump in a running loader with no trainer pace to plan with reads rows (the engine's
    :class:`~asyncflat.engine.waiting.FillWaiter` decides; a start or a resume there waits for
    the fill to stay ahead instead): once the fill decodes, a row read decodes a whole Blosc
    block for one row on the same cores, and waiting for the fill at full speed is sooner.

    ``local``: the store is on this machine's file system; rows are then not read ahead
    (:attr:`reads_ahead`).
    """

    def __init__(
        self,
        plan: ShufflePlan,
        source: TokenSource,
        scheduler: UnitScheduler[Any],
        *,
        local: bool = True,
    ):
        self._plan, self._source, self._scheduler = plan, source, scheduler
        self._local = local
        self._pending: set[asyncio.Future[Any]] = set()
        #: rows of the next steps read ahead (:meth:`read_ahead`), per fill in progress
        self._ahead: dict[Fill, dict[int, asyncio.Task[np.ndarray]]] = {}
        #: seconds a row read takes (a moving average), once one has been read
        self.latency_s: float | None = None

    async def serve(self, fill: Fill, buffer_rows: np.ndarray, out: np.ndarray) -> int:
        """Rows ``buffer_rows`` of ``fill`` into ``out``; returns how many were read directly."""
        spb = self._plan.sequences_per_read_block
        ready = np.fromiter((event.is_set() for event in fill.ready), bool, len(fill.ready))
        have = ready[buffer_rows // spb]
        out[have] = fill.buffer[buffer_rows[have]]
        missing = np.flatnonzero(~have)
        # The load waits on these reads: first in line at the store (the tasks copy the flag).
        with self._source.demand():
            # A fill none of whose reads has started (a resume, start-up) waits until the load's
            # rows are read: its requests would otherwise reach the store first.
            pause = not fill.reads_started
            async with self._scheduler.paused() if pause else contextlib.nullcontext():
                reads = asyncio.gather(
                    *(self._read_or_take(fill, int(buffer_rows[i]), out[i]) for i in missing)
                )
                self._pending.add(reads)
                try:
                    await reads
                finally:
                    self._pending.discard(reads)
        return len(missing)

    @property
    def reads_ahead(self) -> bool:
        """Whether rows are read ahead (:meth:`read_ahead`): behind a network only. On a local
        store a row read is ~0.3-0.5 ms of Python on the engine's loop, holding the GIL, while
        the fill decodes whole blocks without it and soon serves every row: 128 rows read ahead
        after a resume cost the trainer's thread ~70 ms of waiting for the GIL (its first batch
        after a restart took 70-100 ms where it takes 15 without them). There each load reads
        just its own rows, while the trainer waits anyway."""
        return not self._local

    def read_ahead(self, fill: Fill, buffer_rows: np.ndarray) -> None:
        """Start reading rows ``buffer_rows`` of ``fill`` that the next loads will need, unless
        their blocks are ready or they are being read: after a resume, or at start-up, the
        trainer's next steps then find their rows read while the fill streams on. Demand
        requests, like the load's own. Only behind a network (:attr:`reads_ahead`: the caller
        checks, before it computes the rows)."""
        for other in [f for f in self._ahead if f.done or f.cancelled or f.error is not None]:
            self._forget_ahead(other)  # no load reads rows of these one by one any more
        mine = self._ahead.setdefault(fill, {})
        spb = self._plan.sequences_per_read_block
        with self._source.demand():  # the tasks copy the flag
            for row in np.unique(buffer_rows).tolist():
                if row in mine or fill.ready[row // spb].is_set():
                    continue
                task = asyncio.ensure_future(self._read_alone(fill, row))
                task.add_done_callback(_retrieve)
                mine[row] = task

    async def _read_alone(self, fill: Fill, buffer_row: int) -> np.ndarray:
        # Yield first: these tasks are created while a load is being served, so their first
        # steps run before that load's result reaches the trainer. On a local store a row read
        # may never suspend (pread, an inline decode): 128 rows read ahead then delayed the
        # resumed load by ~90 ms. After this yield the load's result is delivered first.
        await asyncio.sleep(0)
        out = np.empty(self._plan.seq_len, np.uint32)
        await self._read(fill, buffer_row, out)
        return out

    async def _read_or_take(self, fill: Fill, buffer_row: int, out: np.ndarray) -> None:
        task = self._ahead.get(fill, {}).pop(buffer_row, None)
        if task is None:
            await self._read(fill, buffer_row, out)
            return
        out[:] = await asyncio.shield(task)

    def _forget_ahead(self, fill: Fill) -> None:
        for task in self._ahead.pop(fill, {}).values():
            task.cancel()

    async def aclose(self) -> None:
        """Cancel the reads in flight and wait for them."""
        ahead = [task for tasks in self._ahead.values() for task in tasks.values()]
        for fill in list(self._ahead):
            self._forget_ahead(fill)
        await asyncio.gather(*ahead, return_exceptions=True)
        pending = list(self._pending)
        for reads in pending:
            reads.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _read(self, fill: Fill, buffer_row: int, out: np.ndarray) -> None:
        spb, seq_len = self._plan.sequences_per_read_block, self._plan.seq_len
        chunk = self._source.token_chunk
        slot, row = divmod(buffer_row, spb)
        start = (int(fill.blocks[slot]) * spb + row) * seq_len  # packed: row r is tokens r*len...
        done = 0
        began = time.perf_counter()
        while done < seq_len:  # a row may cross a chunk boundary
            chunk_id, offset = divmod(start + done, chunk)
            n = min(seq_len - done, chunk - offset)
            await self._source.read_items(chunk_id, offset, out[done : done + n])
            done += n
        took = time.perf_counter() - began
        self.latency_s = took if self.latency_s is None else 0.8 * self.latency_s + 0.2 * took


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A row read ahead that nobody took: its failure is not worth a warning (a load that
    needs the row reads it again)."""
    if not task.cancelled():
        task.exception()
