"""Which fill occupies which buffer: the fills of each stream, started, found and dropped.

A stream has two buffers (:class:`~.fill.BufferPair`) and so usually at most two fills. A load
needing a minipoch that has no fill starts one in a free buffer, or in the buffer of a fill
that nobody needs (that fill is dropped); a failed fill is dropped by the load that meets its
error, so the next load of that minipoch starts it afresh.

Who needs a fill: a load reading it right now (``Fill.owners``: never dropped, never
cancelled), and an iterator positioned in its minipoch or about to enter it (a *pin*: a
prefetch never evicts a pinned fill; a load rather takes one of ``EXTRA_BUFFERS`` more buffers
than evict it, and evicts it only beyond that, which costs the iterator a refill, never an
error). A prefetch only takes a free buffer or evicts a fill nobody needs, else it is not
started.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from asyncflat.engine.fill import BufferPair, Fill, Unit, forget, plan_units
from asyncflat.engine.permutations import RowPermutations
from asyncflat.engine.stats import FillProgress
from asyncflat.errors import LoaderClosedError
from asyncflat.plan.shuffle import ShufflePlan, block_deadlines

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
        on_permutation_ready: Callable[[int, int], None] | None = None,
        order_wanted: Callable[[], None] | None = None,
        prefetch: bool = True,
    ) -> None:
        """``on_permutation_ready(stream, minipoch)`` runs on the loop when a buffer's
        permutation computed ahead lands; it must call :meth:`start_deferred_prefetch` (under
        the lock that guards this table). By default that is called directly.
        ``order_wanted()`` is called when a prefetch waits for the plan's whole block order
        (:meth:`start_deferred_prefetches` starts it once computed). Without ``prefetch`` no
        permutation is computed ahead (no fill would use it)."""
        self.plan, self.streams, self._token_chunk = plan, streams, token_chunk
        self._prefetch = prefetch
        self._queue, self._ended = queue, ended
        self._order_wanted = order_wanted
        self._fills: dict[int, dict[int, Fill]] = {s: {} for s in streams}
        self._buffers = {s: BufferPair(plan.seqs_per_buffer, plan.seq_len) for s in streams}
        #: (stream, minipoch) -> iterators positioned in it (or entering it next)
        self._pins: collections.Counter[tuple[int, int]] = collections.Counter()
        #: every fill not yet collected (dropped ones too: a queued unit or a load's frame may
        #: still hold one), so closing can let go of every view of the buffers
        self._started: weakref.WeakSet[Fill] = weakref.WeakSet()
        #: each buffer's row permutation, computed off the loop before its prefetch starts
        self.permutations = RowPermutations(
            plan, streams, on_permutation_ready or self.start_deferred_prefetch
        )
        #: prefetches waiting for their permutation: (stream, minipoch) -> the keep set
        self._deferred: dict[tuple[int, int], set[int]] = {}

    def get(self, stream: int, minipoch: int) -> Fill | None:
        return self._fills[stream].get(minipoch)

    def serves(self, stream: int) -> bool:
        return stream in self._fills

    def fault_in(self, stream: int, index: int) -> tuple[np.ndarray, asyncio.Event] | None:
        """Buffer ``index`` of ``stream`` (0: its first fill's, 1: its first prefetch's),
        allocated now to be faulted in ahead (see :meth:`BufferPair.fault_in`); None if
        already allocated."""
        return self._buffers[stream].fault_in(index)

    def __iter__(self) -> Iterator[Fill]:
        for fills in self._fills.values():
            yield from fills.values()

    @property
    def allocations(self) -> int:
        return sum(pair.allocations for pair in self._buffers.values())

    def ensure(
        self, stream: int, minipoch: int, from_step: int, *, keep: set[int], reason: str = "demand"
    ) -> Fill:
        """The fill of (stream, minipoch), started if there is none (or only a failed one).

        A load's fill always starts: in a free buffer, else in the buffer of a fill nobody
        needs, else in an extra buffer, else in the buffer of a fill only an iterator is
        positioned in; never in one a load is reading (``keep`` and ``owners``).
        """
        fill = self._usable(stream, minipoch)
        if fill is not None:
            return fill
        index = self._buffer_for(stream, keep, demand=True)
        assert index is not None
        return self._put(stream, minipoch, index, from_step, reason)

    def own(self, groups: Groups, step: int) -> list[Fill]:
        """The fills a load of ``step`` reads (``groups``), started where needed, each owned
        until :meth:`disown`: never dropped nor cancelled meanwhile. If one cannot start (no
        memory for a buffer), those already owned are let go before the error is raised:
        owned, they could never be evicted."""
        fills: list[Fill] = []
        try:
            for stream, minipoch in groups:
                keep = {m for s, m in groups if s == stream}
                fill = self.ensure(stream, minipoch, step, keep=keep)
                fill.owners += 1
                fills.append(fill)
            if self._prefetch:
                self.prefetch_after(groups)
        except BaseException:
            self.disown(fills)
            raise
        return fills

    @staticmethod
    def disown(fills: list[Fill]) -> None:
        """Let go of fills :meth:`own` gave."""
        for fill in fills:
            fill.owners -= 1

    def try_prefetch(self, stream: int, minipoch: int, keep: set[int]) -> Fill | None:
        """Start the prefetch of (stream, minipoch) if a buffer is free or held by a fill nobody
        needs; else None (a prefetch never evicts a fill in use, nor grows the buffers)."""
        fill = self._usable(stream, minipoch)
        if fill is not None:
            return fill
        if not self.plan.block_order_known(minipoch):
            # Its blocks are not known yet: started when the whole order lands.
            self._deferred[(stream, minipoch)] = keep
            if self._order_wanted is not None:
                self._order_wanted()
            return None
        if not self.permutations.ready(stream, minipoch):
            # Its permutation is being computed off the loop: started when it lands.
            self._deferred[(stream, minipoch)] = keep
            return None
        self._deferred.pop((stream, minipoch), None)
        index = self._buffer_for(stream, keep, demand=False)
        if index is None:
            return None
        return self._put(stream, minipoch, index, self.plan.first_step(minipoch), "prefetch")

    def deferred(self) -> set[tuple[int, int]]:
        """The (stream, minipoch) prefetches waiting for their permutation or blocks."""
        return set(self._deferred)

    def start_deferred_prefetches(self) -> None:
        """Start every deferred prefetch whose blocks are known now."""
        for stream, minipoch in list(self._deferred):
            if self.plan.block_order_known(minipoch):
                self.start_deferred_prefetch(stream, minipoch)

    def start_deferred_prefetch(self, stream: int, minipoch: int) -> None:
        """Start the prefetch of (stream, minipoch) that waited for its permutation, if any."""
        keep = self._deferred.pop((stream, minipoch), None)
        if keep is not None:
            self.try_prefetch(stream, minipoch, keep)

    def pin(self, keys: list[tuple[int, int]], delta: int) -> None:
        """Add (``delta`` 1) or remove (-1) an iterator's pin on each (stream, minipoch)."""
        for key in keys:
            if key[0] in self._fills:
                self._pins[key] += delta
                if self._pins[key] <= 0:
                    del self._pins[key]

    def _usable(self, stream: int, minipoch: int) -> Fill | None:
        fill = self._fills[stream].get(minipoch)
        if fill is None or fill.error is None:
            return fill
        # A failed fill is retried afresh (a load still raising its error holds the fill object,
        # not the table's entry; the buffer hand-off keeps its late writes out).
        self.drop(fill)
        return None

    def _buffer_for(self, stream: int, keep: set[int], *, demand: bool) -> int | None:
        fills = self._fills[stream]
        pair = self._buffers[stream]
        used = {f.buffer_index for f in fills.values()}
        free = [i for i in range(pair.count) if i not in used]
        if free:
            return free[0]
        idle = [f for m, f in fills.items() if m not in keep and not f.owners]
        unpinned = [f for f in idle if not self._pins.get((stream, f.minipoch))]
        if unpinned:
            victim = max(unpinned, key=lambda f: f.minipoch)
        elif not demand:
            return None
        elif pair.count < pair.limit or not idle:
            # Every buffer is read by a load or holds an iterator's minipoch: one more buffer.
            # (Beyond the limit that takes loads of several minipochs at once, from several
            # threads; growing then is still better than failing a load.)
            log.debug("stream %d: extra shuffle buffer %d", stream, pair.count)
            return pair.grow()
        else:
            victim = max(idle, key=lambda f: f.minipoch)
        self.drop(victim, cancelled=True)
        return victim.buffer_index

    def _put(self, stream: int, minipoch: int, index: int, from_step: int, reason: str) -> Fill:
        self._deferred.pop((stream, minipoch), None)  # started now, whoever asked first
        fill = self._start(stream, minipoch, index, from_step, reason)
        self._fills[stream][minipoch] = fill
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

    def prefetched(self, minipoch: int) -> bool:
        """Whether ``minipoch`` is ever prefetched: it exists and some step serves its rows."""
        return minipoch < self.plan.minipoch_count and self.plan.served_rows(minipoch) > 0

    def prefetches_due(self, groups: Groups) -> list[tuple[int, int, set[int]]]:
        """(stream, next minipoch, minipochs this step reads) for each prefetch not started yet."""
        due = []
        for stream in {s for s, _ in groups}:
            needed = {m for s, m in groups if s == stream}
            nxt = max(needed) + 1
            if (
                self.prefetched(nxt) and nxt not in self._fills[stream] and len(needed) < 2
            ):  # a step reading two minipochs occupies both buffers
                due.append((stream, nxt, needed))
        return due

    def prefetch_after(self, groups: Groups) -> None:
        """Start the prefetches ``groups`` (a step's reads) make due; a deferred prefetch of a
        stream this step reads that it no longer makes due is dropped (the trainer jumped, or
        a load started that minipoch meanwhile): started late, it would evict a fill in use."""
        due = self.prefetches_due(groups)
        wanted = {(stream, nxt) for stream, nxt, _ in due}
        read = {stream for stream, _ in groups}
        for key in [k for k in self._deferred if k[0] in read and k not in wanted]:
            del self._deferred[key]
        for stream, nxt, needed in due:
            self.try_prefetch(stream, nxt, needed)

    def fail_all(self) -> None:
        """Closing: every fill fails (its waiters learn the engine closed) and writes no more."""
        for fill in self:
            fill.cancelled = True
            fill.fail(LoaderClosedError("the engine was closed"))

    def clear(self) -> None:
        """Forget every fill and drop the buffers (closing: freed now, not by the collector)."""
        for fill in list(self._started):
            forget(fill)
        self._fills = {s: {} for s in self.streams}
        self._pins.clear()
        self._deferred.clear()
        self.permutations.clear()
        for pair in self._buffers.values():
            pair.drop()

    def _start(self, stream: int, minipoch: int, index: int, from_step: int, reason: str) -> Fill:
        plan = self.plan
        perm = self.permutations.take(stream, minipoch)
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
            deadlines=block_deadlines(plan, perm, minipoch, from_step),
            reason=reason,
            needed_from=max(from_step, plan.first_step(minipoch)),
            pending=np.zeros(len(blocks), np.int64),
            ready=[asyncio.Event() for _ in blocks],
            started=now,
            progress=FillProgress(now, len(blocks)),
            write_after=write_after,
        )
        fill.drained.set()
        self._started.add(fill)
        fill.units = plan_units(plan, fill, self._token_chunk)
        for unit in fill.units:
            for slot, *_ in unit.pieces:
                fill.pending[slot] += 1
            self._queue(unit)
        if self._prefetch:  # for the prefetch this fill's start brings
            self.permutations.prepare(stream, minipoch + 1)
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
