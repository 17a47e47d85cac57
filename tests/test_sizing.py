"""Sizing made visible: the share of a split the plan's rounding drops, and the construction log."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import asyncflat
from asyncflat import FlatTokensParams, ShufflePlan, ShufflingLoader, TokenBatchParams
from asyncflat.plan.coverage import coverage, dropped_warning, format_bytes


def _plan(streams: int, spb: int, batch: int, *, packing: bool = True, tokens: int = 1600):
    params = FlatTokensParams("unused.zarr", streams, 2, spb, 0, packing)
    return ShufflePlan.create(
        params, TokenBatchParams(len=16, batch=batch), token_count=tokens, sequence_count=100
    )


def test_coverage_splits_the_loss_by_cause() -> None:
    cov = coverage(_plan(1, 30, 10, tokens=1605))  # 100 rows of 16 + 5 tokens
    assert (cov.unit, cov.total, cov.served) == ("tokens", 1605, 90 * 16)
    assert cov.lost == {
        "tokens after the last whole sequence": 5,
        "the last partial read block": 10 * 16,
        "read blocks beyond a multiple of streams": 0,
        "rows after the last whole batch": 0,
    }
    assert cov.dropped == sum(cov.lost.values()) == 165
    streams = coverage(_plan(3, 20, 3))  # 5 blocks, 3 used
    assert streams.lost["read blocks beyond a multiple of streams"] == 2 * 20 * 16
    batch = coverage(_plan(1, 10, 30))  # 100 rows, 3 steps of 30
    assert batch.lost["rows after the last whole batch"] == 10 * 16
    unpacked = coverage(_plan(1, 30, 10, packing=False))
    assert (unpacked.unit, unpacked.total, unpacked.served) == ("sequences", 100, 90)
    assert unpacked.dropped == sum(unpacked.lost.values())


def test_warning_names_the_figure_the_cause_and_the_fix() -> None:
    text = dropped_warning(_plan(1, 30, 10), "data.zarr/train")
    assert text is not None
    assert text.startswith("data.zarr/train: 160 of 1,600 tokens (10.0%) are never served")
    assert "most of the loss (160 tokens) is the last partial read block" in text
    # 25 rows per block: 4 blocks of the 100 rows, 10 batches of 10, nothing dropped
    assert text.endswith("sequences_per_read_block=25 would drop at most 1%")
    text = dropped_warning(_plan(3, 20, 3), "x")  # 5 blocks, 3 used: 40% dropped
    assert text is not None
    assert "(640 tokens) is read blocks beyond a multiple of streams" in text
    assert text.endswith("sequences_per_read_block=11 would drop at most 1%")  # 99 of 100 rows
    assert dropped_warning(_plan(2, 10, 10), "x") is None  # nothing dropped
    # 1% is tolerated, more is not: 1000 of 1009 sequences served vs 1000 of 1011
    exact = FlatTokensParams("unused.zarr", 1, 2, 100, 0, False)
    at_limit = ShufflePlan.create(
        exact, TokenBatchParams(len=16, batch=10), token_count=0, sequence_count=1009
    )
    over = ShufflePlan.create(
        exact, TokenBatchParams(len=16, batch=10), token_count=0, sequence_count=1011
    )
    assert coverage(at_limit).dropped_fraction < 0.01 and dropped_warning(at_limit, "x") is None
    assert dropped_warning(over, "x") is not None


def test_a_split_too_small_for_any_block_size_is_told_so() -> None:
    too_few = "the split holds too few batches of {} x 16 for 1%, so lower batch or streams, or "
    too_few += "use a larger split"
    # 100 rows, batch 64: one batch whatever the block size, so 36% is always dropped.
    text = dropped_warning(_plan(1, 30, 64), "x")
    assert text is not None and "(36.0%)" in text
    assert text.endswith("no smaller sequences_per_read_block drops less: " + too_few.format(64))
    # 100 rows, batch 30, blocks of 60: 2 batches (40% dropped); blocks of 50 give 3, the most.
    text = dropped_warning(_plan(1, 60, 30), "x")
    assert text is not None and "(40.0%)" in text
    assert text.endswith(
        "the least any sequences_per_read_block drops here is 10.0% "
        "(sequences_per_read_block=50); " + too_few.format(30)
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("sizing") / "data.zarr")
    rng = np.random.default_rng(1)
    asyncflat.write_flat_tokens(path, {"train": [rng.integers(0, 50, 16) for _ in range(104)]})
    return path


def test_construction_warns_when_rounding_drops_more_than_one_percent(
    dataset: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="asyncflat"):
        with ShufflingLoader(
            "train", FlatTokensParams(dataset, 1, 2, 32, 0, True), TokenBatchParams(16, 8)
        ) as loader:
            assert loader.step_count == 12  # 3 blocks of 32 rows; 8 of 104 rows dropped
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    message = warnings[0].getMessage()
    assert f"{dataset}/train: 128 of 1,664 tokens (7.7%) are never served" in message
    assert "sequences_per_read_block" in message
    info = [r.getMessage() for r in caplog.records if "for a split of" in r.getMessage()]
    assert info and "shuffle buffers 4.0 KiB each, 8.0 KiB on this host" in info[0]  # 64 x 16 x 4
    assert "(2 per stream), for a split of 6.5 KiB of tokens" in info[0]  # 1664 x 4


def test_no_warning_when_the_whole_split_is_served(
    dataset: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="asyncflat"):
        with ShufflingLoader(
            "train", FlatTokensParams(dataset, 2, 2, 4, 0, True), TokenBatchParams(16, 8)
        ) as loader:
            assert loader.step_count * 8 * 16 == 1664
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 10.7 * 2**20, 3 * 2**40, 2**50)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "10.7 MiB",
        "3.0 TiB",
        "1024.0 TiB",
    ]
