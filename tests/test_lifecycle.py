"""Lifecycle: close() leaves nothing behind, exit and Ctrl-C never hang, fork and threads are safe.

* after ``close()`` no library thread is alive and no file descriptor leaks, over several cycles;
* a dropped loader stops its thread; a load blocked in another thread when ``close()`` is called
  raises LoaderClosedError promptly;
* an interpreter exiting with open loaders (one of them blocked on slow storage) exits at once;
* SIGINT during a blocking ``load()`` raises KeyboardInterrupt in about the wait slice, and the
  loader is still usable afterwards;
* a process forked after a loader started can build and use its own loader (the parent's refuses
  to run there), and the parent's keeps working;
* loaders used from several threads at once give the oracle's batches.
"""

from __future__ import annotations

import asyncio
import gc
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from conftest import random_store
from helpers.resources import library_threads, open_fds, wait_until
from reference_impl import ReferenceLoader, load_split_arrays

from asyncflat import (
    ConfigError,
    EngineOptions,
    FlatTokensParams,
    LoaderClosedError,
    MixtureParams,
    MixtureSource,
    ShufflingLoader,
    TokenBatchParams,
)
from asyncflat.testing.faults import FaultyStore

pytestmark = pytest.mark.timeout(180)

REPO = str(Path(__file__).resolve().parents[1])
SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
BATCH = TokenBatchParams(len=16, batch=8)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return random_store(tmp_path_factory, "lifecycle", 7, 400, validation=100, chunk_tokens=1024)


def params(path: str, seed: int = 0, packing: bool = True, streams: int = 2) -> FlatTokensParams:
    return FlatTokensParams(path, streams, 2, 4, seed, packing)


def oracle(
    path: str, p: FlatTokensParams, batch: TokenBatchParams = BATCH, split: str = "train"
) -> ReferenceLoader:
    tokens, starts = load_split_arrays(path, split)
    return ReferenceLoader(
        tokens,
        starts,
        seq_len=batch.len,
        batch=batch.batch,
        streams=p.streams,
        read_blocks_per_shuffle_buffer=p.read_blocks_per_shuffle_buffer,
        sequences_per_read_block=p.sequences_per_read_block,
        seed=p.seed,
        sequence_packing=p.sequence_packing,
    )


def run_script(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(script), *args],
        timeout=timeout,
        capture_output=True,
        text=True,
        env=env,
    )


# -- close() --------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_close_leaves_no_thread_and_no_file_descriptor(dataset: str) -> None:
    def cycle(seed: int) -> None:
        options = EngineOptions(prefetch_to_device=2)
        with ShufflingLoader(
            "train", params(dataset, seed), BATCH, SINGLE, options=options
        ) as loader:
            for step in (0, 5, 1):
                loader.load(step)
            iterator = loader.iter(3)  # a device-prefetch thread, left running until close()
            next(iterator)
            assert library_threads()
            loader.stats()

    cycle(0)  # warm-up: jax, zarr and numcodecs open what they keep for the process
    gc.collect()
    fds, threads = open_fds(), threading.active_count()
    for seed in range(1, 6):
        cycle(seed)
        assert library_threads() == [], library_threads()
    gc.collect()
    assert open_fds() == fds, sorted(os.listdir("/proc/self/fd"))
    assert threading.active_count() == threads


def test_a_dropped_loader_stops_its_thread(dataset: str) -> None:
    loader = ShufflingLoader("train", params(dataset), BATCH, SINGLE)
    loader.load(0)
    assert library_threads()
    del loader
    gc.collect()
    assert wait_until(lambda: not library_threads(), 10), library_threads()


def test_close_wakes_a_load_blocked_in_another_thread(dataset: str) -> None:
    stores: list[FaultyStore] = []

    def slow(store: Any) -> FaultyStore:
        stores.append(FaultyStore(store, latency_s=30, fault_keys="train/encoded_tokens/c/*"))
        return stores[-1]

    loader = ShufflingLoader("train", params(dataset), BATCH, SINGLE, store_wrapper=slow)
    outcome: queue.Queue[BaseException | str] = queue.Queue()

    def blocked() -> None:
        try:
            loader.load(2)
            outcome.put("returned")
        except BaseException as exc:
            outcome.put(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    assert wait_until(lambda: stores and stores[0].counts.delayed > 0, 10)
    t0 = time.monotonic()
    loader.close()
    result = outcome.get(timeout=10)
    assert time.monotonic() - t0 < 5
    assert isinstance(result, LoaderClosedError), repr(result)
    thread.join(5)
    assert not library_threads()
    for call in (lambda: loader.load(0), lambda: loader.iter(), loader.stats):
        with pytest.raises(LoaderClosedError, match="closed"):
            call()


def test_close_right_after_dropping_an_iterator_whose_builder_waits_on_the_loop(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A dropped iterator's builder is stopped on the loop's thread (its finalizer queues the
    release there). When ``close()`` has begun before the loop runs that release, the release
    must still know it runs on the loop's thread and not wait for the builder, which waits for
    that loop: close() took 30 s and left the loop's threads alive (3 runs in 3)."""
    path = random_store(tmp_path_factory, "dropped", 2, 1500, validation=50, chunk_tokens=2000)
    for attempt in range(3):
        loader = ShufflingLoader(
            "train",
            FlatTokensParams(path, 2, 3, 16, seed=5, sequence_packing=True),
            TokenBatchParams(len=64, batch=16),
            SINGLE,
            options=EngineOptions(prefetch_to_device=2, fill_on_open="never"),
            store_wrapper=lambda store: FaultyStore(
                store, latency_s=0.5, fault_keys="train/encoded_tokens/c/*"
            ),
        )
        iterator = loader.iter(20)
        time.sleep(0.05)  # its builder is inside build(20), waiting on the loop for the fill
        del iterator  # the finalizer queues the builder's release on the loop
        t0 = time.monotonic()
        loader.close()  # at once: before the loop has run that release
        assert time.monotonic() - t0 < 10, f"attempt {attempt}"
        assert wait_until(lambda: not library_threads(), 5), library_threads()


@pytest.mark.parametrize("close_fails", [False, True])
@pytest.mark.parametrize("refused", ["size", "start"])
def test_a_construction_refused_after_its_store_opened_closes_that_store(
    dataset: str, close_fails: bool, refused: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is open before the plan and the buffers' size are checked and before the
    engine starts: a loader refused there (``max_buffer_bytes``), or whose engine cannot start
    (here: once it has started its block order and step 0's fills, a thread that will not
    start), closes what it opened, with its sessions, threads and read memory, rather than
    leave them behind for every refused attempt; a close that fails does not hide the
    refusal."""
    from asyncflat.engine import Engine

    closed: list[str] = []
    if refused == "start":
        start = Engine.open

        def open_then_fail(self: Engine, **kwargs: Any) -> None:
            start(self, **kwargs)
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(Engine, "open", open_then_fail)

    class Tracked(FaultyStore):
        def close(self) -> None:
            closed.append("closed")
            super().close()
            if close_fails:
                raise RuntimeError("the store failed to close")

    error, match = (
        (ConfigError, "max_buffer_bytes") if refused == "size" else (RuntimeError, "new thread")
    )
    with pytest.raises(error, match=match):
        ShufflingLoader(
            "train",
            params(dataset),
            BATCH,
            SINGLE,
            options=EngineOptions(max_buffer_bytes=1 if refused == "size" else None),
            store_wrapper=Tracked,
        )
    assert closed == ["closed"]
    assert wait_until(lambda: not library_threads(), 5), library_threads()


# -- process exit, Ctrl-C, fork -------------------------------------------------------------------


def test_interpreter_exit_waits_for_a_builder_inside_a_batch_build(dataset: str) -> None:
    """A loader left open after a ``load()`` has its load-ahead builder building the next
    step. Builders are daemon threads, and one the interpreter's finalization caught inside
    jax's C++ code aborted the process ("terminate called after throwing an instance of ...",
    one exit in six). Exit now stops them before it finalizes: by the last exit hook (the
    script's own, registered before the library's) no builder is left, however slow its build
    (here 0.3 s)."""
    script = """
        import atexit, threading

        def last():  # registered first, so it runs after the library's exit hooks
            alive = [t.name for t in threading.enumerate() if "prefetch" in t.name]
            print("builders at exit:", alive, flush=True)

        atexit.register(last)
        import sys, time, jax
        from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams
        from asyncflat.loader.shared.batch import BatchBuilder

        build = BatchBuilder.build
        building = threading.Event()

        def slow(self, rows):
            if "prefetch" in threading.current_thread().name:
                building.set()
                time.sleep(0.3)  # a host-to-device copy in progress
            return build(self, rows)

        BatchBuilder.build = slow
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        loader = ShufflingLoader("train", FlatTokensParams(sys.argv[1], 2, 2, 4, 3, True),
                                 TokenBatchParams(len=16, batch=8), one)
        loader.load(0)
        assert building.wait(10)  # the load-ahead builder is inside its build of step 1
    """
    result = run_script(script, dataset, timeout=90)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "builders at exit: []", result.stdout


def test_interpreter_exit_with_open_loaders_does_not_hang(dataset: str) -> None:
    script = """
        import sys, time, jax
        from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
        from asyncflat.testing.faults import FaultyStore
        path = sys.argv[1]
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        batch = TokenBatchParams(len=16, batch=8)
        idle = ShufflingLoader("train", FlatTokensParams(path, 2, 2, 4, 0, True), batch, one)
        idle.load(0)
        slow = ShufflingLoader(
            "train", FlatTokensParams(path, 2, 2, 4, 1, True), batch, one,
            options=EngineOptions(prefetch_to_device=2),
            store_wrapper=lambda s: FaultyStore(s, latency_s=60, fault_keys="train/encoded_tokens/c/*"))
        it = slow.iter(0)  # its prefetch thread is now blocked in a load waiting 60 s for data
        time.sleep(0.5)
        print("bye", time.time(), flush=True)
    """
    result = run_script(script, dataset, timeout=90)
    exited = time.time()
    assert result.returncode == 0 and result.stdout.startswith("bye "), result.stderr
    assert exited - float(result.stdout.split()[1]) < 10  # from the last line to process exit


def test_ctrl_c_during_a_blocking_load_returns_promptly(dataset: str) -> None:
    script = """
        import signal, sys, time, jax
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell ignores it
        from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams
        from asyncflat.testing.faults import FaultyStore
        stores = []
        def slow(store):
            stores.append(FaultyStore(store, latency_s=4, fault_keys="train/encoded_tokens/c/*"))
            return stores[-1]
        loader = ShufflingLoader("train", FlatTokensParams(sys.argv[1], 2, 2, 4, 0, True),
                                 TokenBatchParams(len=16, batch=8),
                                 jax.sharding.SingleDeviceSharding(jax.devices()[0]), store_wrapper=slow)
        print("blocking", flush=True)
        try:
            loader.load(3)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        stores[0].configure(latency_s=0)
        # Still usable: the interrupted load was cancelled; its fill goes on (reads already
        # sleeping finish within 4 s) and serves this load.
        loader.load(4)
        stores[0].configure(latency_s=60)
        print("blocking again", flush=True)
        loader.load(loader.step_count - 1)  # the second SIGINT is not caught: the process exits
        print("unreachable", flush=True)
    """
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    lines: queue.Queue[tuple[str, float]] = queue.Queue()
    with subprocess.Popen(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(script), dataset],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as child:

        def read() -> None:
            assert child.stdout is not None
            for line in child.stdout:
                lines.put((line.strip(), time.monotonic()))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            assert lines.get(timeout=90)[0] == "blocking"
            time.sleep(0.5)  # well inside load(): its reads sleep for 4 s
            sent = time.monotonic()
            child.send_signal(signal.SIGINT)
            line, at = lines.get(timeout=10)
            assert line == "interrupted" and at - sent < 2.0, (line, at - sent)
            assert lines.get(timeout=30)[0] == "blocking again"
            time.sleep(0.5)
            sent = time.monotonic()
            child.send_signal(signal.SIGINT)
            child.wait(timeout=10)
            assert time.monotonic() - sent < 3.0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            reader.join(5)
        assert child.stderr is not None
        stderr = child.stderr.read()
    assert "KeyboardInterrupt" in stderr, stderr
    assert child.returncode in (-signal.SIGINT, 130, 1), child.returncode


def test_a_forked_process_builds_its_own_loader(dataset: str) -> None:
    """JAX itself cannot run in a child forked after it started (its thread pools do not survive
    fork: a jax array built there deadlocks, with or without asyncflat). So the child checks the
    rows its own engine serves, which is asyncflat's part; a child that needs jax arrays must be
    started with the "spawn" method (docs/reliability.md)."""
    script = """
        import multiprocessing, sys, threading, warnings
        # JAX warns that fork and its threads do not mix; that is the point of this test.
        warnings.filterwarnings("ignore", message=r"os\\.fork\\(\\) was called", category=RuntimeWarning)
        warnings.filterwarnings("ignore", message=r".*use of fork\\(\\) may lead to deadlocks",
                                category=DeprecationWarning)
        import jax, numpy as np
        from asyncflat import FlatTokensParams, LoaderClosedError, ShufflingLoader, TokenBatchParams
        path = sys.argv[1]
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        batch = TokenBatchParams(len=16, batch=8)
        params = FlatTokensParams(path, 2, 2, 4, 0, True)
        parent = ShufflingLoader("train", params, batch, one)
        expected = {step: np.asarray(parent.load(step).targets) for step in (0, 9, 3)}

        def child(results):
            try:
                try:
                    parent.load(0)
                    results.put("the parent's loader ran in the child")
                    return
                except LoaderClosedError:
                    pass
                own = ShufflingLoader("train", params, batch, one)
                for step, targets in expected.items():
                    rows = own.encoded_rows(step)  # the engine's rows (jax cannot run in this child)
                    if not np.array_equal(rows >> 1, targets):
                        results.put(f"step {step} differs")
                        return
                own.close()
                left = [t.name for t in threading.enumerate() if t.name.startswith("asyncflat")]
                results.put("ok" if not left else f"threads left: {left}")
            except BaseException as exc:
                results.put(repr(exc))

        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        process = ctx.Process(target=child, args=(results,))
        process.start()
        print(results.get(timeout=60), flush=True)
        process.join(30)
        print("exit", process.exitcode, flush=True)
        for step, targets in expected.items():  # the parent's loader is unaffected
            assert np.array_equal(np.asarray(parent.load(step).targets), targets)
        parent.close()
        print("parent ok", flush=True)
    """
    result = run_script(script, dataset, timeout=150)
    assert result.stdout.split("\n")[:3] == ["ok", "exit 0", "parent ok"], (
        result.stdout,
        result.stderr,
    )
    assert result.returncode == 0, result.stderr


# -- threads --------------------------------------------------------------------------------------


def test_two_loaders_iterated_from_two_threads_at_once(dataset: str) -> None:
    jobs = [
        ("train", params(dataset, seed=1, packing=True), TokenBatchParams(len=16, batch=8)),
        (
            "validation",
            params(dataset, seed=2, packing=False, streams=1),
            TokenBatchParams(len=32, batch=4),
        ),
    ]
    errors: list[BaseException] = []
    counts = [0, 0]
    start = threading.Barrier(len(jobs))

    def work(index: int) -> None:
        split, p, batch = jobs[index]
        expected = oracle(dataset, p, batch, split)
        try:
            with ShufflingLoader(
                split, p, batch, SINGLE, options=EngineOptions(prefetch_to_device=1)
            ) as loader:
                start.wait(10)
                for step, got in loader.iter():
                    targets, starts = expected.batch(step)
                    np.testing.assert_array_equal(
                        np.asarray(got.targets), targets, err_msg=f"{split} {step}"
                    )
                    np.testing.assert_array_equal(np.asarray(got.is_seq_start), starts)
                    counts[index] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert all(c > 10 for c in counts), counts
    assert not library_threads()


def test_one_loader_shared_by_threads_gives_each_the_right_batch(dataset: str) -> None:
    p = params(dataset, seed=4)
    expected = oracle(dataset, p)
    errors: list[BaseException] = []
    with ShufflingLoader("train", p, BATCH, SINGLE) as loader:

        def work(steps: list[int]) -> None:
            try:
                for step in steps:
                    np.testing.assert_array_equal(
                        np.asarray(loader.load(step).targets), expected.batch(step)[0]
                    )
            except BaseException as exc:
                errors.append(exc)

        order = np.random.default_rng(0).permutation(loader.step_count).tolist()
        threads = [threading.Thread(target=work, args=(order[i::3],)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors


# -- many cycles: threads, descriptors and buffers come back without the garbage collector -------


def _buffers(loader: ShufflingLoader) -> list[Any]:
    """Weak references to the loader's shuffle buffers: the (seqs_per_buffer, len) uint32 arrays
    reachable from the loader object, found by walking the object graph as a memory profiler
    would (modules, classes and functions are not followed: they lead to everything)."""
    import types
    import weakref

    shape = (loader.plan.seqs_per_buffer, loader.plan.seq_len)
    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)
    seen: set[int] = set()
    stack: list[Any] = [loader]
    refs = []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            if obj.base is None and obj.shape == shape and obj.dtype == np.uint32:
                refs.append(weakref.ref(obj))
            continue
        stack.extend(gc.get_referents(obj))
    assert refs, "the loader allocated no buffer"
    return refs


def _loop_catcher(loops: list[Any]) -> Any:
    """A ``store_wrapper`` that notes the loop it is called on (the loader's engine loop)."""

    def wrap(store: Any) -> Any:
        loops.append(asyncio.get_running_loop())
        return store

    return wrap


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_hundreds_of_cycles_free_threads_descriptors_and_buffers_without_gc(dataset: str) -> None:
    """Closed loaders that stay referenced, loaders closed from another thread, and loaders
    dropped in a reference cycle that the collector finds on their own loop thread (their
    ``__del__`` runs there, where ``close()`` cannot join its own thread): all of them free
    every buffer at once and stop every thread, without a garbage collection of the test's."""
    p = params(dataset)
    options = EngineOptions(prefetch_to_device=1)
    with ShufflingLoader("train", p, BATCH, SINGLE, options=options) as warm:
        next(warm.iter(2))  # jax, zarr and numcodecs open what they keep for the process
    gc.collect()
    fds, threads = open_fds(), threading.active_count()
    kept: list[ShufflingLoader] = []  # closed loaders a trainer still references
    dead: list[Any] = []
    gc.disable()
    try:
        for i in range(120):
            loops: list[Any] = []  # the engine loop, to run the collector on (i % 3 == 0)
            wrap = _loop_catcher(loops) if i % 3 == 0 else None
            loader = ShufflingLoader("train", p, BATCH, SINGLE, options=options, store_wrapper=wrap)
            loader.load(i % 7)
            if i % 4 == 0:
                iterator = loader.iter(i % 5)
                next(iterator)  # a device-prefetch thread is running
            refs = _buffers(loader)
            if i % 3 == 0:
                loader.self = loader  # type: ignore[attr-defined]  # only the collector frees it
                del loader
                if i % 4 == 0:
                    del iterator
                    # the iterator's finalizer stopped its thread; the loader is in a cycle
                # The cyclic collector runs on whichever thread allocates: here the loop's own.
                # (It returns before the scheduled shutdown ends, so wait for it below.)
                run_on = asyncio.run_coroutine_threadsafe(_collect_on_the_loop(), loops[0])
                run_on.result(15)
            elif i % 3 == 1:
                closer = threading.Thread(target=loader.close)
                closer.start()
                closer.join(15)
                kept.append(loader)
            else:
                loader.close()
                loader.close()  # idempotent
                kept.append(loader)
            assert wait_until(lambda refs=refs: all(r() is None for r in refs), 5), (
                f"cycle {i}: buffers still alive after close"
            )
            dead.extend(refs)
            assert wait_until(lambda: not library_threads(), 5), (i, library_threads())
    finally:
        gc.enable()
    assert all(r() is None for r in dead)
    assert wait_until(lambda: open_fds() <= fds, 5), (fds, sorted(os.listdir("/proc/self/fd")))
    assert threading.active_count() == threads
    for loader in kept[:3]:
        with pytest.raises(LoaderClosedError):
            loader.stats()


async def _collect_on_the_loop() -> None:
    gc.collect()


# -- Ctrl-C on next(iter), exit with loads in flight, every method after fork -----------------------


@pytest.mark.parametrize(
    ("where", "fire_at"),
    [("forget", 5), ("count_delivered", 5), ("pin_move", 5), ("last_release", 1)],
)
def test_a_ctrl_c_after_next_took_its_batch_leaves_that_batch_to_the_next_next(
    dataset: str, where: str, fire_at: int
) -> None:
    """A Ctrl-C can land anywhere in ``next()``, also after the batch was taken from the
    device-prefetch thread (as the builder is told to forget it, counting it, moving the
    iterator's pin, releasing the builder at the last step). The next ``next()`` then returns
    that same step, counted once: it hung when the builder had already forgotten the step (or
    never did, its depth then full for good), and skipped it once the iterator had moved on."""
    script = """
        import signal, sys, threading, jax, numpy as np
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell ignores it
        from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
        from asyncflat.loader.shared.background import BackgroundBuilder
        from asyncflat.loader.shared.lifecycle import Lifecycle
        from asyncflat.loader.shared.serving import Pin
        path, where, fire_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
        params = FlatTokensParams(path, 2, 2, 4, 0, True)
        batch = TokenBatchParams(len=16, batch=8)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        with ShufflingLoader("train", params, batch, device,
                             options=EngineOptions(prefetch_to_device=0)) as reference:
            expected = [np.asarray(reference.load(s).targets) for s in range(reference.step_count)]
        cls, name = {"forget": (BackgroundBuilder, "forget"),
                     "count_delivered": (Lifecycle, "count_delivered"), "pin_move": (Pin, "move"),
                     "last_release": (Lifecycle, "stop_prefetch")}[where]
        real, calls = getattr(cls, name), [0]
        def interrupted(self, *args):
            if threading.current_thread() is threading.main_thread():
                calls[0] += 1
                if calls[0] == fire_at and where in ("forget", "count_delivered"):
                    signal.raise_signal(signal.SIGINT)  # a Ctrl-C as it is called
            result = real(self, *args)
            if calls[0] == fire_at and where in ("pin_move", "last_release"):
                signal.raise_signal(signal.SIGINT)  # a Ctrl-C right after it
            return result
        setattr(cls, name, interrupted)
        loader = ShufflingLoader("train", params, batch, device,
                                 options=EngineOptions(prefetch_to_device=1))
        iterator, served, interrupts = loader.iter(0), [], 0
        while True:
            try:
                step, got = next(iterator)
            except StopIteration:
                break
            except KeyboardInterrupt:
                interrupts += 1
                continue
            assert np.array_equal(np.asarray(got.targets), expected[step]), step
            served.append(step)
        delivered = loader.interval_stats().steps_loaded
        loader.close()
        assert served == list(range(len(expected))), served
        assert delivered == len(expected), delivered
        print("interrupts", interrupts, "served", len(served), flush=True)
    """
    result = run_script(script, dataset, where, str(fire_at), timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("interrupts 1 served "), result.stdout


def test_a_ctrl_c_while_a_loop_thread_comes_up_leaves_no_thread(dataset: str) -> None:
    """A Ctrl-C while a loader's construction waits for its event-loop thread to come up: the
    construction raises KeyboardInterrupt and the thread, already running, stops (no loop was
    known to close() yet, and it ran for the rest of the process)."""
    script = """
        import asyncio, signal, sys, threading, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell ignores it
        from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams
        main, real, fired = threading.main_thread().ident, asyncio.set_event_loop, []
        def interrupting(loop):
            if not fired and threading.current_thread().name.startswith("asyncflat-loop"):
                fired.append(1)
                signal.pthread_kill(main, signal.SIGINT)  # construction waits for this thread
                time.sleep(0.2)
            real(loop)
        asyncio.set_event_loop = interrupting
        try:
            ShufflingLoader("train", FlatTokensParams(sys.argv[1], 2, 2, 4, 0, True),
                            TokenBatchParams(len=16, batch=8))
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                t.name.startswith("asyncflat") for t in threading.enumerate()):
            time.sleep(0.02)
        print([t.name for t in threading.enumerate() if t.name.startswith("asyncflat")])
    """
    result = run_script(script, dataset, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["interrupted", "[]"], result.stdout


def test_ctrl_c_during_next_of_an_iterator_is_prompt_and_the_iterator_goes_on(
    dataset: str,
) -> None:
    """SIGINT while ``next()`` waits for a device-prefetch thread blocked on slow storage: the
    KeyboardInterrupt arrives within a second (the wait is sliced, and the iterator does not
    join its thread), and the same iterator then returns the next step."""
    script = """
        import signal, sys, time, jax, numpy as np
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell ignores it
        sys.path.insert(0, sys.argv[2])
        from reference_impl import ReferenceLoader, load_split_arrays
        from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
        from asyncflat.testing.faults import FaultyStore
        stores = []
        def slow(store):
            stores.append(FaultyStore(store, fault_keys="train/encoded_tokens/c/*"))
            return stores[-1]
        params = FlatTokensParams(sys.argv[1], 2, 2, 4, 0, True)
        batch = TokenBatchParams(len=16, batch=8)
        loader = ShufflingLoader("train", params, batch,
                                 jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                                 options=EngineOptions(prefetch_to_device=2), store_wrapper=slow)
        tokens, starts = load_split_arrays(sys.argv[1], "train")
        oracle = ReferenceLoader(tokens, starts, seq_len=16, batch=8, streams=2,
                                 read_blocks_per_shuffle_buffer=2, sequences_per_read_block=4,
                                 seed=0, sequence_packing=True)
        next(loader.iter(0))  # jax warmed up
        stores[0].configure(latency_s=5)
        it = loader.iter(40)  # its build thread now waits 5 s on storage
        print("blocking", flush=True)
        try:
            next(it)
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        stores[0].configure(latency_s=0)
        step, got = next(it)  # the same iterator: the step it was interrupted on
        assert step == 40, step
        assert np.array_equal(np.asarray(got.targets), oracle.batch(40)[0])
        step, got = next(it)
        assert step == 41 and np.array_equal(np.asarray(got.targets), oracle.batch(41)[0])
        print("continued", step, flush=True)
        loader.close()
    """
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    lines: queue.Queue[tuple[str, float]] = queue.Queue()
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), dataset, str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as child:

        def read() -> None:
            assert child.stdout is not None
            for line in child.stdout:
                lines.put((line.strip(), time.monotonic()))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            assert lines.get(timeout=90)[0] == "blocking"
            time.sleep(0.4)  # inside next(): the build thread's reads sleep for 5 s
            sent = time.monotonic()
            child.send_signal(signal.SIGINT)
            line, at = lines.get(timeout=10)
            assert line == "interrupted" and at - sent < 1.0, (line, at - sent)
            assert lines.get(timeout=30)[0] == "continued 41"
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            reader.join(5)
        assert child.stderr is not None
        stderr = child.stderr.read()
    assert child.returncode == 0, stderr


def test_exit_with_loads_in_flight_prints_nothing(dataset: str) -> None:
    """Threads blocked in load() and an iterator's build thread, all on slow storage, when the
    interpreter exits: no traceback, no CancelledError, no asyncio complaint on stderr."""
    script = """
        import sys, threading, time, jax
        from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
        from asyncflat.testing.faults import FaultyStore
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        slow = lambda s: FaultyStore(s, latency_s=30, fault_keys="train/encoded_tokens/c/*")
        loader = ShufflingLoader("train", FlatTokensParams(sys.argv[1], 2, 2, 4, 3, True),
                                 TokenBatchParams(len=16, batch=8), one,
                                 options=EngineOptions(prefetch_to_device=2), store_wrapper=slow)
        for step in (5, 40, 80):
            threading.Thread(target=loader.load, args=(step,), daemon=True).start()
        it = loader.iter(20)
        time.sleep(0.5)
        print("bye", flush=True)
    """
    t0 = time.monotonic()
    result = run_script(script, dataset, timeout=90)
    assert result.returncode == 0 and result.stdout.strip() == "bye", result.stderr
    assert time.monotonic() - t0 < 60
    for noise in ("Traceback", "CancelledError", "Task was destroyed", "Exception"):
        assert noise not in result.stderr, result.stderr


def test_every_method_of_a_loader_refuses_to_run_in_a_forked_child(dataset: str) -> None:
    script = """
        import os, sys, warnings
        warnings.simplefilter("ignore")  # jax warns that fork and threads do not mix
        import jax
        from asyncflat import FlatTokensParams, LoaderClosedError, ShufflingLoader, TokenBatchParams
        loader = ShufflingLoader("train", FlatTokensParams(sys.argv[1], 2, 2, 4, 0, True),
                                 TokenBatchParams(len=16, batch=8),
                                 jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        loader.load(0)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            out = []
            calls = {"load": lambda: loader.load(1), "iter": lambda: loader.iter(0),
                     "stats": loader.stats, "interval_stats": loader.interval_stats,
                     "__iter__": lambda: next(iter(loader)), "encoded_rows": lambda: loader.encoded_rows(2)}
            for name, call in calls.items():
                try:
                    call()
                    out.append(f"{name}: ran")
                except LoaderClosedError as exc:
                    out.append(f"{name}: closed" if "another process" in str(exc) else repr(exc))
                except BaseException as exc:
                    out.append(f"{name}: {exc!r}")
            loader.close()  # allowed: it touches nothing of the parent's
            os.write(write, "\\n".join(out).encode())
            os._exit(0)
        os.close(write)
        child = b""
        while chunk := os.read(read, 4096):
            child += chunk
        os.waitpid(pid, 0)
        print(child.decode())
        loader.load(1)  # the parent's loader still works
        loader.close()
    """
    result = run_script(script, dataset, timeout=90)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines == [
        f"{name}: closed"
        for name in ("load", "iter", "stats", "interval_stats", "__iter__", "encoded_rows")
    ], result.stdout


def test_a_close_failing_at_interpreter_shutdown_prints_nothing(dataset: str) -> None:
    """A loader left open whose ``close()`` fails when it is collected at shutdown, once the
    module's globals are torn down (its ``log`` is None by then): the finalizer swallows it, no
    ``AttributeError`` from ``__del__``, no "Exception ignored" on stderr. Before, ``__del__``
    logged the failure through the module's ``log`` and raised AttributeError."""
    script = """
        import atexit, sys, jax
        import asyncflat.loader.shared.lifecycle as lifecycle
        from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        loader = ShufflingLoader("train", FlatTokensParams(sys.argv[1], 2, 2, 4, 3, True),
                                 TokenBatchParams(len=16, batch=8), one)
        loader.load(0)
        real_close = lifecycle.Lifecycle.close

        def failing_close(self):
            real_close(self)
            raise RuntimeError("close failed at shutdown")

        lifecycle.Lifecycle.close = failing_close

        def tear_down():  # what interpreter shutdown does to a module's globals
            lifecycle.log = None

        atexit.register(tear_down)  # runs after the library's own exit hook (LIFO)
        print("bye", flush=True)
    """
    result = run_script(script, dataset, timeout=90)
    assert result.returncode == 0 and result.stdout.strip() == "bye", result.stderr
    for noise in ("AttributeError", "Exception ignored", "Traceback"):
        assert noise not in result.stderr, result.stderr


def test_a_builder_its_dropped_iterator_stopped_on_the_loop_is_joined_by_close(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dropped iterator's builder is stopped on the loop's thread, which must not wait for it
    (its build may wait on that loop). ``close()`` joins it later: when close returns, no
    thread of the loader is left, not even a builder still inside a slow batch build."""
    from asyncflat.loader.shared.batch import BatchBuilder

    build = BatchBuilder.build
    building = threading.Event()

    def slow_build(self: BatchBuilder, rows: np.ndarray) -> Any:
        if threading.current_thread().name.startswith("asyncflat-device-prefetch"):
            building.set()
            time.sleep(0.5)  # a slow host-to-device copy
        return build(self, rows)

    monkeypatch.setattr(BatchBuilder, "build", slow_build)
    loader = ShufflingLoader(
        "train", params(dataset), BATCH, SINGLE, options=EngineOptions(prefetch_to_device=1)
    )
    iterator = loader.iter(0)
    assert building.wait(10)
    del iterator  # the finalizer queues the builder's release on the loop
    time.sleep(0.05)  # the loop has run it: the builder is told to stop, not joined
    assert any(name.startswith("asyncflat-device-prefetch") for name in library_threads())
    loader.close()
    assert library_threads() == []


def _timed_collection(collected: list[float]) -> None:
    t0 = time.monotonic()
    gc.collect()
    collected.append(time.monotonic() - t0)


def _collected_on_its_own_thread(
    make: Callable[[], Any], dropped: threading.Event, collected: list[float], wait_s: float
) -> None:
    """Drop the loader ``make`` builds in a reference cycle, the collector off, and set
    ``dropped``: a hook of the test then runs :func:`_timed_collection` on one of the loader's
    own threads. That collection (which closes the loader) must take under 5 s, and every
    thread of the loader must end."""
    gc.disable()  # the hook's collection is the one that finds the dropped loader
    try:
        cycle: list[Any] = [make()]
        cycle.append(cycle)
        del cycle
        dropped.set()
        assert wait_until(lambda: bool(collected), wait_s), "the hook's collection never ran"
    finally:
        gc.enable()
    assert collected[0] < 5, collected
    assert wait_until(lambda: not library_threads(), 10), library_threads()


@pytest.mark.parametrize("kind", ["plain", "mixture"])
def test_a_loader_closed_on_one_of_its_own_pool_threads_does_not_wait_for_itself(
    tmp_path_factory: pytest.TempPathFactory, kind: str
) -> None:
    """A loader dropped in a reference cycle is closed by the garbage collector, on whatever
    thread allocates: one of its own loop's pool threads too (a decode job). Its loop's thread
    waits for the pool's jobs as it ends, so close() there must not wait for the loop's thread:
    it did, and both waited 15 s for each other. Here the collection runs as a store read's
    job on the loader's own CPU pool (``asyncio.to_thread``)."""
    path = random_store(tmp_path_factory, "pool-close", 3, 600, validation=30, chunk_tokens=500)
    dropped = threading.Event()
    collected: list[float] = []

    class CollectingStore(FaultyStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            await asyncio.sleep(0.2)
            if dropped.is_set() and not collected:
                await asyncio.to_thread(_timed_collection, collected)
            return await super().get(key, prototype, byte_range)

    flat = FlatTokensParams(path, 1, 2, 8, seed=1, sequence_packing=True)
    params: Any = flat if kind == "plain" else MixtureParams((MixtureSource(flat, 1.0),), steps=20)

    def make() -> ShufflingLoader:
        loader = ShufflingLoader(
            "train",
            params,
            TokenBatchParams(len=16, batch=8),
            SINGLE,
            options=EngineOptions(prefetch_to_device=0),
            store_wrapper=CollectingStore if kind == "plain" else (CollectingStore,),
        )
        loader.load(0)  # its next minipoch then fills in the background, through the wrapper
        return loader

    _collected_on_its_own_thread(make, dropped, collected, 20)


def test_a_loader_closed_on_its_block_orders_thread_does_not_wait_for_itself(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same as a pool thread, on the thread that computes the plan's block order (joined
    as the engine closes): a loader dropped in a cycle and collected there waited 15 s."""
    from asyncflat.plan.shuffle import ShufflePlan

    path = random_store(tmp_path_factory, "plan-close", 3, 600, validation=30, chunk_tokens=500)
    dropped = threading.Event()
    collected: list[float] = []
    compute = ShufflePlan.compute_block_order

    def collecting(self: ShufflePlan, stop: Any = None, out: Any = None) -> Any:
        if threading.current_thread().name == "asyncflat-plan" and not collected:
            dropped.wait(10)
            _timed_collection(collected)
        return compute(self, stop, out)

    monkeypatch.setattr(ShufflePlan, "compute_block_order", collecting)
    _collected_on_its_own_thread(
        lambda: ShufflingLoader(
            "train",
            FlatTokensParams(path, 1, 2, 8, seed=1, sequence_packing=True),
            TokenBatchParams(len=16, batch=8),
            SINGLE,
            options=EngineOptions(prefetch_to_device=0),
        ),
        dropped,
        collected,
        40,
    )
