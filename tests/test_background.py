"""The generic background builder (asyncflat.loader.shared.background) on its own: a ``build(step)`` callable.

Events, not sleeps, decide every ordering here; waits are bounded with a clear failure message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from asyncflat.errors import LoaderClosedError
from asyncflat.loader.shared.background import (
    FIRST_BUILD_DELAY_S,
    BackgroundBuilder,
    BackgroundStopped,
    BuildPacing,
    Prefetchers,
)
from asyncflat.loader.shared.iterator import BatchIterator
from asyncflat.loader.shared.serving import Pin

WAIT_S = 10.0


def _wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_S}s waiting for {what}")
        time.sleep(0.002)


class Recorder:
    """``build`` that records its calls; step ``block_at`` waits for ``release``."""

    def __init__(self, *, fail_at: int | None = None, block_at: int | None = None) -> None:
        self.calls: list[int] = []
        self.fail_at, self.block_at = fail_at, block_at
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, step: int) -> str:
        self.calls.append(step)
        if step == self.block_at:
            self.entered.set()
            assert self.release.wait(WAIT_S), "the test never released the build"
        if step == self.fail_at:
            raise OSError(f"build of step {step} failed")
        return f"item {step}"


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_builds_ahead_up_to_depth_and_take_frees_a_slot() -> None:
    build = Recorder()
    builder = BackgroundBuilder(build, 5, 100, 3, name="bg-depth")
    try:
        _wait_until(lambda: build.calls == [5, 6, 7], "three steps built ahead")
        time.sleep(0.05)  # a bounded look for a fourth build that must not happen
        assert build.calls == [5, 6, 7]
        assert builder.take(5) == "item 5"
        _wait_until(lambda: build.calls == [5, 6, 7, 8], "one more step after a take")
        assert [builder.take(s) for s in (6, 7, 8)] == ["item 6", "item 7", "item 8"]
    finally:
        builder.stop()
    assert not _threads("bg-depth")


def test_lookup_returns_a_built_step_without_taking_it() -> None:
    build = Recorder()
    builder = BackgroundBuilder(build, 0, 10, 2, name="bg-lookup")
    try:
        _wait_until(lambda: len(build.calls) == 2, "two steps built")
        assert builder.lookup(1) == "item 1"
        assert builder.lookup(7) is None  # not started: the caller builds it itself
        assert builder.take(0) == "item 0" and builder.take(1) == "item 1"
        assert build.calls.count(1) == 1  # looked up and taken, built once
    finally:
        builder.stop()


def test_lookup_waits_for_a_build_in_progress() -> None:
    build = Recorder(block_at=0)
    builder = BackgroundBuilder(build, 0, 10, 1, name="bg-wait")
    try:
        assert build.entered.wait(WAIT_S)
        result: list[object] = []
        looker = threading.Thread(target=lambda: result.append(builder.lookup(0)))
        looker.start()
        time.sleep(0.02)
        assert not result  # still building
        build.release.set()
        looker.join(WAIT_S)
        assert result == ["item 0"]
    finally:
        build.release.set()
        builder.stop()


def test_a_build_error_is_raised_by_take_and_ends_the_thread() -> None:
    build = Recorder(fail_at=2)
    builder = BackgroundBuilder(build, 0, 10, 4, name="bg-error")
    try:
        assert builder.take(0) == "item 0" and builder.take(1) == "item 1"
        with pytest.raises(OSError, match="build of step 2 failed"):
            builder.take(2)
        assert builder.lookup(2) is None  # a failed build is not served to a lookup
        _wait_until(lambda: not _threads("bg-error"), "the thread to end after the error")
        assert build.calls == [0, 1, 2]
        with pytest.raises(BackgroundStopped):
            builder.take(3)
    finally:
        builder.stop()


def test_stop_joins_after_the_build_in_progress_and_take_then_fails() -> None:
    build = Recorder(block_at=0)
    builder = BackgroundBuilder(build, 0, 10, 1, name="bg-stop")
    assert build.entered.wait(WAIT_S)
    builder.signal_stop()  # returns at once, the build goes on
    assert _threads("bg-stop")
    build.release.set()
    builder.stop()
    assert not _threads("bg-stop") and build.calls == [0]
    with pytest.raises(BackgroundStopped, match="bg-stop has stopped"):
        builder.take(1)
    builder.stop()  # idempotent


def test_the_thread_ends_at_stop_step() -> None:
    build = Recorder()
    builder = BackgroundBuilder(build, 3, 5, 8, name="bg-end")
    assert [builder.take(3), builder.take(4)] == ["item 3", "item 4"]
    _wait_until(lambda: not _threads("bg-end"), "the thread to end at the last step")
    assert build.calls == [3, 4]
    builder.stop()


def test_a_retired_builder_lets_go_of_its_built_items_when_its_thread_ends() -> None:
    """A retired builder (a jump, an ``iter()``) is only joined when its loader closes: the
    items it built must not live until then (each is a batch on the device)."""
    import gc
    import weakref

    class Item:
        pass

    made: list[weakref.ref[Item]] = []

    def build(step: int) -> Item:
        item = Item()
        made.append(weakref.ref(item))
        return item

    registry: Prefetchers[Item] = Prefetchers("bg-retire", lambda: RuntimeError("closed"))
    builder = registry.start(build, 0, 10, 3)
    try:
        _wait_until(lambda: len(made) == 3, "three items built ahead")
        registry.retire(builder)
        _wait_until(lambda: not builder.alive, "the retired builder's thread to end")
        gc.collect()
        assert [ref() for ref in made] == [None, None, None]
    finally:
        for stopped in registry.close():
            stopped.stop()


def test_a_builder_that_reached_its_last_step_keeps_its_items_for_the_taker() -> None:
    build = Recorder()
    builder = BackgroundBuilder(build, 0, 2, 4, name="bg-kept")
    _wait_until(lambda: not _threads("bg-kept"), "the thread to end at the last step")
    assert [builder.take(0), builder.take(1)] == ["item 0", "item 1"]
    builder.stop()


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1"):
        BackgroundBuilder(Recorder(), 0, 1, 0, name="bg-zero")


def test_a_registry_lookup_skips_a_builders_not_built_marker() -> None:
    """A load-ahead builder that holds "not built" for a step must not hide an iterator's real
    item of that step: the load returns the iterator's, not a rebuild."""
    marker = object()
    registry: Prefetchers[object] = Prefetchers("bg-registry", lambda: RuntimeError("closed"))
    not_built = registry.start(lambda step: marker, 0, 10, 2)
    _wait_until(lambda: not_built.lookup(1) is marker, "the marker builder's two steps")
    assert registry.lookup(1) is marker  # without skip the marker is what a lookup finds
    built = Recorder()
    real = registry.start(built, 0, 10, 2)
    try:
        _wait_until(lambda: len(built.calls) == 2, "the real builder's two steps")
        for _ in range(5):  # whatever order the registry holds its builders in
            assert registry.lookup(1, skip=marker) == "item 1"
        assert registry.lookup(7, skip=marker) is None  # neither has started step 7
    finally:
        for builder in registry.close():
            builder.stop()
    assert not real.alive and not not_built.alive


# -- pacing: builds start in the consumer's slack, not the moment it takes an item ---------------


def test_pacing_starts_a_build_halfway_through_the_consumers_slack() -> None:
    pacing = BuildPacing(window=4, max_delay_s=1.0)
    assert pacing.start_at() is None  # nothing seen: at once
    pacing.began(-0.5)  # a builder started right after a take it did not see
    assert pacing.start_at() == pytest.approx(-0.5 + FIRST_BUILD_DELAY_S)
    for t in (0.0, 0.010, 0.020):
        pacing.took(t)
    # no build seen yet: a moment after the last take (the consumer returning from it)
    assert pacing.start_at() == pytest.approx(0.020 + FIRST_BUILD_DELAY_S)
    pacing.built(0.002)
    # the shortest interval (10 ms) less the longest build (2 ms), halved, after the last take
    assert pacing.start_at() == pytest.approx(0.020 + 0.004)
    pacing.took(0.025)  # a shorter step: the slack shrinks at once
    assert pacing.start_at() == pytest.approx(0.025 + 0.0015)
    pacing.built(0.006)  # a longer build too
    assert pacing.start_at() is None  # 5 ms between takes, 6 ms builds: no slack


def test_pacing_forgets_old_intervals_and_caps_the_delay() -> None:
    pacing = BuildPacing(window=2, max_delay_s=0.05)
    for t in (0.0, 0.001, 1.0, 2.0):  # the 1 ms interval falls out of a window of 2
        pacing.took(t)
    pacing.built(0.0)
    assert pacing.start_at() == pytest.approx(2.0 + 0.05)  # half the slack would be 0.5 s


class Timed:
    """``build`` that records when each step's build started."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}

    def __call__(self, step: int) -> str:
        self.started[step] = time.perf_counter()
        return f"item {step}"


def test_a_paced_build_waits_for_the_middle_of_the_interval_between_takes() -> None:
    build = Timed()
    builder = BackgroundBuilder(build, 0, 100, 1, name="bg-paced")
    interval = 0.1
    try:
        taken: dict[int, float] = {}
        for step in range(8):
            _wait_until(lambda s=step: s in build.started, f"the build of step {step}")
            time.sleep(max(0.0, interval - (time.perf_counter() - taken.get(step - 1, 0.0))))
            taken[step] = time.perf_counter()
            assert builder.take(step) == f"item {step}"
        # Unpaced, step s + 1 was built right after step s was taken; paced (after three takes),
        # ~45 ms later (half of 100 ms less a build). 20 ms leaves room for a slow machine.
        delays = [build.started[s + 1] - taken[s] for s in range(3, 7)]
        assert min(delays) > 0.02, delays
        assert all(build.started[s + 1] - taken[s] < 0.02 for s in range(2))
        # ... but not the very moment: the consumer is still returning from its take
        assert all(build.started[s + 1] - taken[s] >= FIRST_BUILD_DELAY_S for s in range(2))
    finally:
        builder.stop()


def test_a_consumer_that_comes_early_does_not_wait_out_the_pacing() -> None:
    build = Timed()
    pacing = BuildPacing(max_delay_s=1.0)
    builder = BackgroundBuilder(build, 0, 100, 1, name="bg-early", pacing=pacing)
    try:
        start = time.perf_counter()
        for step in range(4):  # 0.4 s between takes: each build is then held back ~0.2 s
            time.sleep(max(0.0, start + 0.4 * step - time.perf_counter()))
            assert builder.take(step) == f"item {step}"
        taken = time.perf_counter()
        time.sleep(0.02)  # the build of step 4 is being held back now, until ~0.2 s
        t0 = time.perf_counter()
        assert builder.take(4) == "item 4"  # at once: not ~0.18 s later
        assert time.perf_counter() - t0 < 0.09
        assert build.started[4] - taken < 0.11
    finally:
        builder.stop()


# -- a Ctrl-C while a builder's thread starts ----------------------------------------------------


@pytest.mark.parametrize("when", ["after the thread started", "before it started"])
def test_a_ctrl_c_while_a_builders_thread_starts_leaves_no_thread_close_does_not_stop(
    monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A KeyboardInterrupt is delivered inside ``Thread.start()`` while it waits for the new
    thread to come up: that thread was left running, in no registry, never stopped by close()
    (found by an outside attack: one leaked thread per such Ctrl-C on a loader's second load)."""
    original = threading.Thread.start
    name = "bg-ctrl-c"

    def start_interrupted(thread: threading.Thread) -> None:
        if thread.name.startswith(name) and when == "after the thread started":
            original(thread)
        if thread.name.startswith(name):
            raise KeyboardInterrupt
        original(thread)

    registry: Prefetchers[str] = Prefetchers(name, lambda: RuntimeError("closed"))
    monkeypatch.setattr(threading.Thread, "start", start_interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.start(Recorder(), 0, 100, 1)
    monkeypatch.setattr(threading.Thread, "start", original)
    for builder in registry.close():
        builder.stop()
    _wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith(name)],
        "the interrupted builder's thread to end after close()",
    )


# -- the loaders' iterator over a builder ---------------------------------------------------------


class StoppingOwner:
    """An :class:`~asyncflat.loader.shared.iterator.IteratorOwner` whose prefetch thread is stopped
    by ``close()`` from another thread before it starts step 1: its ``take(1)`` then raises
    ``BackgroundStopped``, as a real builder's does."""

    def __init__(self) -> None:
        self.step_count = 10
        self.closed = False
        self.stopped = threading.Event()
        self.taking = threading.Event()
        self.delivered = 0

    def check_open(self) -> None:
        if self.closed:
            raise LoaderClosedError("this StoppingOwner is closed; create a new one")

    def load(self, step: int) -> str:
        raise AssertionError("an iterator with device prefetch takes from its builder")

    def count_delivered(self, step: int) -> None:
        self.delivered += 1

    def pin(self) -> Pin:
        return Pin(NoPins())

    def start_prefetch(self, start: int, depth: int) -> Any:
        owner = self

        class Stopping:
            def take(self, step: int, *, keep: bool = False) -> str:
                if step == 0:
                    return "item 0"
                owner.taking.set()
                assert owner.stopped.wait(WAIT_S)
                raise BackgroundStopped("asyncflat-device-prefetch-0 has stopped")

            def forget(self, step: int) -> None:
                pass

        return Stopping()

    def stop_prefetch(self, builder: Any, pin: Pin) -> None:
        pin.release()

    def release_collected(self, builder: Any, pin: Pin) -> None:
        pin.release()

    def close(self) -> None:
        self.closed = True
        self.stopped.set()


class NoPins:
    def pin_keys(self, step: int) -> int:
        return 0

    def pin(self, keys: int) -> int:
        return keys

    def unpin(self, pinned: int) -> None:
        pass


def test_an_iterator_whose_prefetch_thread_stops_at_a_close_raises_loader_closed() -> None:
    """The path of a loader closed from another thread while ``next()`` waits for a step its
    prefetch thread had not started (the plain loader's and the mixture's, one iterator):
    ``LoaderClosedError``, not the thread's own stop, and the iteration has ended."""
    owner = StoppingOwner()
    iterator = BatchIterator(owner, 0, 1)
    assert next(iterator) == (0, "item 0")
    closer = threading.Thread(target=lambda: owner.taking.wait(WAIT_S) and owner.close())
    closer.start()
    with pytest.raises(LoaderClosedError, match="StoppingOwner is closed"):
        next(iterator)
    closer.join(WAIT_S)
    with pytest.raises(StopIteration):
        next(iterator)
    assert owner.delivered == 1


def test_a_pin_whose_new_keys_failed_to_pin_pins_them_at_the_next_move() -> None:
    """A move whose pin raised (or was interrupted) leaves the pin as it was: it recorded the
    new keys first, so the next move to them thought them pinned and pinned nothing, while the
    old keys stayed pinned."""

    class Counted:
        def __init__(self) -> None:
            self.pinned: dict[int, int] = {}
            self.fail = False

        def pin_keys(self, step: int) -> int:
            return step // 10  # one minipoch of 10 steps

        def pin(self, keys: int) -> int:
            if self.fail:
                self.fail = False
                raise LoaderClosedError("pin failed")
            self.pinned[keys] = self.pinned.get(keys, 0) + 1
            return keys

        def unpin(self, token: int) -> None:
            self.pinned[token] -= 1

    server = Counted()
    pin = Pin(server)  # type: ignore[arg-type]  # a stand-in with the three methods Pin calls
    pin.move(0)
    server.fail = True
    with pytest.raises(LoaderClosedError):
        pin.move(10)
    assert server.pinned == {0: 1}  # still on the old keys
    pin.move(11)
    assert server.pinned == {0: 0, 1: 1}
    pin.release()
    assert server.pinned == {0: 0, 1: 0}
