"""Epochs: ``ShufflePlan(epoch=e)``, ``ShufflingLoader(epoch=e)`` and ``asyncflat.iter_epochs``.

Epoch 0 is seqax's order (the existing oracle and golden tests run with the default epoch 0; here
it is also checked that ``epoch=0`` changes nothing). Epoch e > 0 is the reference construction
seeded with ``seed + e * 2**64``, so the oracle for it is the reference loader with that seed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import UNSERVED_TAIL_PARAMS
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_impl import ReferenceLoader, load_split_arrays, slow_permutation
from test_plan import plans

import asyncflat
from asyncflat import ConfigError, FlatTokensParams, ShufflePlan, TokenBatchParams
from asyncflat.plan.shuffle import EPOCH_SEED_STRIDE, epoch_seed


def served_rows(plan: ShufflePlan) -> list[int]:
    """Global row ids (block * spb + row in block) in the order an epoch serves them."""
    spb = plan.sequences_per_read_block
    rows = []
    for step in range(plan.step_count):
        loc = plan.locate(step)
        for s, m, p in zip(loc.stream.tolist(), loc.minipoch.tolist(), loc.position.tolist()):
            buffer_row = int(plan.row_permutation(s, m)[p])
            block = int(plan.buffer_blocks(s, m)[buffer_row // spb])
            rows.append(block * spb + buffer_row % spb)
    return rows


def with_epoch(plan: ShufflePlan, epoch: int) -> ShufflePlan:
    return dataclasses.replace(plan, epoch=epoch)


# -- the plan ---------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(plans())
def test_epoch_0_is_the_reference_order(plan: ShufflePlan) -> None:
    assert plan.epoch == 0 and plan.epoch_seed == plan.seed
    np.testing.assert_array_equal(
        plan.block_order, slow_permutation(plan.seed, plan.read_block_count)
    )
    explicit = with_epoch(plan, 0)
    assert served_rows(explicit) == served_rows(plan)


@settings(max_examples=80, deadline=None)
@given(plans(), st.integers(1, 5))
def test_every_epoch_serves_the_same_rows_once_each(plan: ShufflePlan, epoch: int) -> None:
    rows0 = served_rows(plan)
    rows = served_rows(with_epoch(plan, epoch))
    assert len(rows) == len(set(rows)) == plan.step_count * plan.batch
    used = plan.read_block_count * plan.sequences_per_read_block
    assert all(0 <= r < used for r in rows)
    # The same blocks are read in every epoch; which tail rows of the last buffer go unserved
    # may differ, but never more of them than in epoch 0.
    assert {r // plan.sequences_per_read_block for r in rows} <= set(range(plan.read_block_count))
    assert len(rows) == len(rows0)


@settings(max_examples=60, deadline=None)
@given(plans(), st.integers(1, 1000))
def test_epoch_e_is_the_reference_construction_with_the_epoch_seed(
    plan: ShufflePlan, epoch: int
) -> None:
    later = with_epoch(plan, epoch)
    seed = plan.seed + epoch * 2**64
    assert later.epoch_seed == seed == epoch_seed(plan.seed, epoch)
    np.testing.assert_array_equal(later.block_order, slow_permutation(seed, plan.read_block_count))
    m, s = plan.minipoch_count - 1, plan.streams - 1
    np.testing.assert_array_equal(
        later.row_permutation(s, m),
        slow_permutation(seed + 1 + m * plan.streams + s, plan.rows_in_buffer(m)),
    )


def _seeds_of(plan: ShufflePlan) -> set[int]:
    base = plan.epoch_seed
    return {base} | {base + 1 + k for k in range(plan.minipoch_count * plan.streams)}


@settings(max_examples=100, deadline=None)
@given(plans(), st.integers(1, 50), st.integers(1, 50))
def test_epoch_seeds_never_collide(plan: ShufflePlan, e1: int, e2: int) -> None:
    assert not _seeds_of(plan) & _seeds_of(with_epoch(plan, e1))
    if e1 != e2:
        assert not _seeds_of(with_epoch(plan, e1)) & _seeds_of(with_epoch(plan, e2))
    # The documented bound that makes this hold for any plan: every seed of an epoch lies
    # within 2**32 of its epoch seed, and epochs are 2**64 apart.
    assert max(_seeds_of(plan)) - plan.seed <= 2**32 < EPOCH_SEED_STRIDE


def test_epochs_differ() -> None:
    params = FlatTokensParams("unused.zarr", 2, 4, 8, 7, True)
    plan = ShufflePlan.create(
        params, TokenBatchParams(len=16, batch=8), token_count=16 * 4000, sequence_count=0
    )
    orders = [served_rows(with_epoch(plan, e)) for e in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert orders[i] != orders[j]
            assert sorted(orders[i]) == sorted(orders[j])
    for e in range(1, 4):
        assert not np.array_equal(with_epoch(plan, e).block_order, plan.block_order)


@pytest.mark.parametrize("bad", [-1, True, 1.0])
def test_bad_epochs_are_config_errors(bad: object) -> None:
    params = FlatTokensParams("unused.zarr", 1, 2, 4, 0, True)
    with pytest.raises(ConfigError, match="epoch"):
        ShufflePlan.create(
            params, TokenBatchParams(len=4, batch=4), token_count=400, sequence_count=0, epoch=bad
        )  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="epoch must be >= 0"):
        epoch_seed(0, -1)


# -- loaders ----------------------------------------------------------------------------------

SEQ_LEN, BATCH, STREAMS, RBPSB, SPB, SEED = 16, 16, 2, 3, 8, 5


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(21)
    seqs = [rng.integers(1, 1000, rng.integers(1, 41)) for _ in range(500)]
    path = str(tmp_path_factory.mktemp("epochs") / "data.zarr")
    asyncflat.write_flat_tokens(
        path, {"train": seqs, "validation": seqs[:120]}, chunk_tokens=SPB * SEQ_LEN
    )
    return path


def _oracle(path: str, epoch: int, split: str = "train") -> ReferenceLoader:
    tokens, starts = load_split_arrays(path, split)
    return ReferenceLoader(
        tokens,
        starts,
        seq_len=SEQ_LEN,
        batch=BATCH,
        streams=STREAMS,
        read_blocks_per_shuffle_buffer=RBPSB,
        sequences_per_read_block=SPB,
        seed=epoch_seed(SEED, epoch),
        sequence_packing=True,
    )


def _params(path: str) -> FlatTokensParams:
    return FlatTokensParams(path, STREAMS, RBPSB, SPB, SEED, True)


def _assert_batch(batch: asyncflat.TokenBatch, oracle: ReferenceLoader, step: int) -> None:
    targets, is_start = oracle.batch(step)
    np.testing.assert_array_equal(np.asarray(batch.targets), targets, err_msg=f"step {step}")
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), is_start, err_msg=f"step {step}")


def test_loader_epoch_matches_the_oracle_with_the_epoch_seed(dataset: str) -> None:
    oracle = _oracle(dataset, 2)
    with asyncflat.ShufflingLoader(
        "train", _params(dataset), TokenBatchParams(len=SEQ_LEN, batch=BATCH), epoch=2
    ) as loader:
        assert loader.plan.epoch == 2
        for step in (5, 0, loader.step_count - 1, 3):
            _assert_batch(loader.load(step), oracle, step)


def test_iter_epochs_runs_epochs_back_to_back_and_resumes_anywhere(dataset: str) -> None:
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    oracles = {e: _oracle(dataset, e) for e in range(3)}
    seen = []
    with asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=3) as it:
        assert it.loader is None  # nothing is opened before the first next()
        for epoch, step, batch in it:
            _assert_batch(batch, oracles[epoch], step)
            assert it.loader is not None and it.loader.plan.epoch == epoch
            seen.append((epoch, step))
        assert it.loader is None
    steps = oracles[0].step_count
    assert seen == [(e, s) for e in range(3) for s in range(steps)]

    # Resume mid-epoch, and at the very end of an epoch (== the start of the next one).
    for start_epoch, start_step in ((1, 7), (0, steps)):
        with contextlib.closing(
            asyncflat.iter_epochs(
                "train",
                _params(dataset),
                batch_params,
                start_epoch=start_epoch,
                start_step=start_step,
                epochs=3,
            )
        ) as it:
            got = [(e, s) for e, s, _ in it]
        first = start_epoch * steps + start_step
        assert got == seen[first:]
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncflat-next-epoch")]


@pytest.mark.parametrize("layout", ["last-minipoch-served", "last-minipoch-in-the-unserved-tail"])
def test_iter_epochs_builds_the_next_epoch_before_the_boundary(
    dataset: str, unserved_tail: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader of epoch 1 is built, and its first step loaded, while epoch 0's last served
    minipoch is still being served: the consumer never waits for a construction at the
    boundary."""
    import asyncflat.loader.epochs as epochs_mod

    if layout == "last-minipoch-served":
        params, batch_params = _params(dataset), TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    else:
        params = FlatTokensParams(unserved_tail, *UNSERVED_TAIL_PARAMS)
        batch_params = TokenBatchParams(len=SEQ_LEN, batch=8)
    with asyncflat.ShufflingLoader("train", params, batch_params) as loader:
        plan = loader.plan
    unserved = plan.served_rows(plan.minipoch_count - 1) == 0
    assert unserved == (layout != "last-minipoch-served")
    last_minipoch_from = plan.last_minipoch_step
    assert plan.step_count - last_minipoch_from >= 2

    progress: list[tuple[int, int]] = [(-1, -1)]
    events: dict[str, tuple[int, int]] = {}

    class Recording(asyncflat.ShufflingLoader):
        def __init__(self, *args: object, **kwargs: object) -> None:
            if kwargs.get("epoch"):
                events["built"] = progress[0]
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def first_loaded(epoch: int, step: int) -> None:
        if (epoch, step) == (1, 0):
            events.setdefault("first_loaded", progress[0])

    monkeypatch.setattr(epochs_mod, "ShufflingLoader", Recording)
    _record_builds(monkeypatch, first_loaded)
    with contextlib.closing(asyncflat.iter_epochs("train", params, batch_params, epochs=2)) as it:
        for epoch, step, _ in it:
            progress[0] = (epoch, step)
            if epoch == 0 and step >= last_minipoch_from:
                time.sleep(0.3)  # the trainer's step: the builder runs meanwhile
    built, first_loaded = events["built"], events["first_loaded"]
    # Submitted as the first step of the last minipoch was handed over (progress is recorded after
    # each yield, so it still shows the step before), started long before the epoch ended.
    assert built[0] == 0 and last_minipoch_from - 1 <= built[1] < plan.step_count - 1
    assert first_loaded[0] == 0  # epoch 1's step 0 was ready before epoch 0 ended


def _record_builds(monkeypatch: pytest.MonkeyPatch, record: Callable[[int, int], None]) -> None:
    """Call ``record(epoch, step)`` after each batch a loader builds (on any thread)."""
    from asyncflat.loader.shared.lifecycle import Lifecycle
    from asyncflat.loader.shared.load_ahead import NOT_READY

    real = Lifecycle.build

    def build(self: Lifecycle[Any], step: int, *, ready_only: bool = False) -> Any:
        batch = real(self, step, ready_only=ready_only)
        if batch is not NOT_READY:
            record(self.server.engine.plan.epoch, step)
        return batch

    monkeypatch.setattr(Lifecycle, "build", build)


def test_iter_epochs_builds_each_step_once(dataset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next epoch's first step is built ahead and the epoch goes on from it, never building
    step 1 twice (a ``load(0)`` built it ahead, then ``iter(1)`` built it again)."""
    builds: collections.Counter[tuple[int, int]] = collections.Counter()
    lock = threading.Lock()

    def record(epoch: int, step: int) -> None:
        with lock:
            builds[(epoch, step)] += 1

    _record_builds(monkeypatch, record)
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    oracles = {e: _oracle(dataset, e) for e in range(2)}
    with contextlib.closing(
        asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=2)
    ) as it:
        seen = []
        for epoch, step, batch in it:
            _assert_batch(batch, oracles[epoch], step)
            seen.append((epoch, step))
            time.sleep(0.01)  # a trainer's step: the builders run ahead meanwhile
    assert seen == [(e, s) for e in range(2) for s in range(oracles[0].step_count)]
    assert builds.keys() >= set(seen)
    assert {key: n for key, n in builds.items() if n > 1} == {}


def test_iter_epochs_bad_arguments(dataset: str) -> None:
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    for kwargs, match in (
        (dict(start_epoch=-1), "start_epoch"),
        (dict(start_step=-1), "start_step"),
        (dict(epochs=-1), "epochs"),
        (dict(start_step=10**6), "past the epoch"),
    ):
        with pytest.raises(ConfigError, match=match):
            list(asyncflat.iter_epochs("train", _params(dataset), batch_params, **kwargs))
    assert list(asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=0)) == []


def test_a_dropped_epoch_iterator_closes_its_loaders_at_once(dataset: str) -> None:
    """No reference cycle through the iterator: dropping it closes its loaders right away, on
    the dropping thread, without waiting for the cycle collector (which, run on one of the
    loaders' own threads, could deadlock their close)."""
    import gc

    from conftest import wait_until
    from helpers.resources import library_threads

    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    gc.disable()
    try:
        it = asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=3)
        for _ in range(3):
            next(it)
        assert library_threads()
        del it
        wait_until(lambda: library_threads() == [], "the loaders' threads to end", timeout=5)
    finally:
        gc.enable()


def test_a_ctrl_c_while_iter_epochs_winds_down_still_closes_the_next_epochs_loader(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while the iteration winds down (here: in the current loader's close, a thread
    join) still closes the next epoch's loader, being built ahead, and the pool building it:
    the rest of the wind-down was skipped, and that loader's threads and the pool's ran on for
    as long as the caller held the KeyboardInterrupt."""
    from helpers.resources import library_threads

    from asyncflat.loader import epochs

    building = threading.Event()

    class Interrupted(asyncflat.ShufflingLoader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("epoch"):
                building.set()
                time.sleep(1.0)  # the next epoch's loader is still being built at the close
            super().__init__(*args, **kwargs)

        def close(self) -> None:
            super().close()
            if self.epoch == 0 and threading.current_thread() is threading.main_thread():
                raise KeyboardInterrupt  # a Ctrl-C in the close's join

    monkeypatch.setattr(epochs, "ShufflingLoader", Interrupted)
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    it = asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=2)
    for _ in it:
        if building.is_set():
            break
    assert building.is_set()
    with pytest.raises(KeyboardInterrupt) as info:
        it.close()
    held = info.value  # kept, as a REPL or a retry loop keeps it
    deadline = time.monotonic() + 10
    while library_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not library_threads(), library_threads()
    del held


def test_the_first_batch_of_an_epoch_is_not_kept_for_the_whole_epoch(dataset: str) -> None:
    import gc
    import weakref

    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    first: weakref.ref[asyncflat.TokenBatch] | None = None
    with contextlib.closing(
        asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=2)
    ) as it:
        for epoch, step, batch in it:
            if (epoch, step) == (1, 0):
                first = weakref.ref(batch)
            del batch
            if (epoch, step) == (1, 3):
                gc.collect()
                assert first is not None and first() is None
                break


def test_ctrl_c_during_next_leaves_the_epoch_iterator_where_it_was(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt while ``next()`` waits (here: each epoch iterator's third wait) is
    raised, and the next ``next()`` returns the step it interrupted, as a loader's iterator
    does; raised through the generator it used to end the iteration silently."""
    from asyncflat.loader.shared.iterator import BatchIterator

    real = BatchIterator.__next__
    calls: collections.Counter[int] = collections.Counter()

    def interrupted(self: BatchIterator) -> Any:
        calls[id(self)] += 1
        if calls[id(self)] == 3:
            raise KeyboardInterrupt  # BatchIterator's own promise: nothing consumed
        return real(self)

    monkeypatch.setattr(BatchIterator, "__next__", interrupted)
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    oracles = {e: _oracle(dataset, e) for e in range(2)}
    seen, interrupts = [], 0
    with contextlib.closing(
        asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=2)
    ) as it:
        while True:
            try:
                epoch, step, batch = next(it)
            except KeyboardInterrupt:
                interrupts += 1
                continue
            except StopIteration:
                break
            _assert_batch(batch, oracles[epoch], step)
            seen.append((epoch, step))
    assert interrupts == 2  # one in each epoch's iterator
    assert seen == [(e, s) for e in range(2) for s in range(oracles[0].step_count)]


def _closed_from(closer: threading.Thread, it: Iterator[Any]) -> None:
    """``closer`` closes ``it`` while this thread's ``next()`` runs: that ``next()`` raises,
    the iteration is over, and every loader's thread ends."""
    from conftest import wait_until
    from helpers.resources import library_threads

    closer.start()
    with pytest.raises(asyncflat.LoaderClosedError):
        next(it)
    closer.join(5)
    assert not closer.is_alive()
    with pytest.raises(StopIteration):
        next(it)
    wait_until(lambda: library_threads() == [], "the loaders' threads to end", timeout=5)


def test_closing_from_another_thread_while_next_waits_ends_the_iteration(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:

    from asyncflat.loader.shared.iterator import BatchIterator

    real = BatchIterator.__next__
    waiting = threading.Event()

    def slow(self: BatchIterator) -> Any:
        waiting.set()
        time.sleep(0.3)  # a wait for storage
        return real(self)

    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    it = asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=2)
    next(it)
    monkeypatch.setattr(BatchIterator, "__next__", slow)
    _closed_from(threading.Thread(target=lambda: (waiting.wait(5), it.close())), it)


def test_iter_epochs_logs_each_sizing_warning_once(
    dataset: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every epoch's loader has the same sizes: the rows-never-served warning (this layout
    drops more than 1% of the split) is logged once for the run, not once per epoch."""
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        with contextlib.closing(
            asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=3)
        ) as it:
            epochs_seen = {epoch for epoch, _, _ in it}
        warned = [r for r in caplog.records if "never served" in r.getMessage()]
    assert epochs_seen == {0, 1, 2}
    assert len(warned) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
        with asyncflat.ShufflingLoader("train", _params(dataset), batch_params):
            pass  # a loader outside any iter_epochs still says it
    assert [r for r in caplog.records if "never served" in r.getMessage()]


def test_closing_from_another_thread_during_the_boundary_wait_ends_the_iteration(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` while ``next()`` waits for the next epoch's loader (the current loader is
    not what it waits on): that ``next()`` raises instead of carrying on into the next epoch."""

    import asyncflat.loader.epochs as epochs_mod

    building = threading.Event()

    class Slow(asyncflat.ShufflingLoader):
        def __init__(self, *args: object, **kwargs: object) -> None:
            if kwargs.get("epoch"):  # the next epoch's, built in the background
                building.set()
                time.sleep(0.6)
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(epochs_mod, "ShufflingLoader", Slow)
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    it = asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=2)
    steps = 0
    while True:  # epoch 0 at full speed: the boundary's next() waits for the slow build
        epoch, _, _ = next(it)
        if epoch == 0:
            steps += 1
            if steps == _oracle(dataset, 0).step_count:
                break
    _closed_from(threading.Timer(0.2, it.close), it)
    assert building.is_set()


def test_closing_from_another_thread_between_two_nexts_never_raises_value_error(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow ``close()`` on one thread and a ``next()`` on another: the ``next()`` waits for
    the close and finds the iteration over (it raised 'generator already executing')."""
    real = asyncflat.ShufflingLoader.close

    def slow_close(self: asyncflat.ShufflingLoader) -> None:
        time.sleep(0.3)
        real(self)

    monkeypatch.setattr(asyncflat.ShufflingLoader, "close", slow_close)
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    it = asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=2)
    next(it)
    closer = threading.Thread(target=it.close)
    closer.start()
    time.sleep(0.05)
    with pytest.raises(StopIteration):
        next(it)
    closer.join(5)


def test_a_ctrl_c_outside_the_waits_says_where_to_resume(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt that ends the generator (here: as epoch 1 starts, outside its
    waits) is raised, and every later ``next()`` says the run ended and where to resume,
    rather than stop as if it were over; resuming there serves the rest."""
    import asyncflat.loader.epochs as epochs_mod

    real = epochs_mod.build_ahead_from
    calls = [0]

    def interrupted(loader: Any) -> int:
        calls[0] += 1
        if calls[0] == 2:  # epoch 1's
            raise KeyboardInterrupt
        return real(loader)

    monkeypatch.setattr(epochs_mod, "build_ahead_from", interrupted)
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    steps = _oracle(dataset, 0).step_count
    with contextlib.closing(
        asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=2)
    ) as it:
        for _ in range(steps):
            next(it)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        for _ in range(2):
            with pytest.raises(
                asyncflat.AsyncflatError, match=f"resume with start_epoch=0, start_step={steps}"
            ):
                next(it)
    with contextlib.closing(
        asyncflat.iter_epochs(
            "train", _params(dataset), batch_params, start_epoch=0, start_step=steps, epochs=2
        )
    ) as it:
        assert [(e, s) for e, s, _ in it] == [(1, s) for s in range(steps)]


def test_an_iterator_dropped_after_a_caught_ctrl_c_closes_at_once(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither the interrupt nor its traceback keeps the iterator alive in a cycle."""
    import gc

    from conftest import wait_until
    from helpers.resources import library_threads

    from asyncflat.loader.shared.iterator import BatchIterator

    real = BatchIterator.__next__
    calls = [0]

    def interrupted(self: BatchIterator) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(BatchIterator, "__next__", interrupted)
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    gc.disable()
    try:
        it = asyncflat.iter_epochs("train", _params(dataset), batch_params, epochs=2)
        next(it)
        next(it)
        try:
            next(it)
        except KeyboardInterrupt:
            pass
        assert next(it)[:2] == (0, 2)  # the step it was interrupted on
        del it
        wait_until(lambda: library_threads() == [], "the loaders' threads to end", timeout=5)
    finally:
        gc.enable()
