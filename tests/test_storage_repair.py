"""Nothing is cached from a failure: after a damaged store is repaired, every load is correct.

A loader runs while the chunk objects of ``encoded_tokens`` are replaced with garbage: loads
that need them raise ``CorruptChunkError`` (those served from buffers filled before stay
correct); once the files are restored, every step, in an order that mixes fills and rows read
before their blocks, equals the oracle. Frame layouts, decoded chunks, shard indexes and errors
read from the bad bytes must all have been dropped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import oracle, random_sequences

import asyncflat
from asyncflat import CorruptChunkError, FlatTokensParams, ShufflingLoader, TokenBatchParams

BATCH = TokenBatchParams(len=16, batch=8)
LAYOUTS = {
    "v3-checksum": dict(zarr_format=3, chunk_tokens=2048, checksum=True),
    "v3-plain": dict(zarr_format=3, chunk_tokens=2048),
    "v3-sharded": dict(zarr_format=3, chunk_tokens=2048, shard_tokens=8192),
    "v2": dict(zarr_format=2, chunk_tokens=2048),
}


def _encoded(batch: asyncflat.TokenBatch) -> np.ndarray:
    targets = np.asarray(batch.targets)
    return (targets << 1) | np.asarray(batch.is_seq_start).astype(np.uint32)


def _chunk_files(path: Path) -> list[Path]:
    root = path / "train" / "encoded_tokens"
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith((".", "zarr"))]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_garbage_then_repair_every_load_correct(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "d.zarr"
    asyncflat.write_flat_tokens(
        path, {"train": random_sequences(5, 900, max_len=80)}, **LAYOUTS[layout]
    )
    params = FlatTokensParams(str(path), 2, 2, 4, 7, True)
    expected = oracle(path, params, BATCH)
    files = _chunk_files(path)
    originals = {f: f.read_bytes() for f in files}
    rng = np.random.default_rng(0)
    with ShufflingLoader("train", params, BATCH) as loader:
        steps = list(range(loader.step_count))
        np.testing.assert_array_equal(_encoded(loader.load(0)), expected.encoded_batch(0))
        for f, data in originals.items():  # garbage of the same length, and of other lengths
            size = len(data) if rng.random() < 0.5 else int(rng.integers(1, 2 * len(data)))
            f.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        errors = 0
        for step in steps[::-3]:  # backwards: every load is ahead of or behind its fills
            try:
                got = _encoded(loader.load(step))
            except CorruptChunkError as exc:
                errors += 1
                assert "encoded_tokens" in str(exc), exc
                continue
            np.testing.assert_array_equal(got, expected.encoded_batch(step), err_msg=f"{step}")
        assert errors, "garbage chunks should have failed some loads"
        for f, data in originals.items():
            f.write_bytes(data)
        order = steps[::-7] + steps[1::2] + steps[::2]
        for step in order:
            np.testing.assert_array_equal(
                _encoded(loader.load(step)), expected.encoded_batch(step), err_msg=f"step {step}"
            )
