"""Device prefetch: ``iter()`` keeps the next ``EngineOptions.prefetch_to_device`` steps built.

Single process, 8 CPU devices (tests/conftest.py). The background thread is named
``asyncflat-device-prefetch-N``; it must stop with the iterator (closed, exhausted or collected)
and with ``close()``, and its errors surface from ``next()``. Builds are observed (counted, slowed,
failed) through the public ``batch_type=`` hook, which the loader calls once per built batch, in
step order; the generic builder itself is tested in test_background.py.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat
from asyncflat import (
    EngineOptions,
    FlatTokensParams,
    LoaderClosedError,
    ShufflingLoader,
    TokenBatch,
    TokenBatchParams,
)

SEQ_LEN, BATCH, STREAMS, RBPSB, SPB, SEED = 16, 16, 2, 3, 8, 3


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(9)
    seqs = [rng.integers(0, 1000, rng.integers(1, 41)) for _ in range(600)]
    path = str(tmp_path_factory.mktemp("prefetch") / "data.zarr")
    asyncflat.write_flat_tokens(
        path, {"train": seqs, "validation": seqs[:20]}, chunk_tokens=SPB * SEQ_LEN
    )
    return path


@pytest.fixture(scope="module")
def oracle(dataset: str) -> ReferenceLoader:
    tokens, starts = load_split_arrays(dataset, "train")
    return ReferenceLoader(
        tokens,
        starts,
        seq_len=SEQ_LEN,
        batch=BATCH,
        streams=STREAMS,
        read_blocks_per_shuffle_buffer=RBPSB,
        sequences_per_read_block=SPB,
        seed=SEED,
        sequence_packing=True,
    )


def _loader(
    dataset: str, depth: int, batch_type: Callable[..., Any] = TokenBatch
) -> ShufflingLoader:
    params = FlatTokensParams(dataset, STREAMS, RBPSB, SPB, SEED, True)
    return ShufflingLoader(
        "train",
        params,
        TokenBatchParams(len=SEQ_LEN, batch=BATCH),
        options=EngineOptions(prefetch_to_device=depth),
        batch_type=batch_type,
    )


class Hook:
    """A ``batch_type`` that counts builds and can slow, fail or block the n-th one."""

    def __init__(self, *, sleep_s: float = 0.0) -> None:
        self.builds = 0
        self.sleep_s = sleep_s
        self.fail_build: int | None = None  # 1-based build number to fail
        self.block_build: int | None = None
        self.entered = threading.Event()

    def __call__(self, **fields: Any) -> TokenBatch:
        self.builds += 1
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.builds == self.fail_build:
            raise asyncflat.StorageError(f"injected failure at build {self.builds}")
        if self.builds == self.block_build:
            self.entered.set()
            time.sleep(0.3)
        return TokenBatch(**fields)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncflat-device-prefetch-")]


def _assert_batch(batch: asyncflat.TokenBatch, oracle: ReferenceLoader, step: int) -> None:
    targets, is_start = oracle.batch(step)
    np.testing.assert_array_equal(np.asarray(batch.targets), targets, err_msg=f"step {step}")
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), is_start, err_msg=f"step {step}")


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_iter_matches_oracle_and_leaves_no_thread(
    dataset: str, oracle: ReferenceLoader, depth: int
) -> None:
    with _loader(dataset, depth) as loader:
        start = 4  # mid-minipoch (3 steps per minipoch)
        iterator = loader.iter(start)
        steps = []
        for step, batch in iterator:
            if depth:
                # one thread at most; it may already have built the last step and exited
                assert len(_prefetch_threads()) <= 1
            else:
                assert not _prefetch_threads()
            _assert_batch(batch, oracle, step)
            steps.append(step)
        assert steps == list(range(start, loader.step_count))
        assert not _prefetch_threads()  # exhausted: the thread has been joined
        with pytest.raises(StopIteration):
            next(iterator)


def test_next_steps_are_built_ahead_and_load_returns_them(
    dataset: str, oracle: ReferenceLoader
) -> None:
    hook = Hook()
    with _loader(dataset, 2, hook) as loader:
        iterator = loader.iter(0)
        step, first = next(iterator)
        deadline = time.monotonic() + 10
        while hook.builds != 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert hook.builds == 3  # steps 1 and 2 built while the trainer holds step 0
        time.sleep(0.05)
        assert hook.builds == 3  # and no further than prefetch_to_device
        ahead = loader.load(2)  # a prefetched step: the same arrays, not a second build
        assert hook.builds == 3
        assert next(iterator)[1] is not ahead
        step, batch = next(iterator)
        assert step == 2 and batch is ahead
        _assert_batch(batch, oracle, 2)
        assert loader.load(0) is not first  # not prefetched any more: built again, equal
        _assert_batch(loader.load(0), oracle, 0)
        iterator.close()
        assert not _prefetch_threads()


def test_next_returns_at_once_under_a_train_step(dataset: str) -> None:
    build_s, train_s = 0.15, 0.3
    # a slow hand-off; it sleeps, so the timing holds on a busy machine
    with _loader(dataset, 1, Hook(sleep_s=build_s)) as loader:
        iterator = loader.iter(0)
        next(iterator)
        waits = []
        for _ in range(3):
            time.sleep(train_s)  # the train step
            t0 = time.perf_counter()
            next(iterator)
            waits.append(time.perf_counter() - t0)
        iterator.close()
    assert max(waits) < build_s / 2, waits


def test_build_error_surfaces_from_next(dataset: str, oracle: ReferenceLoader) -> None:
    hook = Hook()
    hook.fail_build = 3  # iter(1) builds steps 1, 2, 3: the third build is step 3
    with _loader(dataset, 1, hook) as loader:
        iterator = loader.iter(1)
        assert [next(iterator)[0], next(iterator)[0]] == [1, 2]
        with pytest.raises(asyncflat.StorageError, match="injected failure at build 3"):
            next(iterator)
        with pytest.raises(StopIteration):  # an error ends the iteration
            next(iterator)
        assert not _prefetch_threads()
        _assert_batch(loader.load(3), oracle, 3)  # the loader itself is fine


def test_dropped_iterator_stops_its_thread(dataset: str) -> None:
    with _loader(dataset, 1) as loader:
        iterator: Iterator = loader.iter(0)
        next(iterator)
        assert len(_prefetch_threads()) == 1
        del iterator
        gc.collect()
        # the collected iterator's release runs on the loop's thread (never on the collecting
        # one, which may hold the engine's lock): its thread ends soon after, not at once
        deadline = time.monotonic() + 10
        while _prefetch_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _prefetch_threads()
        # __iter__ (batches only) closes its iterator when the generator is closed
        batches = iter(loader)
        next(batches)
        assert len(_prefetch_threads()) == 1
        batches.close()  # type: ignore[attr-defined]
        assert not _prefetch_threads()


def test_close_stops_threads_and_next_fails(dataset: str) -> None:
    loader = _loader(dataset, 2)
    iterators = [loader.iter(0), loader.iter(5)]
    for iterator in iterators:
        next(iterator)
    assert len(_prefetch_threads()) == 2
    loader.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncflat")]
    for iterator in iterators:
        with pytest.raises(LoaderClosedError):
            next(iterator)
    with pytest.raises(LoaderClosedError):
        loader.iter(0)


def test_close_while_a_build_waits(dataset: str) -> None:
    """close() from another thread while the prefetch thread is inside a build."""
    hook = Hook()
    hook.block_build = 2  # step 1
    loader = _loader(dataset, 1, hook)
    iterator = loader.iter(0)
    next(iterator)
    assert hook.entered.wait(10)
    loader.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncflat")]
    with pytest.raises(LoaderClosedError):
        next(iterator)


def test_prefetch_to_device_option_is_validated() -> None:
    with pytest.raises(asyncflat.ConfigError, match="prefetch_to_device"):
        EngineOptions(prefetch_to_device=-1)
    assert EngineOptions().prefetch_to_device == 1
