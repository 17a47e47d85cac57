"""The seeded permutation that orders read blocks and shuffle-buffer rows.

``permutation(seed, n)`` returns exactly what the reference loader's ``_random_permutation``
returns, bit for bit, for every ``(seed, n)``::

    r = np.random.Philox(seed).random_raw(n) % (np.arange(n, dtype=np.uint64) + 1)
    result = np.arange(n, dtype=np.uint32)
    for i in reversed(range(n)):
        result[i], result[r[i]] = result[r[i]], result[i]

That algorithm is frozen forever: a training run that resumes (on another machine, with another
numpy) must see the same data order as before. It was chosen to make that possible:

* numpy's compatibility policy keeps a bit generator's raw stream (``random_raw``) fixed for a
  given seed across versions and platforms, Philox's included; the algorithms behind
  ``Generator.permutation``/``shuffle`` carry no such promise and may change.
* ``raw % (i + 1)`` instead of rejection sampling needs exactly one raw draw per position. Because
  ``i + 1 <= n < 2**32``, the modulo bias of each draw is at most ``2**-32``, which is acceptable.

Evaluated literally it takes about 0.4 s per million elements, so large ``n`` runs a machine-code
kernel instead (:mod:`asyncflat.plan.kernel`: LLVM IR compiled with llvmlite on first use
in ~0.1 s, where numba took 0.6-1.1 s per process; it runs with the GIL released, so a background
thread can shuffle while the trainer runs Python). The kernel re-implements Philox4x64-10 on the
key of ``np.random.Philox(seed)``; the tests check it against numpy's own ``random_raw``, the
literal algorithm, and checked-in golden vectors. ``n`` up to ``2**16`` (a shuffle buffer's rows
up to a 512 MiB buffer of 2048-token sequences) takes a plain Python path that needs no
compilation: a process that never needs a larger permutation never loads LLVM (~0.1-0.3 s of CPU
and ~64 MiB of resident library code).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import operator
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from asyncflat.config import available_cpus
from asyncflat.errors import AsyncflatError, ConfigError

__all__ = [
    "DRAWS_HITS",
    "DRAW_HELPER_MIN_CPUS",
    "DRAW_PIECE",
    "DRAW_THREAD",
    "NO_COMPILE_MAX",
    "PYTHON_BELOW",
    "YIELD_PAUSE_S",
    "YIELD_SLICE",
    "Stop",
    "Stopped",
    "compiled_draws",
    "ensure_kernel",
    "kernel_status",
    "permutation",
    "permutation_columns",
    "philox_key",
    "warm_up",
    "whole_permutation_size",
]

logger = logging.getLogger(__name__)


class Stopped(AsyncflatError):
    """A permutation was asked to stop (:class:`Stop`) before it was finished."""


class Stop:
    """Asks a running :func:`permutation` or :func:`permutation_columns` to stop (from any
    thread): the kernel reads the flag before each chunk of ``CHUNK`` positions (tens of
    microseconds apart), the yielding Python path between its slices; the call then raises
    :class:`Stopped`."""

    def __init__(self) -> None:
        self._flag = np.zeros(1, np.int32)  # the kernel reads it through its address

    def set(self) -> None:
        self._flag[0] = 1

    def is_set(self) -> bool:
        return bool(self._flag[0])

    @property
    def address(self) -> int:
        return int(self._flag.ctypes.data)


_NEVER = Stop()  # the flag of calls nobody stops

#: Sizes below this always take the plain Python path: fast enough (well under a millisecond),
#: and never paying for compiling the kernel.
PYTHON_BELOW = 2048
#: Sizes up to this one take the Python path (~1 ms per 4,096 items, ~28 ms at 2**16, holding the
#: GIL in switch-interval slices) unless the kernel is already compiled: they never start a
#: compile, so a loader whose permutations all fit (the rows of one buffer, the read blocks of a
#: dataset of up to 2**16 blocks) never pays LLVM's compile time and resident code, and a
#: restart's first batch never waits for it. Larger sizes need the kernel.
NO_COMPILE_MAX = 1 << 16
#: Positions per piece of the kernel's swap targets (1 MiB of them), drawn on a helper thread
#: ahead of the swaps (more than one piece, :data:`DRAW_HELPER_MIN_CPUS`, a C ``usleep``);
#: rounded down to a multiple of 4. Each handover between the threads may sleep ~40 us: pieces
#: under ~2^12 positions make them cost more than the draws they move.
DRAW_PIECE = 1 << 18
#: CPUs from which a permutation of more than one piece draws on a helper thread. On two, the
#: helper took a trainer's Python thread's CPU: beside one, 14.3M positions took 182 against
#: 149 ms and the Python thread kept 68% of its speed against 93% (alone: 92 against 137 ms).
DRAW_HELPER_MIN_CPUS = 4
#: the name of the thread that draws a permutation's pieces ahead of its swaps
DRAW_THREAD = "asyncflat-permutation-draws"
# pieces drawn ahead of the swaps at most (3 MiB at a time)
_DRAWN_AHEAD = 3
_METHODS = ("auto", "python", "kernel")
_Kernel = Callable[[np.uint64, np.uint64, np.ndarray, "Stop"], None]
#: (k0, k1, n, streams, rank, out, stop): see :func:`permutation_columns`
_ColumnsKernel = Callable[[np.uint64, np.uint64, int, int, np.ndarray, np.ndarray, "Stop"], None]
_kernel: _Kernel | None = None
#: (key, lo, out, table, stop) -> indices: see :func:`compiled_draws`; set with ``_kernel``
_Draws = Callable[[np.ndarray, int, np.ndarray, np.ndarray, "Stop | None"], np.ndarray]
_draws: _Draws | None = None
_columns_kernel: _ColumnsKernel | None = None
_kernel_lock = threading.Lock()
_warm_up_thread: threading.Thread | None = None
_warm_up_lock = threading.Lock()


def permutation(
    seed: int,
    n: int,
    *,
    yield_gil: bool = False,
    method: Literal["auto", "python", "kernel"] = "auto",
    stop: Stop | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """A permutation of ``range(n)`` as a ``uint32`` array, fixed forever by ``(seed, n)``.

    ``seed`` is any non-negative integer (as accepted by ``np.random.Philox``); ``0 <= n < 2**32``.

    ``method`` picks the implementation, never the result: ``"auto"`` (the default) takes the
    plain Python path below :data:`PYTHON_BELOW` items, and up to :data:`NO_COMPILE_MAX` items
    while the kernel is not compiled, else the compiled kernel; ``"python"`` and ``"kernel"``
    force one path (``"kernel"`` compiles it if needed), for checking one against the other.

    ``yield_gil``: for a background thread. The plain Python path holds the GIL throughout (up
    to ~28 ms at ``2**16`` items), and a trainer thread wanting it meanwhile waits a whole switch
    interval (5 ms) or more; with ``yield_gil`` it runs in slices of ``YIELD_SLICE`` swaps with a
    short sleep between them, so another thread waits at most one slice (tens of microseconds)
    for it, at several times the wall time (23 ms against 4 ms at 32,768 items, measured by
    ``bench/gil.py``). Same swaps, same result. The kernel path releases the GIL throughout.

    ``stop``: once set (from another thread), the call raises :class:`Stopped` soon after.

    ``out``: a C-contiguous writeable ``uint32`` array of ``n`` entries to compute it in (and
    return). Its pages may be written beforehand, off this thread: first writes of fresh memory
    are a large share of the kernel's time (0.9 s of 2.4 s at 95M entries on a 2-core VM).
    """
    if method not in _METHODS:
        raise ConfigError(
            f"permutation: method must be one of {', '.join(_METHODS)}, got {method!r}"
        )
    seed = _as_int("seed", seed)
    n = _as_int("n", n)
    if seed < 0:
        raise ConfigError(f"permutation: seed must be >= 0, got {seed}")
    if not 0 <= n < 1 << 32:
        raise ConfigError(f"permutation: n must be in [0, 2**32), got {n}")
    if out is not None and (
        out.dtype != np.uint32 or out.shape != (n,) or not out.flags.c_contiguous
        or not out.flags.writeable
    ):  # fmt: skip
        raise ConfigError(
            f"permutation: out must be a writeable C-contiguous uint32 array of shape ({n},), "
            f"got {out.dtype} {out.shape} (C-contiguous: {out.flags.c_contiguous}, writeable: "
            f"{out.flags.writeable})"
        )
    bit_generator = np.random.Philox(seed)
    stop = stop or _NEVER
    if _python_path(method, n):
        result = _python_permutation(bit_generator, n, yield_gil=yield_gil, stop=stop)
        if out is None:
            return result
        out[:] = result
        return out
    key = _philox_key(bit_generator)
    result = np.empty(n, np.uint32) if out is None else out
    _get_kernel()(key[0], key[1], result, stop)
    _raise_if_stopped(stop)
    return result


def permutation_columns(
    seed: int,
    n: int,
    streams: int,
    served: tuple[int, ...],
    *,
    yield_gil: bool = False,
    method: Literal["auto", "python", "kernel"] = "auto",
    stop: Stop | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Columns ``served`` of ``permutation(seed, n)`` seen as ``n // streams`` rows of
    ``streams`` columns: ``uint32[n // streams, len(served)]``, row-major.

    What one host needs of the global block order: the blocks of the streams it serves (entry
    ``p`` of the order goes to stream ``p % streams``). All of ``n`` is still shuffled (any
    entry depends on every swap), but when few columns are served the kernel keeps only theirs
    (a table of wanted positions, about 12 bytes per served entry, instead of the 4 bytes per
    entry of the whole permutation). ``served`` is sorted, distinct, in ``[0, streams)``;
    ``streams`` divides ``n``. ``stop``: as for :func:`permutation`. ``out``: an array of
    :func:`whole_permutation_size` entries for the whole permutation, as for
    :func:`permutation` (the result is a view of it when every column is served).
    """
    seed, n = _as_int("seed", seed), _as_int("n", n)
    if seed < 0:
        raise ConfigError(f"permutation_columns: seed must be >= 0, got {seed}")
    if not 0 <= n < 1 << 32:  # the kernel keeps positions as uint32
        raise ConfigError(f"permutation_columns: n must be in [0, 2**32), got {n}")
    if streams < 1 or n % streams:
        raise ConfigError(f"permutation_columns: streams={streams} must be >= 1 and divide n={n}")
    if list(served) != sorted(set(served)) or not all(0 <= s < streams for s in served):
        raise ConfigError(
            f"permutation_columns: served={served!r} must be sorted distinct columns in "
            f"[0, {streams})"
        )
    rows = n // streams
    if whole_permutation_size(n, streams, len(served), method=method):
        full = permutation(seed, n, yield_gil=yield_gil, method=method, stop=stop, out=out)
        if len(served) == streams:
            return full.reshape(rows, streams)
        return np.ascontiguousarray(full.reshape(rows, streams)[:, list(served)])
    if out is not None:
        raise ConfigError("permutation_columns: out is for the whole permutation's path only")
    stop = stop or _NEVER
    key = philox_key(seed)
    rank = np.full(streams, -1, np.int32)
    rank[list(served)] = np.arange(len(served), dtype=np.int32)
    out = np.empty((rows, len(served)), np.uint32)
    _get_columns_kernel()(key[0], key[1], n, streams, rank, out, stop)
    _raise_if_stopped(stop)
    return out


def whole_permutation_size(
    n: int, streams: int, served: int, *, method: Literal["auto", "python", "kernel"] = "auto"
) -> int:
    """Entries of the whole permutation :func:`permutation_columns` computes for ``served`` of
    ``streams`` columns (``n``, the ``out`` it takes), or 0 when it keeps only the served
    columns (the table of its columns kernel): every column served, the Python path, or most
    columns served (the whole permutation, 4 bytes an entry, is then smaller than the table)."""
    rows = n // max(streams, 1)
    whole = (
        served == streams
        or _python_path(method, n, columns=True)
        or (method == "auto" and 4 * n <= _table_bytes(rows * served))
    )
    return n if whole else 0


def _raise_if_stopped(stop: Stop) -> None:
    if stop.is_set():
        raise Stopped("the permutation was stopped before it was finished")


def _table_slots(entries: int) -> int:
    """Slots of the columns kernel's table for ``entries`` wanted positions: a power of two, at
    most half full (short linear probes)."""
    return 1 << max(1, (2 * entries - 1).bit_length())


def _table_bytes(entries: int) -> int:
    return 8 * _table_slots(entries)


def _python_path(method: str, n: int, *, columns: bool = False) -> bool:
    """Whether ``method`` takes the plain Python path for ``n`` items (see :func:`permutation`):
    the kernel that would run (the columns kernel for ``columns``) is compiled already, or
    ``n`` is too large for Python."""
    if method == "auto":
        compiled = _columns_kernel if columns else _kernel
        return n < PYTHON_BELOW or (compiled is None and n <= NO_COMPILE_MAX)
    return method == "python"


def philox_key(seed: int) -> np.ndarray:
    """The Philox key of ``np.random.Philox(seed)`` (uint64[2]): with it a draw's counter
    names any draw of the stream (``np.random.Philox(key=..., counter=i // 4)`` starts at draw
    ``i`` for ``i % 4 == 0``), which the kernel and :mod:`~asyncflat.plan.entries` rely on."""
    return _philox_key(np.random.Philox(_as_int("seed", seed)))


def _philox_key(bit_generator: np.random.Philox) -> np.ndarray:
    """The key of a fresh generator; the kernel replays the stream from it, so it must start
    where numpy's would."""
    state = bit_generator.state
    if state["state"]["counter"].any() or state["buffer_pos"] != 4:
        raise RuntimeError(f"unexpected initial Philox state {state!r}")  # numpy changed Philox
    return state["state"]["key"]


def warm_up(n: int) -> None:
    """Start compiling the kernel on a background thread if permutations of ``n`` items need it.

    Returns at once; a :func:`permutation` that needs the kernel before then waits for this
    compile instead of starting its own. Sizes up to :data:`NO_COMPILE_MAX` never need it (nor
    start it). The
    compile (~0.1 s) runs in LLVM with the GIL released, apart from importing llvmlite, so a
    loader can call this in its constructor and open its store meanwhile.
    """
    global _warm_up_thread
    # The thread is the process's, not a loader's: it ends when the compile does, whatever
    # becomes of the loader that started it (hence a name outside the loaders' "asyncflat-").
    if n <= NO_COMPILE_MAX or _kernel is not None:
        return
    with _warm_up_lock:
        if _warm_up_thread is None:
            _warm_up_thread = threading.Thread(
                target=_warm_up, name="permutation-kernel-compile", daemon=True
            )
            _warm_up_thread.start()
            # LLVM's static destructors run at exit: a compile still going then crashes the
            # process (seen: a short-lived process that only loaded one batch segfaulted at exit).
            atexit.register(_warm_up_thread.join, 60)


def ensure_kernel() -> None:
    """Compile the kernel now, unless it is compiled; a compile already under way (a
    :func:`warm_up`'s, another thread's) is waited for, not repeated. Raises if it cannot be
    built (llvmlite missing or broken)."""
    _get_kernel()


def compiled_draws() -> _Draws | None:
    """The kernel's swap-target draws once the kernel is compiled, else None (nothing is
    started: see :func:`ensure_kernel`). ``draws(key, lo, out, table, stop)`` fills ``out``
    (writeable, C-contiguous uint32) with ``r[lo:lo + out.size]`` of the stream of
    :func:`philox_key`'s ``key``, ``r[i] = raw[i] % (i + 1)`` (``lo`` a multiple of 4), and
    returns the indices ``k`` (intp, ascending) where ``table[out[k] % table.size]`` is set
    (``table``: bool, a power of two long; ``out``: at most 2**31 entries): one pass with the
    GIL released, ~5 ns a position where numpy's draws, modulo and filter take ~10. Raises
    :class:`Stopped` once ``stop`` is set."""
    return _draws


#: indices a call of the compiled draws keeps at first (a call that finds more draws again)
DRAWS_HITS = 1 << 13


def _check_draws(lo: int, out: np.ndarray, table: np.ndarray) -> None:
    if not (0 <= lo and lo + out.size <= 1 << 32):  # positions as permutation() takes them
        raise ValueError(f"draws: positions [{lo}, {lo + out.size}) must lie in [0, 2**32)")
    if out.size > 1 << 31:  # the kernel keeps the indices it finds as int32
        raise ValueError(f"draws: out holds at most 2**31 entries, got {out.size}")
    if lo % 4 or out.dtype != np.uint32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(
            f"draws: lo must be a multiple of 4 and out a writeable C-contiguous uint32 array, "
            f"got lo={lo}, {out.dtype} (C-contiguous: {out.flags.c_contiguous}, writeable: "
            f"{out.flags.writeable})"
        )
    if (
        table.dtype != np.bool_
        or not table.flags.c_contiguous
        or not table.size
        or table.size & (table.size - 1)
    ):
        raise ValueError(
            f"draws: table must be a C-contiguous bool array a power of two long, got "
            f"{table.dtype} of {table.size}"
        )


def kernel_status() -> str:
    """``"ready"`` once the kernel is compiled; else ``"compiling"`` while a :func:`warm_up`'s
    background compile runs; else ``"absent"`` (never started, or it failed)."""
    if _kernel is not None:
        return "ready"
    thread = _warm_up_thread
    return "compiling" if thread is not None and thread.is_alive() else "absent"


def _warm_up() -> None:
    try:
        _get_kernel()
    except Exception as exc:  # noqa: BLE001  (the first real call compiles again and raises)
        logger.debug("compiling the permutation kernel in the background failed: %r", exc)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"permutation: {name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(
            f"permutation: {name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None


#: Swaps per slice of a yielding permutation (~30-60 us of Python on these machines) and the
#: sleep after each: long enough that a thread waiting for the GIL takes it (a zero sleep
#: releases the GIL, but the releasing thread often takes it back before the waiter wakes).
YIELD_SLICE = 256
YIELD_PAUSE_S = 50e-6


def _python_permutation(
    bit_generator: np.random.Philox, n: int, *, yield_gil: bool = False, stop: Stop = _NEVER
) -> np.ndarray:
    """The literal Fisher-Yates in Python; with ``yield_gil``, cut into slices of
    ``YIELD_SLICE`` swaps with the GIL released between them (the same result), ``stop``
    read between them. Only between them: each pause costs this thread a wait for the GIL
    (up to a switch interval when another thread runs Python), so a permutation of one slice
    takes none."""
    bounds = np.arange(1, n + 1, dtype=np.uint64)
    swaps = bit_generator.random_raw(n) % bounds  # numpy: short, and not worth slicing
    result = list(range(n))
    piece = YIELD_SLICE if yield_gil else max(n, 1)
    # Fisher-Yates runs from the top down: slice [lo, hi) swaps i = hi-1 .. lo.
    for hi in range(n, 0, -piece):
        lo = max(hi - piece, 0)
        for i, j in zip(range(hi - 1, lo - 1, -1), reversed(swaps[lo:hi].tolist())):
            result[i], result[j] = result[j], result[i]
        if yield_gil:
            _raise_if_stopped(stop)
            if lo:
                time.sleep(YIELD_PAUSE_S)
    _raise_if_stopped(stop)
    if not yield_gil:
        return np.array(result, dtype=np.uint32)
    out = np.empty(n, np.uint32)
    step = YIELD_SLICE * 32  # list -> array in pieces too (one piece of 2**16 holds ~2 ms)
    for lo in range(0, n, step):
        if lo:
            time.sleep(YIELD_PAUSE_S)
        out[lo : lo + step] = result[lo : lo + step]
    return out


def _get_kernel() -> _Kernel:
    global _kernel
    if _kernel is None:
        with _kernel_lock:
            if _kernel is None:
                _kernel = _load_kernel()
    return _kernel


def _get_columns_kernel() -> _ColumnsKernel:
    global _columns_kernel
    if _columns_kernel is None:
        with _kernel_lock:
            if _columns_kernel is None:
                _columns_kernel = _load_columns_kernel()
    return _columns_kernel


def _load_kernel() -> _Kernel:
    """Compile the machine-code permutation kernel (llvmlite is imported only here)."""
    started = time.perf_counter()
    from asyncflat.plan import kernel as compiled_kernel

    compiled = compiled_kernel.compile_kernel()
    logger.debug("compiled the permutation kernel in %.3fs", time.perf_counter() - started)

    def kernel(k0: np.uint64, k1: np.uint64, result: np.ndarray, stop: Stop) -> None:
        # (``result`` is permutation()'s own array, or its ``out``, which it checked)
        _run_kernel(compiled, int(k0), int(k1), result, stop)

    def draws(
        key: np.ndarray, lo: int, out: np.ndarray, table: np.ndarray, stop: Stop | None
    ) -> np.ndarray:
        _check_draws(lo, out, table)
        stop = stop or _NEVER
        capacity = DRAWS_HITS
        while True:
            hits = np.empty(capacity, np.int32)
            found = compiled.draws_matching(
                int(key[0]), int(key[1]), out.ctypes.data, lo, lo + out.size, table.ctypes.data,
                table.size - 1, hits.ctypes.data, capacity, stop.address,
            )  # fmt: skip
            _raise_if_stopped(stop)  # else ``out`` may be short of its last draws
            if found <= capacity:
                return hits[:found].astype(np.intp)
            capacity = found  # drawn again: the same draws, every index kept this time

    global _draws
    _draws = draws
    return kernel


def _run_kernel(compiled: Any, k0: int, k1: int, result: np.ndarray, stop: Stop) -> None:
    """The permutation into ``result`` with the kernel (:class:`~asyncflat.plan.kernel.Kernel`):
    one piece of :data:`DRAW_PIECE` positions at a time from the top down, each piece's swap
    targets drawn on a helper thread while the piece above it is swapped (more than one piece,
    at least :data:`DRAW_HELPER_MIN_CPUS`, and a C ``usleep`` for the threads' waits), else on
    this thread before its swaps; one call to the kernel on each thread either way.

    The draws (Philox and a modulo) are ~40% of the kernel's time and the swaps (random
    accesses, one after the other) wait for nothing but their targets: beside them the whole
    order takes about the swaps' time (14.3M positions on a 13-core TPU host: 142-148 against
    187-189 ms; 95M: 1.08 against 1.49 s).
    """
    n = result.size
    piece = max(4, DRAW_PIECE - DRAW_PIECE % 4)  # a piece starts on a Philox block (4 draws)
    counters = np.zeros(3, np.int64)  # pieces drawn, pieces swapped, abort
    sleep = _usleep_address() if n > piece and available_cpus() >= DRAW_HELPER_MIN_CPUS else 0
    helper: threading.Thread | None = None  # once started
    try:
        if sleep:
            ring = np.empty(_DRAWN_AHEAD * piece, np.uint32)
            # its arguments keep the arrays it writes alive until it returns, joined or not
            args = (compiled, k0, k1, ring, piece, n, counters, stop, sleep)
            thread = threading.Thread(target=_draw_all, args=args, name=DRAW_THREAD, daemon=True)
            with contextlib.suppress(RuntimeError):  # no thread to be had (a limit, a shutdown)
                thread.start()
                helper = thread
        if helper is None:
            ring = np.empty(min(n, piece), np.uint32)
        slots = 0 if helper is None else _DRAWN_AHEAD
        compiled.swap_all(
            k0, k1, result.ctypes.data, ring.ctypes.data, slots, piece, n,
            counters.ctypes.data, stop.address, sleep,
        )  # fmt: skip
        if counters[1] < -(-n // piece) and not stop.is_set():  # the helper gave up (abort)
            raise AsyncflatError("drawing the permutation's swap targets failed on its thread")
    finally:
        # A helper waiting for a slot returns: this thread is done. Interrupted in start(), it
        # may run yet: it draws at most the ring's pieces and returns by itself.
        counters[2] = 1
        if helper is not None:
            helper.join()


def _draw_all(
    compiled: Any, k0: int, k1: int, ring: np.ndarray, piece: int, n: int,
    counters: np.ndarray, stop: Stop, sleep: int,
) -> None:  # fmt: skip
    try:
        compiled.draw_all(
            k0, k1, ring.ctypes.data, _DRAWN_AHEAD, piece, n, counters.ctypes.data,
            stop.address, sleep,
        )  # fmt: skip
    except BaseException:
        counters[2] = 1  # the swaps waiting for a piece return, and the caller raises
        raise


@functools.cache
def _usleep_address() -> int:
    """The address of the C library's ``usleep``, or 0 (none found: Windows)."""
    try:
        return ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value or 0
    except (OSError, AttributeError, TypeError):
        return 0


def _load_columns_kernel() -> _ColumnsKernel:
    """Compile the machine-code columns kernel (llvmlite is imported only here)."""
    started = time.perf_counter()
    from asyncflat.plan import kernel as compiled_kernel

    compiled_columns = compiled_kernel.compile_columns_kernel()
    chunk = compiled_kernel.CHUNK
    logger.debug("compiled the columns kernel in %.3fs", time.perf_counter() - started)

    def columns(
        k0: np.uint64,
        k1: np.uint64,
        n: int,
        streams: int,
        rank: np.ndarray,
        out: np.ndarray,
        stop: Stop,
    ) -> None:
        if rank.dtype != np.int32 or out.dtype != np.uint32 or not out.flags.c_contiguous:
            raise TypeError("the columns kernel needs int32 ranks and a C-contiguous uint32 out")
        slots = _table_slots(out.size)
        keys = np.full(slots, 0xFFFFFFFF, np.uint32)  # every slot free
        values = np.empty(slots, np.uint32)
        scratch = np.empty(chunk, np.uint32)
        compiled_columns(
            int(k0), int(k1), n, streams, rank.ctypes.data, out.shape[1], keys.ctypes.data,
            values.ctypes.data, slots.bit_length() - 1, out.ctypes.data, scratch.ctypes.data,
            stop.address,
        )  # fmt: skip

    return columns
