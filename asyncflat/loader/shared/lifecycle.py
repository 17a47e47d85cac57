"""The one lifecycle every loader shares: :class:`Lifecycle`.

A loader (:class:`~asyncflat.loader.shuffling.ShufflingLoader`,
:class:`~asyncflat.loader.mixture.loader.MixtureLoader`) is a thin facade: it builds a
:class:`Lifecycle` and hands it a :class:`~asyncflat.loader.shared.serving.RowServer`, which says
which rows make a step. Everything else is here, once: the loop thread the engines run on,
``load(step)`` and its load-ahead, ``iter()`` (one :class:`~asyncflat.loader.shared.iterator.BatchIterator`
for every loader) and its device prefetch, the jax build of a batch and its build times, the
batches delivered, ``interval_stats()``, and closing (idempotent, from any thread, refused in a
forked child, safe from a finalizer).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Generic, TypeVar

import numpy as np

from asyncflat.config import EngineOptions, step_argument
from asyncflat.engine import IntervalStats
from asyncflat.engine.loop import LoopThread
from asyncflat.errors import LoaderClosedError
from asyncflat.loader.shared.background import BackgroundBuilder, Prefetchers
from asyncflat.loader.shared.batch import BatchBuilder
from asyncflat.loader.shared.iterator import BatchIterator
from asyncflat.loader.shared.load_ahead import NOT_READY, LoadAhead
from asyncflat.loader.shared.serving import Pin, RowServer

__all__ = ["BUILD_HISTORY", "Lifecycle"]

log = logging.getLogger(__name__)

#: build times kept for ``stats().build_median_s``
BUILD_HISTORY = 4096

S = TypeVar("S", bound=RowServer)
T = TypeVar("T")


class Lifecycle(Generic[S]):
    """The loop thread, batches and closing of one loader named ``kind`` (in its errors).

    Built in two steps: ``Lifecycle(...)`` starts the loop thread, :meth:`start` runs the
    coroutine that opens the loader's :class:`RowServer` on that loop (closing everything if it
    fails). ``thread_name`` names the loop thread, ``prefetch_name`` the device-prefetch threads.
    """

    def __init__(
        self,
        kind: str,
        builder: BatchBuilder,
        options: EngineOptions,
        *,
        thread_name: str,
        prefetch_name: str,
    ) -> None:
        self._closed = True  # until the loop thread runs: nothing to close
        self.kind, self.options, self._builder = kind, options, builder
        self._server: S | None = None
        self._load_ahead: LoadAhead | None = None
        self._prefetchers: Prefetchers[Any] = Prefetchers(
            prefetch_name, lambda: LoaderClosedError(f"this {kind} is closed; create a new one")
        )
        self._lock = threading.Lock()
        # The last BUILD_HISTORY build times, in numpy: a fixed size from the start, so a long
        # run's memory does not creep up by one float object per load.
        self._build_s = np.zeros(BUILD_HISTORY, np.float64)
        self._builds = itertools.count()  # next() is atomic: loads from several threads
        self._built = 0
        #: batches handed to the trainer, and that count at the last interval_stats() call
        self._delivered = 0
        self._delivered_at_interval = 0
        self._pid = os.getpid()
        self._runner = LoopThread(
            name=thread_name, cpu_threads=options.decode_threads, nice=options.engine_niceness
        )
        self._closed = False

    def start(self, opening: Coroutine[Any, Any, S]) -> S:
        """Run ``opening`` on the loop and serve from the server it returns (which then belongs
        to this lifecycle). If it fails, the lifecycle is closed and the error raised."""
        try:
            server = self._runner.run(opening)
        except BaseException:
            self.close()
            raise
        self._server = server
        depth = self.options.prefetch_to_device if self.options.load_ahead else 0
        self._load_ahead = LoadAhead(
            self._prefetchers, self.build, server.step_count, depth, spawn=self._runner.call_soon
        )
        return server

    @property
    def keep(self) -> Callable[[Any], None]:
        """``keep(engine)``: hold an engine as long as the loop, so that its tasks never die
        with a dropped loader's reference cycle. The loop's own method, not one of this
        lifecycle's: a holder of it (a mixture's pass opener) keeps no cycle through here."""
        return self._runner.keep

    @property
    def server(self) -> S:
        if self._server is None:
            raise LoaderClosedError(f"this {self.kind} is not open")
        return self._server

    @property
    def host_rows(self) -> np.ndarray:
        return self._builder.host_rows

    @property
    def step_count(self) -> int:
        return self.server.step_count

    @property
    def closed(self) -> bool:
        return self._closed

    # -- batches ------------------------------------------------------------------------------

    def load(self, step: int) -> Any:
        """The batch of ``step``: a live iterator's or load-ahead's if built, else built now."""
        step = step_argument(step)
        self.check_open()
        assert self._load_ahead is not None  # (open: start() made it)
        batch = self._load_ahead.load(step, self.build)
        self.count_delivered(step)
        return batch

    def rows(self, step: int, *, ready_only: bool = False) -> np.ndarray | None:
        """This host's encoded rows of ``step``; with ``ready_only``, None unless all are in
        finished buffers."""
        self.check_open()
        server = self.server
        server.check_step(step)
        rows = server.ready_rows(step)  # steady state: no loop round trip
        if rows is not None or ready_only:
            return rows
        return self._runner.run(server.rows(step), timeout=self.options.load_timeout_s)

    def encoded_rows(self, step: int) -> np.ndarray:
        """This host's rows of ``step`` as stored (flat-tokens codes): what ``load`` decodes.
        They count as delivered rows (a mixture's per-source figures), not as a loaded batch."""
        step = step_argument(step)
        rows = self.rows(step)
        assert rows is not None  # (not ready_only)
        self.server.delivered(step)
        return rows

    def build(self, step: int, *, ready_only: bool = False) -> Any:
        """Build the batch of ``step`` now (what device prefetch and load-ahead run ahead);
        with ``ready_only``, only from finished buffers, else :data:`NOT_READY`."""
        rows = self.rows(step, ready_only=ready_only)
        if rows is None:
            return NOT_READY
        t0 = time.perf_counter()
        batch = self._builder.build(rows)
        n = next(self._builds)
        self._build_s[n % BUILD_HISTORY] = time.perf_counter() - t0
        self._built = max(self._built, n + 1)
        return batch

    def iter(self, start_step: int = 0) -> BatchIterator:
        """An iterator of ``(step, batch)`` from ``start_step`` (``step_count`` included: an
        empty iterator) to the end."""
        start_step = step_argument(start_step, "start_step")
        self.check_open()
        if start_step != self.step_count:
            self.server.check_step(start_step)
        assert self._load_ahead is not None  # (open: start() made it)
        self._load_ahead.retire()  # the iterator builds ahead itself
        return BatchIterator(self, start_step, self.options.prefetch_to_device)

    def __iter__(self) -> Iterator[Any]:
        iterator = self.iter()
        try:
            for _, batch in iterator:
                yield batch
        finally:
            iterator.close()

    # -- what the iterator uses -----------------------------------------------------------------

    def count_delivered(self, step: int) -> None:
        with self._lock:
            self._delivered += 1
        server = self._server
        if server is not None:
            server.delivered(step)

    def pin(self) -> Pin:
        return Pin(self.server)

    def start_prefetch(self, start: int, depth: int) -> BackgroundBuilder[Any]:
        """A builder of steps [start, step_count) ahead of an iterator, known to :meth:`load`."""
        self.check_open()
        return self._prefetchers.start(self.build, start, self.step_count, depth)

    def stop_prefetch(self, builder: BackgroundBuilder[Any], pin: Pin) -> None:
        pin.release()
        # not from the loop's threads: the builder may be waiting on this very thread
        self._prefetchers.stop(builder, join=not self._runner.in_own_thread())

    def release_collected(self, builder: BackgroundBuilder[Any] | None, pin: Pin) -> None:
        """What a collected iterator held (its pin, its builder), let go of on the loop's
        thread, never on the collecting one: the garbage collector runs finalizers on whatever
        thread allocates, which may hold the engine's lock (a pin released there deadlocked),
        a builder's, or be the thread the builder waits on. Run here only when no loop runs
        (the loader is closed: its engine takes no pin any more and its builders are stopped).
        """
        if not self._runner.call_soon(self._release, builder, pin):
            self._release(builder, pin)

    def _release(self, builder: BackgroundBuilder[Any] | None, pin: Pin) -> None:
        if builder is None:
            pin.release()
        else:
            self.stop_prefetch(builder, pin)

    # -- figures ------------------------------------------------------------------------------

    @property
    def delivered(self) -> int:
        """Batches the trainer received (each ``load()`` that returned, each iterator item)."""
        with self._lock:
            return self._delivered

    def build_median_s(self) -> float | None:
        """Median time to build a batch's jax arrays, over the last :data:`BUILD_HISTORY`."""
        builds = self._build_s[: min(self._built, BUILD_HISTORY)]
        return float(np.median(builds)) if len(builds) else None

    def server_stats(self) -> Any:
        """The server's figures, read on the loop."""
        return self._on_loop(self.server.stats)

    def interval_stats(self) -> IntervalStats:
        """The server's figures since the previous call, ``steps_loaded`` the batches
        delivered in the interval."""
        interval = self._on_loop(self.server.interval_stats)
        with self._lock:
            delivered, self._delivered_at_interval = (
                self._delivered - self._delivered_at_interval,
                self._delivered,
            )
        return dataclasses.replace(interval, steps_loaded=delivered)

    def _on_loop(self, read: Callable[[], T]) -> T:
        self.check_open()  # (before the coroutine exists: a closed loader leaves none behind)
        return self._runner.run(_call(read))

    # -- closing ------------------------------------------------------------------------------

    def check_open(self) -> None:
        if self._closed:
            raise LoaderClosedError(f"this {self.kind} is closed; create a new one")
        if self._pid != os.getpid():
            raise LoaderClosedError(
                f"this {self.kind} was created in another process (before a fork); "
                "create a new loader in this process"
            )

    def close(self) -> None:
        """Stop the device-prefetch threads, cancel fills, free the buffers, stop the loop's
        thread. Idempotent, from any thread: from the loop's own thread (a finalizer or
        callback running there) it schedules all that and returns at once; from any other it
        returns when it is done (within about 15 s whatever the storage does)."""
        if self._pid != os.getpid():
            # A forked child: the loop, the threads and the buffers are the parent's, and a lock
            # one of its threads held at the fork (this one, a builder's, the loop's) stays held
            # here forever. Nothing here is this process's to stop or free: touch none of it.
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # no new builds start; a build in progress fails fast below
        prefetchers = self._prefetchers.close()
        server = self._server
        # On the loop's own threads close() only schedules the shutdown: the loop's thread
        # waits for them as it ends (and for the builders, which wait on the loop).
        own_thread = self._runner.in_own_thread()
        if self._runner.in_loop_thread() and server is not None:
            server.release()  # on the loop's thread nothing else runs on the loop: free now
        try:
            if server is not None and self._pid == os.getpid():
                self._runner.close(server.aclose())
            else:
                self._runner.close()
        finally:
            if not own_thread:
                for prefetcher in prefetchers:
                    prefetcher.stop()
                if server is not None:
                    server.release()  # the loop has stopped: nothing can hold a buffer now

    #: the logger as the class holds it: at interpreter shutdown the module's globals may
    #: already be None when a forgotten loader is collected
    _log = log

    def __del__(self) -> None:  # a forgotten loader must not keep its thread nor its buffers
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - a finalizer must never raise
                try:
                    self._log.debug("closing a collected %s failed", self.kind, exc_info=True)
                except Exception:  # noqa: BLE001 - logging torn down at shutdown
                    pass


async def _call(read: Callable[[], T]) -> T:
    return read()
