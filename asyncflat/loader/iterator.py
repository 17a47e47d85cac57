"""A :class:`~asyncflat.loader.shuffling.ShufflingLoader`'s iterator (:class:`BatchIterator`) and the pin it
holds on the minipochs it reads (:class:`_Pin`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncflat.engine import Engine
from asyncflat.errors import LoaderClosedError
from asyncflat.loader.background import BackgroundBuilder, BackgroundStopped

if TYPE_CHECKING:
    from asyncflat.loader.shuffling import ShufflingLoader

__all__ = ["BatchIterator"]


class _Pin:
    """An iterator's pin on the minipochs it is positioned in (:meth:`Engine.pin`), so other
    threads' loads and prefetches do not evict the buffers the iterator reads next.

    Held per minipoch, not per step: moving within the minipochs already pinned changes
    nothing (no engine lock, no counter churn on every ``next()``); entering the next minipoch
    pins the new keys before releasing the old ones, so the minipoch read now is never unpinned
    in between."""

    def __init__(self, engine: Engine, host_rows: np.ndarray) -> None:
        self._engine, self._rows = engine, host_rows
        self._keys: list[tuple[int, int]] | None = None
        self._lock = threading.Lock()

    def move(self, step: int) -> None:
        keys = self._engine.pin_keys(step, self._rows)
        with self._lock:  # pin and unpin under it: a release() in between cannot leak a pin
            if keys == self._keys:
                return
            old, self._keys = self._keys, keys
            self._engine.pin(keys)
            if old is not None:
                self._engine.unpin(old)

    def release(self) -> None:
        with self._lock:
            old, self._keys = self._keys, None
            if old is not None:
                self._engine.unpin(old)


class BatchIterator(Iterator[tuple[int, Any]]):
    """``(step, batch)`` pairs of a :class:`ShufflingLoader`, built ahead when prefetching.

    A ``KeyboardInterrupt`` while ``next()`` waits leaves the iterator where it was: the next
    ``next()`` returns the same step. Any other error ends the iteration.
    """

    def __init__(self, loader: ShufflingLoader, start: int, depth: int) -> None:
        self._loader = loader
        self._step = start
        self._stop_step = loader.step_count
        self._prefetch: BackgroundBuilder[Any] | None = None
        self._finalizer: weakref.finalize | None = None
        self._pin = _Pin(loader._engine, loader._host_rows)
        if start < self._stop_step:
            self._pin.move(start)
        if depth and start < self._stop_step:
            self._prefetch = loader._start_prefetch(start, depth)
            # The finalizer holds the loader and the builder, never this iterator, so a dropped
            # iterator is collected and its thread stopped.
            self._finalizer = weakref.finalize(
                self, loader._stop_prefetch, self._prefetch, self._pin
            )
        else:
            self._finalizer = weakref.finalize(self, self._pin.release)
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
            batch = self._loader.load(step)  # raising leaves the step where it is
        else:
            self._loader._check_open()
            try:
                batch = self._prefetch.take(step)
            except KeyboardInterrupt:
                raise  # the builder goes on; the next next() takes this same step
            except BackgroundStopped:
                self._step = self._stop_step
                self.close()
                self._loader._check_open()  # closed loader: LoaderClosedError
                raise LoaderClosedError("the device-prefetch thread has stopped") from None
            except BaseException:
                self._step = self._stop_step  # an error ends the iteration
                self.close()
                raise
            self._loader._count_delivered()  # (load() above counts its own)
        self._step = step + 1
        if self._step >= self._stop_step:
            self.close()
        elif not self._loader._closed:
            self._pin.move(self._step)
        return step, batch

    def close(self) -> None:
        """Stop the prefetch thread and drop the batches built ahead. Idempotent."""
        self._step = self._stop_step
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
