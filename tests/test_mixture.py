"""``MixtureLoader`` on real stores: per-source order, identity, resume, stages, running out.

The sources are written with disjoint vocabularies, so the source of every served row is read
off its tokens, independently of the assignment the loader used. The expected rows of a source
are its plain loader's (``ShufflingLoader`` with the same ``TokenBatchParams``; pass ``e`` of a
source is the plain loader's ``epoch=e``).
"""

from __future__ import annotations

import gc
import json
import logging
from typing import Any

import numpy as np
import pytest
from conftest import random_sequences
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncflat
from asyncflat import (
    ConfigError,
    EngineOptions,
    FlatTokensParams,
    MixtureParams,
    MixtureSource,
    MixtureStage,
    StepOutOfRangeError,
    TokenBatchParams,
)

VOCAB = 1000
BATCH = TokenBatchParams(len=16, batch=8)
OPTIONS = EngineOptions(prefetch_to_device=0)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("mixture")
    paths = []
    for i, count in enumerate([400, 60, 150]):
        path = str(root / f"source{i}.zarr")
        seqs = [s + i * VOCAB for s in random_sequences(10 + i, count, max_len=40, vocab=VOCAB)]
        asyncflat.write_flat_tokens(path, {"train": seqs}, chunk_tokens=1024)
        paths.append(path)
    return paths


def flat(path: str, streams: int = 2, seed: int = 0) -> FlatTokensParams:
    return FlatTokensParams(path, streams, 2, 4, seed, True)


def encoded(batch: Any) -> np.ndarray:
    """The batch as flat-tokens codes (2 * id + is_seq_start), one row per batch row."""
    targets = np.asarray(batch.targets).astype(np.int64)
    return 2 * targets + np.asarray(batch.is_seq_start)


def plain_steps(params: FlatTokensParams, epoch: int = 0) -> list[np.ndarray]:
    with asyncflat.ShufflingLoader("train", params, BATCH, options=OPTIONS, epoch=epoch) as loader:
        return [encoded(loader.load(step)) for step in range(loader.step_count)]


def all_batches(loader: Any) -> list[np.ndarray]:
    return [encoded(loader.load(step)) for step in range(loader.step_count)]


@pytest.mark.parametrize("streams", [1, 2])
def test_one_source_of_weight_1_is_the_plain_loader_bit_for_bit(
    stores: list[str], streams: int
) -> None:
    params = flat(stores[0], streams, seed=3)
    mixture = MixtureParams((MixtureSource(params, 1.0),), seed=9, block_rows=5)
    expected = plain_steps(params)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        assert type(loader).__name__ == "MixtureLoader"
        assert loader.step_count == len(expected)
        for step, want in enumerate(expected):
            np.testing.assert_array_equal(encoded(loader.load(step)), want)


_PLAIN: dict[tuple[FlatTokensParams, int], list[np.ndarray]] = {}


def plain_cached(params: FlatTokensParams, epoch: int) -> list[np.ndarray]:
    if (params, epoch) not in _PLAIN:
        _PLAIN[(params, epoch)] = plain_steps(params, epoch)
    return _PLAIN[(params, epoch)]


def check_per_source_order(batches: list[np.ndarray], sources: list[FlatTokensParams]) -> None:
    """Each source's rows, per stream and in mixture order, are its plain loader's rows of that
    stream in order, pass after pass; the source of a row is read off its tokens."""
    r = BATCH.batch // 2
    served: dict[tuple[int, int], list[np.ndarray]] = {}
    for batch in batches:
        for row_index, row in enumerate(batch):
            source = int(row.min() // 2 // VOCAB)
            assert (row // 2 // VOCAB == source).all()
            served.setdefault((source, row_index // r), []).append(row)
    for (s, i), got in served.items():
        expected: list[np.ndarray] = []
        epoch = 0
        while len(expected) < len(got):
            for step_rows in plain_cached(sources[s], epoch):
                expected.extend(step_rows[i * r : (i + 1) * r])
            epoch += 1
        np.testing.assert_array_equal(np.array(got), np.array(expected[: len(got)]))


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    weights=st.lists(st.integers(0, 4), min_size=3, max_size=3).filter(lambda w: sum(w) > 0),
    later=st.lists(st.integers(0, 4), min_size=3, max_size=3).filter(lambda w: sum(w) > 0),
    stage_step=st.integers(1, 20),
    block_rows=st.integers(1, 12),
    seed=st.integers(0, 100),
)
def test_per_source_order_holds_for_any_weights_blocks_and_stages(
    stores: list[str],
    weights: list[int],
    later: list[int],
    stage_step: int,
    block_rows: int,
    seed: int,
) -> None:
    sources = [flat(stores[0], seed=1), flat(stores[1], seed=2), flat(stores[2], seed=3)]
    mixture = MixtureParams(
        tuple(MixtureSource(p, w) for p, w in zip(sources, weights)),
        seed=seed,
        block_rows=block_rows,
        stages=(MixtureStage(stage_step, tuple(later)),),
        steps=24,
    )
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        batches = all_batches(loader)
    check_per_source_order(batches, sources)


def test_each_source_serves_its_own_order_and_wraps_into_its_next_pass(
    stores: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    sources = [flat(stores[0], seed=1), flat(stores[1], seed=2), flat(stores[2], seed=3)]
    mixture = MixtureParams(
        tuple(MixtureSource(p, w) for p, w in zip(sources, [0.5, 0.3, 0.2])),
        seed=4,
        block_rows=7,
        stages=(MixtureStage(20, (0.2, 0.6, 0.2)),),
        steps=60,
    )
    r = BATCH.batch // 2
    caplog.set_level(logging.INFO, logger="asyncflat.loader.mixture")
    with asyncflat.get_loader("train", mixture, BATCH, options=OPTIONS) as loader:
        assert loader.step_count == 60
        batches = [encoded(loader.load(step)) for step in range(60)]
        stats = loader.stats()
    # Rows of each source and stream, in mixture order (steps in order, rows in batch order).
    served: dict[tuple[int, int], list[np.ndarray]] = {}
    for batch in batches:
        for row_index, row in enumerate(batch):
            source = int(row.min() // 2 // VOCAB)
            assert (row // 2 // VOCAB == source).all()
            served.setdefault((source, row_index // r), []).append(row)
    for s, params in enumerate(sources):
        counts = sum(len(served.get((s, i), [])) for i in range(2))
        passes = 0
        expected: dict[int, list[np.ndarray]] = {0: [], 1: []}
        while min(len(expected[0]), len(expected[1])) < counts:
            for step_rows in plain_steps(params, epoch=passes):
                for i in range(2):
                    expected[i].extend(step_rows[i * r : (i + 1) * r])
            passes += 1
        for i in range(2):
            got = served.get((s, i), [])
            np.testing.assert_array_equal(np.array(got), np.array(expected[i][: len(got)]))
        needed_passes = max(
            -(-len(served.get((s, i), [])) // (len(expected[i]) // passes)) for i in range(2)
        )
        assert stats.sources[s].passes == needed_passes
        assert stats.sources[s].rows == counts
    assert stats.sources[1].passes >= 3  # the small source at 30-60% ran out more than once
    assert sum(x.rows for x in stats.sources) == 60 * BATCH.batch
    # read by key too, as the engine's figures are, and whole as JSON
    assert stats["steps_built"] == stats.steps_built == 60
    assert stats["sources"][1]["passes"] == stats.sources[1].passes
    assert stats["sources"][0]["engine"]["requests"] == stats.sources[0].engine.requests
    assert "build_median_s" in stats and stats.get("nothing", 7) == 7
    as_json = json.loads(json.dumps(stats.as_dict()))
    assert [src["rows"] for src in as_json["sources"]] == [x.rows for x in stats.sources]
    assert any("starts pass 3" in rec.getMessage() for rec in caplog.records)


def test_a_fresh_loader_at_any_step_gives_the_same_batch(stores: list[str]) -> None:
    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 2), MixtureSource(flat(stores[1]), 1)),
        seed=1,
        block_rows=6,
        steps=40,
    )
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        reference = all_batches(loader)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        for step in [37, 3, 22, 22, 0, 39, 14]:  # any order, repeats, across the source's passes
            np.testing.assert_array_equal(encoded(loader.load(step)), reference[step])
        with loader.iter(25) as iterator:  # and an iterator resumed mid-run, prefetching
            for step, batch in iterator:
                np.testing.assert_array_equal(encoded(batch), reference[step])
    options = EngineOptions(prefetch_to_device=2)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=options) as loader:
        assert [s for s, _ in loader.iter(30)] == list(range(30, 40))
        with pytest.raises(StepOutOfRangeError):
            loader.load(40)


def test_a_stage_takes_effect_exactly_at_its_step_also_after_a_resume(stores: list[str]) -> None:
    first, second = flat(stores[0], seed=5), flat(stores[2], seed=6)
    mixture = MixtureParams(
        (MixtureSource(first, 1.0), MixtureSource(second, 0.0)),
        block_rows=3,  # a block of 3 rows does not divide a stage of 7 steps x 4 rows
        stages=(MixtureStage(7, (0.0, 1.0)),),
        steps=12,
    )
    plain_first, plain_second = plain_steps(first), plain_steps(second)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        batches = all_batches(loader)
    for step in range(7):
        np.testing.assert_array_equal(batches[step], plain_first[step])
    for step in range(7, 12):
        np.testing.assert_array_equal(batches[step], plain_second[step - 7])
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        np.testing.assert_array_equal(encoded(loader.load(7)), plain_second[0])
        np.testing.assert_array_equal(encoded(loader.load(6)), plain_first[6])


def test_without_steps_the_mixture_ends_before_any_source_repeats(stores: list[str]) -> None:
    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 1), MixtureSource(flat(stores[1]), 1)), block_rows=8
    )
    small_steps = len(plain_steps(flat(stores[1])))
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        # The small source gives half of every block: it lasts about twice its own steps.
        assert 2 * small_steps - 2 <= loader.step_count <= 2 * small_steps + 2
        for step in range(loader.step_count):
            loader.load(step)
        assert [s.passes for s in loader.stats().sources] == [1, 1]
        assert loader.buffer_bytes[0] > 0 and len(loader.buffer_bytes) == 2


def test_the_buffer_budget_counts_every_source(stores: list[str]) -> None:
    mixture = MixtureParams((MixtureSource(flat(stores[0]), 1), MixtureSource(flat(stores[1]), 1)))
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        total = sum(loader.buffer_bytes)
    tight = EngineOptions(prefetch_to_device=0, max_buffer_bytes=total - 1)
    with pytest.raises(ConfigError, match=r"source1\.zarr/train"):
        asyncflat.ShufflingLoader("train", mixture, BATCH, options=tight)
    roomy = EngineOptions(prefetch_to_device=0, max_buffer_bytes=total)
    asyncflat.ShufflingLoader("train", mixture, BATCH, options=roomy).close()


def test_a_closed_mixture_loader_refuses_loads(stores: list[str]) -> None:
    mixture = MixtureParams((MixtureSource(flat(stores[1]), 1),))
    loader = asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS)
    loader.load(0)
    loader.close()
    loader.close()
    with pytest.raises(asyncflat.LoaderClosedError):
        loader.load(0)


def test_sources_of_a_step_name_the_source_of_every_row(stores: list[str]) -> None:
    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 3), MixtureSource(flat(stores[2]), 1)),
        seed=2,
        block_rows=4,
        steps=10,
    )
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        for step in range(10):
            from_tokens = encoded(loader.load(step)).min(axis=1) // 2 // VOCAB
            np.testing.assert_array_equal(loader.sources(step), np.where(from_tokens == 2, 1, 0))
        # Blocks of 4 rows at 3:1: exactly 3 of source 0 in every aligned window of 4 rows.
        per_stream = np.concatenate([loader.sources(t).reshape(2, 4) for t in range(10)], axis=1)
        assert (per_stream.reshape(2, -1, 4).sum(axis=2) == 1).all()


def test_store_wrappers_apply_per_source(stores: list[str]) -> None:
    wrapped: list[str] = []

    def wrapper(store: Any) -> Any:
        wrapped.append(str(store))
        return store

    mixture = MixtureParams((MixtureSource(flat(stores[0]), 1), MixtureSource(flat(stores[1]), 1)))
    with asyncflat.ShufflingLoader(
        "train", mixture, BATCH, options=OPTIONS, store_wrapper=(None, wrapper)
    ) as loader:
        loader.load(0)
    assert wrapped and all("source1" in w for w in wrapped)
    with pytest.raises(ConfigError, match="1 wrappers for 2 sources"):
        asyncflat.ShufflingLoader("train", mixture, BATCH, store_wrapper=(wrapper,))


def test_inspect_prints_each_sources_memory_and_passes(
    stores: list[str], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import dataclasses
    import json

    import yaml

    from asyncflat.cli import main

    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 0.5), MixtureSource(flat(stores[1]), 0.5)),
        block_rows=8,
        steps=60,
    )
    config = tmp_path / "mixture.yaml"
    config.write_text(yaml.safe_dump(dataclasses.asdict(mixture)))
    args = ["inspect", str(config), "--mixture", "--len", "16", "--batch", "8", "--no-progress"]
    assert main([*args, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        for step in range(loader.step_count):
            loader.load(step)
        stats = loader.stats()
    assert figures["step_count"] == 60
    for got, want, size in zip(figures["sources"], stats.sources, loader.buffer_bytes):
        assert got["step_count"] == want.step_count
        assert got["passes"] == want.passes
        assert got["buffer_bytes_per_host"] == size
    assert figures["sources"][1]["passes"] >= 2
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "mixture of 2 sources" in text and "source1.zarr: weight 0.5" in text


@pytest.mark.parametrize("layout", ["last-minipoch-served", "last-minipoch-in-the-unserved-tail"])
def test_the_next_pass_is_filled_before_the_mixture_reaches_it(
    stores: list[str], unserved_tail: str, layout: str
) -> None:
    from conftest import UNSERVED_TAIL_PARAMS, wait_until

    if layout == "last-minipoch-served":
        small, steps = flat(stores[1], seed=8), 40
    else:  # its next pass opens at its last served minipoch, not at one no step reaches
        small, steps = FlatTokensParams(unserved_tail, *UNSERVED_TAIL_PARAMS), 330
    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 1), MixtureSource(small, 1)), block_rows=8, steps=steps
    )
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        plan = loader.plans[1]
        assert (plan.served_rows(plan.minipoch_count - 1) == 0) == (
            layout != "last-minipoch-served"
        )
        boundary = next(
            step
            for step in range(loader.step_count)
            if any(g.source == 1 and g.epoch == 1 for g in loader.groups(step))
        )
        for step in range(boundary):
            loader.load(step)

        # Serving its last minipoch, the small source's next pass is opened and its first
        # minipoch filled in the background, before any step needs it: the source's newest
        # pass (whose figures stats() reports) is then a fresh engine, which gathered one step
        # (its first, at the fill's end) and filled minipoch 0 of both streams.
        def next_pass_filled() -> bool:
            newest = loader.stats().sources[1].engine
            done = {
                f.stream for f in newest.fills if f.minipoch == 0 and not (f.failed or f.cancelled)
            }
            return newest.steps_loaded == 1 and done == {0, 1}

        wait_until(next_pass_filled, "the next pass opens and fills its first minipoch")
        assert loader.stats().sources[1].passes == 1  # nothing served from it yet
        loader.load(boundary)
        assert loader.stats().sources[1].passes == 2


def test_wrong_argument_types_fail_at_the_call(stores: list[str]) -> None:
    from asyncflat.loader.mixture.loader import MixtureLoader

    mixture = MixtureParams((MixtureSource(flat(stores[1]), 1),))
    with pytest.raises(asyncflat.ArgumentTypeError, match="token_batch_params"):
        MixtureLoader("train", mixture, {"len": 16, "batch": 8})  # type: ignore[arg-type]
    with pytest.raises(asyncflat.ArgumentTypeError, match="params"):
        MixtureLoader("train", flat(stores[1]), BATCH)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="split must be one of"):
        asyncflat.ShufflingLoader("test", mixture, BATCH)


def test_stats_count_the_steps_built(stores: list[str]) -> None:
    mixture = MixtureParams((MixtureSource(flat(stores[0]), 1), MixtureSource(flat(stores[1]), 1)))
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        for step in (0, 1, 1):
            loader.load(step)
        stats = loader.stats()
    assert stats.steps_built == 3
    assert sum(s.rows for s in stats.sources) == 3 * BATCH.batch
    assert stats.build_median_s is not None and stats.build_median_s > 0


# -- the lifecycle it shares with the plain loader ----------------------------------------------


def test_interval_stats_sum_the_sources_and_count_the_batches_delivered(
    stores: list[str],
) -> None:
    """``interval_stats()`` of a mixture: its sources' engines summed (here every source is on
    its first pass, so the first interval holds all their bytes and fills), ``steps_loaded``
    the batches the trainer received; the next interval starts from there."""
    from conftest import wait_until

    mixture = MixtureParams((MixtureSource(flat(stores[0]), 1), MixtureSource(flat(stores[2]), 1)))
    options = EngineOptions(prefetch_to_device=0, prefetch=False)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=options) as loader:
        for step in (0, 1, 2, 1):
            loader.load(step)
        wait_until(
            lambda: not any(s.engine.active_fills for s in loader.stats().sources), "fills end"
        )
        stats = loader.stats()
        interval = loader.interval_stats()
        assert interval.steps_loaded == 4
        engines = [s.engine for s in stats.sources]
        assert interval.bytes_read == sum(e.bytes_read for e in engines) > 0
        assert interval.fills_completed == sum(e.fills_completed for e in engines) >= 2
        assert interval.requests == sum(e.requests for e in engines)
        assert interval.wait_max_s == max(e.wait_max_s or 0.0 for e in engines)
        loader.load(0)
        again = loader.interval_stats()
        assert again.steps_loaded == 1
        assert again.bytes_read == again.fills_completed == 0  # minipoch 0 is still filled


def test_iter_epochs_over_a_mixture_carries_the_mixture_on(stores: list[str]) -> None:
    """Epoch ``e`` of a mixture is its steps ``[e * step_count, (e + 1) * step_count)``: the
    epochs of ``iter_epochs`` (and ``epoch=e``, and a resume) are the batches of one mixture
    three times as long, the small source wrapping into its later passes."""
    sources = (MixtureSource(flat(stores[0]), 1), MixtureSource(flat(stores[1], seed=8), 1))
    steps = 12
    mixture = MixtureParams(sources, block_rows=8, steps=steps)
    with asyncflat.ShufflingLoader(
        "train", MixtureParams(sources, block_rows=8, steps=3 * steps), BATCH, options=OPTIONS
    ) as long:
        want = all_batches(long)
        assert long.stats().sources[1].passes >= 2  # the epochs cross the small source's passes
        sources_of = [long.sources(step) for step in range(3 * steps)]
    with asyncflat.iter_epochs("train", mixture, BATCH, epochs=3) as epochs:
        got = [(e, s, encoded(batch)) for e, s, batch in epochs]
    assert [(e, s) for e, s, _ in got] == [(e, s) for e in range(3) for s in range(steps)]
    for i, (_, _, batch) in enumerate(got):
        np.testing.assert_array_equal(batch, want[i], err_msg=f"mixture step {i}")
    with asyncflat.iter_epochs(
        "train", mixture, BATCH, start_epoch=1, start_step=5, epochs=2
    ) as epochs:
        resumed = [encoded(batch) for _, _, batch in epochs]
    assert len(resumed) == steps - 5
    for i, batch in enumerate(resumed):
        np.testing.assert_array_equal(batch, want[steps + 5 + i])
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS, epoch=2) as loader:
        assert loader.step_count == steps
        np.testing.assert_array_equal(encoded(loader.load(3)), want[2 * steps + 3])
        np.testing.assert_array_equal(loader.sources(3), sources_of[2 * steps + 3])


def test_a_mixture_iterator_stops_with_loader_closed_when_closed_from_another_thread(
    stores: list[str],
) -> None:
    """Closed from another thread while ``next()`` waits for a batch built ahead (the build in
    progress, or the next one not started yet: the prefetch thread's own stop), the iterator
    ends with ``LoaderClosedError``, as the plain loader's does; no thread is left."""
    import random
    import threading

    from asyncflat.loader.shared.iterator import BatchIterator

    mixture = MixtureParams((MixtureSource(flat(stores[0]), 1), MixtureSource(flat(stores[2]), 1)))
    options = EngineOptions(prefetch_to_device=1)
    rng = random.Random(0)
    for _ in range(12):
        loader = asyncflat.ShufflingLoader("train", mixture, BATCH, options=options)
        try:
            iterator = loader.iter()
            assert isinstance(iterator, BatchIterator)  # the plain loader's, pin and all
            next(iterator)  # the first fills are done: the rest is the builder's pace
            closer = threading.Timer(rng.uniform(0, 0.02), loader.close)
            closer.start()
            with pytest.raises(asyncflat.LoaderClosedError):
                for _step in iterator:
                    pass
            closer.join()
            with pytest.raises((StopIteration, asyncflat.LoaderClosedError)):  # no batch after
                next(iterator)
        finally:
            loader.close()
        assert not [t for t in threading.enumerate() if t.name.startswith("asyncflat")]


@pytest.mark.parametrize("depth", [0, 2])
def test_a_mixture_iterator_pins_the_buffers_it_reads_next(
    stores: list[str], monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """As the plain loader's iterator does: while it walks, the buffers the next step reads
    (from every source) are pinned, once each, in every source's engine, so other threads'
    loads do not evict them; pins are taken when a source enters a minipoch, not on every
    step, and a finished or closed iterator holds none."""
    from test_concurrency import PinLog

    mixture = MixtureParams((MixtureSource(flat(stores[0]), 2), MixtureSource(flat(stores[2]), 1)))
    log = PinLog(monkeypatch)
    options = EngineOptions(prefetch_to_device=depth)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=options) as loader:
        steps = loader.step_count

        iterator = loader.iter()
        tables = set()
        for step, _batch in iterator:
            if step + 1 < steps:
                held = log.held()
                assert set(held.values()) == {1}, step  # each buffer pinned once
                by_table: dict[int, set[tuple[int, int]]] = {}
                for table, key in held:
                    by_table.setdefault(table, set()).add(key)
                for group in loader.groups(step + 1):  # what the next step reads is pinned
                    loc = loader.plans[group.source].locate(group.step, group.rows)
                    keys = set(zip(loc.stream.tolist(), loc.minipoch.tolist()))
                    assert any(keys <= pinned for pinned in by_table.values()), (step, group)
                tables |= set(by_table)
        assert len(tables) == 2  # both sources' engines
        # both engines are pinned again when a source enters a minipoch, not on every step
        assert 0 < len(log.calls) < 2 * steps
        assert not log.held()
        iterator = loader.iter(steps // 2)
        next(iterator)
        assert log.held()
        iterator.close()
        assert not log.held()


@pytest.mark.parametrize(("block_rows", "warned"), [(2, True), (4, False)])
def test_a_source_whose_share_of_a_block_rounds_to_zero_is_warned_about_once(
    stores: list[str],
    tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    block_rows: int,
    warned: bool,
) -> None:
    """Weights (0.75, 0.25) with block_rows=2 give counts (2, 0) per block: source 1 would
    never be served. One WARNING at construction says so and how to choose block_rows, and
    ``inspect --mixture`` prints the same; block_rows=4 (counts 3, 1) warns of nothing."""
    import dataclasses

    import yaml

    from asyncflat.cli import main

    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 0.75), MixtureSource(flat(stores[1]), 0.25)),
        block_rows=block_rows,
        steps=8,
    )
    caplog.set_level(logging.WARNING)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        served = [encoded(loader.load(step)) for step in range(8)]
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.getMessage().startswith("mixture:")
    ]
    if warned:
        assert len(warnings) == 1, warnings
        assert "source 1 (weight 0.25)" in warnings[0] and "block_rows >= 4" in warnings[0]
    else:
        assert warnings == []
    # what the warning is about: with block_rows=2, no row of source 1 is served
    sources_served = {int(row.min() // 2 // VOCAB) for batch in served for row in batch}
    assert sources_served == ({0} if warned else {0, 1})
    config = tmp_path / "mixture.yaml"
    config.write_text(yaml.safe_dump(dataclasses.asdict(mixture)))
    args = ["inspect", str(config), "--mixture", "--len", "16", "--batch", "8", "--no-progress"]
    assert main(args) == 0
    assert ("warning: mixture: source 1 (weight 0.25)" in capsys.readouterr().out) is warned


def test_a_pass_filling_ahead_that_a_jump_closes_warns_of_nothing(
    stores: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Serving its last minipoch, a source opens and fills its next pass in the background. A
    load that jumps two passes further closes that pass while its fill still waits for the
    store: nothing failed (nobody needs that pass any more), so nothing is logged as failed,
    and the jump's batch is the one a fresh loader serves. The rows every pass of the small
    source never serves are warned of once, not at each pass's open."""
    from conftest import wait_until

    from asyncflat.testing.faults import FaultyStore

    opened: list[FaultyStore] = []

    def slow_after_the_first_pass(store: Any) -> Any:
        # each pass opens its own store: the passes after the first answer in 0.3 s
        wrapped = FaultyStore(store, latency_s=0.3 if opened else 0.0, fault_keys="*/c/*")
        opened.append(wrapped)
        return wrapped

    small = flat(stores[1], seed=8)
    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 1), MixtureSource(small, 1)), block_rows=8, steps=200
    )
    caplog.set_level(logging.WARNING)
    with asyncflat.ShufflingLoader(
        "train", mixture, BATCH, options=OPTIONS, store_wrapper=(None, slow_after_the_first_pass)
    ) as loader:
        steps = range(loader.step_count)
        pass_1 = next(s for s in steps if any(g.epoch == 1 for g in loader.groups(s)))
        pass_3 = next(s for s in steps if any(g.epoch == 3 for g in loader.groups(s)))
        for step in range(pass_1):  # ends in pass 0's last minipoch: pass 1 opens ahead
            loader.load(step)
        wait_until(lambda: len(opened) == 2, "the next pass to open")
        wait_until(lambda: opened[1].counts.requests > 0, "the next pass to read")
        jumped = encoded(loader.load(pass_3))  # opens pass 3, closes pass 1 mid-fill
        loader.load(0)  # opens pass 0 again
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # the one warning is of the small source's rows never served, once for its five opens
    assert len(warnings) == 1 and "source1.zarr/train: 65 of 1,217 tokens" in warnings[0]
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as fresh:
        np.testing.assert_array_equal(jumped, encoded(fresh.load(pass_3)))


def test_an_iterator_of_a_dropped_mixture_loader_serves_every_step(stores: list[str]) -> None:
    """``for step, batch in ShufflingLoader(mixture, ...).iter()``: nothing but the iterator
    holds the loader, whose passes still open as the sources run out (a loader that held its
    pass opener weakly, to be freed without the collector, ended such a loop with
    LoaderClosedError at the first pass it had to open)."""
    mixture = MixtureParams((MixtureSource(flat(stores[1]), 1.0),), steps=60)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as kept:
        assert kept.groups(59)[0].epoch >= 2  # the loop below opens passes 1 and 2
    served = [
        step
        for step, _batch in asyncflat.ShufflingLoader(
            "train", mixture, BATCH, options=OPTIONS
        ).iter()
    ]
    assert served == list(range(60))


def test_a_dropped_mixture_loader_is_closed_at_once_without_the_collector(
    stores: list[str],
) -> None:
    """Nothing holds a mixture loader in a reference cycle: dropped with the collector off,
    it stops its threads and frees its sources' buffers at once, as a plain loader does (its
    passes held the loader's own pass-opening method, and it waited for the collector, which
    then ran its close on whatever thread allocated)."""
    from helpers.resources import library_threads, wait_until

    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 1.0), MixtureSource(flat(stores[1]), 2.0)), steps=20
    )
    options = EngineOptions(prefetch_to_device=1)
    gc.collect()
    gc.disable()
    try:
        loader = asyncflat.ShufflingLoader("train", mixture, BATCH, options=options)
        loader.load(0)
        loader.load(1)  # a load-ahead thread builds step 2
        assert library_threads()
        del loader
        assert wait_until(lambda: not library_threads(), 5), library_threads()
    finally:
        gc.enable()


def test_rows_and_passes_count_the_batches_delivered_not_those_built_ahead(
    stores: list[str],
) -> None:
    """``rows`` are the rows *loaded* from a source and ``passes`` the highest pass served
    (docs/mixtures.md): steps an iterator (or the load-ahead) built but never handed out are
    not counted (they were, so a run stopped before a source's boundary reported its next pass)."""
    from conftest import wait_until

    small = flat(stores[1], seed=8)
    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 1), MixtureSource(small, 1)), block_rows=8, steps=40
    )
    options = EngineOptions(prefetch_to_device=3)
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        boundary = next(
            step
            for step in range(loader.step_count)
            if any(g.source == 1 and g.epoch == 1 for g in loader.groups(step))
        )
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=options) as loader:
        with loader.iter(boundary - 1) as iterator:
            step, _ = next(iterator)  # the last step of the small source's first pass
            assert step == boundary - 1
            wait_until(lambda: loader.stats().steps_built >= 4, "the iterator builds ahead")
            stats = loader.stats()
        assert sum(s.rows for s in stats.sources) == BATCH.batch  # one batch delivered
        assert stats.sources[1].passes == 1  # the next pass was built ahead, not served
        for step in (0, 1, 1):
            loader.load(step)
        stats = loader.stats()
        assert sum(s.rows for s in stats.sources) == 4 * BATCH.batch
        loader.encoded_rows(2)  # rows handed out without jax count too (not as a batch)
        stats = loader.stats()
        assert sum(s.rows for s in stats.sources) == 5 * BATCH.batch


def test_a_source_of_weight_zero_in_every_stage_is_not_filled(stores: list[str]) -> None:
    """No step reads it: its first buffer was still filled when the loader opened (reads and
    two buffers' memory for nothing)."""
    mixture = MixtureParams(
        (MixtureSource(flat(stores[0]), 1), MixtureSource(flat(stores[1]), 0)), steps=6
    )
    options = EngineOptions(prefetch_to_device=0, fill_on_open="always")
    with asyncflat.ShufflingLoader("train", mixture, BATCH, options=options) as loader:
        for step in range(loader.step_count):
            loader.load(step)
        stats = loader.stats()
    assert stats.sources[0].engine.fills_completed > 0
    unread = stats.sources[1]
    assert unread.rows == 0 and unread.engine.buffer_allocations == 0
    assert unread.engine.fills_completed == unread.engine.fills_cancelled == 0
