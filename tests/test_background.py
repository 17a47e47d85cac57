"""The generic background builder (asyncflat._background) on its own: a ``build(step)`` callable.

Events, not sleeps, decide every ordering here; waits are bounded with a clear failure message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from asyncflat._background import BackgroundBuilder, BackgroundStopped, Prefetchers

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
