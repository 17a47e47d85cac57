"""The engine: per-stream double buffers, filled in the background on the engine's event loop.

For every stream this host serves there are two buffers, allocated once and reused for every
minipoch (first-touching fresh memory is expensive on these machines; re-touching is cheap).
When a stream starts serving minipoch m, the fill of m+1 starts into the other buffer, so the
boundary costs nothing when the fill finishes in time.

A fill is cut into *read units*. With sequence packing a unit is the part of one zarr chunk that
the fill's blocks cover: each chunk object is fetched once per fill even when several blocks
share it, and each block's piece is decoded straight into its slot of the buffer (for Blosc,
only the items it uses; see ``_blosc.py``). Codecs we cannot decode ourselves (sharding,
filters) go through zarr, one decode per chunk, and are copied into the slots. Without packing
a unit is one block (seq_starts, then the tokens, truncated/padded to ``len``).
Units wait in one priority queue shared by all fills, keyed by the first step that needs them
(:meth:`ShufflePlan.block_deadlines`), and a fixed set of workers pulls from it: that bounds the
reads in flight (a sliding window) and makes every fill demand-first, so a load waits only for
the blocks its own rows live in and the next step's blocks always go first.

The in-buffer shuffle is never materialised: a gather reads buffer row ``perm[position]``. A
load whose buffers are complete (the steady state) is served from the caller's thread
(:meth:`Engine.try_gather`), without a round trip to the loop.

Fills compete with the trainer for the CPU. A prefetch that no load waits for yet runs one
unit at a time on a local store and decodes on all but one thread; once a load waits for it,
it gets everything.

Failure model: a unit that fails (after the store's retries) fails its fill; the load that needs
that fill raises the error (with the array, range and cause), the fill is dropped, and a later
load that needs the same minipoch starts it afresh. Steps served from other fills are unaffected.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .config import EngineOptions
from .errors import AsyncflatError, DatasetFormatError, LoaderClosedError, StorageError
from .plan import NEVER, ShufflePlan
from .source import TokenSource

__all__ = ["Engine"]

log = logging.getLogger(__name__)

_STEP_HISTORY = 1 << 16  # per-step wait records kept for stats()


@dataclasses.dataclass(eq=False)
class _Unit:
    """One read: ``[start, stop)`` of an array, copied as ``pieces`` into block slots."""

    fill: _Fill
    priority: int
    start: int
    stop: int
    #: (slot, row offset inside the slot's flat tokens, offset in the read data, length)
    pieces: list[tuple[int, int, int, int]]
    decoded_bytes: int


@dataclasses.dataclass(eq=False)
class _Fill:
    """The filling (or filled) buffer of one (stream, minipoch)."""

    stream: int
    minipoch: int
    buffer_index: int
    buffer: np.ndarray  # (rows_in_buffer, len) view of the stream's buffer
    perm: np.ndarray  # buffer row served at each position
    blocks: np.ndarray  # global read-block id of each slot
    deadlines: np.ndarray  # first step needing each slot
    reason: str  # "prefetch" or "demand"
    pending: np.ndarray  # units still outstanding per slot
    ready: list[asyncio.Event]
    started: float
    finished: float | None = None
    error: BaseException | None = None
    cancelled: bool = False
    blocks_done: int = 0
    units: list[_Unit] = dataclasses.field(default_factory=list)  # all of the fill's reads
    #: decodes writing into ``buffer`` right now; ``drained`` is set when there are none
    writers: int = 0
    drained: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: the previous occupant's ``drained``: its last writes must land before ours
    write_after: asyncio.Event | None = None
    urgent: bool = False
    useful_bytes: int = 0
    late_warned: bool = False

    @property
    def done(self) -> bool:
        return self.blocks_done == len(self.blocks)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for event in self.ready:  # wake every waiter; each checks .error
            event.set()


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
        self.streams = tuple(sorted(set(int(s) for s in streams)))
        self.options = options
        self._loop: asyncio.AbstractEventLoop | None = None  # set by the first gather
        self._buffers: dict[int, list[np.ndarray | None]] = {s: [None, None] for s in self.streams}
        self._fills: dict[int, dict[int, _Fill]] = {s: {} for s in self.streams}
        self._queue: asyncio.PriorityQueue[tuple[int, int, _Unit]] = asyncio.PriorityQueue()
        self._order = itertools.count()  # FIFO among equal priorities
        self._workers: list[asyncio.Task[None]] = []
        self._gather_lock = asyncio.Lock()
        # Guards the state other threads touch: which fill owns which buffer, and the step
        # records. The loop takes it briefly (never across an await) to start or drop fills;
        # try_gather takes it to read finished buffers from the caller's thread, so a buffer is
        # never handed to a new fill mid-read.
        self._lock = threading.Lock()
        #: per (stream, buffer index): writes a fill that left the buffer may still be making
        self._pending_writes: dict[tuple[int, int], asyncio.Event] = {}
        self._budget = asyncio.Condition()
        self._inflight_bytes = 0
        self._inflight_budget = self._default_inflight_budget()
        # decoded bytes of the largest unit: what a worker reserves before taking one
        self._unit_bytes = 4 * (
            source.token_chunk
            if plan.sequence_packing
            else plan.sequences_per_read_block * plan.seq_len
        )
        # decoded chunks: reads in flight, then a few recent ones (see _read_in_chunk)
        self._chunks: collections.OrderedDict[int, asyncio.Future[np.ndarray]] = (
            collections.OrderedDict()
        )
        self._chunks_cached = 2
        # Decode chunk objects ourselves, straight into the buffers (partial Blosc decodes),
        # when the source can hand them out; otherwise zarr decodes and we copy.
        self._direct = plan.sequence_packing and getattr(source, "raw_codec", None) is not None
        self._closed = False
        # stats
        # (step, wait) of the last loads, in numpy so that per-step records never become objects
        # the garbage collector has to walk (a full collection in a jax process costs ~100 ms).
        self._wait_steps = np.zeros(_STEP_HISTORY, np.int64)
        self._wait_s = np.zeros(_STEP_HISTORY, np.float64)
        self._waits_recorded = 0
        # Prefetch fills decode on all but one CPU thread, leaving a core to the trainer; a fill
        # that a load is waiting for (urgent) uses them all.
        self._background_decodes = asyncio.Semaphore(max(1, options.decode_threads - 1))
        # A prefetch fill nobody waits for yet runs one unit at a time on a local store (reads
        # are CPU copies there), so it takes at most about one core from the trainer; behind a
        # network its reads still overlap, since latency, not CPU, bounds them.
        self._background = asyncio.Condition()
        self._background_active = 0
        self._background_limit = (
            options.max_concurrent_reads if getattr(source, "remote", False) else 1
        )
        self._fill_records: list[dict[str, Any]] = []
        self._buffer_allocations = 0
        self._rows_read_directly = 0  # rows served before their block arrived (_serve_early)
        # Cleared while a load reads its rows one by one: fills take no new unit meanwhile.
        self._rows_first = asyncio.Event()
        self._rows_first.set()
        self._row_reads: set[asyncio.Future[Any]] = set()
        self._units_in_flight = 0
        self._peak_units_in_flight = 0
        self._decoded_bytes = 0
        self._useful_bytes = 0
        self._last_step: tuple[int, float] | None = None
        self._step_interval: float | None = None  # EWMA of time between gathers

    def _default_inflight_budget(self) -> int:
        # Decoded bytes of reads in flight. An eighth of a buffer keeps peak memory near two
        # buffers per stream; a few whole chunks keep the read window open on small buffers.
        # Behind a network, latency is hidden only by keeping the whole read window busy.
        if self.options.max_inflight_bytes is not None:
            return self.options.max_inflight_bytes
        chunk_bytes = self.source.token_chunk * 4
        window = self.options.max_concurrent_reads if getattr(self.source, "remote", False) else 4
        return max(
            self.plan.buffer_bytes // 8,
            min(self.options.max_concurrent_reads, window) * chunk_bytes,
        )

    # -- public -------------------------------------------------------------------------------

    async def gather(self, step: int, batch_indices: np.ndarray) -> np.ndarray:
        """The encoded rows (uint32[len(batch_indices), len]) of ``step`` at ``batch_indices``.

        ``batch_indices`` must be sorted; the loader passes this host's rows.
        """
        if self._closed:
            raise LoaderClosedError("the engine is closed")
        self.plan.check_step(step)
        self._loop = asyncio.get_running_loop()
        self._start_workers()
        t0 = time.perf_counter()
        async with self._gather_lock:
            if self._closed:  # closed while this gather queued behind another (no workers now)
                raise LoaderClosedError("the engine is closed")
            loc = self.plan.locate(step, batch_indices)
            groups = self._groups(loc)
            with self._lock:
                for stream, minipoch in groups:
                    self._ensure_fill(
                        stream, minipoch, step, keep={m for s, m in groups if s == stream}
                    )
                if self.options.prefetch:
                    self._prefetch_after(groups)
            out = np.empty((len(loc.batch_index), self.plan.seq_len), np.uint32)
            for (stream, minipoch), rows in groups.items():
                fill = self._fills[stream][minipoch]
                buffer_rows = fill.perm[loc.position[rows]]
                if not fill.done and self._direct and self.options.prefetch:
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
        if self._closed:
            raise LoaderClosedError("the engine is closed")
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
        self._record_step(step, time.perf_counter() - t0)
        return out

    def _start_prefetches(self, groups: dict[tuple[int, int], slice]) -> None:
        if self._closed:
            return
        with self._lock:
            self._prefetch_after(groups)

    async def aclose(self) -> None:
        """Cancel every fill and worker, drop the buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fills in self._fills.values():
            for fill in fills.values():
                fill.cancelled = True
                fill.fail(LoaderClosedError("the engine was closed"))
        pending = [*self._workers, *self._chunks.values(), *self._row_reads]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._chunks.clear()
        self._workers.clear()
        with self._lock:
            self._fills = {s: {} for s in self.streams}
            self._buffers = {s: [None, None] for s in self.streams}
        await self.source.aclose()

    def stats(self) -> dict[str, Any]:
        """Figures for humans and benchmarks (see docs/design.md for each field)."""
        kept = min(self._waits_recorded, _STEP_HISTORY)
        order = np.arange(self._waits_recorded - kept, self._waits_recorded) % _STEP_HISTORY
        steps, waits = self._wait_steps[order], self._wait_s[order]
        io = self.source.io
        active = []
        for fills in self._fills.values():
            for fill in fills.values():
                if not fill.done and fill.error is None:
                    active.append(
                        {
                            "stream": fill.stream,
                            "minipoch": fill.minipoch,
                            "reason": fill.reason,
                            "blocks_done": fill.blocks_done,
                            "blocks": len(fill.blocks),
                            "must_finish_by_step": self.plan.first_step(fill.minipoch),
                        }
                    )
        return {
            "steps_loaded": self._waits_recorded,
            "step_waits_s": list(zip(steps.tolist(), waits.tolist())),
            "wait_median_s": float(np.median(waits)) if len(waits) else None,
            "wait_max_s": float(waits.max()) if len(waits) else None,
            "fills": list(self._fill_records),
            "active_fills": active,
            "buffer_allocations": self._buffer_allocations,
            "rows_read_directly": self._rows_read_directly,
            "units_in_flight": self._units_in_flight,
            "peak_units_in_flight": self._peak_units_in_flight,
            "bytes_read": io.bytes_read,
            "bytes_decoded": self._decoded_bytes,
            "bytes_useful": self._useful_bytes,
            "read_amplification": self._decoded_bytes / self._useful_bytes
            if self._useful_bytes
            else None,
            "requests": io.requests,
            "retries": io.retries,
            "peak_requests_in_flight": io.peak_in_flight,
            # store throttling (429/503) seen, and the adaptive in-flight limit it led to
            "throttled": getattr(io, "throttled", 0),
            "concurrency_limit": getattr(io, "concurrency_limit", None),
            "streams": list(self.streams),
        }

    # -- planning fills -----------------------------------------------------------------------

    def _groups(self, loc: Any) -> dict[tuple[int, int], slice]:
        """The (stream, minipoch) buffers a step reads, each with its run of output rows.

        Sorted batch indices give non-decreasing streams, and within a stream the minipoch
        only grows, so every buffer's rows form one contiguous run.
        """
        keys = loc.stream * self.plan.minipoch_count + loc.minipoch
        edges = [0, *(np.flatnonzero(np.diff(keys)) + 1).tolist(), len(keys)]
        groups = {}
        for lo, hi in zip(edges[:-1], edges[1:]):
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

    def _prefetches_due(
        self, groups: dict[tuple[int, int], slice]
    ) -> list[tuple[int, int, set[int]]]:
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

    def _prefetch_after(self, groups: dict[tuple[int, int], slice]) -> None:
        for stream, nxt, needed in self._prefetches_due(groups):
            self._ensure_fill(
                stream, nxt, self.plan.first_step(nxt), keep=needed, reason="prefetch"
            )

    def _ensure_fill(
        self, stream: int, minipoch: int, from_step: int, *, keep: set[int], reason: str = "demand"
    ) -> _Fill:
        fills = self._fills[stream]
        fill = fills.get(minipoch)
        if fill is not None:
            if fill.error is None:
                return fill
            self._retire(fills.pop(minipoch))  # a failed fill is retried by the next load
        used = {f.buffer_index for f in fills.values()}
        free = [i for i in (0, 1) if i not in used]
        if not free:
            victims = [f for m, f in fills.items() if m not in keep]
            # A step spans at most two minipochs (bips <= seqs_per_buffer is not required, but
            # the rows of one step for one stream are consecutive q's), so keep has at most two
            # entries and one of them is the minipoch being ensured.
            assert victims, "a step cannot need more than two minipochs of one stream"
            victim = max(victims, key=lambda f: f.minipoch)
            self._cancel(victim)
            free = [victim.buffer_index]
        write_after = self._pending_writes.pop((stream, free[0]), None)
        fill = self._start_fill(stream, minipoch, free[0], from_step, reason)
        fill.write_after = write_after
        fills[minipoch] = fill
        return fill

    def _cancel(self, fill: _Fill) -> None:
        """Forget a fill nobody needs any more; its queued units are skipped by the workers."""
        self._retire(fill)
        del self._fills[fill.stream][fill.minipoch]
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

    def _retire(self, fill: _Fill) -> None:
        """``fill`` leaves its buffer (cancelled, or failed and dropped): it must never write
        into it again, and the buffer's next fill must wait for the decodes already writing.

        Without this a failed fill's reads still in flight landed in a buffer that a later fill
        (of another minipoch) had taken: wrong rows served after a storage error.
        """
        fill.cancelled = True
        if fill.write_after is not None and not fill.write_after.is_set():
            # Its own decodes have not started (they wait for the previous occupant's, and
            # will see ``cancelled``): the buffer's next fill waits for that occupant instead.
            pending: asyncio.Event | None = fill.write_after
        else:
            pending = fill.drained if fill.writers else None
        if pending is not None:
            self._pending_writes[(fill.stream, fill.buffer_index)] = pending

    def _buffer(self, stream: int, index: int) -> np.ndarray:
        buffer = self._buffers[stream][index]
        if buffer is None:
            buffer = np.empty((self.plan.seqs_per_buffer, self.plan.seq_len), np.uint32)
            self._buffers[stream][index] = buffer
            self._buffer_allocations += 1
        return buffer

    def _start_fill(
        self, stream: int, minipoch: int, index: int, from_step: int, reason: str
    ) -> _Fill:
        plan = self.plan
        rows = plan.rows_in_buffer(minipoch)
        perm = plan.row_permutation(stream, minipoch)
        blocks = plan.buffer_blocks(stream, minipoch)
        deadlines = plan.block_deadlines(perm, minipoch, from_step)
        fill = _Fill(
            stream=stream,
            minipoch=minipoch,
            buffer_index=index,
            buffer=self._buffer(stream, index)[:rows],
            perm=perm,
            blocks=blocks,
            deadlines=deadlines,
            reason=reason,
            pending=np.zeros(len(blocks), np.int64),
            ready=[asyncio.Event() for _ in blocks],
            started=time.perf_counter(),
        )
        fill.drained.set()
        units = self._units_packed(fill) if plan.sequence_packing else self._units_unpacked(fill)
        fill.units = units
        for unit in units:
            for slot, *_ in unit.pieces:
                fill.pending[slot] += 1
            self._queue.put_nowait((unit.priority, next(self._order), unit))
        log.debug(
            "%s fill of stream %d minipoch %d from step %d: %d blocks, %d reads",
            reason,
            stream,
            minipoch,
            from_step,
            len(blocks),
            len(units),
        )
        return fill

    def _units_packed(self, fill: _Fill) -> list[_Unit]:
        """Group the fill's token ranges by chunk: one read (one decode) per chunk touched."""
        block_tokens = self.plan.sequences_per_read_block * self.plan.seq_len
        chunk = self.source.token_chunk
        by_chunk: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)
        for slot, block in enumerate(fill.blocks.tolist()):
            lo, hi = block * block_tokens, (block + 1) * block_tokens
            while lo < hi:  # split the block at chunk boundaries
                end = min(hi, (lo // chunk + 1) * chunk)
                by_chunk[lo // chunk].append((slot, lo - block * block_tokens, lo, end))
                lo = end
        units = []
        for chunk_id, parts in by_chunk.items():
            start, stop = min(p[2] for p in parts), max(p[3] for p in parts)
            pieces = [(slot, off, lo - start, hi - lo) for slot, off, lo, hi in parts]
            chunk_len = min(chunk, self.plan.token_count - chunk_id * chunk)
            priority = int(min(fill.deadlines[slot] for slot, *_ in pieces))
            units.append(_Unit(fill, priority, start, stop, pieces, chunk_len * 4))
        units.sort(key=lambda u: (u.priority, u.start))
        return units

    def _units_unpacked(self, fill: _Fill) -> list[_Unit]:
        spb, seq_len = self.plan.sequences_per_read_block, self.plan.seq_len
        units = [
            _Unit(
                fill,
                int(fill.deadlines[slot]),
                block * spb,
                (block + 1) * spb,
                [(slot, 0, 0, spb * seq_len)],
                spb * seq_len * 4,
            )
            for slot, block in enumerate(fill.blocks.tolist())
        ]
        units.sort(key=lambda u: (u.priority, u.start))
        return units

    # -- waiting ------------------------------------------------------------------------------

    async def _serve_early(
        self, fill: _Fill, step: int, buffer_rows: np.ndarray, out: np.ndarray
    ) -> None:
        """Rows of a fill still in progress: those in finished blocks from the buffer, the others
        read one by one from storage (only the bytes that hold them) while the fill goes on.

        A step's rows are scattered over most of a buffer's blocks (the in-buffer permutation),
        so waiting for whole blocks after a resume or behind a late fill would cost most of a
        fill; a few rows cost a few small reads.
        """
        if fill.error is not None:
            self._raise_fill_error(fill, step)
        await self._make_urgent(fill)
        spb = self.plan.sequences_per_read_block
        ready = np.fromiter((event.is_set() for event in fill.ready), bool, len(fill.ready))
        have = ready[buffer_rows // spb]
        out[have] = fill.buffer[buffer_rows[have]]
        missing = np.flatnonzero(~have)
        self._rows_first.clear()
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
        except Exception as exc:
            self._raise_with_context(
                exc,
                f"step {step}: reading rows of stream {fill.stream} "
                f"minipoch {fill.minipoch} failed",
            )
        finally:
            self._row_reads.discard(reads)
            self._rows_first.set()
        self._rows_read_directly += len(missing)

    async def _read_row(self, fill: _Fill, buffer_row: int, out: np.ndarray) -> None:
        spb, seq_len, chunk = (
            self.plan.sequences_per_read_block,
            self.plan.seq_len,
            self.source.token_chunk,
        )
        slot, row = divmod(buffer_row, spb)
        start = (int(fill.blocks[slot]) * spb + row) * seq_len  # packed: row r is tokens r*len...
        done = 0
        while done < seq_len:  # a row may cross a chunk boundary
            chunk_id, offset = divmod(start + done, chunk)
            n = min(seq_len - done, chunk - offset)
            await self.source.read_items(chunk_id, offset, out[done : done + n])
            done += n

    async def _make_urgent(self, fill: _Fill) -> None:
        if not fill.urgent:
            fill.urgent = True  # a load waits on it: full speed from now on
            async with self._background:
                self._background.notify_all()

    async def _wait_ready(self, fill: _Fill, step: int, buffer_rows: np.ndarray) -> None:
        await self._make_urgent(fill)
        if self.options.prefetch:
            slots = np.unique(buffer_rows // self.plan.sequences_per_read_block)
        else:  # the reference's behaviour: a load waits for the whole buffer
            slots = np.arange(len(fill.blocks))
        for slot in slots.tolist():
            if fill.deadlines[slot] > step and fill.deadlines[slot] != NEVER:
                # Filled in order of need, except when a load jumps backwards: bump it.
                self._bump(fill, slot, step)
            await fill.ready[slot].wait()
            if fill.error is not None:
                self._raise_fill_error(fill, step)

    def _bump(self, fill: _Fill, slot: int, step: int) -> None:
        fill.deadlines[slot] = step
        # Re-queue the slot's units not taken yet at the new priority; their old queue entries
        # no longer match ``unit.priority`` and are skipped. A taken unit has priority -1, so
        # it is never queued (and run) twice.
        for unit in fill.units:
            if unit.priority > step and any(p[0] == slot for p in unit.pieces):
                unit.priority = step
                self._queue.put_nowait((step, next(self._order), unit))

    def _raise_fill_error(self, fill: _Fill, step: int) -> None:
        exc = fill.error
        assert exc is not None
        with self._lock:
            if self._fills[fill.stream].get(fill.minipoch) is fill:
                # the next load retries this minipoch
                self._retire(self._fills[fill.stream].pop(fill.minipoch))
        self._raise_with_context(
            exc, f"step {step}: filling stream {fill.stream} minipoch {fill.minipoch} failed"
        )

    @staticmethod
    def _raise_with_context(exc: BaseException, context: str) -> None:
        """Re-raise ``exc`` (same library class, else StorageError) with ``context`` prefixed."""
        message = f"{context}: {exc}"
        if isinstance(exc, AsyncflatError):
            raise type(exc)(message) from exc
        raise StorageError(message) from exc

    # -- workers ------------------------------------------------------------------------------

    def _start_workers(self) -> None:
        if not self._workers:
            self._workers = [
                asyncio.create_task(self._worker(), name=f"asyncflat-read-{i}")
                for i in range(self.options.max_concurrent_reads)
            ]

    async def _worker(self) -> None:
        # Admission before selection: a worker first reserves room in the byte budget, then
        # takes the most urgent unit queued *at that moment*. Taking a unit first and waiting for
        # room after would let prefetch units that were popped early hold the budget while a
        # load's units queue behind them (a priority inversion that made first fills 8x slower).
        reserve = self._unit_bytes
        while True:
            async with self._budget:
                await self._budget.wait_for(
                    lambda: (
                        self._inflight_bytes == 0
                        or self._inflight_bytes + reserve <= self._inflight_budget
                    )
                )
                self._inflight_bytes += reserve
            try:
                await self._rows_first.wait()
                unit = await self._next_unit()
                await self._execute(unit)
            finally:
                async with self._budget:
                    self._inflight_bytes -= reserve
                    self._budget.notify_all()

    async def _next_unit(self) -> _Unit:
        while True:
            priority, _, unit = await self._queue.get()
            fill = unit.fill
            if fill.cancelled or fill.error is not None or unit.priority != priority:
                continue  # skipped: fill gone, or a stale entry of a re-prioritised unit
            unit.priority = -1  # taken: any other queue entry for this unit is now stale
            return unit

    async def _execute(self, unit: _Unit) -> None:
        fill = unit.fill
        background = fill.reason == "prefetch" and not fill.urgent
        if background:
            async with self._background:
                await self._background.wait_for(
                    lambda: fill.urgent or self._background_active < self._background_limit
                )
                self._background_active += 1
        self._units_in_flight += 1
        self._peak_units_in_flight = max(self._peak_units_in_flight, self._units_in_flight)
        try:
            await self._run_unit(unit)
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
        finally:
            self._units_in_flight -= 1
            if background:
                async with self._background:
                    self._background_active -= 1
                    self._background.notify_all()

    async def _run_unit(self, unit: _Unit) -> None:
        fill = unit.fill
        if self._direct:
            await self._decode_unit(unit)
        else:
            if self.plan.sequence_packing:
                data = await self._read_in_chunk(unit.start, unit.stop)
            else:
                data = await self._read_unpacked_block(unit.start, unit.stop)
            if fill.cancelled:
                return  # the buffer may already belong to another fill: never write into it
            flat, slot_tokens = fill.buffer.reshape(-1), self._slot_tokens
            # Copies happen on the loop thread, so "not cancelled" cannot change mid-copy.
            for slot, offset, src, length in unit.pieces:
                dst = slot * slot_tokens + offset
                flat[dst : dst + length] = data.reshape(-1)[src : src + length]
        if fill.cancelled:
            return
        for slot, offset, src, length in unit.pieces:
            fill.pending[slot] -= 1
            fill.useful_bytes += length * 4
            self._useful_bytes += length * 4
            if fill.pending[slot] == 0:
                fill.blocks_done += 1
                fill.ready[slot].set()
        if not self.plan.sequence_packing:
            self._decoded_bytes += unit.decoded_bytes
        if fill.done:
            fill.finished = time.perf_counter()
            self._record_fill(fill)
        else:
            self._check_late(fill)

    @property
    def _slot_tokens(self) -> int:
        return self.plan.sequences_per_read_block * self.plan.seq_len

    async def _decode_unit(self, unit: _Unit) -> None:
        """Fetch the unit's chunk object and decode its pieces straight into their slots."""
        fill = unit.fill
        chunk = self.source.token_chunk
        chunk_id, lo = unit.start // chunk, unit.start // chunk * chunk
        if self.source.raw_codec == "raw":  # uncompressed: fetch just the bytes we use
            frame = await self.source.read_frame(chunk_id, (unit.start - lo, unit.stop - lo))
        else:
            frame = await self._shared_chunk(chunk_id, lambda: self.source.read_frame(chunk_id), 0)
        if fill.write_after is not None:
            await fill.write_after.wait()  # the buffer's previous fill is still decoding into it
        if fill.cancelled:
            return
        flat, slot_tokens = fill.buffer.reshape(-1), self._slot_tokens
        targets = [
            (unit.start - lo + src, flat[slot * slot_tokens + offset :][:length])
            for slot, offset, src, length in unit.pieces
        ]
        fill.writers += 1
        fill.drained.clear()
        try:
            if fill.reason == "prefetch" and not fill.urgent:
                async with self._background_decodes:
                    await asyncio.get_running_loop().run_in_executor(
                        None, self._decode_targets, frame, targets
                    )
            else:
                await asyncio.get_running_loop().run_in_executor(
                    None, self._decode_targets, frame, targets
                )
        except AsyncflatError:
            # Bad bytes must not stay cached for the fills that come after: fetch them afresh.
            cached = self._chunks.get(chunk_id)
            if (
                cached is not None
                and cached.done()
                and not cached.cancelled()
                and cached.exception() is None
                and cached.result() is frame
            ):
                del self._chunks[chunk_id]
            raise
        finally:
            fill.writers -= 1
            if not fill.writers:
                fill.drained.set()
        self._decoded_bytes += sum(out.nbytes for _, out in targets)

    def _decode_targets(self, frame: Any, targets: list[tuple[int, np.ndarray]]) -> None:
        for first_item, out in targets:
            self.source.decode_into(frame, first_item, out)

    def _shared_chunk(self, chunk_id: int, read: Any, decoded_bytes: int) -> asyncio.Future[Any]:
        """One read per chunk for everyone who needs it; the last few results stay cached.

        Fills of different streams (and consecutive fills) often need the same chunk at about
        the same time. Shielded: a cancelled fill must not cancel a read another fill shares.
        """
        task = self._chunks.get(chunk_id)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.ensure_future(read())
            self._chunks[chunk_id] = task
            self._decoded_bytes += decoded_bytes
        self._chunks.move_to_end(chunk_id)
        while len(self._chunks) > self._chunks_cached:
            old_id, old = next(iter(self._chunks.items()))
            if not old.done():
                break  # never drop a read others may be waiting on
            del self._chunks[old_id]
        return asyncio.shield(task)

    async def _read_in_chunk(self, start: int, stop: int) -> np.ndarray:
        """``encoded_tokens[start:stop]`` (inside one chunk) through zarr, one decode per chunk."""
        chunk = self.source.token_chunk
        chunk_id = start // chunk
        lo, hi = chunk_id * chunk, min((chunk_id + 1) * chunk, self.plan.token_count)
        data = await self._shared_chunk(
            chunk_id, lambda: self.source.read_tokens(lo, hi), (hi - lo) * 4
        )
        return data[start - lo : stop - lo]

    async def _read_unpacked_block(self, first_seq: int, end_seq: int) -> np.ndarray:
        """Sequences [first_seq, end_seq) truncated to len and padded with 1 (token 0, start)."""
        raw = await self.source.read_seq_starts(first_seq, end_seq + 1)
        _check_seq_starts(self.source.name, raw, first_seq, self.plan.token_count)
        starts = raw.astype(np.int64)
        seq_len = self.plan.seq_len
        lengths = np.minimum(np.diff(starts), seq_len)
        # Read only up to the end of the last kept token, not the whole last sequence.
        stop = int((starts[:-1] + lengths).max()) if len(lengths) else int(starts[0])
        tokens = await self.source.read_tokens(int(starts[0]), stop)
        return await asyncio.get_running_loop().run_in_executor(
            None, _pad_rows, tokens, starts - starts[0], lengths, seq_len
        )

    # -- stats --------------------------------------------------------------------------------

    def _record_step(self, step: int, wait: float) -> None:
        with self._lock:
            self._record_step_locked(step, wait)

    def _record_step_locked(self, step: int, wait: float) -> None:
        now = time.perf_counter()
        if self._last_step is not None and step > self._last_step[0]:
            per_step = (now - self._last_step[1]) / (step - self._last_step[0])
            self._step_interval = (
                per_step
                if self._step_interval is None
                else (0.8 * self._step_interval + 0.2 * per_step)
            )
        self._last_step = (step, now)
        slot = self._waits_recorded % _STEP_HISTORY
        self._wait_steps[slot], self._wait_s[slot] = step, wait
        self._waits_recorded += 1

    def _record_fill(self, fill: _Fill, *, cancelled: bool = False) -> None:
        end = fill.finished or time.perf_counter()
        duration = end - fill.started
        self._fill_records.append(
            {
                "stream": fill.stream,
                "minipoch": fill.minipoch,
                "reason": fill.reason,
                "blocks": len(fill.blocks),
                "blocks_done": fill.blocks_done,
                "cancelled": cancelled,
                "duration_s": duration,
                "useful_bytes": fill.useful_bytes,
                "throughput_bytes_per_s": fill.useful_bytes / duration if duration > 0 else None,
                "must_finish_by_step": self.plan.first_step(fill.minipoch),
                "finished_at_step": self._last_step[0] if self._last_step else None,
            }
        )

    def _check_late(self, fill: _Fill) -> None:
        """Warn once when a prefetch is predicted to finish after the step that needs it."""
        if fill.late_warned or fill.reason != "prefetch" or not fill.blocks_done:
            return
        if self._step_interval is None or self._last_step is None:
            return
        now = time.perf_counter()
        elapsed = now - fill.started
        predicted_end = fill.started + elapsed * len(fill.blocks) / fill.blocks_done
        deadline_step = self.plan.first_step(fill.minipoch)
        needed_at = self._last_step[1] + (deadline_step - self._last_step[0]) * self._step_interval
        if predicted_end > needed_at and elapsed > 0.05:
            fill.late_warned = True
            log.warning(
                "fill of stream %d minipoch %d is predicted to finish %.2f s after step %d needs "
                "it (%d/%d blocks after %.2f s); expect a stall there. Faster storage, more "
                "max_concurrent_reads or a smaller buffer would help.",
                fill.stream,
                fill.minipoch,
                predicted_end - needed_at,
                deadline_step,
                fill.blocks_done,
                len(fill.blocks),
                elapsed,
            )


def _check_seq_starts(name: str, raw: np.ndarray, first: int, token_count: int) -> None:
    """Refuse ``seq_starts[first : first + len(raw)]`` that leave ``[0, token_count]`` or
    decrease: open_split checks only the first and last entries, and a bad middle entry would
    otherwise read outside the tokens or serve rows of the wrong sequence."""
    raw = np.asarray(raw, dtype=np.uint64)  # compare unsigned: a value >= 2**63 stays huge
    over = np.flatnonzero(raw > np.uint64(token_count))
    if len(over):
        i = int(over[0])
        raise DatasetFormatError(
            f"{name}/seq_starts[{first + i}] = {int(raw[i])}: expected an offset <= the token "
            f"count {token_count}"
        )
    down = np.flatnonzero(raw[1:] < raw[:-1])
    if len(down):
        i = int(down[0]) + 1
        raise DatasetFormatError(
            f"{name}/seq_starts: expected non-decreasing offsets, got seq_starts[{first + i}] = "
            f"{int(raw[i])} < seq_starts[{first + i - 1}] = {int(raw[i - 1])}"
        )


def _pad_rows(
    tokens: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, seq_len: int
) -> np.ndarray:
    """Rows ``tokens[offsets[i] : offsets[i] + lengths[i]]``, padded with 1 to ``seq_len``."""
    cols = np.arange(seq_len)
    mask = cols[None, :] < lengths[:, None]
    rows = np.ones((len(lengths), seq_len), np.uint32)
    rows[mask] = tokens[(offsets[:-1, None] + cols[None, :])[mask]]
    return rows
