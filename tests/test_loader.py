"""The ShufflingLoader facade against the independent oracle (tests/reference_impl.py).

Packed batches must be bit-identical to seqax's semantics; non-packed batches follow the
corrected semantics (truncate to len, pad with 1).
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from conftest import random_sequences
from helpers.seqax_v2 import write_seqax_v2
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat
from asyncflat import (
    ArgumentTypeError,
    ConfigError,
    DatasetFormatError,
    EngineOptions,
    FlatTokensParams,
    LoaderClosedError,
    ShufflingLoader,
    StepOutOfRangeError,
    TokenBatch,
    TokenBatchParams,
)

# (streams, rbpsb, spb, len, batch): chosen to cover 1/2/4/8 streams, steps straddling a
# minipoch boundary (seqs_per_buffer not a multiple of batch/streams) and short last minipochs.
PARAMS = [
    (1, 4, 16, 32, 8),  # bips 8, seqs_per_buffer 64: aligned
    (2, 3, 10, 64, 16),  # bips 8, seqs_per_buffer 30: straddles; short last minipoch
    (4, 2, 8, 16, 24),  # bips 6, seqs_per_buffer 16: straddles
    (8, 1, 8, 32, 24),  # bips 3, seqs_per_buffer 8: straddles every third step
]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    seqs = random_sequences(1, 1500)
    root = tmp_path_factory.mktemp("loader")
    paths = {
        "v3": str(root / "v3.zarr"),
        "v3_sharded": str(root / "v3s.zarr"),
        "v2_seqax": str(root / "v2.zarr"),
        "v3_bare": str(root / "v3bare.zarr"),
    }
    asyncflat.write_flat_tokens(
        paths["v3"], {"train": seqs, "validation": seqs[:50]}, chunk_tokens=7000
    )
    asyncflat.write_flat_tokens(
        paths["v3_sharded"],
        {"train": seqs, "validation": seqs[:50]},
        chunk_tokens=4096,
        shard_tokens=16384,
    )
    write_seqax_v2(paths["v2_seqax"], {"train": seqs, "validation": seqs[:50]})
    asyncflat.write_flat_tokens(
        paths["v3_bare"],
        {"train": seqs, "validation": seqs[:50]},
        chunk_tokens=7000,
        checksum=False,
    )
    return paths


def _oracle(path: str, params: FlatTokensParams, batch: TokenBatchParams) -> ReferenceLoader:
    tokens, starts = load_split_arrays(path, "train")
    return ReferenceLoader(
        tokens,
        starts,
        seq_len=batch.len,
        batch=batch.batch,
        streams=params.streams,
        read_blocks_per_shuffle_buffer=params.read_blocks_per_shuffle_buffer,
        sequences_per_read_block=params.sequences_per_read_block,
        seed=params.seed,
        sequence_packing=params.sequence_packing,
    )


def _assert_batch(batch: TokenBatch, oracle: ReferenceLoader, step: int) -> None:
    targets, starts = oracle.batch(step)
    assert batch.targets.dtype == np.uint32 and batch.is_seq_start.dtype == np.bool_
    np.testing.assert_array_equal(np.asarray(batch.targets), targets, err_msg=f"step {step}")
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), starts, err_msg=f"step {step}")


@pytest.mark.parametrize("store", ["v3", "v3_sharded", "v2_seqax"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize(("streams", "rbpsb", "spb", "seq_len", "batch"), PARAMS)
def test_every_step_matches_the_oracle(
    datasets: dict[str, str],
    store: str,
    packing: bool,
    streams: int,
    rbpsb: int,
    spb: int,
    seq_len: int,
    batch: int,
) -> None:
    params = FlatTokensParams(
        datasets[store], streams, rbpsb, spb, seed=11, sequence_packing=packing
    )
    batch_params = TokenBatchParams(len=seq_len, batch=batch)
    oracle = _oracle(datasets[store], params, batch_params)
    with ShufflingLoader("train", params, batch_params) as loader:
        assert loader.step_count == oracle.step_count
        assert loader.plan.minipoch_count == oracle.minipoch_count >= 3
        for step, got in loader.iter():
            _assert_batch(got, oracle, step)


@pytest.mark.parametrize("prefetch", [True, False])
def test_any_step_order_gives_the_same_batches(datasets: dict[str, str], prefetch: bool) -> None:
    params = FlatTokensParams(datasets["v3"], 2, 3, 16, seed=5, sequence_packing=True)
    batch_params = TokenBatchParams(len=64, batch=16)
    oracle = _oracle(datasets["v3"], params, batch_params)
    rng = np.random.default_rng(0)
    with ShufflingLoader(
        "train", params, batch_params, options=EngineOptions(prefetch=prefetch)
    ) as loader:
        steps = rng.permutation(loader.step_count)[:60].tolist() + [0, loader.step_count - 1, 0]
        for step in steps:
            _assert_batch(loader.load(step), oracle, step)


def test_resume_mid_minipoch(datasets: dict[str, str]) -> None:
    params = FlatTokensParams(datasets["v2_seqax"], 1, 4, 16, seed=3, sequence_packing=True)
    batch_params = TokenBatchParams(len=32, batch=8)
    oracle = _oracle(datasets["v2_seqax"], params, batch_params)
    with ShufflingLoader("train", params, batch_params) as loader:
        start = loader.plan.first_step(1) + 3
        steps = [step for step, _ in zip(range(start, start + 12), range(12))]
        for (step, got), expected_step in zip(loader.iter(start_step=start), steps):
            assert step == expected_step
            _assert_batch(got, oracle, step)


def test_validation_split_and_reference_api(datasets: dict[str, str]) -> None:
    params = FlatTokensParams(datasets["v3"], 1, 2, 4, seed=0, sequence_packing=False)
    batch_params = TokenBatchParams(len=16, batch=8)
    loader = asyncflat.get_loader("validation", params, batch_params)
    try:
        assert isinstance(loader, ShufflingLoader)
        assert loader.max_token_id == 999
        tokens, starts = load_split_arrays(datasets["v3"], "validation")
        oracle = ReferenceLoader(
            tokens,
            starts,
            seq_len=16,
            batch=8,
            streams=1,
            read_blocks_per_shuffle_buffer=2,
            sequences_per_read_block=4,
            seed=0,
            sequence_packing=False,
        )
        for step in range(loader.step_count):
            _assert_batch(loader.load(step), oracle, step)
        batches = list(loader)
        assert len(batches) == loader.step_count
    finally:
        loader.close()


def test_batch_is_a_sharded_pytree_over_all_devices(datasets: dict[str, str]) -> None:
    params = FlatTokensParams(datasets["v3"], 2, 2, 8, seed=0, sequence_packing=True)
    with ShufflingLoader("train", params, TokenBatchParams(len=32, batch=16)) as loader:
        batch = loader.load(0)
        leaves = jax.tree_util.tree_leaves(batch)
        assert len(leaves) == 2
        for leaf in leaves:
            assert leaf.shape == (16, 32)
            assert len(leaf.sharding.device_set) == len(jax.devices()) == 8
            assert leaf.sharding.shard_shape(leaf.shape) == (2, 32)
        doubled = jax.jit(lambda b: jax.tree_util.tree_map(lambda x: x.astype(np.int32) * 2, b))(
            batch
        )
        np.testing.assert_array_equal(np.asarray(doubled.targets), np.asarray(batch.targets) * 2)


def test_custom_sharding_splitting_the_sequence_axis(datasets: dict[str, str]) -> None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    params = FlatTokensParams(datasets["v3"], 4, 2, 8, seed=2, sequence_packing=True)
    batch_params = TokenBatchParams(len=32, batch=8)
    oracle = _oracle(datasets["v3"], params, batch_params)
    with ShufflingLoader("train", params, batch_params, sharding) as loader:
        for step in (0, 7, 3):
            batch = loader.load(step)
            assert batch.targets.sharding == sharding
            _assert_batch(batch, oracle, step)


def test_errors_at_construction(datasets: dict[str, str], tmp_path) -> None:
    good = FlatTokensParams(datasets["v3"], 2, 2, 8, seed=0, sequence_packing=True)
    with pytest.raises(ConfigError, match="split must be one of"):
        ShufflingLoader("test", good, TokenBatchParams(len=8, batch=8))
    with pytest.raises(
        ConfigError, match=r"batch=9 must be a multiple of FlatTokensParams\.streams=2"
    ):
        ShufflingLoader(
            "train",
            good,
            TokenBatchParams(len=8, batch=9),
            jax.sharding.SingleDeviceSharding(jax.devices()[0]),
        )
    with pytest.raises(ConfigError, match="fewer than one read block per stream"):
        ShufflingLoader(
            "train",
            FlatTokensParams(datasets["v3"], 8, 2, 10_000, 0, True),
            TokenBatchParams(len=8, batch=8),
        )
    with pytest.raises(ConfigError, match="cannot shard a batch"):
        ShufflingLoader("train", good, TokenBatchParams(len=8, batch=10))
    with pytest.raises(ConfigError, match="max_buffer_bytes"):
        ShufflingLoader(
            "train",
            good,
            TokenBatchParams(len=8, batch=8),
            options=EngineOptions(max_buffer_bytes=1000),
        )
    with pytest.raises(DatasetFormatError, match="not a directory"):
        ShufflingLoader(
            "train",
            FlatTokensParams(str(tmp_path / "missing.zarr"), 1, 1, 1, 0, True),
            TokenBatchParams(len=8, batch=8),
        )
    with pytest.raises(ConfigError, match="streams must be >= 1, got 0"):
        FlatTokensParams(datasets["v3"], 0, 2, 8, seed=0, sequence_packing=True)
    with pytest.raises(ConfigError, match="sequence_packing must be a bool"):
        FlatTokensParams(datasets["v3"], 1, 2, 8, seed=0, sequence_packing=1)
    with pytest.raises(ConfigError, match="len must be >= 1"):
        TokenBatchParams(len=0, batch=8)
    with pytest.raises(
        ArgumentTypeError,
        # (a union since ShufflingLoader also takes a MixtureParams)
        match=r'argument "params" \(dict\) is not an instance of asyncflat\.config\.FlatTokensParams or .*MixtureParams',
    ):
        ShufflingLoader("train", {"filespec": datasets["v3"]}, TokenBatchParams(len=8, batch=8))
    # a failed construction leaves no thread behind
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncflat")]


def test_load_errors_and_lifecycle(datasets: dict[str, str]) -> None:
    params = FlatTokensParams(datasets["v3"], 2, 2, 8, seed=0, sequence_packing=True)
    loader = ShufflingLoader("train", params, TokenBatchParams(len=16, batch=8))
    with pytest.raises(StepOutOfRangeError, match=f"step {loader.step_count} is out of range"):
        loader.load(loader.step_count)
    with pytest.raises(StepOutOfRangeError):
        loader.load(-1)
    loader.load(0)
    assert any(t.name.startswith("asyncflat") for t in threading.enumerate())
    loader.close()
    loader.close()  # idempotent
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncflat")]
    with pytest.raises(LoaderClosedError, match="closed"):
        loader.load(0)


def test_two_loaders_in_one_process_do_not_interfere(datasets: dict[str, str]) -> None:
    p1 = FlatTokensParams(datasets["v3"], 2, 3, 16, seed=1, sequence_packing=True)
    p2 = FlatTokensParams(datasets["v2_seqax"], 1, 2, 8, seed=2, sequence_packing=False)
    b = TokenBatchParams(len=32, batch=8)
    o1, o2 = _oracle(datasets["v3"], p1, b), _oracle(datasets["v2_seqax"], p2, b)
    with ShufflingLoader("train", p1, b) as l1, ShufflingLoader("train", p2, b) as l2:
        for step in range(0, min(l1.step_count, l2.step_count), 7):
            _assert_batch(l1.load(step), o1, step)
            _assert_batch(l2.load(step), o2, step)


@pytest.mark.parametrize("store", ["v3_bare", "v2_seqax"])
def test_a_jump_reads_its_rows_from_partial_blosc_frames(
    datasets: dict[str, str], store: str
) -> None:
    """A running loader asked for a step of a minipoch not started (random access) serves it
    before its blocks arrive, from row-sized reads decoded out of the Blosc frames (header,
    block table, the blocks in range). Stores without checksums only: a checksummed chunk is
    verified whole, so it is read whole. (A fresh loader's first load waits for its fill.)"""
    params = FlatTokensParams(datasets[store], 2, 4, 16, seed=9, sequence_packing=True)
    batch_params = TokenBatchParams(len=32, batch=16)
    oracle = _oracle(datasets[store], params, batch_params)
    with ShufflingLoader("train", params, batch_params) as loader:
        _assert_batch(loader.load(0), oracle, 0)
        assert loader.stats()["rows_read_directly"] == 0
        step = loader.plan.first_step(2) + 1
        _assert_batch(loader.load(step), oracle, step)
        assert loader.stats()["rows_read_directly"] > 0
        for later in range(step + 1, step + 6):
            _assert_batch(loader.load(later), oracle, later)


def test_a_row_read_from_a_missing_local_chunk_is_a_clear_error(tmp_path) -> None:
    """Row reads of a plain local store bypass the store layer (pread on the loop thread); a
    lost chunk file must still be an AsyncflatError naming the array and range, not zeros."""
    import os

    from asyncflat import CorruptChunkError

    path = str(tmp_path / "lost.zarr")
    asyncflat.write_flat_tokens(path, {"train": random_sequences(4, 400)}, chunk_tokens=2048)
    params = FlatTokensParams(path, 1, 4, 16, seed=0, sequence_packing=True)
    batch_params = TokenBatchParams(len=32, batch=8)
    with ShufflingLoader("train", params, batch_params) as loader:
        step = loader.plan.first_step(1) + 1
        chunk = 2048
        lost = {int(b) * 16 * 32 // chunk for b in loader.plan.buffer_blocks(0, 1)}
        for chunk_id in lost:
            os.remove(os.path.join(path, "train", "encoded_tokens", "c", str(chunk_id)))
        with pytest.raises(CorruptChunkError, match=r"encoded_tokens\[\d+:\d+\].*missing"):
            loader.load(step)


@pytest.mark.parametrize(
    "bad",
    [True, False, np.bool_(False), 1.0, np.float32(1), "1", None, np.array(1), np.array([1])],
    ids=repr,
)
def test_load_and_iter_take_only_integer_steps(datasets: dict[str, str], bad: object) -> None:
    params = FlatTokensParams(datasets["v3"], 2, 2, 8, seed=0, sequence_packing=True)
    batch_params = TokenBatchParams(len=16, batch=8)
    oracle = _oracle(datasets["v3"], params, batch_params)
    with ShufflingLoader("train", params, batch_params) as loader:
        with pytest.raises(
            ArgumentTypeError, match=r"^step must be a Python or numpy integer"
        ) as e:
            loader.load(bad)  # type: ignore[arg-type]
        assert repr(bad) in str(e.value)
        with pytest.raises(ArgumentTypeError, match=r"^start_step must be a Python or numpy int"):
            loader.iter(bad)  # type: ignore[arg-type]
        # numpy integers of every width are steps
        for step in (np.uint64(1), np.int32(2), np.int64(loader.step_count - 1)):
            _assert_batch(loader.load(step), oracle, int(step))  # type: ignore[arg-type]
        first_step, _ = next(loader.iter(np.uint32(3)))  # type: ignore[arg-type]
        assert first_step == 3 and type(first_step) is int
