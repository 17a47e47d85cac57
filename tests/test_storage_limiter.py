"""The adaptive request limit alone: halves once per burst of throttling, recovers additively."""

from __future__ import annotations

import asyncio

import pytest

from asyncflat.storage import AdaptiveLimiter, IOCounters


def test_one_burst_of_throttling_halves_the_limit_once_then_it_recovers() -> None:
    async def main() -> None:
        io = IOCounters()
        limiter = AdaptiveLimiter(8, io)
        epochs = [await limiter.acquire() for _ in range(8)]  # all in flight together
        for epoch in epochs:
            limiter.release(epoch, ok=False, throttled=True)
        assert limiter.limit == 4 and io.concurrency_limit == 4
        for _ in range(200):  # successes grow it back by ~1 per window
            limiter.release(await limiter.acquire(), ok=True, throttled=False)
        assert limiter.limit == 8 and io.concurrency_limit == 8

    asyncio.run(main())


def test_waiters_get_slots_in_order_and_a_cancelled_waiter_passes_its_slot_on() -> None:
    async def main() -> None:
        limiter = AdaptiveLimiter(1, IOCounters())
        held = await limiter.acquire()
        first = asyncio.ensure_future(limiter.acquire())
        second = asyncio.ensure_future(limiter.acquire())
        await asyncio.sleep(0)
        limiter.release(held, ok=True, throttled=False)  # hands the slot to `first` ...
        first.cancel()  # ... which gives it up: `second` must get it, not wait forever
        epoch = await asyncio.wait_for(second, 5)
        assert limiter.in_flight == 1
        limiter.release(epoch, ok=True, throttled=False)
        assert limiter.in_flight == 0

    asyncio.run(main())


def test_the_maximum_must_be_positive() -> None:
    with pytest.raises(ValueError, match="maximum must be >= 1"):
        AdaptiveLimiter(0, IOCounters())
