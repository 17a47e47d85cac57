"""What a loader supplies to the lifecycle every loader shares: :class:`RowServer`, the rows of
a step, and :class:`Pin`, an iterator's hold on the buffers those rows come from.

The plain loader serves from one engine, the mixture from one engine per source and pass; the
rest (the loop thread, ``load``/``iter``, load-ahead, device prefetch, statistics, closing) is
:mod:`asyncflat.loader.shared.lifecycle`, written once.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any, Protocol

import numpy as np

from asyncflat.engine import IntervalStats

__all__ = ["Pin", "RowServer"]


class RowServer(Protocol):
    """The rows of a loader's steps, and the figures and buffers behind them.

    Methods marked *on the loop* run on the lifecycle's event loop; the others on any thread.
    """

    @property
    def step_count(self) -> int: ...

    def check_step(self, step: int) -> None:
        """Raise :class:`~asyncflat.errors.StepOutOfRangeError` unless ``step`` is served."""

    def ready_rows(self, step: int) -> np.ndarray | None:
        """This host's encoded rows of ``step`` if they are all in finished buffers (no trip
        to the loop), else None."""

    async def rows(self, step: int) -> np.ndarray:
        """This host's encoded rows of ``step``, waiting for their fills (on the loop)."""
        ...

    def delivered(self, step: int) -> None:
        """The batch of ``step`` was handed to the trainer (a ``load()`` returned it, or an
        iterator did): for figures counted per batch served, not per batch built (any thread)."""

    def pin_keys(self, step: int) -> Hashable:
        """What an iterator at ``step`` pins; equal for every step of a minipoch (no churn)."""

    def pin(self, keys: Any) -> Any:
        """Pin ``keys`` (from :meth:`pin_keys`) so other threads' loads do not evict those
        buffers; returns what :meth:`unpin` takes back."""

    def unpin(self, pinned: Any) -> None: ...

    def stats(self) -> Any:
        """The engines' figures (on the loop)."""

    def interval_stats(self) -> IntervalStats:
        """The engines' figures since the previous call (on the loop)."""
        ...

    async def aclose(self) -> None:
        """Cancel fills and free buffers (on the loop, as the loop closes)."""

    def release(self) -> None:
        """Drop every buffer, once nothing runs on the loop (idempotent)."""


class Pin:
    """An iterator's pin on the buffers it is positioned in, so other threads' loads and
    prefetches do not evict the buffers the iterator reads next.

    Held per minipoch, not per step: moving within the keys already pinned changes nothing (no
    engine lock, no counter churn on every ``next()``); entering new keys pins them before
    releasing the old ones, so the buffers read now are never unpinned in between."""

    def __init__(self, server: RowServer) -> None:
        self._server = server
        self._keys: Hashable | None = None
        self._pinned: Any = None
        self._lock = threading.Lock()

    def move(self, step: int) -> None:
        keys = self._server.pin_keys(step)
        with self._lock:  # pin and unpin under it: a release() in between cannot leak a pin
            if self._pinned is not None and keys == self._keys:
                return
            pinned = self._server.pin(keys)  # raising (or a Ctrl-C in it) changes nothing here
            old, self._keys, self._pinned = self._pinned, keys, pinned
            if old is not None:
                self._server.unpin(old)

    def release(self) -> None:
        with self._lock:
            old, self._keys, self._pinned = self._pinned, None, None
            if old is not None:
                self._server.unpin(old)
