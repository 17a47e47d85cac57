"""A writer killed with SIGKILL never leaves a dataset that reads as valid and wrong.

A child process writes with FlatTokensWriter and is killed: in the middle of its appends (after
the staging directory holds some chunk files), while flushing at close, and at each step of the
commit (after the previous dataset is moved aside; after the new one is renamed into place).
Afterwards the target path holds exactly one of: nothing (opening it is a clear
DatasetFormatError), the previous complete dataset, or the new complete dataset; each checked
against the data its writer was given, through the loader and ``verify_split``.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat
from asyncflat import DatasetFormatError, FlatTokensParams, ShufflingLoader, TokenBatchParams
from asyncflat.inspection import verify_split

pytestmark = pytest.mark.timeout(240)

REPO = str(Path(__file__).resolve().parents[1])
SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])

# Shared by the parent and the writing child, so both know what a complete dataset holds.
RECIPE = """
import numpy as np

def batches(seed, count):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield [rng.integers(0, 1000, int(rng.integers(1, 100))) for _ in range(20)]
"""

CHILD = """
import os, signal, sys
import asyncflat.writer.output as output
from asyncflat import FlatTokensWriter

path, seed, count, overwrite, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

renames = 0
real_rename = os.rename

def rename(src, dst):
    global renames
    real_rename(src, dst)
    renames += 1
    if kill_at == f"rename{renames}":
        die()

output.os.rename = rename  # this child only
if kill_at == "fsync":
    output.os.fsync = lambda fd: die()  # the commit's first flush, before any rename

with FlatTokensWriter(path, chunk_tokens=256, overwrite=overwrite) as w:
    print("writing", flush=True)
    for batch in batches(seed, count):
        w.append("train", batch)
        w.append("validation", batch[:2])
print("committed", flush=True)
"""


def expected_sequences(seed: int, count: int) -> dict[str, list[np.ndarray]]:
    namespace: dict[str, Any] = {}
    exec(RECIPE, namespace)
    train: list[np.ndarray] = []
    validation: list[np.ndarray] = []
    for batch in namespace["batches"](seed, count):
        train += batch
        validation += batch[:2]
    return {"train": train, "validation": validation}


def spawn(
    path: str, seed: int, count: int, *, overwrite: bool, kill_at: str = ""
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [
            sys.executable,
            "-W",
            "error",
            "-c",
            textwrap.dedent(RECIPE + CHILD),
            path,
            str(seed),
            str(count),
            "1" if overwrite else "0",
            kill_at,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def kill_after_chunks(child: subprocess.Popen[str], path: str, chunks: int) -> None:
    """SIGKILL the child once its staging directory holds ``chunks`` token chunk files."""
    pattern = f"{path}.partial-*/train/encoded_tokens/c/*"
    deadline = time.monotonic() + 90
    while len(glob.glob(pattern)) < chunks:
        assert child.poll() is None, f"the writer ended early: {child.communicate()}"
        assert time.monotonic() < deadline, "the writer wrote nothing in time"
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    finish(child, killed=True)


def finish(child: subprocess.Popen[str], *, killed: bool) -> None:
    out, err = child.communicate(timeout=90)
    if killed:
        assert child.returncode == -signal.SIGKILL, (child.returncode, out, err)
        assert "committed" not in out
    else:
        assert child.returncode == 0, err


def assert_holds(path: str, seqs: dict[str, list[np.ndarray]]) -> None:
    """``path`` is a complete, valid dataset holding exactly ``seqs``."""
    for split, sequences in seqs.items():
        tokens, starts = load_split_arrays(path, split)
        lengths = np.array([len(s) for s in sequences])
        np.testing.assert_array_equal(starts, np.concatenate([[0], np.cumsum(lengths)]))
        np.testing.assert_array_equal(tokens >> 1, np.concatenate(sequences))
        assert verify_split(path, split).sequence_count == len(sequences)
    params = FlatTokensParams(path, 2, 2, 4, 0, False)
    batch = TokenBatchParams(len=32, batch=4)
    tokens, starts = load_split_arrays(path, "train")
    oracle = ReferenceLoader(
        tokens,
        starts,
        seq_len=32,
        batch=4,
        streams=2,
        read_blocks_per_shuffle_buffer=2,
        sequences_per_read_block=4,
        seed=0,
        sequence_packing=False,
    )
    with ShufflingLoader("train", params, batch, SINGLE) as loader:
        for step in (0, loader.step_count // 2, loader.step_count - 1):
            np.testing.assert_array_equal(
                np.asarray(loader.load(step).targets), oracle.batch(step)[0]
            )


def assert_rejected(path: str) -> None:
    with pytest.raises(DatasetFormatError, match=f"{path}: no flat-tokens dataset here"):
        ShufflingLoader(
            "train",
            FlatTokensParams(path, 1, 1, 1, 0, True),
            TokenBatchParams(len=8, batch=1),
            SINGLE,
        )
    with pytest.raises(DatasetFormatError):
        verify_split(path, "train")


@pytest.fixture
def old_dataset(tmp_path: Path) -> tuple[str, dict[str, list[np.ndarray]]]:
    """A complete dataset at the target path, for the overwrite cases."""
    path = str(tmp_path / "data.zarr")
    seqs = expected_sequences(seed=1, count=10)
    asyncflat.write_flat_tokens(path, seqs, chunk_tokens=256)
    return path, seqs


def test_a_first_write_killed_mid_append_leaves_nothing_that_opens(tmp_path: Path) -> None:
    path = str(tmp_path / "data.zarr")
    kill_after_chunks(spawn(path, seed=2, count=100_000, overwrite=False), path, chunks=8)
    assert not os.path.exists(path)
    assert_rejected(path)
    # what is left behind is the staging directory, named so that it is never mistaken for data
    assert [os.path.basename(p).split("-")[0] for p in glob.glob(f"{path}.*")] == [
        "data.zarr.partial"
    ]


@pytest.mark.parametrize("chunks", [1, 30])
def test_an_overwrite_killed_mid_append_keeps_the_previous_dataset(
    old_dataset: tuple[str, dict[str, list[np.ndarray]]], chunks: int
) -> None:
    path, old = old_dataset
    kill_after_chunks(spawn(path, seed=3, count=100_000, overwrite=True), path, chunks=chunks)
    assert_holds(path, old)


@pytest.mark.parametrize("kill_at", ["fsync", "rename1", "rename2"])
def test_an_overwrite_killed_while_committing(
    old_dataset: tuple[str, dict[str, list[np.ndarray]]], kill_at: str
) -> None:
    """fsync: the staging copy is complete but never renamed, so the old dataset stays.
    rename1: the old dataset was moved aside (``<path>.old-*``) and the new one not yet moved in:
    the path is empty, a clear error, and the old dataset can be recovered by hand.
    rename2: the new dataset is in place (its old copy not yet removed): it is complete."""
    path, old = old_dataset
    child = spawn(path, seed=4, count=40, overwrite=True, kill_at=kill_at)
    finish(child, killed=True)
    if kill_at == "fsync":
        assert_holds(path, old)
    elif kill_at == "rename1":
        assert_rejected(path)
        (aside,) = glob.glob(f"{path}.old-*")
        assert_holds(aside, old)
    else:
        assert_holds(path, expected_sequences(seed=4, count=40))


def test_the_same_child_commits_when_not_killed(
    old_dataset: tuple[str, dict[str, list[np.ndarray]]],
) -> None:
    """The control: the child used above does write the dataset the checks expect."""
    path, _ = old_dataset
    finish(spawn(path, seed=4, count=40, overwrite=True), killed=False)
    assert_holds(path, expected_sequences(seed=4, count=40))
    assert glob.glob(f"{path}.*") == []
