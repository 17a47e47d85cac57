"""Row permutations of the shuffle buffers, computed before the fills that need them.

A fill needs its buffer's row permutation the moment it starts. Buffers of up to ``2**16`` rows
take the plain Python path of :func:`~asyncflat.plan.permutation.permutation` (no compile), which
holds the GIL for ~1 ms per 4,096 rows: started on the loop thread at a minipoch boundary, it
made the trainer's next ``load()`` wait for the GIL (a switch interval, 5 ms, or more). So when
a fill of minipoch ``m`` starts, the permutation of ``m + 1`` is computed on the loop's one
background thread (not the CPU pool, whose threads a waiting load's decodes need) with the GIL
yielded every few hundred swaps, and the prefetch of ``m + 1`` starts once it is ready
(as soon as it lands, or at a later step's check; the prefetch has the whole minipoch to
finish). A load that needs a fill whose permutation is not ready computes it at once, as
before.

The plan's whole block order of the host's streams (:func:`block_order_off_loop`) is computed
on a thread of its own once wanted (:class:`~asyncflat.engine.opening.Opening` says when).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from asyncflat.engine.loop import adopt_thread, background_executor
from asyncflat.errors import AsyncflatError, LoaderClosedError
from asyncflat.plan.permutation import Stop, Stopped, ensure_kernel
from asyncflat.plan.shuffle import ShufflePlan

__all__ = ["RowPermutations", "block_order_off_loop", "on_own_thread"]

_T = TypeVar("_T")

_Key = tuple[int, int]


def on_own_thread(
    name: str, compute: Callable[..., _T], *args: object
) -> tuple[asyncio.Future[_T], threading.Thread]:
    """``compute(*args)`` on a thread of its own (call on the loop): a future of its result,
    and that thread. For work that takes time in proportion to the whole split (~10 ns a read
    block, the GIL released): no loop pool runs it, so a load's decodes never queue behind it.
    A :class:`Stopped` computation (closing) fails the future with ``LoaderClosedError``. The
    thread is the loop's own (:func:`adopt_thread`): its engine joins it as it closes, so it
    never outlives its loader. ``args`` are the thread's: it drops them once run."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run(*args: object) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = compute(*args)
        except Stopped:  # closing stopped it: a load still waiting learns the engine closed
            error = LoaderClosedError("the engine was closed")
        except Exception as exc:  # noqa: BLE001  (handed to the load that waits)
            error = exc
        except BaseException as exc:  # noqa: BLE001  (a SystemExit on the loop would stop it)
            error = AsyncflatError(f"{name} stopped: {exc!r}")
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    # A failure nobody collects (the loader closed first) is not an unretrieved exception.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    thread = threading.Thread(target=run, args=args, name=name, daemon=True)
    adopt_thread(thread)  # joined as the engine closes: a close() there must not wait for that
    thread.start()
    return future, thread


def block_order_off_loop(
    plan: ShufflePlan,
    stop: Stop,
    pages: tuple[np.ndarray, threading.Event] | None = None,
    wanted: threading.Event | None = None,
) -> tuple[asyncio.Future[np.ndarray], threading.Thread]:
    """``plan.served_block_order``, computed on a thread of its own (:func:`on_own_thread`)
    once ``wanted`` is set (None: at once), and that thread. Closing the engine sets ``stop``
    (the kernel returns within tens of microseconds) and ``wanted``.

    ``pages``: the whole permutation's array and an event set once its pages are written
    (:class:`~asyncflat.engine.fill.PageWriter`): the thread compiles the kernel meanwhile,
    then computes the order in it.
    """

    def compute(pages: tuple[np.ndarray, threading.Event] | None) -> np.ndarray:
        if wanted is not None:
            wanted.wait()
        out = None
        if pages is not None and not stop.is_set():
            ensure_kernel()  # while the pages are written
            out, written = pages
            written.wait()  # set by the last page write, or by closing (PageWriter.stop)
        if stop.is_set():  # closed meanwhile: compute nothing
            raise Stopped("closed before the block order was computed")
        del pages  # only the plan's order (a view of it, or a copy of its columns) is kept
        return plan.compute_block_order(stop, out)

    # ``pages`` as an argument: the thread drops it once run (the Thread object is kept until
    # closing, and the whole array must not live on where only some columns are kept).
    return on_own_thread("asyncflat-plan", compute, pages)


class RowPermutations:
    """The row permutations computed ahead, per (stream, minipoch); used on the loop thread."""

    def __init__(
        self,
        plan: ShufflePlan,
        streams: tuple[int, ...],
        on_ready: Callable[[int, int], None] | None = None,
    ) -> None:
        self.plan = plan
        #: called on the loop with (stream, minipoch) when a permutation computed ahead lands
        self._on_ready = on_ready
        self._ready: dict[_Key, np.ndarray] = {}
        self._pending: dict[_Key, asyncio.Future[np.ndarray]] = {}
        #: permutations of at most two minipochs ahead per stream are kept
        self._keep = 2 * max(1, len(streams))
        #: fills whose permutation was computed ahead, and those that computed it themselves
        self.ahead = 0
        self.inline = 0

    def take(self, stream: int, minipoch: int) -> np.ndarray:
        """The permutation of (stream, minipoch): the one computed ahead, else computed now."""
        key = (stream, minipoch)
        self._pending.pop(key, None)  # still computing: this fill cannot wait for it
        perm = self._ready.pop(key, None)
        if perm is not None:
            self.ahead += 1
            return perm
        self.inline += 1
        return self.plan.row_permutation(stream, minipoch)

    def ready(self, stream: int, minipoch: int) -> bool:
        """Whether a prefetch of (stream, minipoch) may start now: its permutation is ready, or
        cannot be computed ahead (no running loop); else start computing it and say no."""
        key = (stream, minipoch)
        if key in self._ready:
            return True
        if key in self._pending:
            return False
        return not self.prepare(stream, minipoch)

    def prepare(self, stream: int, minipoch: int) -> bool:
        """Start computing (stream, minipoch)'s permutation on the loop's background thread
        (:func:`~asyncflat.engine.loop.background_executor`); whether it started
        (or is already under way or done)."""
        key = (stream, minipoch)
        if key in self._ready or key in self._pending:
            return True
        if not 0 <= minipoch < self.plan.minipoch_count:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        compute = functools.partial(self.plan.row_permutation, stream, minipoch, yield_gil=True)
        try:
            # Not on the CPU pool: a waiting load's decodes must never queue behind these.
            future = loop.run_in_executor(background_executor(), compute)
        except RuntimeError:  # the CPU pool is shut down: the engine is closing
            return False
        self._pending[key] = future
        future.add_done_callback(functools.partial(self._done, key))
        return True

    def _done(self, key: _Key, future: asyncio.Future[np.ndarray]) -> None:
        # Retrieved first, so asyncio never logs a failure nobody asked for as unretrieved.
        failed = future.cancelled() or future.exception() is not None
        if self._pending.get(key) is not future:
            return  # taken meanwhile (computed by its fill), or cleared
        del self._pending[key]
        if failed:
            return  # the fill computes it itself, and reports what fails
        self._ready[key] = future.result()
        while len(self._ready) > self._keep:  # the oldest first (dicts keep insertion order)
            self._ready.pop(next(iter(self._ready)))
        if self._on_ready is not None and key in self._ready:
            self._on_ready(*key)

    def computing(self) -> dict[_Key, asyncio.Future[np.ndarray]]:
        """The permutations being computed off the loop now, by (stream, minipoch) (a copy)."""
        return dict(self._pending)

    def computed(self) -> set[_Key]:
        """The (stream, minipoch) keys whose permutation is ready and not yet taken."""
        return set(self._ready)

    def clear(self) -> None:
        """Forget every permutation (closing); computations under way finish unused."""
        self._pending.clear()
        self._ready.clear()
