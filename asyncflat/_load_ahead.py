"""Consecutive ``load(step)`` calls get their next batches built ahead, as ``iter()`` does.

seqax's ``train.py`` (and most trainers written for the reference) call ``load(step)`` for
``step, step + 1, ...``: each ``load()`` then built its batch on the trainer's thread (the rows'
copy, the decode, the device transfer) while the engine's threads competed for the same cores.
Once two loads in a row were consecutive, :class:`LoadAhead` keeps the next
``EngineOptions.prefetch_to_device`` steps built on a background thread
(:class:`~asyncflat._background.BackgroundBuilder`), and the ``load()`` of the step it expects
takes the built batch. A batch is a pure function of its step, so a batch built ahead is the
batch ``load()`` would have built. Any other step (a jump, another thread's load) is built by
the ``load()`` itself; a jump retires the builder and the next two consecutive loads start a new
one. A build that failed in the background raises its error from the ``load()`` of that step,
as ``iter()`` does (the failed fill is dropped, so the next load of the step starts afresh);
``EngineOptions.load_timeout_s`` counts from the build's start.

The builder holds the loader weakly: a dropped loader is still collected (and closed).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ._background import BackgroundBuilder, BackgroundStopped, Prefetchers
from .errors import LoaderClosedError

__all__ = ["LoadAhead"]


def _build_weakly(loader: weakref.ref[Any], step: int) -> Any:
    owner = loader()
    if owner is None:
        raise LoaderClosedError("the loader was collected")
    return owner._load_now(step)


class LoadAhead:
    """The load-ahead of one loader: which step its builder expects next, if it runs."""

    def __init__(
        self,
        prefetchers: Prefetchers[Any],
        build: Callable[[int], Any],
        stop_step: int,
        depth: int,
    ) -> None:
        """``build`` is a bound method of the loader (held weakly); ``depth`` 0 turns it off."""
        self._prefetchers = prefetchers
        owner = getattr(build, "__self__", None)
        self._build = (
            functools.partial(_build_weakly, weakref.ref(owner)) if owner is not None else build
        )
        self._stop_step = stop_step
        self._depth = depth
        self._lock = threading.Lock()
        self._builder: BackgroundBuilder[Any] | None = None
        #: the step the builder's next batch is for; None while a load is taking it
        self._next: int | None = None
        self._last: int | None = None  # the step of the latest load that returned
        #: builders started (figures for tests and stats)
        self.started = 0

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
        return batch

    def loaded(self, step: int) -> None:
        """``load(step)`` returned: start the builder after two consecutive loads, retire it
        after a jump."""
        retired = None
        with self._lock:
            consecutive = self._last is not None and step == self._last + 1
            self._last = step
            if self._builder is not None:
                if self._next is None or self._next == step + 1:
                    return  # in step (or another thread is taking its batch)
                retired, self._builder, self._next = self._builder, None, None
            elif consecutive and self._depth and step + 1 < self._stop_step:
                try:
                    self._builder = self._prefetchers.start(
                        self._build, step + 1, self._stop_step, self._depth
                    )
                except LoaderClosedError:
                    return
                self._next = step + 1
                self.started += 1
        if retired is not None:
            self._prefetchers.retire(retired)

    def _retire(self, builder: BackgroundBuilder[Any]) -> None:
        with self._lock:
            if self._builder is not builder:
                return
            self._builder, self._next = None, None
        self._prefetchers.retire(builder)
