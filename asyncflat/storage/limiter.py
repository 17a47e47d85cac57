"""An adaptive bound on requests in flight: AIMD, like TCP's congestion window, with a lane for
the requests a waiting load needs."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Protocol

__all__ = ["AdaptiveLimiter", "demand", "demand_headroom", "pool_size"]

log = logging.getLogger(__name__)

#: True in the tasks whose requests a waiting ``load()`` needs right now (its rows read one by
#: one, the units it waits for): they take a free slot before any other request, and may use
#: a few slots above the limit (:func:`demand_headroom`), so they never queue behind a fill.
_DEMAND: contextvars.ContextVar[bool] = contextvars.ContextVar("asyncflat_demand", default=False)


@contextlib.contextmanager
def demand(needed: bool = True) -> Iterator[None]:
    """While inside: this task's requests (and those of the tasks it starts meanwhile, which
    copy its context) are demand requests when ``needed``, plain ones when not."""
    token = _DEMAND.set(needed)
    try:
        yield
    finally:
        _DEMAND.reset(token)


def demand_headroom(maximum: int) -> int:
    """Slots demand requests may use above ``maximum``: a quarter of it, at least 2."""
    return max(2, maximum // 4)


def pool_size(maximum: int) -> int:
    """HTTP connections a store needs for ``maximum`` requests plus the demand headroom."""
    return maximum + demand_headroom(maximum)


class _LimitGauge(Protocol):
    concurrency_limit: int


class AdaptiveLimiter:
    """Bounds requests in flight; AIMD like TCP: the limit halves when the store throttles and
    grows by one per window of successful requests, back up to ``maximum``.

    A throttling response halves the limit only if its request started after the last decrease,
    so one burst of 429s from requests that were all in flight together halves it once.
    ``io`` (anything with a ``concurrency_limit`` field) shows the current limit.

    Demand requests (``acquire(demand=True)``) are served before every other waiter, and may
    run ``headroom`` above the limit: the fill's requests keep the wire busy up to the limit, and
    a load's few small reads still start at once.
    """

    def __init__(self, maximum: int, io: _LimitGauge, *, headroom: int | None = None) -> None:
        if maximum < 1:
            raise ValueError(f"maximum must be >= 1, got {maximum}")
        self.maximum = maximum
        self._headroom_given = headroom is not None
        self.headroom = demand_headroom(maximum) if headroom is None else headroom
        self.limit = float(maximum)
        self.in_flight = 0
        self.epoch = 0
        self._io = io
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._demand: collections.deque[asyncio.Future[None]] = collections.deque()
        io.concurrency_limit = maximum

    def resize(self, maximum: int) -> None:
        """Bound requests by ``maximum`` from now on (a store's default, known once its
        chunks' size is): the limit moves to it unless a throttling store already lowered it
        below."""
        if maximum < 1:
            raise ValueError(f"maximum must be >= 1, got {maximum}")
        throttled = self.limit < self.maximum
        self.maximum = maximum
        self.limit = min(self.limit, float(maximum)) if throttled else float(maximum)
        if not self._headroom_given:
            self.headroom = demand_headroom(maximum)
        self._io.concurrency_limit = int(self.limit)
        self._wake()

    def _admits(self, demand: bool) -> bool:
        if demand:
            return self.in_flight < int(self.limit) + self.headroom
        return self.in_flight < int(self.limit) and not self._demand

    async def acquire(self, *, demand: bool | None = None) -> int:
        """Wait for a slot; returns the epoch to pass to :meth:`release`. ``demand``: a
        waiting load needs this request (default: whether the calling task is inside
        :func:`demand`)."""
        if demand is None:
            demand = _DEMAND.get()
        queue = self._demand if demand else self._waiters
        while not self._admits(demand):
            waiter = asyncio.get_running_loop().create_future()
            queue.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in queue:
                    queue.remove(waiter)
                elif not waiter.cancelled():
                    self._wake()  # we were handed a slot we will not use: pass it on
                raise
        self.in_flight += 1
        return self.epoch

    def release(self, epoch: int, *, ok: bool, throttled: bool) -> None:
        self.in_flight -= 1
        if throttled:
            if epoch == self.epoch:
                self.limit = max(1.0, self.limit / 2)
                self.epoch += 1
                log.info("store throttled: concurrency limit now %d", int(self.limit))
        elif ok and self.limit < self.maximum:
            self.limit = min(float(self.maximum), self.limit + 1.0 / self.limit)
        self._io.concurrency_limit = int(self.limit)
        self._wake()

    def _wake(self) -> None:
        woken = 0
        free = int(self.limit) + self.headroom - self.in_flight
        while free > woken and self._demand:
            waiter = self._demand.popleft()
            if not waiter.done():
                waiter.set_result(None)
                woken += 1
        if self._demand:
            return  # the rest wait behind the demand requests
        free = int(self.limit) - self.in_flight
        while free > woken and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                woken += 1
