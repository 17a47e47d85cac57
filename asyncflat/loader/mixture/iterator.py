"""``MixtureLoader.iter()``: ``(step, batch)`` pairs, built ahead on a thread when asked."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from asyncflat.loader.background import BackgroundBuilder

if TYPE_CHECKING:
    from asyncflat.loader.mixture.loader import MixtureLoader

__all__ = ["MixtureIterator"]


class MixtureIterator(Iterator[tuple[int, Any]]):
    """``(step, batch)`` pairs of a :class:`MixtureLoader`; an error ends the iteration."""

    def __init__(self, loader: MixtureLoader, start: int, depth: int) -> None:
        self._loader, self._step, self._stop_step = loader, start, loader.step_count
        self._prefetch: BackgroundBuilder[Any] | None = None
        self._finalizer: weakref.finalize | None = None
        if depth and start < self._stop_step:
            self._prefetch = loader._start_prefetch(start, depth)
            self._finalizer = weakref.finalize(self, loader._stop_prefetch, self._prefetch)
            self._finalizer.atexit = False

    def __iter__(self) -> MixtureIterator:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._step >= self._stop_step:
            raise StopIteration
        step = self._step
        try:
            if self._prefetch is None:
                batch = self._loader.load(step)
            else:
                self._loader._check_open()
                batch = self._prefetch.take(step)
        except KeyboardInterrupt:
            raise
        except BaseException:
            self.close()
            raise
        self._step = step + 1
        if self._step >= self._stop_step:
            self.close()
        return step, batch

    def close(self) -> None:
        """Stop the prefetch thread. Idempotent."""
        self._step = self._stop_step
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> MixtureIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
