"""The one place where synchronous code meets asyncio.

Each engine owns a :class:`LoopThread`: an event loop (uvloop when importable) running on a
named daemon thread, started lazily. The rest of the library calls :meth:`LoopThread.run` or
:meth:`LoopThread.submit` and never thinks about loops. Design points, after zarr-python's
``core/sync.py`` and fsspec's ``asyn.py``:

* No global loop policy is set: the host program's own loops are left alone.
* ``run`` re-raises the coroutine's exception in the caller's thread, unchanged, and waits in
  short slices so Ctrl-C still reaches the main thread; the coroutine is then cancelled.
* Calling ``run`` from the loop's own thread would deadlock, so it raises LoopReentryError.
* After ``fork`` the child has no loop thread; the next use there starts a fresh loop.
* ``close`` (also run at interpreter exit) runs an optional last coroutine, cancels pending
  tasks, stops the loop; the loop's own thread then shuts its CPU pool down and closes the loop,
  so no library thread outlives its owner. From any other thread ``close`` waits (bounded) for
  that; from the loop's own thread (a finalizer or callback running there) it only schedules
  it, since a thread cannot join itself.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from asyncflat.errors import LoaderClosedError, LoadTimeoutError, LoopReentryError

__all__ = ["LoopThread", "background_executor", "thread_adopter"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_WAIT_SLICE_S = 0.2  # how often a blocked caller wakes to let signals (Ctrl-C) through
_JOIN_TIMEOUT_S = 10.0
#: how long ``close`` gives its last coroutine (an engine's aclose) before cancelling it
_LAST_WORDS_S = 5.0
_ids = itertools.count()
_live: weakref.WeakSet[LoopThread] = weakref.WeakSet()
#: each running loop's one-thread pool for work done ahead (see background_executor)
_background: weakref.WeakKeyDictionary[Any, concurrent.futures.Executor] = (
    weakref.WeakKeyDictionary()
)


#: each running loop's own threads (its pools', and those it joins as it closes: the block
#: order's), for :meth:`LoopThread.in_own_thread`
_own_threads: weakref.WeakKeyDictionary[Any, weakref.WeakSet[threading.Thread]] = (
    weakref.WeakKeyDictionary()
)


def adopt_thread(thread: threading.Thread) -> None:
    """Count ``thread`` (started from the running loop, and joined by it as its engine
    closes) among the loop's own, like its pools' threads: a ``close()`` that runs there (a
    garbage collection) schedules the shutdown instead of waiting for the loop, which waits
    for this thread. A no-op on a loop this module did not start."""
    own = _running_loops_own()
    if own is not None:
        own.add(thread)


def thread_adopter() -> Callable[[], None]:
    """A callable (make it on the running loop) that counts the thread it is called on among
    the loop's own, as :func:`adopt_thread` does: for the pool threads that a thread of the
    loop's starts (the early blocks' draws), joined with it."""
    own = _running_loops_own()
    return (lambda: None) if own is None else lambda: own.add(threading.current_thread())


def _running_loops_own() -> weakref.WeakSet[threading.Thread] | None:
    """The running loop's own threads, or None (no running loop, or not one of this
    module's)."""
    with contextlib.suppress(RuntimeError, TypeError):  # no running loop; not weakly held
        return _own_threads.get(asyncio.get_running_loop())
    return None


def background_executor() -> concurrent.futures.Executor | None:
    """The running loop's one-thread pool for work done ahead of the loads that need it (a
    next minipoch's permutation, the pages of the first prefetch's buffer), or None on a loop
    this module did not start (then use the default executor). Kept apart from the CPU pool,
    whose threads a waiting load's decodes need: 8 streams' permutations queued there delayed
    a first load by ~300 ms. A long job goes there in pieces, each queueing the next
    (:class:`~asyncflat.engine.fill.PageWriter`), so that it holds up the others for one piece
    at most."""
    try:
        return _background.get(asyncio.get_running_loop())
    except (RuntimeError, TypeError):  # no running loop; a loop type that cannot be weakly held
        return None


def _niceness_target(nice: int) -> int | None:
    """The nice value ``nice`` steps below the calling thread's, or None where unsupported."""
    if nice <= 0 or not hasattr(os, "getpriority"):
        return None
    return min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)


def _pool_thread(threads: weakref.WeakSet[threading.Thread], target: int | None) -> None:
    """A pool thread's initializer: note the thread among its loop's own (``threads``), and
    lower its priority (:func:`_lower_priority`)."""
    threads.add(threading.current_thread())
    _lower_priority(target)


def _lower_priority(target: int | None) -> None:
    """Give this thread the nice value ``target`` (Linux schedules threads as tasks).

    The engine's work is background work: when the trainer's thread (or jax's) wants a core,
    the scheduler should give it one. When a load waits for data the trainer is idle anyway, so
    fills lose nothing then. Best effort: elsewhere this is a no-op.
    """
    if target is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), target)
    except OSError:  # pragma: no cover - not permitted here
        log.debug("could not lower the priority of %s", threading.current_thread().name)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """An event loop on a private daemon thread, plus a small pool for CPU work off the loop."""

    def __init__(self, *, name: str = "asyncflat", cpu_threads: int = 2, nice: int = 0) -> None:
        self._name = f"{name}-loop-{next(_ids)}"
        self._cpu_threads = cpu_threads
        self._nice = nice
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the thread that runs (or ran) the loop, kept after close(): a callback the loop runs
        #: after close() began still knows its own thread (:meth:`in_loop_thread`)
        self._thread: threading.Thread | None = None
        #: the threads of the loop's pools, and others it joins as it closes
        #: (:func:`adopt_thread`): the loop's thread waits for them as it ends (held weakly:
        #: a mixture adopts a thread at each pass it opens)
        self._pool_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._closed = False
        self._roots: set[Any] = set()
        _live.add(self)

    def keep(self, obj: Any) -> None:
        """Hold ``obj`` from the loop thread itself until the loop stops.

        asyncio holds tasks weakly: when the owner of the loop (a loader) is dropped in a
        reference cycle, its engine and the engine's pending tasks would be in the same garbage
        set, and the collector would finalize (close) their coroutines before the owner's
        ``__del__`` could shut them down. Kept here, they stay alive until the loop stops.
        """
        self._roots.add(obj)

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, started on first use (and afresh in a forked child)."""
        with self._lock:
            if self._closed:
                raise LoaderClosedError(f"{self._name} is closed")
            if self._pid != os.getpid():
                # The parent's thread does not exist here; its loop object is unusable.
                self._loop = self._thread = self._executor = None
                self._pool_threads = weakref.WeakSet()
                self._pid = os.getpid()
            if self._loop is None:
                self._start()
            assert self._loop is not None
            return self._loop

    def _start(self) -> None:
        loop = _new_event_loop()
        # Relative to the thread starting the loop (the trainer's); threads inherit their
        # creator's nice value, so the pool's threads get the same absolute value, not more.
        target = _niceness_target(self._nice)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self._cpu_threads,
            thread_name_prefix=f"{self._name}-cpu",
            initializer=_pool_thread,
            initargs=(self._pool_threads, target),
        )
        # zarr's codecs decode via asyncio.to_thread, i.e. on the loop's default executor.
        loop.set_default_executor(self._executor)
        background = concurrent.futures.ThreadPoolExecutor(
            1,
            thread_name_prefix=f"{self._name}-background",
            initializer=_pool_thread,
            initargs=(self._pool_threads, target),
        )
        with contextlib.suppress(TypeError):  # a loop type that cannot be weakly held
            _background[loop] = background
            _own_threads[loop] = self._pool_threads
        started = threading.Event()
        executor = self._executor
        roots = self._roots

        def main() -> None:
            # ``roots`` is reachable from this running frame: what it holds (an engine, its
            # tasks) is never part of a garbage cycle, even when its owner is.
            assert roots is not None
            _lower_priority(target)
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            try:
                loop.run_forever()
            finally:
                # Stopped by close() (from any thread, this one included): the pool and the
                # loop are released here, by their own thread, never left to the collector.
                executor.shutdown(wait=True, cancel_futures=True)
                background.shutdown(wait=True, cancel_futures=True)
                loop.close()
                asyncio.set_event_loop(None)
                roots.clear()

        self._thread = threading.Thread(target=main, name=self._name, daemon=True)
        try:
            self._thread.start()
            started.wait()
        except BaseException:
            # A Ctrl-C while the thread comes up: it may run already, and close(), which finds
            # no loop, would never stop it. Stopped once it runs, it releases what it holds.
            loop.call_soon_threadsafe(loop.stop)
            raise
        self._loop = loop
        log.debug("started event loop thread %s", self._name)

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> bool:
        """Schedule ``callback(*args)`` on the running loop's thread; False (and not scheduled)
        when no loop runs (not started, closed, or a forked child). Takes no lock and never
        starts the loop: safe from a finalizer on any thread, whatever locks that thread holds
        (a garbage collection can run a finalizer anywhere)."""
        loop = self._loop
        if loop is None or self._closed or self._pid != os.getpid() or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # closed meanwhile
            return False
        return True

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's thread, also once close() has begun: a
        callback queued before it (a collected iterator's release) still runs there, and must
        not wait for a thread that waits for this loop."""
        return self._thread is not None and threading.current_thread() is self._thread

    def in_own_thread(self) -> bool:
        """Whether the caller runs on the loop's thread, one of its pools' or another it joins
        as it closes (:func:`adopt_thread`; a decode job, a garbage collection that happens to
        run there): :meth:`close` from one of them cannot wait for the loop's thread, which
        waits for them as it ends."""
        return self.in_loop_thread() or threading.current_thread() in self._pool_threads

    def close(self, last: Coroutine[Any, Any, Any] | None = None) -> None:
        """Run ``last`` (bounded), cancel pending tasks, stop the loop. Idempotent.

        From another thread it returns once the loop thread has stopped (or after a bound of
        about ``_LAST_WORDS_S + _JOIN_TIMEOUT_S`` seconds); from the loop's own thread or one of
        its pools' (:meth:`in_own_thread`) it schedules the shutdown and returns at once (the
        loop's thread ends after the current callback, and after the pools' current jobs).
        """
        with self._lock:
            if self._closed:
                if last is not None:
                    last.close()
                return
            self._closed = True
            loop, thread = self._loop, self._thread
            self._loop = self._executor = None
            same_process = self._pid == os.getpid()
        if loop is None or not same_process or loop.is_closed():
            if last is not None:
                last.close()
            return

        async def shutdown() -> None:
            if last is not None:
                try:
                    await asyncio.wait_for(last, _LAST_WORDS_S)
                except BaseException:
                    log.debug("%s: closing coroutine failed", self._name, exc_info=True)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                done, pending = await asyncio.wait(tasks, timeout=_JOIN_TIMEOUT_S)
                for task in done:  # retrieved, so asyncio never logs them as unretrieved
                    if not task.cancelled():
                        task.exception()
                if pending:
                    log.warning("%s: %d tasks did not finish cancelling", self._name, len(pending))
            loop.stop()

        if thread is not None and threading.current_thread() is thread:
            # A finalizer or callback on the loop's own thread: it cannot wait for itself.
            loop.create_task(shutdown())
            log.debug("%s: shutdown scheduled from its own thread", self._name)
            return
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop)
        except RuntimeError:  # the loop already stopped (interpreter exit): nothing to run
            return
        if threading.current_thread() in self._pool_threads:
            # A pool's thread (or an adopted one): the loop's thread waits for it as it ends.
            log.debug("%s: shutdown scheduled from one of its pools' threads", self._name)
            return
        if thread is not None:
            thread.join(_LAST_WORDS_S + _JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning("%s: loop thread did not stop in time", self._name)
        log.debug("closed event loop thread %s", self._name)

    # -- calls from the synchronous side ------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future."""
        try:
            loop = self.loop
        except BaseException:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result in the calling thread.

        Raises the coroutine's own exception, LoadTimeoutError after ``timeout`` seconds, and
        lets KeyboardInterrupt through promptly; in the last two cases the coroutine is cancelled.
        """
        if self.in_loop_thread():
            coro.close()
            raise LoopReentryError(
                f"blocking call made from {self._name}'s own thread; await the coroutine instead"
            )
        future = self.submit(coro)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise LoadTimeoutError(f"no result within {timeout:.3g} s")
                wait = _WAIT_SLICE_S if remaining is None else min(_WAIT_SLICE_S, remaining)
                try:
                    return future.result(wait)
                except concurrent.futures.CancelledError:
                    if self._closed:  # close() cancelled it: say so, not a bare CancelledError
                        raise LoaderClosedError(f"{self._name} was closed") from None
                    raise
                except concurrent.futures.TimeoutError:
                    # On 3.11+ this is the builtin TimeoutError: the coroutine's own may land here.
                    if future.done():
                        raise

        except BaseException:
            future.cancel()
            if _exiting and threading.current_thread() is not threading.main_thread():
                # Interpreter exit ended this load: end the (daemon) thread quietly; threading's
                # excepthook prints nothing for SystemExit. Nobody waits for this load any more.
                raise SystemExit(0) from None
            raise


#: Set at interpreter exit, before the loops are closed.
_exiting = False


@atexit.register
def close_all_loops() -> None:
    """Stop every live loop (at interpreter exit, so that exit never waits on a fill; an exit
    hook registered later, which runs first, may call it before its own work)."""
    global _exiting
    _exiting = True
    for runner in list(_live):
        try:
            runner.close()
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("error closing %r at exit", runner, exc_info=True)
