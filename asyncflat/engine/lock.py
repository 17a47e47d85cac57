"""The engine's lock, which knows the thread that holds it.

A garbage collection runs finalizers on whatever thread allocates, possibly in the middle of
that thread's own critical section: a pin released there must not wait for the lock its own
thread holds (it would wait forever). Every other thread's release waits for the lock like any
other change, so the pin state anyone reads afterwards is exact (see ``Engine.unpin``).
"""

from __future__ import annotations

import threading
from types import TracebackType

__all__ = ["OwnedLock"]


class OwnedLock:
    """A :class:`threading.Lock` (not re-entrant) that says whether this thread holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> OwnedLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._owner = None
        self._lock.release()

    def held_here(self) -> bool:
        """Whether the calling thread holds the lock (then taking it again would hang)."""
        return self._owner == threading.get_ident()
