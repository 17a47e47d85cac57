"""stats() and interval_stats() through the facade, on a real store."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conftest import random_sequences

import asyncflat
from asyncflat.engine import EngineStats, IntervalStats


def test_stats_are_a_typed_snapshot_and_the_interval_view_counts_since_the_last_call(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "data.zarr")
    with asyncflat.FlatTokensWriter(path, zarr_format=3, chunk_tokens=4096) as writer:
        writer.append("train", random_sequences(5, 600))
    params = asyncflat.FlatTokensParams(path, 1, 4, 16, seed=0, sequence_packing=True)
    with asyncflat.ShufflingLoader(
        "train", params, asyncflat.TokenBatchParams(len=32, batch=8)
    ) as loader:
        loader.interval_stats()  # start of the interval
        for step in range(6):
            loader.load(step)
        interval = loader.interval_stats()
        loader.load(6)
        stats = loader.stats()
        again = loader.interval_stats()
    assert isinstance(interval, IntervalStats) and interval.steps_loaded == 6
    assert interval.bytes_useful > 0 and interval.wait_max_s is not None
    assert again.steps_loaded == 1
    assert isinstance(stats, EngineStats) and stats.steps_loaded == 7
    assert stats["host_batch_rows"] == stats.host_batch_rows == 8  # dict-style reads still work
    assert stats.build_median_s is not None and stats.streams == (0,)
    json.dumps(stats.as_dict())  # JSON-ready, records included
    assert set(stats.scalars()) >= {"steps_loaded", "bytes_read", "fills_late", "retries"}


def test_steps_loaded_counts_what_the_trainer_received_not_the_look_ahead(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "data.zarr")
    with asyncflat.FlatTokensWriter(path, zarr_format=3, chunk_tokens=4096) as writer:
        writer.append("train", random_sequences(6, 600))
    params = asyncflat.FlatTokensParams(path, 1, 4, 16, seed=0, sequence_packing=True)
    depth, taken = 3, 4
    options = asyncflat.EngineOptions(prefetch_to_device=depth)
    with asyncflat.ShufflingLoader(
        "train", params, asyncflat.TokenBatchParams(len=32, batch=8), options=options
    ) as loader:
        assert loader.step_count > taken + depth
        loader.interval_stats()
        iterator = loader.iter()
        for _ in range(taken):
            next(iterator)
        # The device prefetch builds `depth` steps past the last one handed out; wait (bounded)
        # until the engine has served them, so the look-ahead is there to be miscounted.
        deadline = time.monotonic() + 30
        while max((s for s, _ in loader.stats().step_waits_s), default=-1) < taken + depth - 1:
            assert time.monotonic() < deadline, "the device prefetch did not build ahead"
            time.sleep(0.01)
        assert loader.stats().steps_loaded == taken
        assert loader.interval_stats().steps_loaded == taken
        loader.load(taken)  # the iterator's step, built ahead: one more batch received
        assert loader.stats().steps_loaded == taken + 1
        assert loader.interval_stats().steps_loaded == 1
        iterator.close()
