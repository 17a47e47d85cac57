"""The jax glue (asyncflat.loader.shared.batch): host decode, the user's batch type, sharding, no compile.

Single process, 8 CPU devices (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import logging
import typing

import jax
import numpy as np
import pytest
from conftest import random_sequences
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat
from asyncflat import ConfigError, FlatTokensParams, ShufflingLoader, TokenBatchParams
from asyncflat.loader.shared.batch import BatchBuilder, TokenBatch, check_batch_type, decode

SEQ_LEN, BATCH = 24, 16
PARAMS = dict(streams=2, read_blocks_per_shuffle_buffer=2, sequences_per_read_block=8, seed=4)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("batch") / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": random_sequences(5, 400, max_len=60)})
    return path


@pytest.fixture(scope="module")
def oracle(dataset: str) -> ReferenceLoader:
    tokens, starts = load_split_arrays(dataset, "train")
    return ReferenceLoader(
        tokens,
        starts,
        seq_len=SEQ_LEN,
        batch=BATCH,
        sequence_packing=True,
        **PARAMS,  # type: ignore[arg-type]
    )


def _params(dataset: str) -> FlatTokensParams:
    return FlatTokensParams(dataset, sequence_packing=True, **PARAMS)  # type: ignore[arg-type]


class PairBatch(typing.NamedTuple):  # a NamedTuple is a pytree with no registration
    targets: jax.Array
    is_seq_start: jax.Array


@dataclasses.dataclass
class PlainBatch:  # a dataclass jax does not know: still built, fields are jax.Arrays
    is_seq_start: jax.Array
    targets: jax.Array
    note: str = "mine"


def test_host_decode_is_bit_identical_to_the_device_decode() -> None:
    rng = np.random.default_rng(0)
    encoded = rng.integers(0, 2**32, size=(64, 128), dtype=np.uint64).astype(np.uint32)
    encoded[:, :3] = [0, 1, 2**32 - 1]  # the extremes: id 0 in and out of a start, the top id
    targets, starts = decode(encoded)
    on_device = jax.jit(lambda e: (e >> 1, (e & 1) == 1))(encoded)
    assert targets.dtype == np.uint32 and starts.dtype == np.bool_
    np.testing.assert_array_equal(targets, np.asarray(on_device[0]))
    np.testing.assert_array_equal(starts, np.asarray(on_device[1]))
    assert targets[0, 2] == 2**31 - 1 and starts[0, 1] and not starts[0, 0]


@pytest.mark.parametrize("batch_type", [PairBatch, PlainBatch], ids=lambda t: t.__name__)
def test_the_loader_builds_the_users_batch_type(
    dataset: str, oracle: ReferenceLoader, batch_type: type
) -> None:
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    with asyncflat.get_loader(
        "train", _params(dataset), batch_params, batch_type=batch_type
    ) as loader:
        for step, batch in [(3, loader.load(3)), *list(loader.iter(loader.step_count - 2))]:
            assert type(batch) is batch_type
            targets, starts = oracle.batch(step)
            assert batch.targets.dtype == np.uint32 and batch.is_seq_start.dtype == np.bool_
            np.testing.assert_array_equal(np.asarray(batch.targets), targets)
            np.testing.assert_array_equal(np.asarray(batch.is_seq_start), starts)
            assert len(batch.targets.sharding.device_set) == 8


def test_a_batch_type_without_the_fields_is_refused(dataset: str) -> None:
    @dataclasses.dataclass
    class Tokens:
        tokens: jax.Array

    with pytest.raises(ConfigError, match=r"batch_type .*Tokens has no field\(s\)"):
        ShufflingLoader(
            "train", _params(dataset), TokenBatchParams(len=SEQ_LEN, batch=BATCH), batch_type=Tokens
        )
    with pytest.raises(ConfigError, match="must be a class or callable"):
        check_batch_type(3)


def test_token_batch_is_a_pytree_with_named_keys() -> None:
    batch = TokenBatch(targets=jax.numpy.zeros(2), is_seq_start=jax.numpy.ones(2, bool))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    assert paths == [".targets", ".is_seq_start"]
    rebuilt = jax.tree_util.tree_map(lambda x: x + 1, batch)
    assert type(rebuilt) is TokenBatch and int(rebuilt.targets[0]) == 1


def test_builder_shards_each_field_and_reads_only_host_rows() -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d", "t"))
    sharding = NamedSharding(mesh, PartitionSpec("d", None))  # seqax's 'batch/d len'
    builder = BatchBuilder(sharding, (8, 4), PairBatch)
    np.testing.assert_array_equal(builder.host_rows, np.arange(8))
    encoded = np.arange(32, dtype=np.uint32).reshape(8, 4)
    batch = builder.build(encoded)
    for leaf in batch:
        assert leaf.sharding == sharding
        assert {s.data.shape for s in leaf.addressable_shards} == {(2, 4)}
    np.testing.assert_array_equal(np.asarray(batch.targets), encoded >> 1)
    full = builder.build_full(encoded >> 1, (encoded & 1) == 1)
    np.testing.assert_array_equal(np.asarray(full.is_seq_start), (encoded & 1) == 1)


def test_no_compile_on_the_way_to_the_first_batch(
    dataset: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A batch shape no other test uses, so a compile keyed on it could not be cached already.
    batch_params = TokenBatchParams(len=SEQ_LEN - 1, batch=BATCH)
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.DEBUG):
            with ShufflingLoader("train", _params(dataset), batch_params) as loader:
                batch = loader.load(1)
                jax.block_until_ready(batch)
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]
    assert not compiles, compiles
