"""A fill, its read units, and the pair of buffers each stream's fills take turns in.

A *fill* writes one (stream, minipoch) shuffle buffer. It is cut into *read units*: with
sequence packing a unit is the part of one stored chunk the fill's blocks cover (each chunk is
fetched once per fill even when several blocks share it); without packing a unit is one block
(seq_starts, then the tokens, truncated/padded to ``len``). Each unit knows the buffer slots it
writes and the first step that needs it (its priority).

Every stream has two buffers, allocated once and reused for every minipoch (first-touching
fresh memory is expensive on these machines; re-touching is cheap). The buffers a loader's
first fill and first prefetch will take can be faulted in ahead (:meth:`BufferPair.fault_in`,
:class:`PageWriter`): their pages written once when the loader opens (step 0's on the CPU
pool, the prefetch's on the loop's background thread), rather than by the fills' decodes, one
page fault at a time (the prefetch's inside the trainer's steps). A fill that leaves its buffer
(dropped, failed) may still have decodes writing into it; :class:`BufferPair` hands the buffer
to the next fill with an event to wait for first, so those writes never land in rows the next
fill has written (:class:`FillWriter` waits for it).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np

from asyncflat.engine.stats import FillProgress
from asyncflat.errors import DatasetFormatError
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.source.protocol import TokenSource

__all__ = [
    "EXTRA_BUFFERS",
    "BufferPair",
    "Fill",
    "FillWriter",
    "PageWriter",
    "Unit",
    "first_need",
    "forget",
    "plan_units",
    "read_unpacked_rows",
]


@dataclasses.dataclass(eq=False)
class Unit:
    """One read: ``[start, stop)`` of an array, copied as ``pieces`` into block slots."""

    fill: Fill
    #: the first step that needs it: units run lowest first
    priority: int
    start: int
    stop: int
    #: (slot, row offset inside the slot's flat tokens, offset in the read data, length)
    pieces: list[tuple[int, int, int, int]]
    #: set by the scheduler when a worker takes it: never run twice
    taken: bool = False

    def dropped(self) -> bool:
        return self.fill.cancelled or self.fill.error is not None

    def background(self) -> bool:
        return self.fill.background


@dataclasses.dataclass(eq=False)
class Fill:
    """The filling (or filled) buffer of one (stream, minipoch)."""

    stream: int
    minipoch: int
    buffer_index: int
    # (arrays and events out of repr: a unit's failure is logged with its fill, not a dump)
    buffer: np.ndarray = dataclasses.field(repr=False)  # (rows_in_buffer, len) view of a buffer
    perm: np.ndarray = dataclasses.field(repr=False)  # buffer row served at each position
    blocks: np.ndarray = dataclasses.field(repr=False)  # global read-block id of each slot
    deadlines: np.ndarray = dataclasses.field(repr=False)  # first step needing each slot
    reason: str  # "prefetch", "demand" or "open" (started when the loader opened)
    needed_from: int  # the first step that needs it
    pending: np.ndarray = dataclasses.field(repr=False)  # units still outstanding per slot
    ready: list[asyncio.Event] = dataclasses.field(repr=False)
    started: float
    progress: FillProgress
    finished: float | None = None
    error: BaseException | None = None
    cancelled: bool = False
    blocks_done: int = 0
    units: list[Unit] = dataclasses.field(default_factory=list, repr=False)  # all its reads
    #: decodes writing into ``buffer`` right now; ``drained`` is set when there are none
    writers: int = 0
    drained: asyncio.Event = dataclasses.field(default_factory=asyncio.Event, repr=False)
    #: the previous occupant's ``drained``: its last writes must land before ours
    write_after: asyncio.Event | None = None
    #: a load waits on it: it runs at full speed from now on
    urgent: bool = False
    waited_on: bool = False
    useful_bytes: int = 0
    #: loads reading it right now: while non-zero it is never dropped or cancelled
    owners: int = 0

    @property
    def done(self) -> bool:
        return self.blocks_done == len(self.blocks)

    @property
    def reads_started(self) -> bool:
        """Some unit has been taken by a worker: its reads reach the store, its decodes the CPU."""
        return any(unit.taken for unit in self.units)

    @property
    def cold(self) -> bool:
        """No load has waited on it yet, and its reads had no head start a load could use:
        none started, or it was started when the loader opened (for the first load)."""
        return not self.waited_on and (self.reason == "open" or not self.reads_started)

    @property
    def background(self) -> bool:
        """A prefetch nobody waits for yet: it leaves CPU and reads to the trainer."""
        return self.reason == "prefetch" and not self.urgent

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for event in self.ready:  # wake every waiter; each checks .error
            event.set()
        self.units = []  # no cycle with its queued units: freed by refcount, not the collector

    def unit_done(self, unit: Unit) -> None:
        for slot, _, _, length in unit.pieces:
            self.pending[slot] -= 1
            self.useful_bytes += length * 4
            if self.pending[slot] == 0:
                self.blocks_done += 1
                self.ready[slot].set()
        self.progress.blocks_done = self.blocks_done
        if self.done:
            self.finished = time.perf_counter()
            self.units = []  # see fail()


class FillWriter:
    """Writes a unit's data into its fill's buffer: after the buffer's previous occupant has
    drained, never once the fill is dropped, on the CPU pool (a background prefetch on all but
    one of its threads, through ``background``)."""

    def __init__(self, fill: Fill, background: asyncio.Semaphore) -> None:
        self._fill, self._background = fill, background

    async def write(self, fill_targets: Callable[[], None]) -> bool:
        fill = self._fill
        if fill.write_after is not None:
            await fill.write_after.wait()  # the buffer's previous fill is still decoding into it
        if fill.cancelled:
            return False  # the buffer may already belong to another fill: never write into it
        fill.writers += 1
        fill.drained.clear()
        loop = asyncio.get_running_loop()
        try:
            if fill.background:
                async with self._background:
                    await loop.run_in_executor(None, fill_targets)
            else:
                await loop.run_in_executor(None, fill_targets)
        finally:
            fill.writers -= 1
            if not fill.writers:
                fill.drained.set()
        return True


#: buffers a stream may hold beyond its two, for loads of other minipochs while iterators are
#: positioned in both (see docs/reliability.md); allocated only when needed, kept until close
EXTRA_BUFFERS = 2


class BufferPair:
    """The two buffers of one stream (and up to ``extra`` more, on demand), allocated on first
    use, and the hand-off between fills."""

    def __init__(self, rows: int, seq_len: int, extra: int = EXTRA_BUFFERS) -> None:
        self._shape = (rows, seq_len)
        self._buffers: list[np.ndarray | None] = [None, None]
        self.limit = 2 + extra
        #: per buffer index: writes a fill that left the buffer may still be making
        self._pending_writes: dict[int, asyncio.Event] = {}
        self.allocations = 0

    @property
    def count(self) -> int:
        """Buffer slots (allocated or not): 2, more once :meth:`grow` was needed."""
        return len(self._buffers)

    def grow(self) -> int:
        """One more buffer slot (allocated by :meth:`take`); its index."""
        self._buffers.append(None)
        return len(self._buffers) - 1

    def take(self, index: int) -> tuple[np.ndarray, asyncio.Event | None]:
        """Buffer ``index`` for a new fill, and what that fill must wait for before writing."""
        buffer = self._buffers[index]
        if buffer is None:
            buffer = np.empty(self._shape, np.uint32)
            self._buffers[index] = buffer
            self.allocations += 1
        return buffer, self._pending_writes.pop(index, None)

    def fault_in(self, index: int) -> tuple[np.ndarray, asyncio.Event] | None:
        """Allocate buffer ``index`` now for a :class:`PageWriter`, which sets the event returned
        once it is done: the buffer's first fill decodes into it after that. None
        when the buffer is already allocated."""
        if self._buffers[index] is not None:
            return None
        buffer, pending = self.take(index)
        assert pending is None  # nothing ever wrote into a buffer not yet allocated
        done = asyncio.Event()
        self._pending_writes[index] = done
        return buffer, done

    def release(self, fill: Fill) -> None:
        """``fill`` leaves its buffer (dropped, or failed): it must never write into it again,
        and the buffer's next fill must wait for the decodes already writing.

        Without this a failed fill's reads still in flight landed in a buffer that a later fill
        (of another minipoch) had taken: wrong rows served after a storage error.
        """
        fill.cancelled = True
        fill.units = []  # see Fill.fail()
        if fill.write_after is not None and not fill.write_after.is_set():
            # Its own decodes have not started (they wait for the previous occupant's, and
            # will see ``cancelled``): the buffer's next fill waits for that occupant instead.
            pending: asyncio.Event | None = fill.write_after
        else:
            pending = fill.drained if fill.writers else None
        if pending is not None:
            self._pending_writes[fill.buffer_index] = pending

    def drop(self) -> None:
        self._buffers = [None, None]
        self._pending_writes.clear()


#: bytes one :class:`PageWriter` job writes
PAGES_PIECE_BYTES = 4 << 20


class PageWriter:
    """Writes every page of a fresh buffer once, in jobs of ``piece_bytes`` (default
    :data:`PAGES_PIECE_BYTES`) queued on the loop's CPU pool (or on ``executor``), and sets
    ``done`` when the last has finished: the buffer's first fill writes after that, so a page
    write never lands on rows a decode wrote.

    A fresh buffer's pages are mapped at their first write. Left to the first fill, that is one
    fault per 4 KiB page inside its decodes, interleaved with its reads and checksums; written
    ahead on the whole pool, they cost less (measured on a sandboxed TPU host: first-writing
    256 MiB took 265-290 ms on one thread, ~100 ms on eight). The jobs are queued ahead of the
    fill's own, so its reads of a local store (on the same pool) start behind them: measured,
    the first load still came sooner (64 MiB: 85 -> 71 ms there). ``ctypes.memset`` releases the
    GIL. Dedicated threads beside the pool measured no better there than the pool itself.

    ``finished`` is ``done`` for a thread off the loop (the block order's, whose array is
    written the same way). ``executor`` runs the jobs instead of the CPU pool, one at a time,
    each queueing the next, so that its other jobs wait for one piece at most: the loop's
    background thread writes the first prefetch's buffer beside the first fill, not ahead of
    it, and the next minipochs' permutations computed there are not held up by it.
    """

    def __init__(
        self,
        buffer: np.ndarray,
        done: asyncio.Event,
        piece_bytes: int | None = None,
        *,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self._buffer = buffer
        self._done: asyncio.Event | None = done  # None once set: an opening keeps its writers
        self._piece_bytes = PAGES_PIECE_BYTES if piece_bytes is None else piece_bytes
        self._executor = executor
        self.finished = threading.Event()
        self._stopped = False
        self._left = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Queue the jobs (on the loop)."""
        loop = self._loop = asyncio.get_running_loop()
        pieces = range(0, self._buffer.nbytes, self._piece_bytes)
        self._left = len(pieces)
        if not pieces:
            self._set_done()
            self.finished.set()
        elif self._executor is not None:
            self._executor.submit(self._piece, 0)  # each piece queues the next (_piece)
        else:
            for lo in pieces:
                loop.run_in_executor(None, self._piece, lo)

    def stop(self) -> None:
        """Closing (on the loop): no job writes any more once it starts, and no fill waits any
        more: the engine cancels every fill right after, before the loop runs anything else, so
        none writes after this."""
        self._stopped = True
        self._set_done()
        self.finished.set()

    def _piece(self, lo: int) -> None:
        if not self._stopped:
            size = min(self._piece_bytes, self._buffer.nbytes - lo)
            ctypes.memset(self._buffer.ctypes.data + lo, 0, size)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:  # no job writes any more: let go of the array (a block order's may be copied)
            self._buffer = np.empty(0, np.uint32)
            self.finished.set()
        elif self._executor is not None and not self._stopped:
            with contextlib.suppress(RuntimeError):  # shut down: the loop is closing
                self._executor.submit(self._piece, lo + self._piece_bytes)
        if last and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._set_done)

    def _set_done(self) -> None:
        """Set ``done`` (on the loop) and let go of it: the fill that waits on it holds it."""
        done, self._done = self._done, None
        if done is not None:
            done.set()


def forget(fill: Fill) -> None:
    """Break the fill <-> unit cycle and let go of its buffer, so closing frees the memory at
    once rather than when the cyclic garbage collector next runs."""
    fill.cancelled = True
    fill.units = []
    fill.buffer = np.empty((0, fill.buffer.shape[1]), fill.buffer.dtype)  # not a view of it
    fill.write_after = None


def plan_units(plan: ShufflePlan, fill: Fill, token_chunk: int) -> list[Unit]:
    """The fill's reads, most urgent first."""
    units = (
        _units_packed(plan, fill, token_chunk)
        if plan.sequence_packing
        else _units_unpacked(plan, fill)
    )
    units.sort(key=lambda u: (u.priority, u.start))
    return units


def _units_packed(plan: ShufflePlan, fill: Fill, chunk: int) -> list[Unit]:
    """Group the fill's token ranges by chunk: one read (one decode) per chunk touched."""
    block_tokens = plan.sequences_per_read_block * plan.seq_len
    by_chunk: dict[int, list[tuple[int, int, int, int]]] = collections.defaultdict(list)
    for slot, block in enumerate(fill.blocks.tolist()):
        lo, hi = block * block_tokens, (block + 1) * block_tokens
        while lo < hi:  # split the block at chunk boundaries
            end = min(hi, (lo // chunk + 1) * chunk)
            by_chunk[lo // chunk].append((slot, lo - block * block_tokens, lo, end))
            lo = end
    units = []
    for parts in by_chunk.values():
        start, stop = min(p[2] for p in parts), max(p[3] for p in parts)
        pieces = [(slot, off, lo - start, hi - lo) for slot, off, lo, hi in parts]
        units.append(Unit(fill, first_need(fill.deadlines, pieces), start, stop, pieces))
    return units


def first_need(deadlines: np.ndarray, pieces: list[tuple[int, int, int, int]]) -> int:
    """A unit's priority: the first step that needs one of its pieces' slots."""
    return int(min(deadlines[slot] for slot, *_ in pieces))


def _units_unpacked(plan: ShufflePlan, fill: Fill) -> list[Unit]:
    spb, seq_len = plan.sequences_per_read_block, plan.seq_len
    units = []
    for slot, block in enumerate(fill.blocks.tolist()):
        pieces = [(slot, 0, 0, spb * seq_len)]
        units.append(
            Unit(fill, first_need(fill.deadlines, pieces), block * spb, (block + 1) * spb, pieces)
        )
    return units


async def read_unpacked_rows(
    source: TokenSource, first_seq: int, end_seq: int, seq_len: int
) -> np.ndarray:
    """Sequences [first_seq, end_seq) truncated to len and padded with 1 (token 0, start)."""
    raw = await source.read_seq_starts(first_seq, end_seq + 1)
    check_seq_starts(source.name, raw, first_seq, source.token_count)
    starts = raw.astype(np.int64)
    lengths = np.minimum(np.diff(starts), seq_len)
    # Read only up to the end of the last kept token, not the whole last sequence.
    stop = int((starts[:-1] + lengths).max()) if len(lengths) else int(starts[0])
    tokens = await source.read_tokens(int(starts[0]), stop)
    return await asyncio.get_running_loop().run_in_executor(
        None, pad_rows, tokens, starts - starts[0], lengths, seq_len
    )


def check_seq_starts(name: str, raw: np.ndarray, first: int, token_count: int) -> None:
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


def pad_rows(
    tokens: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, seq_len: int
) -> np.ndarray:
    """Rows ``tokens[offsets[i] : offsets[i] + lengths[i]]``, padded with 1 to ``seq_len``."""
    cols = np.arange(seq_len)
    mask = cols[None, :] < lengths[:, None]
    rows = np.ones((len(lengths), seq_len), np.uint32)
    rows[mask] = tokens[(offsets[:-1, None] + cols[None, :])[mask]]
    return rows
