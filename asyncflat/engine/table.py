"""Which fill occupies which buffer: the fills of each stream, started, found and dropped.

A stream has two buffers (:class:`~.fill.BufferPair`) and so at most two fills. A load needing
a minipoch that has no fill starts one in a free buffer, or in the buffer of a fill that the
step does not read (that fill is dropped); a failed fill is dropped by the load that meets its
error, so the next load of that minipoch starts it afresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from ..errors import LoaderClosedError
from ..plan import ShufflePlan
from .fill import BufferPair, Fill, Unit, plan_units
from .stats import FillProgress

__all__ = ["FillTable"]

log = logging.getLogger("asyncflat.engine")

#: (stream, minipoch) -> the run of output rows a step reads from that buffer
Groups = Mapping[tuple[int, int], slice]


class FillTable:
    """The fills of every stream this host serves, and the buffers they live in."""

    def __init__(
        self,
        plan: ShufflePlan,
        streams: tuple[int, ...],
        token_chunk: int,
        *,
        queue: Callable[[Unit], None],
        ended: Callable[..., None],
    ) -> None:
        self.plan, self.streams, self._token_chunk = plan, streams, token_chunk
        self._queue, self._ended = queue, ended
        self._fills: dict[int, dict[int, Fill]] = {s: {} for s in streams}
        self._buffers = {s: BufferPair(plan.seqs_per_buffer, plan.seq_len) for s in streams}

    def get(self, stream: int, minipoch: int) -> Fill | None:
        return self._fills[stream].get(minipoch)

    def serves(self, stream: int) -> bool:
        return stream in self._fills

    def __iter__(self) -> Iterator[Fill]:
        for fills in self._fills.values():
            yield from fills.values()

    @property
    def allocations(self) -> int:
        return sum(pair.allocations for pair in self._buffers.values())

    def ensure(
        self, stream: int, minipoch: int, from_step: int, *, keep: set[int], reason: str = "demand"
    ) -> Fill:
        """The fill of (stream, minipoch), started if there is none (or only a failed one)."""
        fills = self._fills[stream]
        fill = fills.get(minipoch)
        if fill is not None:
            if fill.error is None:
                return fill
            self.drop(fill)  # a failed fill is retried by the next load
        used = {f.buffer_index for f in fills.values()}
        free = [i for i in (0, 1) if i not in used]
        if not free:
            # A step spans at most two minipochs of one stream (its rows of one stream are
            # consecutive q's), so keep has at most two entries, one of them ``minipoch``.
            victims = [f for m, f in fills.items() if m not in keep]
            assert victims, "a step cannot need more than two minipochs of one stream"
            victim = max(victims, key=lambda f: f.minipoch)
            self.drop(victim, cancelled=True)
            free = [victim.buffer_index]
        fill = self._start(stream, minipoch, free[0], from_step, reason)
        fills[minipoch] = fill
        return fill

    def drop(self, fill: Fill, *, cancelled: bool = False) -> None:
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
                self._ended(fill, cancelled=True)
            fill.fail(LoaderClosedError("fill cancelled"))
        elif fill.error is not None:
            self._ended(fill, failed=True)

    def prefetches_due(self, groups: Groups) -> list[tuple[int, int, set[int]]]:
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

    def prefetch_after(self, groups: Groups) -> None:
        for stream, nxt, needed in self.prefetches_due(groups):
            self.ensure(stream, nxt, self.plan.first_step(nxt), keep=needed, reason="prefetch")

    def fail_all(self) -> None:
        """Closing: every fill fails (its waiters learn the engine closed) and writes no more."""
        for fill in self:
            fill.cancelled = True
            fill.fail(LoaderClosedError("the engine was closed"))

    def clear(self) -> None:
        """Forget every fill and drop the buffers."""
        self._fills = {s: {} for s in self.streams}
        for pair in self._buffers.values():
            pair.drop()

    def _start(self, stream: int, minipoch: int, index: int, from_step: int, reason: str) -> Fill:
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
        fill.units = plan_units(plan, fill, self._token_chunk)
        for unit in fill.units:
            for slot, *_ in unit.pieces:
                fill.pending[slot] += 1
            self._queue(unit)
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
