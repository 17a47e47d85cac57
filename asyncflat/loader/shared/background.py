"""Build items ahead of a consumer on a background thread: ``build(step)`` for consecutive steps.

Modelled on Levanter's ``BackgroundIterator``, keyed by step so that an item built ahead can also
be looked up by step (a ``load(step)`` that an iterator has already built returns the same item).
Knows nothing of loaders: it only calls ``build``. Once the consumer's rhythm is known, each
build starts halfway through the consumer's slack rather than the moment an item is taken
(:class:`BuildPacing`), so that it does not compete for the GIL with the consumer's own work.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from asyncflat.engine.loop import close_all_loops

__all__ = ["BackgroundBuilder", "BackgroundStopped", "BuildPacing", "Prefetchers", "wait_result"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_JOIN_TIMEOUT_S = 30.0
#: the most interpreter exit waits for builder threads to end (in all)
_EXIT_JOIN_S = 2.0
#: every builder whose thread was started, for :func:`_stop_builders_at_exit`
_started: weakref.WeakSet[BackgroundBuilder[object]] = weakref.WeakSet()
_WAIT_SLICE_S = 0.2  # waits are sliced so Ctrl-C reaches the main thread


#: How many recent takes and builds the pacing looks at.
PACING_WINDOW = 8
#: The longest a build ahead is held back after a take, however long the consumer's steps.
MAX_BUILD_DELAY_S = 0.1
#: Before the consumer's rhythm is known, how long a build waits after the last take (or the
#: builder's start): the consumer is still returning from the load that started the builder.
#: Without it, the first builds (a new thread's first jax calls) held the GIL through that
#: return: a trainer's second ``load()`` took 3-7 ms against 0.1-0.2 ms later on. A consumer
#: that asks sooner starts the build at once.
FIRST_BUILD_DELAY_S = 0.002


class BuildPacing:
    """When a build ahead should start: in the middle of the consumer's slack, not at once.

    The consumer takes an item, returns to its own work (a trainer dispatches its step: Python
    under the GIL), and comes back one step later. A build started the moment an item is taken
    competes for the GIL with exactly that work, and with the rest of the consumer's call: on a
    13-core host under gVisor, where a GIL hand-over costs ~0.4 ms, the load-ahead builder
    alone made one ``load()`` in a hundred take 0.8-1 ms where the synchronous loader took 0.65.
    Started halfway through the slack (the shortest recent interval between takes less the
    longest recent build), the build lands where the consumer waits on its accelerator, and
    still ends well before the next take. A consumer that takes back to back has no slack: its
    builds start at once. Pure timing arithmetic: fed the take times and build durations.
    """

    def __init__(self, window: int = PACING_WINDOW, max_delay_s: float = MAX_BUILD_DELAY_S):
        self._takes: collections.deque[float] = collections.deque(maxlen=window + 1)
        self._builds: collections.deque[float] = collections.deque(maxlen=window)
        self._max_delay_s = max_delay_s
        self._began: float | None = None

    def took(self, when: float) -> None:
        """The consumer asked for an item at ``when`` (``time.perf_counter()``)."""
        self._takes.append(when)

    def built(self, seconds: float) -> None:
        self._builds.append(seconds)

    def began(self, when: float) -> None:
        """The builder started at ``when`` (right after a take it did not see)."""
        self._began = when

    def start_at(self) -> float | None:
        """When the next build should start (a ``perf_counter()`` time), or None: at once.
        Before a rhythm is seen, :data:`FIRST_BUILD_DELAY_S` after the last take."""
        if len(self._takes) < 3 or not self._builds:  # no rhythm seen yet
            last = self._takes[-1] if self._takes else self._began
            return None if last is None else last + FIRST_BUILD_DELAY_S
        shortest = min(b - a for a, b in itertools.pairwise(self._takes))
        slack = shortest - max(self._builds)
        if slack <= 0:
            return None
        return self._takes[-1] + min(slack / 2, self._max_delay_s)


class BackgroundStopped(RuntimeError):
    """The builder was stopped (or its thread ended) before the asked-for step was started."""


def wait_result(future: concurrent.futures.Future[T]) -> T:
    """``future.result()``, waiting in slices so a KeyboardInterrupt is not deferred."""
    while True:
        try:
            return future.result(_WAIT_SLICE_S)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise


class BackgroundBuilder(Generic[T]):
    """A thread that calls ``build(step)`` for steps ``[start, stop)`` ahead of a consumer.

    At most ``depth`` steps are built (or being built) and not yet taken. An exception from
    ``build`` is stored in that step's future (the consumer re-raises it) and ends the thread.
    The thread holds ``build`` and this object, never the consumer, so a consumer that is dropped
    can be collected and its finalizer can call :meth:`stop`.
    """

    def __init__(
        self,
        build: Callable[[int], T],
        start: int,
        stop: int,
        depth: int,
        *,
        name: str,
        start_thread: bool = True,
        pacing: BuildPacing | None = None,
    ) -> None:
        """``start_thread=False`` leaves the thread to :meth:`start_thread`: a registry records
        the builder first, so that no Ctrl-C can leave a thread running that it does not know.
        ``pacing`` decides when each build starts (default: :class:`BuildPacing`'s)."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._build: Callable[[int], T] | None = build
        self._stop_step = stop
        self._depth = depth
        self._cond = threading.Condition()
        self._built: dict[int, concurrent.futures.Future[T]] = {}
        self._stopping = False
        self._pacing = BuildPacing() if pacing is None else pacing
        self._pacing.began(time.perf_counter())  # right after the consumer's last take
        #: the consumer is waiting for a step whose build has not started: start it now
        self._wanted = False
        #: start_thread() has run (its thread may have ended since)
        self._launched = False
        self._thread = threading.Thread(target=self._run, args=(start,), daemon=True, name=name)
        if start_thread:
            self.start_thread()

    def start_thread(self) -> None:
        try:
            with self._cond:
                if self._stopping:  # stopped before its thread was started: never start it
                    return
                self._launched = True
                _started.add(self)  # type: ignore[arg-type]  # any T: only stopped at exit
            self._thread.start()
        except BaseException:
            # A Ctrl-C inside start() (delivered while it waits for the thread to come up): the
            # thread may be running already, and its caller never gets this builder to stop it.
            self.signal_stop()
            raise

    def _run(self, step: int) -> None:
        try:
            self._build_from(step)
        finally:
            # ``build`` holds its loader: a stopped builder a registry still holds (retired,
            # until the loader closes) must not keep the loader in a cycle the collector has
            # to find.
            self._build = None
            with self._cond:
                if self._stopping:
                    # Retired or stopped: nobody takes from it any more (a take in progress
                    # holds its own future). Its built items go now, not when the loader
                    # closes: a retired builder kept device batches alive for the whole run.
                    self._built.clear()
                self._cond.notify_all()

    def _build_from(self, step: int) -> None:
        while step < self._stop_step:
            with self._cond:
                while not self._stopping and len(self._built) >= self._depth:
                    self._cond.wait()
                start_at = self._pacing.start_at()
                while start_at is not None and not (self._stopping or self._wanted):
                    remaining = start_at - time.perf_counter()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._stopping:
                    return
                self._wanted = False
                future: concurrent.futures.Future[T] = concurrent.futures.Future()
                self._built[step] = future
                self._cond.notify_all()
            started = time.perf_counter()
            try:
                assert self._build is not None  # dropped only once this thread ends
                future.set_result(self._build(step))
            except BaseException as exc:  # noqa: BLE001 (raised by whoever takes this step)
                future.set_exception(exc)
                return
            with self._cond:
                self._pacing.built(time.perf_counter() - started)
            step += 1

    def take(self, step: int, *, keep: bool = False) -> T:
        """The item of ``step`` (the consumer's next step), waiting for it; then forget it, or,
        with ``keep``, leave that to the consumer's :meth:`forget` once it holds the item (a
        Ctrl-C between the two then leaves the step to take again, never lost).

        Interrupted (Ctrl-C) it keeps the step, so the consumer can take it again."""
        with self._cond:
            self._pacing.took(time.perf_counter())
            while step not in self._built:
                if self._stopping or (self._launched and not self._thread.is_alive()):
                    raise BackgroundStopped(f"{self._thread.name} has stopped")
                if not self._wanted:
                    self._wanted = True  # a build held back by the pacing starts now
                    self._cond.notify_all()
                self._cond.wait(_WAIT_SLICE_S)
            future = self._built[step]
        try:
            result = wait_result(future)
        except KeyboardInterrupt:
            raise  # the step stays: taking it again returns it
        except BaseException:
            self.forget(step)
            raise
        if not keep:
            self.forget(step)
        return result

    def forget(self, step: int) -> None:
        """Drop ``step``'s item: the builder may build one more step ahead."""
        with self._cond:
            self._built.pop(step, None)
            self._cond.notify_all()

    def lookup(self, step: int) -> T | None:
        """The item of ``step`` if it is built or being built (waiting for it), else None.

        A failed build gives None: the caller builds the step itself, and the consumer still sees
        the error when it takes the step.
        """
        with self._cond:
            future = self._built.get(step)
        if future is None:
            return None
        try:
            return wait_result(future)
        except Exception:  # noqa: BLE001 (the consumer sees it when it takes the step)
            return None

    @property
    def alive(self) -> bool:
        """Whether its thread still runs (a build in progress after a stop included)."""
        return self._thread.is_alive()

    def signal_stop(self) -> None:
        """Start no further build (one in progress finishes). Returns at once."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def join_until(self, deadline: float) -> None:
        """Wait for the thread to end, until ``deadline`` (``time.monotonic()``) at most."""
        if self._thread.ident is not None and threading.current_thread() is not self._thread:
            self._thread.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Stop and join the thread (a build in progress finishes first). Idempotent."""
        self.signal_stop()
        if threading.current_thread() is self._thread:
            return  # stopped from our own thread (a finalizer ran there): it exits at its next check
        if self._thread.ident is None:
            return  # never started (interrupted before it was): nothing to join
        self._thread.join(_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("%s did not stop within %ss", self._thread.name, _JOIN_TIMEOUT_S)
        with self._cond:
            self._built.clear()


_prefetch_ids = itertools.count()


class Prefetchers(Generic[T]):
    """The builders running ahead of one loader's iterators: ``load(step)`` takes a step one of
    them has built instead of building it again, and closing the loader stops them all.

    Holds no ``build``: it is given to :meth:`start`, so a loader that owns this registry is not
    referenced from it (dropping the loader frees it without the cycle collector). After
    :meth:`close`, :meth:`start` raises: a builder started concurrently with the close cannot
    outlive it."""

    def __init__(self, name: str, closed_error: Callable[[], BaseException]) -> None:
        self._name = name
        self._closed_error = closed_error
        self._lock = threading.Lock()
        self._live: set[BackgroundBuilder[T]] = set()
        #: stopped without a join (their build in progress ends on its own): joined by close()
        self._retired: set[BackgroundBuilder[T]] = set()
        self._closed = False

    def start(
        self,
        build: Callable[[int], T],
        start: int,
        stop: int,
        depth: int,
        *,
        spawn: Callable[[Callable[[], None]], bool] | None = None,
    ) -> BackgroundBuilder[T]:
        """A builder of ``[start, stop)``, known to :meth:`close` before its thread runs. Its
        thread is started here, or by ``spawn(start_thread)`` on another thread (False: it
        could not be; the builder is stopped, and whoever takes from it builds for itself)."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            self._retired = {b for b in self._retired if b.alive}
            builder = BackgroundBuilder(
                build,
                start,
                stop,
                depth,
                name=f"{self._name}-{next(_prefetch_ids)}",
                start_thread=False,
            )
            self._live.add(builder)  # known before its thread runs: close() stops it whatever
            if spawn is None:
                builder.start_thread()  # a Ctrl-C raises here (or above) after that
        if spawn is not None and not spawn(builder.start_thread):
            builder.signal_stop()
        return builder

    def stop(self, builder: BackgroundBuilder[T], *, join: bool) -> None:
        """Stop ``builder``; ``join`` waits for its thread (not from a thread it may wait on:
        then it is retired, see :meth:`retire`)."""
        if not join:
            self.retire(builder)
            return
        builder.signal_stop()
        with self._lock:
            self._live.discard(builder)
        builder.stop()

    def retire(self, builder: BackgroundBuilder[T]) -> None:
        """Stop ``builder`` without waiting (from a thread that must not wait for its build in
        progress); :meth:`close` still returns it, so closing joins it."""
        builder.signal_stop()
        with self._lock:
            self._live.discard(builder)
            if not self._closed:
                self._retired.add(builder)

    def busy(self) -> bool:
        """Whether a builder runs (an iterator's, or the load-ahead's)."""
        with self._lock:
            return bool(self._live)

    def lookup(self, step: int, *, skip: object = None) -> T | None:
        """``step``'s item if a live builder has built it (or is building it), else None.

        An item that is ``skip`` (a builder's "not built" marker) does not hide another
        builder's real item of the same step."""
        with self._lock:
            live = list(self._live)
        for builder in live:
            item = builder.lookup(step)
            if item is not None and item is not skip:
                return item
        return None

    def close(self) -> list[BackgroundBuilder[T]]:
        """Signal every builder to stop (a build in progress ends on its own) and return them,
        for the caller to join once what they may wait on is closed; idempotent."""
        with self._lock:
            self._closed = True
            live, self._live = list(self._live), set()
            live += self._retired
            self._retired = set()
        for builder in live:
            builder.signal_stop()
        return live


@atexit.register
def _stop_builders_at_exit() -> None:
    """Stop the builder threads before the interpreter finalizes. They are daemon threads,
    and one the finalization catches inside jax's C++ code (building a batch's arrays) aborts
    the process ("terminate called after throwing an instance of ..."; one exit in six of a
    script that left a loader open after a ``load()``). Registered after the loops' exit hook,
    so it runs first: it tells the builders to stop, closes the loops they may wait on, and
    waits for them, at most :data:`_EXIT_JOIN_S` in all."""
    builders = list(_started)
    for builder in builders:
        builder.signal_stop()
    close_all_loops()
    deadline = time.monotonic() + _EXIT_JOIN_S
    for builder in builders:
        builder.join_until(deadline)
