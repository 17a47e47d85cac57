"""Consecutive ``load(step)`` calls get their next batches built ahead, as ``iter()`` does.

seqax's ``train.py`` (and most trainers written for the reference) call ``load(step)`` for
``step, step + 1, ...``: each ``load()`` then built its batch on the trainer's thread (the rows'
copy, the decode, the device transfer) while the engine's threads competed for the same cores.
After a loader's first load, and after two consecutive loads, :class:`LoadAhead` keeps the next
``EngineOptions.prefetch_to_device`` steps built on a background thread
(:class:`~asyncflat.loader.shared.background.BackgroundBuilder`), and the ``load()`` of the step it expects
takes the built batch. A batch is a pure function of its step, so a batch built ahead is the
batch ``load()`` would have built. Any other step (a jump, another thread's load) is built by
the ``load()`` itself; a jump retires the builder (its built batches with it) and the next two
consecutive loads start a new one; so does an ``iter()``, which builds its own. The first load
starts one at once because a trainer's first load is the start of its run (a start, or a
resume in a fresh process): waiting for a second load left that second load to build its own
batch on the trainer's thread while the next fill started, 2-3x the later loads.
A build that failed in the background raises its error from the ``load()`` of that step,
as ``iter()`` does (the failed fill is dropped, so the next load of the step starts afresh);
``EngineOptions.load_timeout_s`` counts from the build's start.

Only a step whose rows are all in finished buffers is built ahead (the engine's fast path, no
round trip to its loop). A step of a fill still streaming (start-up, a resume, a late fill) is
left to its own ``load()``: asked for early, its rows would be read one by one where, a train
step later, most of them are in finished blocks (built ahead at start-up, loads 16-23 of a
256 MiB buffer took 10-27 ms against ~2 ms).

The builder holds the loader's lifecycle weakly: a dropped loader is still collected (and
closed).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from asyncflat.errors import LoaderClosedError
from asyncflat.loader.shared.background import BackgroundBuilder, BackgroundStopped, Prefetchers

__all__ = ["NOT_READY", "LoadAhead"]


#: What a build ahead gives for a step whose rows are not all in finished buffers yet.
NOT_READY: Any = object()


def _build_weakly(build: weakref.WeakMethod[Any], step: int) -> Any:
    method = build()
    if method is None:
        raise LoaderClosedError("the loader was collected")
    return method(step, ready_only=True)


class LoadAhead:
    """The load-ahead of one loader: which step its builder expects next, if it runs."""

    def __init__(
        self,
        prefetchers: Prefetchers[Any],
        build: Callable[..., Any],
        stop_step: int,
        depth: int,
        spawn: Callable[[Callable[[], None]], bool] | None = None,
    ) -> None:
        """``build`` is the loader's ``build(step, ready_only=...)``, a bound method (held
        weakly): with ``ready_only`` it returns :data:`NOT_READY` for a step it cannot serve
        from finished buffers; ``depth`` 0 turns load-ahead off."""
        self._prefetchers = prefetchers
        self._build = functools.partial(_build_weakly, weakref.WeakMethod(build))
        self._stop_step = stop_step
        self._depth = depth
        self._spawn = spawn
        self._lock = threading.Lock()
        self._builder: BackgroundBuilder[Any] | None = None
        #: the step the builder's next batch is for; None while a load is taking it
        self._next: int | None = None
        self._last: int | None = None  # the step of the latest load that returned
        #: no load or iter() yet: the first load starts a builder
        self._fresh = True

    def load(self, step: int, build: Callable[[int], Any]) -> Any:
        """The batch of ``load(step)``: the builder's if it expects ``step``, else an
        iterator's (a builder's :data:`NOT_READY` for the step does not hide it), else
        ``build(step)`` on this thread; then the builder follows the step (:meth:`loaded`).
        ``build`` is passed per call, not kept: the builder holds the loader weakly."""
        batch = self.take(step)
        if batch is None:
            batch = self._prefetchers.lookup(step, skip=NOT_READY)
        if batch is None:
            batch = build(step)
        self.loaded(step)
        return batch

    def take(self, step: int) -> Any | None:
        """The batch of ``step`` if the builder expects it (waiting for it), else None."""
        with self._lock:
            builder = self._builder
            if builder is None or step != self._next:
                return None
            self._next = None  # claimed: another thread's load of this step builds its own
        try:
            batch = builder.take(step)
        except KeyboardInterrupt:
            with self._lock:
                if self._builder is builder:
                    self._next = step  # the step stays built: the next load takes it
            raise
        except BackgroundStopped:  # retired meanwhile (another thread's jump): build it here
            self._retire(builder)
            return None
        except BaseException:
            # The build of this very step failed: this load raises its error, as iter() does
            # (building it again would make the trainer wait out a deadline twice); the next
            # load of the step starts afresh.
            self._retire(builder)
            raise
        with self._lock:
            if self._builder is builder:
                self._next = step + 1
        return None if batch is NOT_READY else batch

    def loaded(self, step: int) -> None:
        """``load(step)`` returned: start the builder after the first load and after two
        consecutive loads, retire it after a jump.

        Its thread is started by ``spawn`` (the engine's loop thread) when given, not by this
        load: ``Thread.start`` waits for the new thread, which needs the GIL the engine's
        threads hold at start-up, and that cost the trainer's second load 1-7 ms."""
        retired = None
        with self._lock:
            consecutive = self._last is not None and step == self._last + 1
            starts, self._fresh = self._fresh or consecutive, False
            self._last = step
            if self._builder is not None:
                if self._next is None or self._next == step + 1:
                    return  # in step (or another thread is taking its batch)
                retired, self._builder, self._next = self._builder, None, None
            elif starts and self._depth and step + 1 < self._stop_step:
                if self._prefetchers.busy():
                    return  # an iterator builds ahead: a load beside it looks its steps up
                try:
                    self._builder = self._prefetchers.start(
                        self._build, step + 1, self._stop_step, self._depth, spawn=self._spawn
                    )
                except LoaderClosedError:
                    return
                self._next = step + 1
        if retired is not None:
            self._prefetchers.retire(retired)

    def retire(self) -> None:
        """Retire the builder if one runs (an ``iter()`` starts, with a builder of its own):
        once no iterator runs, the next two consecutive loads start a new one."""
        with self._lock:
            builder = self._builder
            self._fresh, self._last = False, None  # a load while it iterates starts none
        if builder is not None:
            self._retire(builder)

    def _retire(self, builder: BackgroundBuilder[Any]) -> None:
        with self._lock:
            if self._builder is not builder:
                return
            self._builder, self._next = None, None
        self._prefetchers.retire(builder)
