"""The private loop thread: results, exceptions, re-entry, timeouts, Ctrl-C, fork, shutdown."""

from __future__ import annotations

import _thread
import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from asyncflat import LoaderClosedError, LoadTimeoutError, LoopReentryError
from asyncflat.engine.loop import LoopThread


@pytest.fixture
def runner():
    runner = LoopThread(name="test")
    yield runner
    runner.close()


def test_runs_coroutines_on_a_named_daemon_thread_lazily(runner: LoopThread) -> None:
    assert not [t for t in threading.enumerate() if t.name.startswith("test-loop")]

    async def where() -> str:
        return threading.current_thread().name

    name = runner.run(where())
    assert name.startswith("test-loop-")
    thread = next(t for t in threading.enumerate() if t.name == name)
    assert thread.daemon
    assert type(runner.loop).__module__.startswith("uvloop")
    # no global policy was touched: a fresh asyncio loop here is still the stdlib's
    fresh = asyncio.new_event_loop()
    try:
        assert type(fresh).__module__.startswith("asyncio")
    finally:
        fresh.close()


def test_exceptions_are_re_raised_unchanged(runner: LoopThread) -> None:
    error = KeyError("the very object")

    async def fail() -> None:
        raise error

    with pytest.raises(KeyError) as info:
        runner.run(fail())
    assert info.value is error

    async def own_timeout() -> None:  # a coroutine's own TimeoutError is not our timeout
        raise TimeoutError("inner")

    with pytest.raises(TimeoutError, match="inner"):
        runner.run(own_timeout(), timeout=5)


def test_blocking_call_from_the_loop_thread_is_refused(runner: LoopThread) -> None:
    async def inner() -> int:
        return 1

    async def reenter() -> None:
        coro = inner()
        runner.run(coro)

    with pytest.raises(LoopReentryError, match="own thread"):
        runner.run(reenter())


def _sleeper(seconds: float) -> tuple[threading.Event, Any]:
    """A coroutine function sleeping ``seconds``, and an event set when it is cancelled."""
    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    return cancelled, slow


def test_timeout_cancels_the_coroutine(runner: LoopThread) -> None:
    cancelled, slow = _sleeper(30)

    t0 = time.monotonic()
    with pytest.raises(LoadTimeoutError):
        runner.run(slow(), timeout=0.3)
    assert time.monotonic() - t0 < 2
    assert cancelled.wait(2)


def test_ctrl_c_returns_control_promptly(runner: LoopThread) -> None:
    cancelled, slow = _sleeper(30)

    # interrupt_main does nothing where SIGINT is ignored (a test run started in the background).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.3, _thread.interrupt_main).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run(slow())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t0 < 1.5
    assert cancelled.wait(2)


def test_close_cancels_tasks_joins_the_thread_and_is_idempotent() -> None:
    runner = LoopThread(name="closing")
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    runner.submit(forever())
    runner.run(asyncio.sleep(0))
    runner.close()
    runner.close()
    assert cancelled.is_set()
    assert not [t for t in threading.enumerate() if t.name.startswith("closing-loop")]
    with pytest.raises(LoaderClosedError):
        runner.run(asyncio.sleep(0))


def test_a_forked_child_gets_a_fresh_loop(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import asyncio, os, sys, threading, warnings
        warnings.simplefilter("ignore")  # jax warns that fork and threads do not mix
        from asyncflat.engine.loop import LoopThread
        runner = LoopThread(name="parent")
        async def ident():
            return threading.current_thread().name, os.getpid()
        parent_name, _ = runner.run(ident())
        pid = os.fork()
        if pid == 0:
            name, child_pid = runner.run(ident(), timeout=10)
            ok = child_pid == os.getpid() and name.startswith("parent-loop")
            runner.close()
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        runner.close()
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        timeout=120,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert result.returncode == 0, result.stderr


def test_interpreter_exit_with_a_busy_loop_does_not_hang() -> None:
    script = textwrap.dedent(
        """
        import asyncio
        from asyncflat.engine.loop import LoopThread
        runner = LoopThread(name="exiting")
        runner.submit(asyncio.sleep(3600))
        runner.run(asyncio.sleep(0))
        print("bye")
        """
    )
    t0 = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script],
        timeout=120,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert result.returncode == 0 and result.stdout.strip() == "bye", result.stderr
    assert time.monotonic() - t0 < 60


def test_engine_threads_run_at_a_lower_priority_than_the_caller() -> None:
    runner = LoopThread(name="nice", cpu_threads=1, nice=5)
    try:

        async def priorities() -> tuple[int, int]:
            loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            pool_nice = await asyncio.get_running_loop().run_in_executor(
                None, lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            )
            return loop_nice, pool_nice

        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert runner.run(priorities()) == (min(19, mine + 5), min(19, mine + 5))
        assert (
            os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
        )  # caller untouched
    finally:
        runner.close()
