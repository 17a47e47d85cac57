"""The adaptive request limit alone: halves once per burst of throttling, recovers additively."""

from __future__ import annotations

import asyncio

import pytest

from asyncflat.storage import AdaptiveLimiter, IOCounters
from asyncflat.storage.limiter import demand, demand_headroom, pool_size


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


def test_demand_requests_pass_queued_ones_and_use_the_headroom() -> None:
    async def main() -> None:
        limiter = AdaptiveLimiter(4, IOCounters(), headroom=1)
        held = [await limiter.acquire() for _ in range(4)]  # a fill holds every slot
        queued = [asyncio.ensure_future(limiter.acquire()) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(q.done() for q in queued)
        # A demand request starts at once, in the headroom above the limit...
        first = await asyncio.wait_for(limiter.acquire(demand=True), 1)
        assert limiter.in_flight == 5
        # ...a second one waits, but ahead of the three queued before it.
        with demand():  # the default comes from the task's context, which the task copies
            second = asyncio.ensure_future(limiter.acquire())
        late = asyncio.ensure_future(limiter.acquire())  # started after it: a plain request
        await asyncio.sleep(0)
        assert not second.done()
        limiter.release(held.pop(), ok=True, throttled=False)
        await asyncio.sleep(0)
        assert second.done() and not any(q.done() for q in (*queued, late))
        # Once no demand request waits, the others get the slots under the limit.
        limiter.release(first, ok=True, throttled=False)
        limiter.release(second.result(), ok=True, throttled=False)
        await asyncio.sleep(0)
        assert [q.done() for q in queued] == [True, False, False]  # 3 held + 1: at the limit
        assert not late.done()
        assert limiter.in_flight == 4
        for epoch in [*held, queued[0].result()]:
            limiter.release(epoch, ok=True, throttled=False)
        await asyncio.sleep(0)
        assert queued[1].done() and queued[2].done()
        assert late.done()  # last in line: a plain request queued behind the three
        for q in [*queued[1:], late]:
            limiter.release(q.result(), ok=True, throttled=False)
        assert limiter.in_flight == 0

    asyncio.run(asyncio.wait_for(main(), 10))


def test_the_pool_holds_the_limit_and_the_headroom() -> None:
    assert demand_headroom(16) == 4 and pool_size(16) == 20
    assert demand_headroom(1) == 2 and pool_size(1) == 3


def test_a_resize_moves_the_limit_and_keeps_a_throttled_one_lower() -> None:
    async def main() -> None:
        io = IOCounters()
        limiter = AdaptiveLimiter(64, io)  # before a store's chunk size is known
        limiter.resize(32)
        assert (limiter.maximum, limiter.limit, io.concurrency_limit) == (32, 32, 32)
        assert limiter.headroom == demand_headroom(32)
        held = [await limiter.acquire() for _ in range(32)]
        blocked = asyncio.ensure_future(limiter.acquire())
        await asyncio.sleep(0)
        assert not blocked.done()  # the 33rd waits
        limiter.resize(40)  # more room: a waiter is let in at once
        await asyncio.wait_for(blocked, 1)
        for epoch in [*held, blocked.result()]:
            limiter.release(epoch, ok=False, throttled=True)  # one burst: halved once
        assert limiter.limit == 20
        limiter.resize(64)  # a store that throttled stays lowered, and recovers from there
        assert (limiter.maximum, limiter.limit) == (64, 20)
        limiter.resize(8)
        assert limiter.limit == 8 and io.concurrency_limit == 8
        with pytest.raises(ValueError, match="maximum must be >= 1"):
            limiter.resize(0)

    asyncio.run(main())
