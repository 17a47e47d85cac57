"""An adaptive bound on requests in flight: AIMD, like TCP's congestion window."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Protocol

__all__ = ["AdaptiveLimiter"]

log = logging.getLogger(__name__)


class _LimitGauge(Protocol):
    concurrency_limit: int


class AdaptiveLimiter:
    """Bounds requests in flight; AIMD like TCP: the limit halves when the store throttles and
    grows by one per window of successful requests, back up to ``maximum``.

    A throttling response halves the limit only if its request started after the last decrease,
    so one burst of 429s from requests that were all in flight together halves it once.
    ``io`` (anything with a ``concurrency_limit`` field) shows the current limit.
    """

    def __init__(self, maximum: int, io: _LimitGauge) -> None:
        if maximum < 1:
            raise ValueError(f"maximum must be >= 1, got {maximum}")
        self.maximum = maximum
        self.limit = float(maximum)
        self.in_flight = 0
        self.epoch = 0
        self._io = io
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        io.concurrency_limit = maximum

    async def acquire(self) -> int:
        """Wait for a slot; returns the epoch to pass to :meth:`release`."""
        while self.in_flight >= int(self.limit):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
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
        free = int(self.limit) - self.in_flight
        while free > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1
