"""Tests of asyncflat.format.split: encoding, decoding, and opening/validating a split."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers.seqax_v2 import write_seqax_v2
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflat.errors import (
    AsyncflatError,
    ConfigError,
    CorruptChunkError,
    DatasetFormatError,
    StorageError,
    TransientStorageError,
)
from asyncflat.format.codec import SPLITS, TOKEN_ID_LIMIT, decode, encode_sequences
from asyncflat.format.split import SplitArrays, open_split, translate_errors
from asyncflat.storage.guarded import guard_store

NAME = "STORE<test>"  # a display name that cannot be confused with anything zarr prints


def open_local(path: Path | str, split: str = "train", name: str = NAME) -> SplitArrays:
    return open_with(zarr.storage.LocalStore(str(path), read_only=True), split, name)


def open_with(store: Any, split: str = "train", name: str = NAME) -> SplitArrays:
    guarded = guard_store(store, name, allow_missing=True)
    return asyncio.run(open_split(guarded, split, name=name))


# ---------------------------------------------------------------------------------------------
# encode / decode
# ---------------------------------------------------------------------------------------------


def test_encode_worked_example() -> None:
    encoded, lengths = encode_sequences([[5, 6], [7]])
    assert encoded.dtype == np.uint32 and lengths.dtype == np.uint64
    np.testing.assert_array_equal(encoded, [11, 12, 15])
    np.testing.assert_array_equal(lengths, [2, 1])
    targets, is_start = decode(encoded)
    np.testing.assert_array_equal(targets, [5, 6, 7])
    np.testing.assert_array_equal(is_start, [True, False, True])


def test_encode_empty_iterable() -> None:
    encoded, lengths = encode_sequences(iter(()))
    assert encoded.shape == (0,) and encoded.dtype == np.uint32
    assert lengths.shape == (0,) and lengths.dtype == np.uint64


def test_encode_largest_id_and_mixed_dtypes() -> None:
    big = TOKEN_ID_LIMIT - 1
    seqs = [
        np.array([big], np.uint64),
        np.array([0, 3], np.int8),
        [big, 1],
        np.array([2], np.uint16),
    ]
    encoded, lengths = encode_sequences(seqs)
    np.testing.assert_array_equal(encoded, [2 * big + 1, 1, 6, 2 * big + 1, 2, 5])
    np.testing.assert_array_equal(lengths, [1, 2, 2, 1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, TOKEN_ID_LIMIT - 1), min_size=1, max_size=20), max_size=30))
def test_encode_decode_round_trip(seqs: list[list[int]]) -> None:
    encoded, lengths = encode_sequences(seqs)
    targets, is_start = decode(encoded)
    assert lengths.tolist() == [len(s) for s in seqs]
    assert targets.tolist() == [t for s in seqs for t in s]
    starts = np.flatnonzero(is_start)
    assert (
        starts.tolist()
        == np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()[: len(seqs)]
    )


@settings(max_examples=50, deadline=None)
@given(
    st.integers(0, 6),
    st.integers(1, 6),
    st.sampled_from([np.int32, np.int64, np.uint32, np.uint64]),
)
def test_encode_2d_matches_list_path(rows: int, cols: int, dtype: type) -> None:
    data = (np.arange(rows * cols, dtype=np.int64).reshape(rows, cols) * 7919 % 100_000).astype(
        dtype
    )
    fast = encode_sequences(data)
    slow = encode_sequences(list(data))
    np.testing.assert_array_equal(fast[0], slow[0])
    np.testing.assert_array_equal(fast[1], slow[1])


@pytest.mark.parametrize(
    ("seqs", "match"),
    [
        ([[1], []], "sequence 1 is empty"),
        ([np.zeros(0, np.uint32)], "sequence 0 is empty"),
        (np.zeros((2, 0), np.uint32), "sequence 0 is empty"),
        ([[1], [2, -1]], r"sequence 1: token id -1 is outside \[0, 2\*\*31\)"),
        ([[TOKEN_ID_LIMIT]], "token id 2147483648 is outside"),
        ([np.array([1 << 63], np.uint64)], "token id 9223372036854775808 is outside"),
        (np.array([[1, -5]]), "token id -5 is outside"),
        ([[1.0, 2.0]], "must be integers, got dtype float64"),
        ([[True]], "must be integers, got dtype bool"),
        ([[1 << 70]], "must be integers, got dtype object"),
        ([5], r"sequence 0 must be 1-D, got shape \(\).*pass a list holding it"),
        ([[[1, 2]]], r"sequence 0 must be 1-D, got shape \(1, 2\)"),
    ],
)
def test_encode_rejects(seqs: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        encode_sequences(seqs)


# ---------------------------------------------------------------------------------------------
# open_split on valid stores
# ---------------------------------------------------------------------------------------------


def test_open_split_reads_seqax_v2_store(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 1000, n) for n in rng.integers(1, 50, 40)]
    write_seqax_v2(tmp_path / "d.zarr", {"train": seqs, "validation": seqs[:3]})
    sa = open_local(tmp_path / "d.zarr")
    assert sa.name == f"{NAME}/train" and sa.split == "train"
    assert sa.zarr_format == 2
    assert sa.token_count == sum(len(s) for s in seqs)
    assert sa.sequence_count == 40
    assert sa.max_token_id == max(int(s.max()) for s in seqs)
    assert sa.token_chunk == sa.tokens_per_object == 4_194_304
    encoded = asyncio.run(sa.encoded_tokens.getitem(slice(None)))
    targets, _ = decode(encoded)
    np.testing.assert_array_equal(targets, np.concatenate(seqs))
    assert open_local(tmp_path / "d.zarr", "validation").sequence_count == 3


def test_open_split_name_trailing_slash(tmp_path: Path) -> None:
    write_seqax_v2(tmp_path / "d.zarr", {"train": [np.array([1])]})
    assert open_local(tmp_path / "d.zarr", name="gs://b/d.zarr/").name == "gs://b/d.zarr/train"


def test_open_split_empty_split(tmp_path: Path) -> None:
    write_seqax_v2(tmp_path / "d.zarr", {"train": []})
    sa = open_local(tmp_path / "d.zarr")
    assert (sa.token_count, sa.sequence_count, sa.max_token_id) == (0, 0, 0)


def test_open_split_v3_sharded_granularity(tmp_path: Path) -> None:
    root = zarr.open_group(str(tmp_path / "d.zarr"), mode="w", zarr_format=3)
    g = root.create_group("train")
    t = g.create_array("encoded_tokens", shape=(100,), chunks=(8,), shards=(32,), dtype="uint32")
    t[:] = np.full(100, 4, np.uint32)
    g.create_array("seq_starts", shape=(2,), chunks=(2,), dtype="uint64")[:] = [0, 100]
    g.attrs["max_token_id"] = 2
    sa = open_local(tmp_path / "d.zarr")
    assert (sa.zarr_format, sa.token_chunk, sa.tokens_per_object) == (3, 8, 32)


class CountingStore(zarr.storage.WrapperStore):  # type: ignore[type-arg]
    """Records every key read, to prove that opening does not scan the data."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.keys: list[str] = []

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        self.keys.append(key)
        return await super().get(key, prototype, byte_range)


def test_open_split_reads_no_token_chunks(tmp_path: Path) -> None:
    seqs = [np.arange(1, 1 + n) for n in range(1, 200)]
    write_seqax_v2(tmp_path / "d.zarr", {"train": seqs})
    store = CountingStore(zarr.storage.LocalStore(str(tmp_path / "d.zarr"), read_only=True))
    open_with(store)
    chunk_reads = [k for k in store.keys if not os.path.basename(k).startswith((".z", "zarr.json"))]
    assert all(k.startswith("train/seq_starts/") for k in chunk_reads), store.keys
    assert len(set(chunk_reads)) == 1  # first and last entry share seq_starts' only chunk


# ---------------------------------------------------------------------------------------------
# open_split on malformed stores
# ---------------------------------------------------------------------------------------------

GOOD_TOKENS = np.array([11, 12, 15], np.uint32)  # [5, 6], [7]
GOOD_STARTS = np.array([0, 2, 3], np.uint64)


def build(
    path: Path,
    fmt: int,
    *,
    tokens: Any = GOOD_TOKENS,
    starts: Any = GOOD_STARTS,
    attrs: dict[str, Any] | None = None,
    omit: tuple[str, ...] = (),
) -> Path:
    """Write one ``train`` split with plain zarr, with the given deviations from valid."""
    root = zarr.open_group(str(path), mode="w", zarr_format=fmt)
    g = root.create_group("train")
    for key, data in (("encoded_tokens", tokens), ("seq_starts", starts)):
        if key in omit:
            continue
        data = np.asarray(data)
        arr = g.create_array(key, shape=data.shape, dtype=data.dtype, chunks=data.shape or (1,))
        if data.size:
            arr[...] = data
    g.attrs.update({"max_token_id": 7} if attrs is None else attrs)
    return path


def assert_format_error(path: Path, *parts: str, cls: type[Exception] = DatasetFormatError) -> str:
    with pytest.raises(cls) as info:
        open_local(path)
    message = str(info.value)
    assert f"{NAME}/train" in message or NAME in message, message
    for part in parts:
        assert part in message, message
    return message


@pytest.mark.parametrize("fmt", [2, 3])
def test_valid_baseline(tmp_path: Path, fmt: int) -> None:
    sa = open_local(build(tmp_path / "d", fmt))
    assert (sa.token_count, sa.sequence_count, sa.max_token_id, sa.zarr_format) == (3, 2, 7, fmt)


def test_unknown_split_is_config_error(tmp_path: Path) -> None:
    build(tmp_path / "d", 3)
    with pytest.raises(
        ConfigError, match=r"split must be one of \('train', 'validation'\), got 'test'"
    ):
        open_local(tmp_path / "d", "test")


def test_missing_store(tmp_path: Path) -> None:
    message = assert_format_error(tmp_path / "nothing-here", "missing flat-tokens zarr group")
    assert message.startswith(NAME)
    (tmp_path / "empty").mkdir()
    assert_format_error(tmp_path / "empty", "missing flat-tokens zarr group")


@pytest.mark.parametrize("fmt", [2, 3])
def test_missing_split_group(tmp_path: Path, fmt: int) -> None:
    zarr.open_group(str(tmp_path / "d"), mode="w", zarr_format=fmt).create_group("validation")
    assert_format_error(tmp_path / "d", f"{NAME}/train: missing split group")


def test_split_is_an_array(tmp_path: Path) -> None:
    root = zarr.open_group(str(tmp_path / "d"), mode="w", zarr_format=3)
    root.create_array("train", shape=(1,), dtype="uint32")
    assert_format_error(tmp_path / "d", f"{NAME}/train: expected a zarr group, found an array")


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize("key", ["encoded_tokens", "seq_starts"])
def test_missing_array(tmp_path: Path, fmt: int, key: str) -> None:
    build(tmp_path / "d", fmt, omit=(key,))
    assert_format_error(tmp_path / "d", f"{NAME}/train/{key}: missing array")


def test_array_is_a_group(tmp_path: Path) -> None:
    build(tmp_path / "d", 3, omit=("encoded_tokens",))
    zarr.open_group(str(tmp_path / "d"), mode="a")["train"].create_group("encoded_tokens")
    assert_format_error(
        tmp_path / "d", "train/encoded_tokens: expected a zarr array, found a group"
    )


@pytest.mark.parametrize("fmt", [2, 3])
@pytest.mark.parametrize(
    ("kwargs", "parts"),
    [
        (
            {"tokens": GOOD_TOKENS.astype(np.int64)},
            ("encoded_tokens", "expected dtype uint32", "int64"),
        ),
        (
            {"tokens": GOOD_TOKENS.astype(np.uint64)},
            ("encoded_tokens", "expected dtype uint32", "uint64"),
        ),
        (
            {"tokens": GOOD_TOKENS.reshape(1, 3)},
            ("encoded_tokens", "expected a 1-D array, got 2-D"),
        ),
        (
            {"starts": GOOD_STARTS.astype(np.int64)},
            ("seq_starts", "expected dtype uint64", "int64"),
        ),
        (
            {"starts": GOOD_STARTS.astype(np.uint32)},
            ("seq_starts", "expected dtype uint64", "uint32"),
        ),
        ({"starts": GOOD_STARTS.reshape(3, 1)}, ("seq_starts", "expected a 1-D array, got 2-D")),
        ({"starts": np.zeros(0, np.uint64)}, ("seq_starts", "expected at least 1 entry", "got 0")),
        ({"starts": np.array([1, 2, 3], np.uint64)}, ("seq_starts", "seq_starts[0] == 0, got 1")),
        (
            {"starts": np.array([0, 2, 4], np.uint64)},
            ("seq_starts", "seq_starts[-1] == len(encoded_tokens) == 3, got 4"),
        ),
        ({"starts": np.array([0], np.uint64)}, ("seq_starts", "== 3, got 0")),
        ({"attrs": {}}, ("missing group attribute 'max_token_id'",)),
        ({"attrs": {"max_token_id": True}}, ("max_token_id must be an integer, got True",)),
        ({"attrs": {"max_token_id": 7.0}}, ("max_token_id must be an integer, got float 7.0",)),
        ({"attrs": {"max_token_id": "7"}}, ("max_token_id must be an integer, got str '7'",)),
        ({"attrs": {"max_token_id": -1}}, ("max_token_id must be in [0, 2**31), got -1",)),
        (
            {"attrs": {"max_token_id": 1 << 31}},
            ("max_token_id must be in [0, 2**31), got 2147483648",),
        ),
    ],
)
def test_malformed_split(
    tmp_path: Path, fmt: int, kwargs: dict[str, Any], parts: tuple[str, ...]
) -> None:
    build(tmp_path / "d", fmt, **kwargs)
    message = assert_format_error(tmp_path / "d", *parts)
    assert message.startswith(f"{NAME}/train"), message


def test_big_endian_tokens_rejected(tmp_path: Path) -> None:
    # Format 2 can store '>u4'; zarr hands it back big-endian, which raw readers would misread.
    build(tmp_path / "d", 2, tokens=GOOD_TOKENS.astype(">u4"))
    assert_format_error(tmp_path / "d", "encoded_tokens: expected dtype uint32, got >u4")


@pytest.mark.parametrize("fmt", [2, 3])
def test_corrupt_metadata_keeps_cause(tmp_path: Path, fmt: int) -> None:
    build(tmp_path / "d", fmt)
    meta = tmp_path / "d" / "train" / "seq_starts" / (".zarray" if fmt == 2 else "zarr.json")
    meta.write_text("{ not json")
    with pytest.raises(DatasetFormatError) as info:
        open_local(tmp_path / "d")
    assert str(info.value).startswith(
        f"{NAME}/train/seq_starts: invalid array metadata: JSONDecodeError"
    )
    assert info.value.__cause__ is not None


def test_corrupt_seq_starts_chunk(tmp_path: Path) -> None:
    write_seqax_v2(tmp_path / "d", {"train": [np.array([1, 2]), np.array([3])]})
    (tmp_path / "d" / "train" / "seq_starts" / "0").write_bytes(b"garbage, not blosc")
    with pytest.raises(
        CorruptChunkError, match=rf"{NAME}/train/seq_starts: reading entry \d failed"
    ) as info:
        open_local(tmp_path / "d")
    assert info.value.__cause__ is not None


def test_fixture_style_attrs_survive_json(tmp_path: Path) -> None:
    # max_token_id written by another tool as a JSON integer in .zattrs, not via zarr.
    write_seqax_v2(tmp_path / "d", {"train": [np.array([1, 2])]})
    (tmp_path / "d" / "train" / ".zattrs").write_text(json.dumps({"max_token_id": 1017}))
    assert open_local(tmp_path / "d").max_token_id == 1017


class FailingStore(zarr.storage.WrapperStore):  # type: ignore[type-arg]
    def __init__(self, store: Any, exc: BaseException) -> None:
        super().__init__(store)
        self.exc = exc

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        raise self.exc


def test_asyncflat_errors_pass_through(tmp_path: Path) -> None:
    build(tmp_path / "d", 3)
    store = FailingStore(
        zarr.storage.LocalStore(str(tmp_path / "d"), read_only=True),
        TransientStorageError("throttled"),
    )
    with pytest.raises(TransientStorageError, match="throttled"):
        open_with(store)


def test_os_errors_become_storage_errors(tmp_path: Path) -> None:
    build(tmp_path / "d", 3)
    store = FailingStore(
        zarr.storage.LocalStore(str(tmp_path / "d"), read_only=True), PermissionError("denied")
    )
    with pytest.raises(StorageError, match=f"{NAME}.*PermissionError: denied") as info:
        open_with(store)
    assert not isinstance(info.value, DatasetFormatError)
    assert isinstance(info.value.__cause__, PermissionError)


@pytest.mark.parametrize("exc", [asyncio.CancelledError(), KeyboardInterrupt()])
def test_guard_does_not_swallow_base_exceptions(exc: BaseException) -> None:
    async def raising() -> None:
        raise exc

    with pytest.raises(type(exc)):
        asyncio.run(translate_errors(raising(), "where", "what"))


def test_errors_are_value_errors_and_asyncflat_errors() -> None:
    # Code written against the reference catches ValueError; trainers catch AsyncflatError.
    assert issubclass(DatasetFormatError, ValueError) and issubclass(
        DatasetFormatError, AsyncflatError
    )
    assert SPLITS == ("train", "validation")


def test_both_arrays_missing_reports_encoded_tokens_first(tmp_path: Path) -> None:
    # The arrays are opened concurrently; the error must not depend on which finished first.
    build(tmp_path / "d", 3, omit=("encoded_tokens", "seq_starts"))
    assert_format_error(tmp_path / "d", f"{NAME}/train/encoded_tokens: missing array")


@pytest.mark.slow
def test_an_open_cancelled_at_any_point_leaves_no_coroutine_unawaited(tmp_path: Path) -> None:
    """A loader closed (or a deadline hit) while it opens its split cancels the open wherever
    it is: no zarr coroutine may be left made and never awaited (Python warns when it is
    collected, during whatever runs then)."""
    import gc
    import warnings

    import asyncflat

    path = tmp_path / "d.zarr"
    asyncflat.write_flat_tokens(path, {"train": [[1, 2, 3], [4, 5]]}, zarr_format=3)
    store = guard_store(
        zarr.storage.LocalStore(str(path), read_only=True), NAME, allow_missing=True
    )

    async def cancel_after(ticks: int) -> bool:
        task = asyncio.ensure_future(open_split(store, "train", name=NAME))
        for _ in range(ticks):
            await asyncio.sleep(0)
        finished = task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return finished

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for ticks in range(200):
            finished = asyncio.run(cancel_after(ticks))
            gc.collect()
            if finished:
                break
    assert finished, "the open never finished: raise the tick count"
