"""One read per key for everyone who needs it, a few recent results kept, failures forgotten.

The engine and the reader share in-flight reads in several places: a chunk object several fills
need at once, the header and block table of a Blosc frame that many row reads use, a shard index
that every inner chunk of a shard needs. They all follow the same rules, kept here once:

* **single flight**: concurrent callers of :meth:`SingleFlight.get` with one key await one task;
* **shielded**: a caller that is cancelled does not cancel the read the others share;
* **failures are never cached**: a read that raised or was cancelled is dropped the moment it
  ends, so the next caller tries afresh (a store that heals is seen at once);
* **bad results can be dropped**: a value that later turns out to be bad (bytes that do not
  decode, a layout parsed from a damaged header) is removed with :meth:`SingleFlight.forget`;
* **bounded**: at most ``keep`` entries, least recently used first out, except that a read still
  in flight is never evicted (someone is waiting on it).

All methods run on one event loop (the engine's); nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["SingleFlight"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """A keyed cache of shared, shielded in-flight reads that forgets failures."""

    def __init__(self, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self._tasks: collections.OrderedDict[K, asyncio.Future[V]] = collections.OrderedDict()
        #: reads started (cache misses), for tests and stats
        self.started = 0
        #: calls answered by a read already started or finished (cache hits)
        self.shared = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, key: object) -> bool:
        return key in self._tasks

    async def get(self, key: K, read: Callable[[], Awaitable[V]]) -> V:
        """The result of ``read()`` for ``key``, started once and shared with every caller."""
        task = self._tasks.get(key)
        if task is not None and task.done() and (task.cancelled() or task.exception() is not None):
            task = None  # failed a moment ago, before its done-callback forgot it
        if task is None:
            task = asyncio.ensure_future(read())
            self._tasks[key] = task
            self.started += 1
            task.add_done_callback(lambda done: self._forget_failure(key, done))
            self._evict()
        else:
            self._tasks.move_to_end(key)
            self.shared += 1
        return await asyncio.shield(task)

    def forget(self, key: K, value: V | None = None) -> None:
        """Drop ``key``'s finished result (only if it is ``value``, when given): it was bad."""
        task = self._tasks.get(key)
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return
        if value is None or task.result() is value:
            del self._tasks[key]

    def clear(self) -> None:
        """Drop every finished result (reads in flight go on and are forgotten when they end)."""
        for key in [k for k, t in self._tasks.items() if t.done()]:
            del self._tasks[key]

    async def aclose(self) -> None:
        """Cancel the reads in flight, wait for them to end, drop everything."""
        pending = [t for t in self._tasks.values() if not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._tasks.clear()

    def _forget_failure(self, key: K, done: asyncio.Future[V]) -> None:
        if (done.cancelled() or done.exception() is not None) and self._tasks.get(key) is done:
            del self._tasks[key]  # the next caller tries afresh
        self._evict()

    def _evict(self) -> None:
        excess = len(self._tasks) - self.keep
        if excess <= 0:
            return
        victims: list[K] = []
        for key, task in self._tasks.items():  # least recently used first
            if len(victims) == excess:
                break
            if task.done():
                victims.append(key)
        for key in victims:
            del self._tasks[key]
