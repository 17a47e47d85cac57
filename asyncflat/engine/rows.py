"""Rows read on their own, for a load that arrives before its blocks.

A step's rows are scattered over most of a buffer's blocks (the in-buffer permutation), so
waiting for whole blocks after a resume or behind a late fill would cost most of a fill; a few
rows cost a few small reads (:meth:`~asyncflat.source.TokenSource.read_items`: for Blosc, the
frame's header and block table, shared, and the compressed blocks holding the row).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..plan import ShufflePlan
from ..source import TokenSource
from ..storage.limiter import DEMAND
from .fill import Fill
from .scheduler import UnitScheduler

__all__ = ["RowReader"]


class RowReader:
    """Serves the rows of a fill in progress: those in finished blocks from the buffer, the
    others read from storage while the fill goes on (its workers take no new unit meanwhile)."""

    def __init__(self, plan: ShufflePlan, source: TokenSource, scheduler: UnitScheduler[Any]):
        self._plan, self._source, self._scheduler = plan, source, scheduler
        self._pending: set[asyncio.Future[Any]] = set()

    async def serve(self, fill: Fill, buffer_rows: np.ndarray, out: np.ndarray) -> int:
        """Rows ``buffer_rows`` of ``fill`` into ``out``; returns how many were read directly."""
        spb = self._plan.sequences_per_read_block
        ready = np.fromiter((event.is_set() for event in fill.ready), bool, len(fill.ready))
        have = ready[buffer_rows // spb]
        out[have] = fill.buffer[buffer_rows[have]]
        missing = np.flatnonzero(~have)
        # The load waits on these reads: first in line at the store (the tasks copy the flag).
        demand = DEMAND.set(True)
        try:
            async with self._scheduler.paused():
                reads = asyncio.gather(
                    *(self._read(fill, int(buffer_rows[i]), out[i]) for i in missing)
                )
                self._pending.add(reads)
                try:
                    await reads
                finally:
                    self._pending.discard(reads)
        finally:
            DEMAND.reset(demand)
        return len(missing)

    async def aclose(self) -> None:
        """Cancel the reads in flight and wait for them."""
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
        while done < seq_len:  # a row may cross a chunk boundary
            chunk_id, offset = divmod(start + done, chunk)
            n = min(seq_len - done, chunk - offset)
            await self._source.read_items(chunk_id, offset, out[done : done + n])
            done += n
