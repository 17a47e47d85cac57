"""The one in-flight cache: shared, shielded, bounded, and never caching a failure."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from asyncflat.storage.single_flight import SingleFlight


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), timeout=10))


class Reader:
    """Counts reads; each read waits on ``gate`` and then returns or raises what it is told."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate = asyncio.Event()
        self.error: BaseException | None = None

    async def __call__(self) -> bytes:
        self.calls += 1
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        return b"value-%d" % self.calls


def test_concurrent_callers_share_one_read() -> None:
    async def main() -> None:
        cache: SingleFlight[str, bytes] = SingleFlight(keep=4)
        read = Reader()
        waiters = [asyncio.ensure_future(cache.get("k", read)) for _ in range(5)]
        await asyncio.sleep(0)
        read.gate.set()
        assert await asyncio.gather(*waiters) == [b"value-1"] * 5
        assert read.calls == 1 and cache.started == 1 and cache.shared == 4
        assert await cache.get("k", read) == b"value-1"  # kept after it finished

    run(main)


def test_a_failure_is_never_cached() -> None:
    async def main() -> None:
        cache: SingleFlight[str, bytes] = SingleFlight(keep=4)
        read = Reader()
        read.error = OSError("store down")
        read.gate.set()
        first = [asyncio.ensure_future(cache.get("k", read)) for _ in range(3)]
        for outcome in await asyncio.gather(*first, return_exceptions=True):
            assert isinstance(outcome, OSError)  # everyone waiting shares the failure ...
        assert read.calls == 1 and "k" not in cache  # ... and it is gone at once
        read.error = None
        assert await cache.get("k", read) == b"value-2"  # the healed store is read afresh

    run(main)


def test_a_cancelled_caller_does_not_cancel_the_shared_read() -> None:
    async def main() -> None:
        cache: SingleFlight[str, bytes] = SingleFlight(keep=4)
        read = Reader()
        impatient = asyncio.ensure_future(cache.get("k", read))
        patient = asyncio.ensure_future(cache.get("k", read))
        await asyncio.sleep(0)
        impatient.cancel()
        read.gate.set()
        assert await patient == b"value-1"
        assert impatient.cancelled() and read.calls == 1

    run(main)


def test_a_read_cancelled_at_its_source_is_forgotten() -> None:
    async def main() -> None:
        cache: SingleFlight[str, bytes] = SingleFlight(keep=4)
        read = Reader()
        waiter = asyncio.ensure_future(cache.get("k", read))
        await asyncio.sleep(0)
        await cache.aclose()  # cancels the read itself
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert len(cache) == 0
        read.gate.set()
        calls = read.calls
        assert await cache.get("k", read) == b"value-%d" % (calls + 1)  # a fresh read

    run(main)


def test_a_value_found_bad_is_dropped_only_if_it_is_still_the_cached_one() -> None:
    # The case of a Blosc layout or shard index parsed from bytes that later fail to decode:
    # the reader forgets it, and the next read parses fresh bytes.
    async def main() -> None:
        cache: SingleFlight[str, bytes] = SingleFlight(keep=4)
        read = Reader()
        read.gate.set()
        bad = await cache.get("k", read)
        cache.forget("k", b"some other value")  # not the cached one: kept
        assert await cache.get("k", read) is bad and read.calls == 1
        cache.forget("k", bad)
        assert await cache.get("k", read) == b"value-2"

    run(main)


def test_finished_results_are_bounded_but_reads_in_flight_are_never_evicted() -> None:
    async def main() -> None:
        cache: SingleFlight[int, bytes] = SingleFlight(keep=2)
        slow = Reader()
        in_flight = asyncio.ensure_future(cache.get(0, slow))
        await asyncio.sleep(0)
        fast = Reader()
        fast.gate.set()
        for key in range(1, 6):
            await cache.get(key, fast)
        assert 0 in cache  # still in flight: kept although it is the oldest
        assert len(cache) <= 3 and 5 in cache and 1 not in cache
        slow.gate.set()
        assert await in_flight == b"value-1"
        await cache.get(6, fast)
        assert len(cache) == 2

    run(main)


def test_clear_keeps_reads_in_flight() -> None:
    async def main() -> None:
        cache: SingleFlight[str, bytes] = SingleFlight(keep=4)
        done, pending = Reader(), Reader()
        done.gate.set()
        await cache.get("done", done)
        waiter = asyncio.ensure_future(cache.get("pending", pending))
        await asyncio.sleep(0)
        cache.clear()
        assert "done" not in cache and "pending" in cache
        pending.gate.set()
        assert await waiter == b"value-1"

    run(main)
