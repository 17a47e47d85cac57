"""A relative dataset path names the dataset where the loader was built, whatever the working
directory later: fills and row reads open their chunk files long after construction, and an
``os.chdir()`` in between (a trainer's output directory, a notebook's ``%cd``) made them read
another directory's files (a "missing chunk" error, or another dataset's rows)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import oracle, random_sequences

import asyncflat
from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams
from asyncflat.source.local_source import LocalTokenSource
from asyncflat.source.zarr_source import ZarrTokenSource
from asyncflat.testing.faults import FaultyStore

pytestmark = pytest.mark.timeout(120)

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
BATCH = TokenBatchParams(len=16, batch=8)


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    before = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(before)


def test_a_relative_filespec_is_resolved_when_the_params_are_built(in_tmp: Path) -> None:
    params = FlatTokensParams("data.zarr", 2, 2, 4, 0, True)
    assert params.filespec == str(in_tmp / "data.zarr")
    assert FlatTokensParams("gs://bucket/data.zarr", 2, 2, 4, 0, True).filespec == (
        "gs://bucket/data.zarr"
    )


@pytest.mark.parametrize("reader", ["plain", "zarr"])
def test_every_step_is_served_after_chdir_with_a_relative_path(in_tmp: Path, reader: str) -> None:
    (in_tmp / "run").mkdir()
    (in_tmp / "elsewhere").mkdir()
    os.chdir(in_tmp / "run")
    asyncflat.write_flat_tokens(
        "data.zarr", {"train": random_sequences(3, 300, max_len=60)}, chunk_tokens=512
    )
    params = FlatTokensParams("data.zarr", 2, 2, 4, 0, True)
    reference = oracle(str(in_tmp / "run" / "data.zarr"), params, BATCH)
    # A store wrapper sends the reads through zarr's store; without one, the zarr-free reader.
    wrapper = (lambda store: FaultyStore(store)) if reader == "zarr" else None
    with ShufflingLoader("train", params, BATCH, SINGLE, store_wrapper=wrapper) as loader:
        expected = LocalTokenSource if reader == "plain" else ZarrTokenSource
        assert isinstance(loader.source, expected), type(loader.source)
        os.chdir(in_tmp / "elsewhere")  # before the first load: every chunk is read from here
        for step in range(loader.step_count):
            batch = loader.load(step)
            targets, is_seq_start = reference.batch(step)
            np.testing.assert_array_equal(np.asarray(batch.targets), targets)
            np.testing.assert_array_equal(np.asarray(batch.is_seq_start), is_seq_start)
