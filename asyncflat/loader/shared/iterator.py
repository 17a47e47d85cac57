"""The iterator of every loader (:class:`BatchIterator`): ``(step, batch)`` pairs, built ahead
on a thread when device prefetch is on, holding a :class:`~asyncflat.loader.shared.serving.Pin` on
the buffers it reads next.

It knows its loader only through :class:`IteratorOwner` (what
:class:`~asyncflat.loader.shared.lifecycle.Lifecycle` gives it), so the plain loader and the mixture
share it whole.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from asyncflat.errors import LoaderClosedError
from asyncflat.loader.shared.background import BackgroundBuilder, BackgroundStopped
from asyncflat.loader.shared.serving import Pin

__all__ = ["BatchIterator", "IteratorOwner"]


class IteratorOwner(Protocol):
    """What an iterator needs of its loader's lifecycle."""

    @property
    def step_count(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def check_open(self) -> None: ...

    def load(self, step: int) -> Any: ...

    def count_delivered(self, step: int) -> None: ...

    def pin(self) -> Pin: ...

    def start_prefetch(self, start: int, depth: int) -> BackgroundBuilder[Any]: ...

    def stop_prefetch(self, builder: BackgroundBuilder[Any], pin: Pin) -> None: ...

    def release_collected(self, builder: BackgroundBuilder[Any] | None, pin: Pin) -> None: ...


class BatchIterator(Iterator[tuple[int, Any]]):
    """``(step, batch)`` pairs of a loader, built ahead when prefetching.

    A ``KeyboardInterrupt`` while ``next()`` waits leaves the iterator where it was: the next
    ``next()`` returns the same step. With device prefetch (``depth`` > 0) any other error ends
    the iteration (its builder thread has stopped); without it, ``next()`` is a ``load()`` and an
    error leaves the iterator where it was too (the next ``next()`` loads that step again). A
    loader closed meanwhile (from any thread) raises :class:`~asyncflat.errors.LoaderClosedError`.
    """

    def __init__(self, owner: IteratorOwner, start: int, depth: int) -> None:
        self._owner = owner
        self._step = start
        self._stop_step = owner.step_count
        self._prefetch: BackgroundBuilder[Any] | None = None
        #: the step taken from the builder, its batch and whether it was counted as delivered,
        #: until next() returns it
        self._held: tuple[int, Any, bool] | None = None
        self._finalizer: weakref.finalize | None = None
        self._pin = owner.pin()
        if start < self._stop_step:
            self._pin.move(start)
        if depth and start < self._stop_step:
            self._prefetch = owner.start_prefetch(start, depth)
        # The finalizer holds the owner, the builder and the pin, never this iterator, so a
        # dropped iterator is collected and its thread stopped; it hands the release to the
        # loop's thread (the collecting thread may hold the engine's lock), close() does it here.
        self._finalizer = weakref.finalize(self, owner.release_collected, self._prefetch, self._pin)
        # Not at interpreter exit: joining a thread blocked in a load could wait a whole
        # load; the thread is a daemon and the loop's own exit hook cancels its load.
        self._finalizer.atexit = False

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._step >= self._stop_step:
            raise StopIteration
        step = self._step
        if self._prefetch is None:
            batch = self._owner.load(step)  # raising leaves the step where it is
        else:
            if self._held is None or self._held[0] != step:  # else a Ctrl-C came after the take
                self._owner.check_open()
                try:
                    batch = self._prefetch.take(step, keep=True)
                except KeyboardInterrupt:
                    raise  # the builder goes on; the next next() takes this same step
                except BackgroundStopped:
                    self._step = self._stop_step
                    self.close()
                    self._owner.check_open()  # closed loader: LoaderClosedError
                    raise LoaderClosedError("the device-prefetch thread has stopped") from None
                except BaseException:
                    self._step = self._stop_step  # an error ends the iteration
                    self.close()
                    raise
                self._held = (step, batch, False)  # held before the builder forgets it
            batch = self._held[1]
            self._prefetch.forget(step)  # again after a Ctrl-C: forgetting twice is harmless
            if not self._held[2]:
                self._owner.count_delivered(step)  # (load() above counts its own)
                self._held = (step, batch, True)
        # What can be interrupted comes before the step moves on: a Ctrl-C in it leaves the
        # iterator at this step, whose batch the next next() returns (nothing checks for a
        # signal between the two assignments and the return).
        if step + 1 >= self._stop_step:
            self._release()
        elif not self._owner.closed:
            self._pin.move(step + 1)
        self._held = None
        self._step = step + 1
        return step, batch

    def close(self) -> None:
        """Stop the prefetch thread and drop the batches built ahead. Idempotent."""
        self._step = self._stop_step
        self._held = None
        self._release()

    def _release(self) -> None:
        if self._finalizer is not None and self._finalizer.detach() is not None:
            if self._prefetch is None:
                self._pin.release()
            else:
                self._owner.stop_prefetch(self._prefetch, self._pin)

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
