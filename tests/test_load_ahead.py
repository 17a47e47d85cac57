"""Consecutive ``load(step)`` calls get their next batches built ahead on a background thread.

* after a loader's first load a builder runs; the next loads take its batches, which equal
  the reference's, and are built on its thread, not the trainer's;
* a jump retires it (batches still right), and two consecutive loads start a new one; an
  ``iter()`` retires it too (the iterator builds its own);
* ``load_ahead=False`` or ``prefetch_to_device=0`` never start one;
* a background build's error is raised by the ``load()`` of its step; the next load retries;
* several threads loading the same steps get the right batches, none waits forever;
* a dropped loader is still collected (the builder holds it weakly) and its threads stop;
  ``close()`` after jumps leaves no thread.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from conftest import oracle, random_store
from helpers.resources import library_threads, wait_until

import asyncflat
from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams

pytestmark = pytest.mark.timeout(180)

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
BATCH = TokenBatchParams(len=16, batch=8)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return random_store(tmp_path_factory, "load-ahead", 11, 400, validation=50, chunk_tokens=1024)


def params(path: str) -> FlatTokensParams:
    return FlatTokensParams(path, 2, 2, 4, 3, True)


def expected(path: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    batch = oracle(path, params(path), BATCH).batch(step)
    return np.asarray(batch[0]), np.asarray(batch[1])


#: A train step: long enough for the tiny fills here to finish, so that the builder (which
#: builds only steps whose rows are all in finished buffers) finds every next step ready.
STEP_S = 0.03


def train(loader: Any, steps: Any, path: str | None = None) -> None:
    for step in steps:
        batch = loader.load(step)
        if path is not None:
            check(path, batch, step)
        time.sleep(STEP_S)


def check(path: str, batch: Any, step: int) -> None:
    targets, starts = expected(path, step)
    np.testing.assert_array_equal(np.asarray(batch.targets), targets, err_msg=f"step {step}")
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), starts, err_msg=f"step {step}")


def builder_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("asyncflat-device-")]


Built = list[tuple[int, str]]


def recording(
    want: list[np.ndarray], fail: Callable[[int], bool] = lambda step: False
) -> tuple[Callable[..., asyncflat.TokenBatch], Built]:
    """A batch type that records (step, thread name) of every batch the loader builds (the
    step known by its targets, ``want[step]``), and raises where ``fail(step)`` says."""
    built: Built = []
    steps = {targets.tobytes(): step for step, targets in enumerate(want)}

    def batch_type(*, targets: jax.Array, is_seq_start: jax.Array) -> asyncflat.TokenBatch:
        step = steps[np.asarray(targets).tobytes()]
        if fail(step):
            raise OSError(f"injected: step {step} cannot be built")
        built.append((step, threading.current_thread().name))
        return asyncflat.TokenBatch(targets, is_seq_start)

    return batch_type, built


def targets_of(path: str, steps: int = 40) -> list[np.ndarray]:
    return [expected(path, step)[0] for step in range(steps)]


def builders(built: Built, prefix: str = "asyncflat-device-prefetch-") -> set[str]:
    """The load-ahead builders that built a batch (each runs on its own thread)."""
    return {name for _, name in built if name.startswith(prefix)}


def test_consecutive_loads_take_batches_built_on_a_background_thread(dataset: str) -> None:
    batch_type, built = recording(targets_of(dataset))
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, batch_type=batch_type) as loader:
        me = threading.current_thread().name
        train(loader, range(12), dataset)
        assert len(builders(built)) == 1
        mine = [s for s, name in built if name == me]
        assert mine == [0]  # the first load; the rest were built ahead
        ahead = sorted(s for s, name in built if name.startswith("asyncflat-device-prefetch-"))
        assert ahead[:11] == list(range(1, 12))
        assert loader.stats().steps_loaded == 12  # what the trainer got, not what was built


def test_a_jump_retires_the_builder_and_consecutive_loads_start_a_new_one(dataset: str) -> None:
    batch_type, built = recording(targets_of(dataset))
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, batch_type=batch_type) as loader:
        train(loader, (0, 1, 2, 3, 9, 10, 11, 4), dataset)
        me = threading.current_thread().name
        # 0 by the trainer (the first load); 1-3 ahead; 9 and 10 by the trainer (the jump,
        # then the load that shows the pattern again); 11 ahead; 4 by the trainer again
        assert [s for s, name in built if name == me] == [0, 9, 10, 4]
        assert len(builders(built)) == 2
        assert wait_until(lambda: len(builder_threads()) == 0)  # 4 was a jump: retired
    assert library_threads() == []


def test_an_iterator_retires_the_load_ahead_builder(dataset: str) -> None:
    """``iter_epochs`` loads step 0 and then iterates from step 1: the load-ahead builder the
    first load started must not keep building (and holding) the iterator's steps beside it."""
    batch_type, built = recording(targets_of(dataset))
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, batch_type=batch_type) as loader:
        check(dataset, loader.load(0), 0)
        assert wait_until(lambda: any(s == 1 for s, _ in built))  # built ahead of a load(1)
        (load_ahead,) = builders(built)
        with loader.iter(1) as iterator:
            for step, batch in itertools.islice(iterator, 6):
                check(dataset, batch, step)
                time.sleep(STEP_S)
            assert wait_until(lambda: load_ahead not in builder_threads())
            assert len(builder_threads()) == 1  # the iterator's
        assert [s for s, name in built if name == load_ahead] == [1]
    assert library_threads() == []


@pytest.mark.parametrize(
    "options", [EngineOptions(load_ahead=False), EngineOptions(prefetch_to_device=0)]
)
def test_load_ahead_can_be_turned_off(dataset: str, options: EngineOptions) -> None:
    batch_type, built = recording(targets_of(dataset))
    with ShufflingLoader(
        "train", params(dataset), BATCH, SINGLE, options=options, batch_type=batch_type
    ) as loader:
        for step in range(5):
            check(dataset, loader.load(step), step)
            time.sleep(STEP_S)
        assert not builders(built) and not builder_threads()
        assert [s for s, _ in built] == list(range(5))


def test_a_failed_background_build_raises_from_the_load_of_its_step(dataset: str) -> None:
    """As iter() does: the error of building that step (building it again would make the
    trainer wait out a deadline twice); the next load of the step builds it afresh."""
    failed: Built = []

    def fail(step: int) -> bool:
        name = threading.current_thread().name
        if step == 3 and name.startswith("asyncflat-device-"):
            failed.append((step, name))
            return True
        return False

    batch_type, built = recording(targets_of(dataset), fail)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, batch_type=batch_type) as loader:
        train(loader, range(3), dataset)
        with pytest.raises(OSError, match="step 3 cannot be built"):
            loader.load(3)
        assert [step for step, _ in failed] == [3]
        for step in range(3, 6):
            check(dataset, loader.load(step), step)
            time.sleep(STEP_S)
        # the failure ended the first builder; the loads of 3 and 4 started a second one
        assert len(builders(built + failed)) == 2


def test_a_load_that_fails_raises_its_own_error(dataset: str) -> None:
    batch_type, _ = recording(targets_of(dataset), lambda step: step == 3)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, batch_type=batch_type) as loader:
        for step in range(3):
            loader.load(step)
        with pytest.raises(OSError, match="step 3 cannot be built"):
            loader.load(3)
        check(dataset, loader.load(4), 4)


def test_threads_loading_the_same_steps_get_the_right_batches(dataset: str) -> None:
    with ShufflingLoader(
        "train", params(dataset), BATCH, SINGLE, options=EngineOptions(prefetch_to_device=2)
    ) as loader:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                for step in range(16):
                    check(dataset, loader.load(step), step)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a load never returned"
        assert not errors, errors


def test_a_dropped_loader_with_a_builder_is_collected_and_its_threads_stop(
    dataset: str,
) -> None:
    loader = ShufflingLoader("train", params(dataset), BATCH, SINGLE)
    for step in range(4):
        loader.load(step)
    assert builder_threads()
    ref = weakref.ref(loader)
    del loader
    # The builder's thread holds the loader only while a build is in flight (a CI run collected
    # during one): once that build ends, nothing keeps the loader alive.
    assert wait_until(lambda: gc.collect() >= 0 and ref() is None)
    assert wait_until(lambda: not library_threads()), library_threads()


def test_a_mixture_loader_builds_consecutive_loads_ahead_too(dataset: str) -> None:
    from asyncflat import MixtureParams, MixtureSource

    mixture = MixtureParams(
        (MixtureSource(params(dataset), 0.5), MixtureSource(params(dataset), 0.5)),
        seed=1,
        block_rows=2,
        steps=10,
    )
    plain = EngineOptions(load_ahead=False)
    with ShufflingLoader("train", mixture, BATCH, SINGLE, options=plain) as loader:
        want = []
        for step in range(10):
            want.append(np.asarray(loader.load(step).targets))
            time.sleep(STEP_S)
        assert not [t for t in library_threads() if "prefetch" in t]
    batch_type, built = recording(want)
    with ShufflingLoader("train", mixture, BATCH, SINGLE, batch_type=batch_type) as loader:
        got = []
        for step in range(10):
            got.append(np.asarray(loader.load(step).targets))
            time.sleep(STEP_S)
        assert len(builders(built, "asyncflat-mixture-prefetch-")) == 1
        me = threading.current_thread().name
        assert [s for s, name in built if name == me] == [0]
    for step, (a, b) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
    assert library_threads() == []


def test_the_builders_thread_is_started_off_the_trainers_thread(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Thread.start`` waits for the new thread, which needs the GIL the engine's threads hold
    at start-up: started inside the trainer's second load() it cost that load 1-7 ms."""
    starters: list[str] = []
    original = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith("asyncflat-device-prefetch-"):
            starters.append(threading.current_thread().name)
        original(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE) as loader:
        train(loader, range(6), dataset)
        assert len(starters) == 1 and starters[0] != threading.current_thread().name
    assert library_threads() == []
