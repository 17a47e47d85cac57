"""Bad inputs: every malformed dataset and invalid parameter is a clear AsyncflatError.

* Malformed datasets, one by one, through the public entry points (``ShufflingLoader``,
  ``asyncflat.inspection.verify_split``): each raises a specific subclass whose message names the
  store, the array and what was expected versus found.
* Malformed datasets generated with hypothesis by mutating small valid stores (truncated,
  flipped or deleted chunk files, edited metadata, rewritten ``seq_starts``, edited
  attributes): the loader either serves exactly what the oracle computes from the same
  (mutated but readable) arrays, or raises an AsyncflatError. Never another exception, a hang
  or wrong data.
* Invalid parameters fail at construction with the field and the value in the message.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import zarr
from conftest import random_sequences
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat
from asyncflat import (
    ArgumentTypeError,
    AsyncflatError,
    ConfigError,
    CorruptChunkError,
    DatasetFormatError,
    EngineOptions,
    FlatTokensParams,
    RetryPolicy,
    ShufflingLoader,
    TokenBatchParams,
)
from asyncflat.inspection import verify_split

pytestmark = pytest.mark.timeout(180)

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
BATCH = TokenBatchParams(len=8, batch=4)
STREAMS, RBPSB, SPB, SEED = 2, 2, 2, 3
OPTIONS = EngineOptions(
    load_timeout_s=20, retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.001)
)
_METADATA = ("zarr.json", ".zarray", ".zgroup", ".zattrs")

WRITERS: dict[str, dict[str, Any]] = {
    "v3": dict(chunk_tokens=64),
    "v2": dict(zarr_format=2, chunk_tokens=64),
    "v3_sharded": dict(chunk_tokens=32, shard_tokens=128),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Small valid stores (about 500 tokens, 8 token chunks) in each layout."""
    seqs = random_sequences(4, 40, max_len=24, vocab=50)
    root = tmp_path_factory.mktemp("bases")
    paths = {}
    for name, kwargs in WRITERS.items():
        paths[name] = str(root / f"{name}.zarr")
        asyncflat.write_flat_tokens(paths[name], {"train": seqs, "validation": seqs[:12]}, **kwargs)
    return paths


@contextlib.contextmanager
def copy_of(base: str) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="asyncflat-mut-") as tmp:
        path = os.path.join(tmp, "data.zarr")
        shutil.copytree(base, path)
        yield path


def params(path: str, packing: bool = True) -> FlatTokensParams:
    return FlatTokensParams(path, STREAMS, RBPSB, SPB, SEED, packing)


def open_loader(path: str, packing: bool = True, split: str = "train") -> ShufflingLoader:
    return ShufflingLoader(split, params(path, packing), BATCH, SINGLE, options=OPTIONS)


def load_all(path: str, packing: bool = True, split: str = "train") -> None:
    with open_loader(path, packing, split) as loader:
        for step in range(loader.step_count):
            loader.load(step)


def meta_path(array_dir: str) -> str:
    v3 = os.path.join(array_dir, "zarr.json")
    return v3 if os.path.exists(v3) else os.path.join(array_dir, ".zarray")


def edit_json(file: str, edit: Callable[[dict[str, Any]], None]) -> None:
    with open(file) as f:
        doc = json.load(f)
    edit(doc)
    with open(file, "w") as f:
        json.dump(doc, f)


def set_attr(path: str, split: str, key: str, value: Any, *, delete: bool = False) -> None:
    group = zarr.open_group(path, mode="r+")[split]
    if delete:
        if key in group.attrs:
            del group.attrs[key]
    else:
        group.attrs[key] = value


def chunk_files(array_dir: str) -> list[str]:
    return sorted(
        os.path.join(d, f)
        for d, _, files in os.walk(array_dir)
        for f in files
        if f not in _METADATA
    )


def write_entry(path: str, index: int, value: int) -> None:
    arr = zarr.open_array(os.path.join(path, "train", "seq_starts"), mode="r+")
    arr[index] = value


def no_library_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("asyncflat")]


# -- malformed datasets, one by one ---------------------------------------------------------------


def _dtype(array: str, v3: str, v2: str) -> Callable[[str], None]:
    def mutate(path: str) -> None:
        def edit(doc: dict[str, Any]) -> None:
            doc["data_type" if "data_type" in doc else "dtype"] = v3 if "data_type" in doc else v2

        edit_json(meta_path(os.path.join(path, "train", array)), edit)

    return mutate


def _rank2(array: str) -> Callable[[str], None]:
    def mutate(path: str) -> None:
        group = zarr.open_group(path, mode="r+")["train"]
        data = np.asarray(group[array][:])
        group.create_array(array, data=np.stack([data, data]), overwrite=True)

    return mutate


CASES: list[tuple[str, Callable[[str], None], str, type, str]] = [
    # (id, mutation, split, error class, regex after the store path)
    (
        "missing split",
        lambda p: shutil.rmtree(os.path.join(p, "validation")),
        "validation",
        DatasetFormatError,
        r"/validation: missing split group",
    ),
    (
        "missing encoded_tokens",
        lambda p: shutil.rmtree(os.path.join(p, "train", "encoded_tokens")),
        "train",
        DatasetFormatError,
        r"/train/encoded_tokens: missing array",
    ),
    (
        "missing seq_starts",
        lambda p: shutil.rmtree(os.path.join(p, "train", "seq_starts")),
        "train",
        DatasetFormatError,
        r"/train/seq_starts: missing array",
    ),
    (
        "missing max_token_id",
        lambda p: set_attr(p, "train", "max_token_id", None, delete=True),
        "train",
        DatasetFormatError,
        r"/train: missing group attribute 'max_token_id'",
    ),
    (
        "max_token_id a string",
        lambda p: set_attr(p, "train", "max_token_id", "49"),
        "train",
        DatasetFormatError,
        r"/train: attribute max_token_id must be an integer, got str '49'",
    ),
    (
        "max_token_id negative",
        lambda p: set_attr(p, "train", "max_token_id", -1),
        "train",
        DatasetFormatError,
        r"/train: attribute max_token_id must be in \[0, 2\*\*31\), got -1",
    ),
    (
        "tokens int32",
        _dtype("encoded_tokens", "int32", "<i4"),
        "train",
        DatasetFormatError,
        r"/train/encoded_tokens: expected dtype uint32, got int32",
    ),
    (
        "tokens uint64",
        _dtype("encoded_tokens", "uint64", "<u8"),
        "train",
        DatasetFormatError,
        r"/train/encoded_tokens: expected dtype uint32, got uint64",
    ),
    (
        "seq_starts uint32",
        _dtype("seq_starts", "uint32", "<u4"),
        "train",
        DatasetFormatError,
        r"/train/seq_starts: expected dtype uint64, got uint32",
    ),
    (
        "tokens 2-D",
        _rank2("encoded_tokens"),
        "train",
        DatasetFormatError,
        r"/train/encoded_tokens: expected a 1-D array, got 2-D shape \(2, \d+\)",
    ),
    (
        "seq_starts 2-D",
        _rank2("seq_starts"),
        "train",
        DatasetFormatError,
        r"/train/seq_starts: expected a 1-D array, got 2-D shape",
    ),
    (
        "seq_starts not from 0",
        lambda p: write_entry(p, 0, 1),
        "train",
        DatasetFormatError,
        r"/train/seq_starts: expected seq_starts\[0\] == 0, got 1",
    ),
    (
        "seq_starts short of the end",
        lambda p: write_entry(p, -1, 7),
        "train",
        DatasetFormatError,
        r"/train/seq_starts: expected seq_starts\[-1\] == len\(encoded_tokens\) == \d+, got 7",
    ),
    (
        "metadata not json",
        lambda p: Path(meta_path(os.path.join(p, "train", "encoded_tokens"))).write_text("{oops"),
        "train",
        DatasetFormatError,
        r"/train/encoded_tokens: invalid array metadata",
    ),
]


@pytest.mark.parametrize("fmt", ["v3", "v2"])
@pytest.mark.parametrize(
    ("case", "mutate", "split", "error", "match"), CASES, ids=[c[0] for c in CASES]
)
def test_a_malformed_dataset_is_named_at_construction(
    bases: dict[str, str],
    fmt: str,
    case: str,
    mutate: Callable[[str], None],
    split: str,
    error: type,
    match: str,
) -> None:
    with copy_of(bases[fmt]) as path:
        mutate(path)
        with pytest.raises(error, match=r"^" + re.escape(path) + match) as info:
            open_loader(path, split=split)
        assert type(info.value) is error, type(info.value)
    assert no_library_threads()


def test_a_missing_store_is_named(tmp_path: Path) -> None:
    path = str(tmp_path / "nowhere.zarr")
    with pytest.raises(DatasetFormatError, match=f"{path}: no flat-tokens dataset here"):
        open_loader(path)
    Path(path).mkdir()
    with pytest.raises(DatasetFormatError, match=f"{path}: missing flat-tokens zarr group"):
        open_loader(path)


@pytest.mark.parametrize("fmt", ["v3", "v2"])
@pytest.mark.parametrize(
    ("index", "value", "expect"),
    [
        (9, 3, r"expected non-decreasing offsets, got seq_starts\[9\] = 3 < seq_starts\[8\] = \d+"),
        (20, 10**6, r"seq_starts\[20\] = 1000000: expected an offset <= the token count \d+"),
        (
            20,
            2**64 - 1,
            r"seq_starts\[20\] = 18446744073709551615: expected an offset <= the token count",
        ),
    ],
)
def test_bad_seq_starts_inside_the_array_fail_the_load_that_reads_them(
    bases: dict[str, str], fmt: str, index: int, value: int, expect: str
) -> None:
    """open() checks only the first and last offsets (no scan); the non-packed block read checks
    the ones it uses. Steps whose blocks avoid the bad entry still load; packed mode never reads
    the middle of seq_starts and is unaffected."""
    with copy_of(bases[fmt]) as path:
        write_entry(path, index, value)
        tokens, starts = load_split_arrays(path, "train")
        oracle = ReferenceLoader(
            tokens,
            starts,
            seq_len=BATCH.len,
            batch=BATCH.batch,
            streams=STREAMS,
            read_blocks_per_shuffle_buffer=RBPSB,
            sequences_per_read_block=SPB,
            seed=SEED,
            sequence_packing=False,
        )
        failed = served = 0
        with open_loader(path, packing=False) as loader:
            for step in range(loader.step_count):
                # A step may fail if a fill serving it holds a block whose read includes entry
                # `index` (a failed unit fails its whole fill: docs/reliability.md).
                blocks = {
                    blk
                    for b in range(BATCH.batch)
                    for blk in oracle.buffer_blocks(*oracle.locate(step, b)[:2])
                }
                touches = any(b * SPB <= index <= (b + 1) * SPB for b in blocks)
                try:
                    batch = loader.load(step)
                except DatasetFormatError as exc:
                    assert f"{path}/train/seq_starts" in str(exc) and touches, str(exc)
                    assert re.search(expect, str(exc)), str(exc)
                    failed += 1
                    continue
                served += 1
                np.testing.assert_array_equal(np.asarray(batch.targets), oracle.batch(step)[0])
        assert failed >= 1 and served >= 1
        load_all(path, packing=True)  # packed: the middle of seq_starts is never read
        with pytest.raises(
            DatasetFormatError, match=r"seq_starts: not strictly increasing at index"
        ):
            verify_split(path, "train")


@pytest.mark.parametrize("fmt", ["v3", "v2"])
def test_a_token_above_max_token_id_is_found_by_verify(bases: dict[str, str], fmt: str) -> None:
    """The loader does not scan token values (it would cost a pass over the data); the full check
    is ``asyncflat inspect --verify`` (asyncflat.inspection.verify_split)."""
    with copy_of(bases[fmt]) as path:
        set_attr(path, "train", "max_token_id", 40)  # the data holds ids up to 49
        with pytest.raises(
            DatasetFormatError,
            match=rf"^{path}/train/encoded_tokens\[\d+\]: token id 4\d > max_token_id 40$",
        ):
            verify_split(path, "train")
        assert verify_split(path, "validation").split == "validation"


@pytest.mark.parametrize("fmt", list(WRITERS))
@pytest.mark.parametrize("damage", ["truncate", "zero", "header", "delete"])
def test_damaged_token_chunks_raise_corrupt_chunk_error(
    bases: dict[str, str], fmt: str, damage: str
) -> None:
    with copy_of(bases[fmt]) as path:
        target = chunk_files(os.path.join(path, "train", "encoded_tokens"))[1]
        data = Path(target).read_bytes()
        if damage == "truncate":
            Path(target).write_bytes(data[: len(data) // 2])
        elif damage == "zero":
            Path(target).write_bytes(b"")
        elif damage == "header":
            Path(target).write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
        else:
            os.remove(target)
        key = os.path.relpath(target, path)
        with pytest.raises(CorruptChunkError) as info:
            load_all(path)
        message = str(info.value)
        assert path in message and "encoded_tokens" in message, message
        if damage == "delete":
            assert f"{key}" in message and "missing from the store" in message, message
        else:
            assert re.search(
                r"do(es)? not decode|is truncated|not a whole Blosc frame|fails its crc32c checksum",
                message,
            ), message
        with pytest.raises(CorruptChunkError, match=r"encoded_tokens"):
            verify_split(path, "train")
    assert no_library_threads()


def test_a_damaged_seq_starts_chunk_is_named_at_construction(bases: dict[str, str]) -> None:
    with copy_of(bases["v2"]) as path:
        target = chunk_files(os.path.join(path, "train", "seq_starts"))[0]
        Path(target).write_bytes(Path(target).read_bytes()[:20])
        with pytest.raises(
            CorruptChunkError,
            match=rf"^{path}/train/seq_starts: reading entry 0 failed, its chunk does not decode",
        ):
            open_loader(path)


# -- malformed datasets, generated ----------------------------------------------------------------


class Unreadable(Exception):
    """The oracle could not read the mutated split at all."""


def read_mutated(
    path: str, split: str = "train"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The arrays as zarr reads them, chunk by chunk, and masks of the entries that could be
    read (a chunk that fails to decode is unknown; a missing one reads as fill values, which
    the loader refuses, so either way no successful load can contain it unchecked)."""
    try:
        group = zarr.open_group(path, mode="r")[split]
        arrays = group["encoded_tokens"], group["seq_starts"]
    except Exception as exc:
        raise Unreadable(repr(exc)) from exc
    out = []
    for arr, dtype in zip(arrays, (np.uint32, np.uint64), strict=True):
        if not isinstance(arr, zarr.Array) or arr.ndim != 1 or np.dtype(arr.dtype) != dtype:
            raise Unreadable(f"{arr}")
        n, chunk = arr.shape[0], arr.chunks[0]
        values, known = np.zeros(n, dtype), np.zeros(n, bool)
        for lo in range(0, n, chunk):
            if not _whole_blosc_frame(path, arr, lo // chunk):
                continue  # numcodecs would read past its end: garbage (or a crash), not data
            try:
                values[lo : lo + chunk] = arr[lo : lo + chunk]
                known[lo : lo + chunk] = True
            except Exception:
                pass
        out += [values, known]
    return out[0], out[1], out[2], out[3]


class Mutation:
    """A named change to a store (hypothesis prints the name of a falsifying example)."""

    def __init__(self, name: str, apply: Callable[[str], None]) -> None:
        self.name, self.apply = name, apply

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _whole_blosc_frame(path: str, arr: zarr.Array, index: int) -> bool:
    """False when chunk ``index`` of an unsharded array is a file whose Blosc header claims
    more (or fewer) bytes than it holds."""
    if arr.shards is not None:
        return True
    base = os.path.join(path, arr.path)
    for file in (os.path.join(base, "c", str(index)), os.path.join(base, str(index))):
        if os.path.isfile(file):
            data = Path(file).read_bytes()
            return len(data) >= 16 and int.from_bytes(data[12:16], "little") == len(data)
    return True  # missing: zarr reads fill values, the loader refuses


def _known_rows(
    packing: bool, tok_known: np.ndarray, starts: np.ndarray, st_known: np.ndarray
) -> Callable[[int], bool]:
    L = BATCH.len

    def known(row: int) -> bool:
        if packing:
            return bool(tok_known[row * L : (row + 1) * L].all())
        if not (st_known[row] and st_known[row + 1]):
            return False
        lo, hi = int(starts[row]), int(starts[row + 1])
        return bool(tok_known[lo : min(hi, lo + L)].all())

    return known


def _json_edit(array: str, field: str) -> st.SearchStrategy[Mutation]:
    """Edit one metadata field of ``array`` (shape, chunk shape, dtype) to a drawn value."""
    dtypes_v3 = ["int32", "uint16", "uint64", "float32", "int64", "uint32", "bool"]
    dtypes_v2 = ["<i4", "<u2", "<u8", "<f4", ">u4", "<u4", "|b1"]

    @st.composite
    def strategy(draw: st.DrawFn) -> Mutation:
        delta = draw(st.integers(-600, 300))
        dtype_index = draw(st.integers(0, len(dtypes_v3) - 1))
        extra_dim = draw(st.booleans())

        def mutate(path: str) -> None:
            def edit(doc: dict[str, Any]) -> None:
                v3 = "data_type" in doc
                if field == "shape":
                    n = max(0, doc["shape"][0] + delta)
                    doc["shape"] = [n, 2] if extra_dim else [n]
                elif field == "chunks":
                    if v3:
                        grid = doc["chunk_grid"]["configuration"]
                        grid["chunk_shape"] = [max(1, grid["chunk_shape"][0] + delta)]
                    else:
                        doc["chunks"] = [max(1, doc["chunks"][0] + delta)]
                elif v3:
                    doc["data_type"] = dtypes_v3[dtype_index]
                else:
                    doc["dtype"] = dtypes_v2[dtype_index]

            edit_json(meta_path(os.path.join(path, "train", array)), edit)

        return Mutation(
            f"edit {array} {field} (delta {delta}, dtype #{dtype_index}, 2-D {extra_dim})", mutate
        )

    return strategy()


@st.composite
def _file_damage(draw: st.DrawFn) -> Mutation:
    array = draw(st.sampled_from(["encoded_tokens", "seq_starts"]))
    which = draw(st.integers(0, 50))
    how = draw(st.sampled_from(["truncate", "flip", "delete", "garbage"]))
    cut = draw(st.floats(0, 1))
    flips = draw(
        st.lists(
            st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
            min_size=1,
            max_size=4,
        )
    )

    def mutate(path: str) -> None:
        files = chunk_files(os.path.join(path, "train", array))
        target = files[which % len(files)]
        data = bytearray(Path(target).read_bytes())
        if how == "delete":
            os.remove(target)
            return
        if how == "truncate":
            data = data[: int(len(data) * cut)]
        elif how == "flip" and data:
            for where, mask in flips:
                data[int(where * len(data))] ^= mask
        else:
            data = bytearray(os.urandom(max(1, int(len(data) * cut))))
        Path(target).write_bytes(bytes(data))

    return Mutation(f"{how} {array} chunk file #{which} (cut {cut:.2f}, flips {flips})", mutate)


@st.composite
def _seq_starts_rewrite(draw: st.DrawFn) -> Mutation:
    index = draw(st.integers(0, 41))
    value = draw(st.one_of(st.integers(0, 600), st.just(2**64 - 1), st.integers(2**62, 2**63 + 5)))
    reverse = draw(st.booleans())

    def mutate(path: str) -> None:
        arr = zarr.open_array(os.path.join(path, "train", "seq_starts"), mode="r+")
        n = arr.shape[0]
        if reverse:  # a decreasing run
            lo = index % max(1, n - 4)
            arr[lo : lo + 4] = np.asarray(arr[lo : lo + 4])[::-1]
        else:
            arr[index % n] = value

    return Mutation(
        f"seq_starts[{index}] = {value}" if not reverse else f"reverse seq_starts[{index}:+4]",
        mutate,
    )


@st.composite
def _attr_edit(draw: st.DrawFn) -> Mutation:
    value = draw(st.sampled_from([None, -1, 0, 5, 2**31, "49", 49.0, [49], True]))

    def mutate(path: str) -> None:
        set_attr(path, "train", "max_token_id", value, delete=value is None)

    return Mutation(f"max_token_id = {value!r}", mutate)


@st.composite
def _structure(draw: st.DrawFn) -> Mutation:
    victim = draw(
        st.sampled_from(
            [
                "train/encoded_tokens/zarr.json",
                "train/encoded_tokens/.zarray",
                "train/seq_starts/zarr.json",
                "train/seq_starts/.zarray",
                "train/zarr.json",
                "train/.zgroup",
                "train/.zattrs",
            ]
        )
    )
    garbage = draw(
        st.sampled_from([None, b"", b"{}", b"[1, 2]", b'{"zarr_format": 3}', b"\xff\xfe"])
    )

    def mutate(path: str) -> None:
        file = os.path.join(path, victim)
        if not os.path.exists(file):
            return
        if garbage is None:
            os.remove(file)
        else:
            Path(file).write_bytes(garbage)

    return Mutation(
        f"{'delete' if garbage is None else f'overwrite with {garbage!r}'} {victim}", mutate
    )


MUTATIONS = st.one_of(
    _file_damage(),
    _seq_starts_rewrite(),
    _json_edit("encoded_tokens", "shape"),
    _json_edit("seq_starts", "shape"),
    _json_edit("encoded_tokens", "chunks"),
    _json_edit("seq_starts", "chunks"),
    _json_edit("encoded_tokens", "dtype"),
    _json_edit("seq_starts", "dtype"),
    _attr_edit(),
    _structure(),
)

_OUTCOMES: dict[str, int] = {}


@pytest.mark.slow
@settings(
    max_examples=int(os.environ.get("RELIABILITY_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    fmt=st.sampled_from(list(WRITERS)),
    packing=st.booleans(),
    mutations=st.lists(MUTATIONS, min_size=1, max_size=2),
)
def test_mutated_stores_load_correctly_or_raise_an_asyncflat_error(
    bases: dict[str, str], fmt: str, packing: bool, mutations: list[Mutation]
) -> None:
    with copy_of(bases[fmt]) as path:
        for mutation in mutations:
            with contextlib.suppress(Exception):  # e.g. rewriting seq_starts in a damaged chunk
                mutation.apply(path)
        try:
            tokens, tok_known, starts, st_known = read_mutated(path)
            oracle: ReferenceLoader | None = ReferenceLoader(
                tokens,
                starts,
                seq_len=BATCH.len,
                batch=BATCH.batch,
                streams=STREAMS,
                read_blocks_per_shuffle_buffer=RBPSB,
                sequences_per_read_block=SPB,
                seed=SEED,
                sequence_packing=packing,
            )
            known = _known_rows(packing, tok_known, starts, st_known)
        except (Unreadable, ValueError):
            oracle = None
        try:
            loader = open_loader(path, packing)
        except (DatasetFormatError, ConfigError) as exc:
            _OUTCOMES[type(exc).__name__] = _OUTCOMES.get(type(exc).__name__, 0) + 1
            return
        with loader:
            assert oracle is not None, "the loader opened a split the oracle cannot read"
            assert loader.step_count == oracle.step_count
            for step in range(loader.step_count):
                try:
                    batch = loader.load(step)
                except DatasetFormatError as exc:  # CorruptChunkError included
                    assert path in str(exc), str(exc)
                    _OUTCOMES["load " + type(exc).__name__] = (
                        _OUTCOMES.get("load " + type(exc).__name__, 0) + 1
                    )
                    continue
                got, got_starts = np.asarray(batch.targets), np.asarray(batch.is_seq_start)
                want, want_starts = oracle.batch(step)
                ids = oracle.row_ids(step)
                for b in range(BATCH.batch):
                    if known(int(ids[b])):
                        np.testing.assert_array_equal(
                            got[b], want[b], err_msg=f"step {step} row {b}"
                        )
                        np.testing.assert_array_equal(got_starts[b], want_starts[b])
                _OUTCOMES["served"] = _OUTCOMES.get("served", 0) + 1
    assert no_library_threads()


# -- invalid parameters ---------------------------------------------------------------------------


def _good_flat(**changes: Any) -> Any:
    fields = dict(
        filespec="data.zarr",
        streams=2,
        read_blocks_per_shuffle_buffer=2,
        sequences_per_read_block=2,
        seed=0,
        sequence_packing=True,
    )
    fields.update(changes)
    return lambda: FlatTokensParams(**fields)


PARAM_CASES: list[tuple[str, Callable[[], Any], str]] = [
    (
        "len 0",
        lambda: TokenBatchParams(len=0, batch=4),
        r"TokenBatchParams\.len must be >= 1, got 0",
    ),
    (
        "batch negative",
        lambda: TokenBatchParams(len=8, batch=-4),
        r"TokenBatchParams\.batch must be >= 1, got -4",
    ),
    (
        "len float",
        lambda: TokenBatchParams(len=8.0, batch=4),
        r"TokenBatchParams\.len must be an integer, got float 8\.0",
    ),
    (
        "batch bool",
        lambda: TokenBatchParams(len=8, batch=True),
        r"TokenBatchParams\.batch must be an integer, got bool True",
    ),
    (
        "len str",
        lambda: TokenBatchParams(len="8", batch=4),
        r"TokenBatchParams\.len must be an integer, got str '8'",
    ),
    (
        "filespec empty",
        _good_flat(filespec=""),
        r"FlatTokensParams\.filespec must be a non-empty path \(str or os\.PathLike\) or URL "
        r"string, got str ''",
    ),
    (
        "filespec bytes",  # a pathlib.Path is accepted (tests/test_config_types.py)
        _good_flat(filespec=b"x"),
        r"FlatTokensParams\.filespec must be a non-empty .* got bytes",
    ),
    ("streams 0", _good_flat(streams=0), r"FlatTokensParams\.streams must be >= 1, got 0"),
    (
        "rbpsb 0",
        _good_flat(read_blocks_per_shuffle_buffer=0),
        r"read_blocks_per_shuffle_buffer must be >= 1, got 0",
    ),
    (
        "spb negative",
        _good_flat(sequences_per_read_block=-1),
        r"sequences_per_read_block must be >= 1, got -1",
    ),
    (
        "spb float",
        _good_flat(sequences_per_read_block=2.5),
        r"sequences_per_read_block must be an integer, got float 2\.5",
    ),
    ("seed negative", _good_flat(seed=-1), r"FlatTokensParams\.seed must be >= 0, got -1"),
    (
        "seed None",
        _good_flat(seed=None),
        r"FlatTokensParams\.seed must be an integer, got NoneType None",
    ),
    ("packing int", _good_flat(sequence_packing=1), r"sequence_packing must be a bool, got int 1"),
    (
        "packing str",
        _good_flat(sequence_packing="False"),
        r"sequence_packing must be a bool, got str 'False'",
    ),
    (
        "storage_options list",
        _good_flat(storage_options=[("token", "x")]),
        r"storage_options must be a mapping .* got list",
    ),
    (
        "prefetch str",
        lambda: EngineOptions(prefetch="yes"),
        r"EngineOptions\.prefetch must be a bool, got str 'yes'",
    ),
    (
        "reads 0",
        lambda: EngineOptions(max_concurrent_reads=0),
        r"max_concurrent_reads must be >= 1, got 0",
    ),
    (
        "decode threads 0",
        lambda: EngineOptions(decode_threads=0),
        r"decode_threads must be >= 1, got 0",
    ),
    (  # one task each: 10**5 made a loader take seconds to open, 2**70 hung it
        "reads 10**5",
        lambda: EngineOptions(max_concurrent_reads=10**5),
        r"max_concurrent_reads must be <= 1,024, got 100,000",
    ),
    (
        "decode threads 2**70",
        lambda: EngineOptions(decode_threads=2**70),
        r"decode_threads must be <= 1,024, got 1,180,591,620,717,411,303,424",
    ),
    (
        "timeout negative",
        lambda: EngineOptions(load_timeout_s=-1),
        r"load_timeout_s must be >= 0\.0, got -1",
    ),
    (
        "timeout nan",
        lambda: EngineOptions(load_timeout_s=float("nan")),
        r"load_timeout_s must be >= 0\.0, got nan",
    ),
    (
        "timeout str",
        lambda: EngineOptions(load_timeout_s="5"),
        r"load_timeout_s must be a number, got str '5'",
    ),
    (
        "buffer budget 0",
        lambda: EngineOptions(max_buffer_bytes=0),
        r"max_buffer_bytes must be >= 1, got 0",
    ),
    (
        "device prefetch negative",
        lambda: EngineOptions(prefetch_to_device=-1),
        r"prefetch_to_device must be >= 0, got -1",
    ),
    (
        "retry dict",
        lambda: EngineOptions(retry={"max_attempts": 3}),
        r"EngineOptions\.retry must be a RetryPolicy, got dict",
    ),
    (
        "attempts 0",
        lambda: RetryPolicy(max_attempts=0),
        r"RetryPolicy\.max_attempts must be >= 1, got 0",
    ),
    (
        "backoff negative",
        lambda: RetryPolicy(initial_backoff_s=-0.5),
        r"RetryPolicy\.initial_backoff_s must be >= 0\.0, got -0\.5",
    ),
    (
        "deadline inf ok, nan not",
        lambda: RetryPolicy(deadline_s=float("nan")),
        r"RetryPolicy\.deadline_s must be >= 0\.0, got nan",
    ),
]


@pytest.mark.parametrize(("case", "build", "match"), PARAM_CASES, ids=[c[0] for c in PARAM_CASES])
def test_invalid_parameters_name_the_field_and_value(
    case: str, build: Callable[[], Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        build()


def test_valid_parameters_are_normalised() -> None:
    p = FlatTokensParams("d.zarr", np.int64(2), np.uint8(3), np.int32(4), np.int64(5), True)
    assert (p.streams, p.read_blocks_per_shuffle_buffer, p.sequences_per_read_block, p.seed) == (
        2,
        3,
        4,
        5,
    )
    assert all(type(v) is int for v in (p.streams, p.seed))
    assert EngineOptions(load_timeout_s=1).load_timeout_s == 1.0


@pytest.mark.parametrize(
    ("case", "make", "error", "match"),
    [
        (
            "batch not divisible by streams",
            lambda p: ShufflingLoader(
                "train",
                FlatTokensParams(p, 3, 2, 2, 0, True),
                TokenBatchParams(len=8, batch=4),
                SINGLE,
            ),
            ConfigError,
            r"TokenBatchParams\.batch=4 must be a multiple of FlatTokensParams\.streams=3",
        ),
        (
            "fewer read blocks than streams",
            lambda p: ShufflingLoader(
                "train",
                FlatTokensParams(p, 4, 1, 20, 0, False),
                TokenBatchParams(len=8, batch=4),
                SINGLE,
            ),
            ConfigError,
            r"the split has 40 sequences, fewer than one read block per stream \(sequences_per_read_block=20 x streams=4\)",
        ),
        (
            "not one whole batch",
            lambda p: ShufflingLoader(
                "train",
                FlatTokensParams(p, 1, 1, 20, 0, False),
                TokenBatchParams(len=8, batch=64),
                SINGLE,
            ),
            ConfigError,
            r"the split yields 40 rows, fewer than one batch of 64",
        ),
        (
            "buffers over the memory budget",
            lambda p: ShufflingLoader(
                "train",
                FlatTokensParams(p, 2, 2, 2, 0, True),
                TokenBatchParams(len=8, batch=4),
                SINGLE,
                options=EngineOptions(max_buffer_bytes=100),
            ),
            ConfigError,
            r"shuffle buffers need 512 bytes on this host .* over EngineOptions\.max_buffer_bytes=100",
        ),
        (
            "unknown split",
            lambda p: ShufflingLoader(
                "test",
                FlatTokensParams(p, 2, 2, 2, 0, True),
                TokenBatchParams(len=8, batch=4),
                SINGLE,
            ),
            ConfigError,
            r"split must be one of \('train', 'validation'\), got 'test'",
        ),
        (
            "unshardable batch",
            lambda p: ShufflingLoader(
                "train", FlatTokensParams(p, 1, 2, 2, 0, True), TokenBatchParams(len=8, batch=6)
            ),
            ConfigError,
            r"cannot shard a batch of shape \(6, 8\)",
        ),
        (
            "params of the wrong type",
            lambda p: ShufflingLoader(
                "train", TokenBatchParams(len=8, batch=4), TokenBatchParams(len=8, batch=4), SINGLE
            ),
            ArgumentTypeError,
            r'argument "params" \(asyncflat\.config\.TokenBatchParams\) is not an instance of',
        ),
        (
            "options of the wrong type",
            lambda p: ShufflingLoader(
                "train",
                FlatTokensParams(p, 2, 2, 2, 0, True),
                TokenBatchParams(len=8, batch=4),
                SINGLE,
                options={"prefetch": False},
            ),
            ArgumentTypeError,
            r'(?s)argument "options" \(dict\) did not match.*EngineOptions',
        ),
        (
            "store_wrapper not callable",
            lambda p: ShufflingLoader(
                "train",
                FlatTokensParams(p, 2, 2, 2, 0, True),
                TokenBatchParams(len=8, batch=4),
                SINGLE,
                store_wrapper="faulty",
            ),
            ArgumentTypeError,
            r'argument "store_wrapper" \(str\)',
        ),
    ],
)
def test_invalid_combinations_fail_at_loader_construction(
    bases: dict[str, str], case: str, make: Callable[[str], Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match) as info:
        make(bases["v3"])
    assert isinstance(info.value, AsyncflatError)
    assert no_library_threads()
