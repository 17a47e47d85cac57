"""A few entries of :func:`~asyncflat.plan.permutation.permutation` without the whole of it.

A loader's first batch needs the read blocks of its first buffers: 16 entries, say, of a block
order of 14 million at 1.5x10^13 tokens. The whole order needs the compiled kernel (importing
llvmlite and compiling: 0.1-0.3 s) and then time in proportion to the split; the entries alone
need neither. Walking the Fisher-Yates swaps backward (``i = 0 .. n-1``), the value that ends at
position ``p`` started at the position reached by following ``p`` through them: a swap of
``(i, r[i])`` moves a tracked position that is ``i`` to ``r[i]`` and one that is ``r[i]`` to
``i``. Each tracked position moves about ``ln(n)`` times, so the walk costs one Philox draw and
one modulo per position (numpy, the GIL released, pieces drawn on several threads) and a scan
for the rare swaps that touch a tracked position.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from asyncflat.config import available_cpus
from asyncflat.errors import ConfigError
from asyncflat.plan.permutation import (
    DRAW_PIECE,
    Stop,
    Stopped,
    compiled_draws,
    philox_key,
)

__all__ = ["ENTRIES_COMPILE_MIN", "ENTRIES_THREADS_MAX", "permutation_entries"]

#: threads that draw the swap targets at most (each piece of ``DRAW_PIECE`` positions on one).
#: Beyond four the thread that walks the swaps bounds the time, and each thread adds its pieces
#: and temporaries to the peak (14.3M positions on a 13-core host: 0.13 s on 4 threads, 0.15 s
#: on 8; on a 2-core VM, asked for with ``threads``: +18 MiB on 4, +34 on 8).
ENTRIES_THREADS_MAX = 4
#: positions from which compiling the permutation kernel beside the entries pays: they draw with
#: it once it is compiled (:func:`~asyncflat.plan.permutation.compiled_draws`: draws and filter in
#: one pass, about half numpy's time), with numpy meanwhile, but importing llvmlite and compiling
#: take ~0.1 s of a core (holding the GIL for the import): at 14.3M positions that made the
#: entries slower (264 against 184 ms on a 13-core host), at 95M faster (575 against 752 ms).
#: The entries never compile it themselves (a stopped walk would wait for the compile): a
#: loader's opening starts it (``permutation.warm_up``, in ``engine.opening``).
ENTRIES_COMPILE_MIN = 1 << 25
# the value filter: a table of 2**16 flags, small enough to stay in a core's cache
_FILTER_MASK = (1 << 16) - 1
# values _matches compares one by one (each a pass over the piece), not through the table
_COMPARED_MAX = 4
# positions of the first piece: its swaps touch each other's positions, so a tracked position
# there brings many more (the pieces then grow by half each, up to ``piece``)
_FIRST_PIECE = 1024
# positions drawn at a time inside a piece: 512 KB arrays, from the heap once one was freed
# (fresh pages for each piece's temporaries tripled its time on a 2-core VM), few enough
# calls that the threads' GIL handovers cost little (at 2^14 a piece, 14.3M positions took
# 0.16-0.21 s on two threads there, at 2^16 0.13-0.19 s, at 2^18 0.35-0.38 s)
_SUB = 1 << 16
_RAMP = np.arange(_SUB, dtype=np.uint64)

_Piece = tuple[int, np.ndarray, frozenset[int]]  # lo, r[lo:hi], the snapshot it was matched to


def permutation_entries(
    seed: int,
    n: int,
    positions: Iterable[int],
    *,
    stop: Stop | None = None,
    threads: int | None = None,
    piece: int = DRAW_PIECE,
    on_thread: Callable[[], object] | None = None,
) -> np.ndarray:
    """``permutation(seed, n)[positions]`` (uint32), without computing the permutation.

    ``positions``: distinct, in ``[0, n)``; a few hundred at most (each moves ~``ln(n)``
    times, at a few microseconds of Python a move). Takes 10-15 ns a position of ``n`` on one
    core of a 2-core VM (a Philox draw, a modulo, a filter), split over ``threads`` (default:
    the CPUs available, at most :data:`ENTRIES_THREADS_MAX`). ``piece``: positions drawn at a
    time (a multiple of 4: a piece starts on a Philox block). ``stop``: as for
    :func:`~asyncflat.plan.permutation.permutation`. ``on_thread``: called first on each
    thread that draws (an event loop's owner may count them as its own).
    """
    wanted = [int(p) for p in positions]
    if seed < 0:
        raise ConfigError(f"permutation_entries: seed must be >= 0, got {seed}")
    if not 0 <= n < 1 << 32:
        raise ConfigError(f"permutation_entries: n must be in [0, 2**32), got {n}")
    if len(set(wanted)) != len(wanted) or not all(0 <= p < n for p in wanted):
        raise ConfigError(
            f"permutation_entries: positions must be distinct and in [0, {n}), got {wanted!r}"
        )
    if piece < 4 or piece % 4:
        raise ConfigError(f"permutation_entries: piece must be a positive multiple of 4: {piece}")
    # each tracked position's current place, walking the swaps backward -> its slot in wanted
    where = {p: slot for slot, p in enumerate(wanted)}
    threads = threads or available_cpus()
    pieces = _swap_targets(philox_key(seed), n, piece, threads, stop, where, on_thread)
    # closed here, not when collected: a failure's traceback holds this frame, and through it
    # the pieces' pool and its threads, as long as the error is kept (a future holds it)
    with contextlib.closing(pieces):
        for (lo, targets, snapshot), matched in pieces:
            _walk(targets, lo, where, matched, snapshot)
    out = np.empty(len(wanted), np.uint32)
    for place, slot in where.items():
        out[slot] = place
    return out


def _swap_targets(
    key: np.ndarray,
    n: int,
    piece: int,
    threads: int,
    stop: Stop | None,
    where: dict[int, int],
    on_thread: Callable[[], object] | None = None,
) -> Generator[tuple[_Piece, np.ndarray], None, None]:
    """``((lo, r[lo:hi], snapshot), matched)`` for each piece in order, ``r[i] = draw_i % (i +
    1)`` (uint32: ``n < 2**32``; half the memory of the draws), drawn a few pieces ahead on a
    pool of ``threads`` (numpy releases the GIL).
    ``matched``: the indices of the piece holding one of ``snapshot``, the positions tracked
    (the keys of ``where``) when the piece was handed to the pool. A piece's array is reused
    once the caller asks for the next one."""
    workers = max(1, min(threads, ENTRIES_THREADS_MAX, -(-n // piece)))
    # the pieces in flight, and the one the caller reads
    free = [np.empty(min(piece, n), np.uint32) for _ in range(workers + 2)]
    ahead: collections.deque[tuple[_Piece, np.ndarray, Future[np.ndarray]]]
    ahead = collections.deque()
    bounds = _pieces(n, piece)
    with ThreadPoolExecutor(workers, "asyncflat-entries", on_thread) as pool:
        try:
            while True:
                while len(ahead) <= workers and (lo_hi := next(bounds, None)) is not None:
                    lo, hi = lo_hi
                    snapshot = frozenset(where)
                    values = np.fromiter(snapshot, np.uint64, len(snapshot))
                    buffer = free.pop()
                    future = pool.submit(_draw, key, lo, buffer[: hi - lo], values, stop)
                    ahead.append(((lo, buffer[: hi - lo], snapshot), buffer, future))
                if not ahead:
                    return
                if stop is not None and stop.is_set():
                    raise Stopped("the permutation's entries were stopped before they were done")
                taken, buffer, future = ahead.popleft()
                yield taken, future.result()
                free.append(buffer)  # the caller is done with it: it asked for the next
        finally:
            for *_, future in ahead:
                future.cancel()


def _pieces(n: int, piece: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of the pieces: from :data:`_FIRST_PIECE` positions growing by half each
    (multiples of 4) up to ``piece``."""
    lo, size = 0, min(piece, _FIRST_PIECE)
    while lo < n:
        yield lo, min(n, lo + size)
        lo += size
        size = min(piece, size + size // 8 * 4)


def _draw(
    key: np.ndarray, lo: int, targets: np.ndarray, values: np.ndarray, stop: Stop | None
) -> np.ndarray:
    """Fill ``targets`` with ``r[lo:lo + len(targets)]`` (with the compiled kernel's draws
    once it is compiled, else numpy's); the indices where it holds one of ``values``."""
    table = _filter_table(values)
    draws = compiled_draws()
    if draws is not None:
        return _exact(targets, draws(key, lo, targets, table, stop), values)
    generator = np.random.Philox(key=key, counter=lo // 4)
    bounds, low = np.empty(_SUB, np.uint64), np.empty(_SUB, np.uint64)
    found = []
    for start in range(0, len(targets), _SUB):
        size = min(_SUB, len(targets) - start)
        raw = generator.random_raw(size)
        np.add(_RAMP[:size], np.uint64(lo + start + 1), out=bounds[:size])
        np.remainder(raw, bounds[:size], out=raw)
        targets[start : start + size] = raw  # each below i + 1 <= n < 2**32
        np.bitwise_and(raw, np.uint64(_FILTER_MASK), out=low[:size])
        hits = np.flatnonzero(table[low[:size].view(np.intp)])
        if hits.size:
            found.append(hits + start)
    return _exact(targets, np.concatenate(found) if found else np.empty(0, np.intp), values)


def _filter_table(values: np.ndarray) -> np.ndarray:
    table = np.zeros(_FILTER_MASK + 1, bool)
    table[(values & np.uint64(_FILTER_MASK)).view(np.intp)] = True
    return table


def _walk(
    targets: np.ndarray,
    lo: int,
    where: dict[int, int],
    matched: np.ndarray,
    snapshot: frozenset[int],
) -> None:
    """Apply to ``where`` the swaps ``(i, r[i])`` of one piece (``targets = r[lo:hi]``) that
    touch a tracked position, in order. Candidates: where the piece holds a position of the
    ``snapshot`` (``matched``, found on the pool) or of one tracked since it, a tracked
    position inside the piece, and after each swap that moves a position, where the rest of
    the piece holds its new place (a comparison over the rest: ~ln(hi / lo) such moves a
    tracked position, so pieces grow from a small first one, :func:`_pieces`)."""
    hi = lo + len(targets)
    since = [v for v in where if v not in snapshot]
    candidates = matched.tolist() + [v - lo for v in where if lo <= v < hi]
    if since:
        candidates += _matches(targets, np.array(since, np.uint64)).tolist()
    heapq.heapify(candidates)
    done = -1
    while candidates:
        k = heapq.heappop(candidates)
        if k <= done:
            continue  # a candidate found twice
        done, i, j = k, lo + k, int(targets[k])
        moved_i, moved_j = where.pop(i, None), where.pop(j, None) if j != i else None
        if moved_i is not None:  # its value moves to j (i's own swap takes it)
            where[j] = moved_i
        if moved_j is not None:
            where[i] = moved_j
        for place in (j,) * (moved_i is not None) + (i,) * (moved_j is not None):
            later = np.flatnonzero(targets[k + 1 :] == place)
            for hit in (later + k + 1).tolist():
                heapq.heappush(candidates, hit)


def _matches(targets: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Indices of ``targets`` equal to one of ``values``: a comparison each for a few, else
    the filter table first and an exact check of the few it lets through."""
    if len(values) <= _COMPARED_MAX:
        return np.concatenate([np.flatnonzero(targets == v) for v in values.tolist()])
    table = _filter_table(values)
    candidates = np.flatnonzero(table[(targets & np.uint32(_FILTER_MASK)).astype(np.intp)])
    return _exact(targets, candidates, values)


def _exact(targets: np.ndarray, candidates: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The ``candidates`` (indices of ``targets``) that hold one of ``values``: a set's
    lookups, since ``np.isin`` costs ~0.5 ms even for a hundred candidates."""
    wanted = set(values.tolist())
    held = targets[candidates].tolist()
    return np.array([k for k, v in zip(candidates.tolist(), held) if v in wanted], np.intp)
