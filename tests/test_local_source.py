"""A plain local split is opened and read without zarr, and serves exactly the oracle's batches.

The zarr-free path (``asyncflat/source/local_source.py``) exists for start-up time: a restart's first
batch must not pay zarr's import. These tests check that it is taken where it should be (and
zarr is then never imported), that it serves the reference loader's batches on every layout it
accepts, that anything else falls back to zarr's reader with zarr's errors, and that hostile
objects are refused by it as by the guarded store.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from conftest import oracle, random_sequences
from zarr.codecs import BloscCodec, ZstdCodec

import asyncflat
from asyncflat import (
    AsyncflatError,
    CorruptChunkError,
    DatasetFormatError,
    FlatTokensParams,
    ShufflingLoader,
    TokenBatchParams,
)
from asyncflat.source.local_source import LocalTokenSource
from asyncflat.source.zarr_source import ZarrTokenSource
from asyncflat.storage.local_split import parse_local_split

BATCH = TokenBatchParams(len=32, batch=8)


def params(path: Path, packing: bool = True) -> FlatTokensParams:
    return FlatTokensParams(str(path), 1, 4, 16, seed=3, sequence_packing=packing)


@pytest.fixture(scope="module")
def sequences() -> list[np.ndarray]:
    return random_sequences(11, 600, max_len=90)


def written(tmp: Path, sequences: list[np.ndarray], **options: Any) -> Path:
    path = tmp / f"ds-{len(os.listdir(tmp))}.zarr"
    asyncflat.write_flat_tokens(path, {"train": sequences}, chunk_tokens=4096, **options)
    return path


def zarr_written(tmp: Path, source: Path, name: str, **array: Any) -> Path:
    """The split of ``source`` rewritten by zarr itself with other array options."""
    group: Any = zarr.open_group(str(source), mode="r")["train"]
    tokens, starts = group["encoded_tokens"][:], group["seq_starts"][:]
    path = tmp / name
    root = zarr.open_group(str(path), mode="w", zarr_format=array.pop("zarr_format", 3))
    out = root.create_group("train")
    # shape and dtype, then the data: zarr 3.0 (the floor) has no ``data=``
    config = {"write_empty_chunks": True}
    made = out.create_array(
        "encoded_tokens", shape=tokens.shape, dtype=tokens.dtype, config=config, **array
    )
    made[:] = tokens
    # uncompressed (zarr's default in format 3 is zstd, which only zarr's reader decodes)
    made = out.create_array(
        "seq_starts", shape=starts.shape, dtype=starts.dtype, chunks=(1024,), compressors=None
    )
    made[:] = starts
    out.attrs["max_token_id"] = int(group.attrs["max_token_id"])
    return path


def assert_serves_oracle(
    path: Path, packing: bool, steps: list[int], reference: Any = None
) -> type:
    p = params(path, packing)
    reference = reference or oracle(path, p, BATCH)
    with ShufflingLoader("train", p, BATCH) as loader:
        kind = type(loader.source)
        for step in steps:
            batch = loader.load(step)
            targets, is_seq_start = reference.batch(step)
            np.testing.assert_array_equal(np.asarray(batch.targets), targets)
            np.testing.assert_array_equal(np.asarray(batch.is_seq_start), is_seq_start)
    return kind


# -- which path, and what it serves -------------------------------------------------------------


LAYOUTS: dict[str, dict[str, Any]] = {
    "v3-blosc": {},
    "v3-blosc-crc32c": {"checksum": True},
    "v2-seqax": {"zarr_format": 2},  # seqax's layout: seq_starts behind a delta filter
}


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_plain_local_split_is_read_without_zarr_and_serves_the_oracle(
    tmp_path: Path, sequences: list[np.ndarray], layout: str, packing: bool
) -> None:
    path = written(tmp_path, sequences, **LAYOUTS[layout])
    assert parse_local_split(str(path), "train", "x") is not None
    steps = [0, 1, 7, params(path).read_blocks_per_shuffle_buffer * 2 + 1]
    assert assert_serves_oracle(path, packing, steps) is LocalTokenSource


@pytest.mark.parametrize(
    "name,array",
    [
        ("v3-none", dict(chunks=(1000,), compressors=None)),
        ("v2-none", dict(zarr_format=2, chunks=(1000,), compressors=None)),
        ("v3-blosc-typesize8", dict(chunks=(1500,), compressors=BloscCodec(typesize=8))),
    ],
)
def test_other_plain_codecs_take_the_zarr_free_path_too(
    tmp_path: Path, sequences: list[np.ndarray], name: str, array: dict[str, Any]
) -> None:
    path = zarr_written(tmp_path, written(tmp_path, sequences), f"{name}.zarr", **array)
    assert parse_local_split(str(path), "train", "x") is not None
    for packing in (True, False):
        assert assert_serves_oracle(path, packing, [0, 5, 9]) is LocalTokenSource


@pytest.mark.parametrize(
    "name,array",
    [
        ("v3-zstd", dict(chunks=(1000,), compressors=ZstdCodec())),
        ("v3-sharded", dict(chunks=(500,), shards=(2000,), compressors=BloscCodec())),
    ],
)
def test_other_layouts_are_read_through_zarr(
    tmp_path: Path, sequences: list[np.ndarray], name: str, array: dict[str, Any]
) -> None:
    path = zarr_written(tmp_path, written(tmp_path, sequences), f"{name}.zarr", **array)
    assert parse_local_split(str(path), "train", "x") is None
    assert assert_serves_oracle(path, True, [0, 5]) is ZarrTokenSource


CLOUD_AND_CODEC_MODULES = (
    "zarr",
    "fsspec",
    "numcodecs",
    "s3fs",
    "gcsfs",
    "obstore",
    "aiohttp",
    "botocore",
    "aiobotocore",
    "google",
)


def test_a_restart_imports_no_zarr(tmp_path: Path, sequences: list[np.ndarray]) -> None:
    """A fresh process's loader on a local store, to its first batch of a mid-epoch step,
    imports neither zarr, its codecs, fsspec nor any cloud client (their imports alone cost a
    restart 0.1-0.3 s)."""
    path = written(tmp_path, sequences, zarr_format=2)
    step = 9
    script = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np
        import asyncflat
        p = asyncflat.FlatTokensParams({str(path)!r}, 1, 4, 16, seed=3, sequence_packing=True)
        b = asyncflat.TokenBatchParams(len={BATCH.len}, batch={BATCH.batch})
        with asyncflat.ShufflingLoader("train", p, b) as loader:
            batch = loader.load({step})
            kind = type(loader.source).__name__
        print(json.dumps({{
            "imported": [m for m in {list(CLOUD_AND_CODEC_MODULES)!r} if m in sys.modules],
            "source": kind,
            "targets": np.asarray(batch.targets).tolist(),
        }}))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] == [] and result["source"] == "LocalTokenSource"
    expected = oracle(path, params(path), BATCH).batch(step)[0]
    np.testing.assert_array_equal(np.array(result["targets"], np.uint32), expected)


def test_a_cold_start_runs_no_subprocess(tmp_path: Path, sequences: list[np.ndarray]) -> None:
    """Construction and the first loads of a checksummed local store (the writer's default)
    start no subprocess: the first checksums looked for the system's crc32c library with
    ``ldconfig`` and ``gcc`` (six processes forked from the trainer on its way to step 0)."""
    path = written(tmp_path, sequences, zarr_format=3)
    script = textwrap.dedent(
        f"""
        import subprocess
        import asyncflat, jax
        jax.devices()
        started = []
        class Recorded(subprocess.Popen):
            def __init__(self, args, *rest, **kwargs):
                started.append(args)
                super().__init__(args, *rest, **kwargs)
        subprocess.Popen = Recorded
        p = asyncflat.FlatTokensParams({str(path)!r}, 1, 4, 16, seed=3, sequence_packing=True)
        b = asyncflat.TokenBatchParams(len={BATCH.len}, batch={BATCH.batch})
        with asyncflat.ShufflingLoader("train", p, b) as loader:
            for step in range(min(loader.step_count, 12)):
                loader.load(step)
        print(started)
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


# -- what falls back, and with which errors ------------------------------------------------------


def test_an_invalid_split_is_reported_by_zarrs_open(
    tmp_path: Path, sequences: list[np.ndarray]
) -> None:
    path = written(tmp_path, sequences)
    meta = path / "train" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["max_token_id"] = "many"
    meta.write_text(json.dumps(doc))
    assert parse_local_split(str(path), "train", "x") is None
    with pytest.raises(DatasetFormatError, match="max_token_id must be an integer"):
        ShufflingLoader("train", params(path), BATCH)


@pytest.mark.parametrize("where", ["train/encoded_tokens", "train/seq_starts", "train"])
@pytest.mark.parametrize(
    "extension,ignorable",
    [
        ({"must_understand": False, "note": "x"}, True),
        ({"must_understand": True}, False),
        ({"note": "x"}, False),  # must_understand defaults to true
        (5, False),
    ],
    ids=["optional", "required", "unmarked", "not-an-object"],
)
def test_zarr3_extensions_are_honoured_as_zarrs_open_does(
    tmp_path: Path, sequences: list[np.ndarray], where: str, extension: Any, ignorable: bool
) -> None:
    """An unknown field of a zarr 3 document may be skipped only when it says it may: one the
    reader must understand sends the split to zarr's open (which refuses it), never served.
    (zarr 3.1 itself refuses any extra field of a group: the oracle reads the store as written.)"""
    path = written(tmp_path, sequences)
    reference = oracle(path, params(path), BATCH)
    meta = path / where / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["an_extension"] = extension
    meta.write_text(json.dumps(doc))
    if ignorable:
        assert parse_local_split(str(path), "train", "x") is not None
        assert assert_serves_oracle(path, True, [0, 5], reference) is LocalTokenSource
    else:
        assert parse_local_split(str(path), "train", "x") is None
        with pytest.raises(DatasetFormatError, match="an_extension"):
            ShufflingLoader("train", params(path), BATCH)


def _edit(path: Path, key: str, change: Any) -> None:
    doc = json.loads((path / key).read_text())
    change(doc)
    (path / key).write_text(json.dumps(doc))


def _blosc(doc: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in doc["codecs"] if c["name"] == "blosc")["configuration"]


T3, G3, T2 = "train/encoded_tokens/zarr.json", "train/zarr.json", "train/encoded_tokens/.zarray"
#: Metadata zarr's open refuses (each once served by the zarr-free reader): (format, edit).
REFUSED_BY_ZARR: dict[str, tuple[int, Any]] = {
    "v3-root-is-an-array": (
        3,
        lambda p: _edit(p, "zarr.json", lambda d: d.update(node_type="array")),
    ),
    "v3-root-says-format-2": (
        3,
        lambda p: _edit(p, "zarr.json", lambda d: d.update(zarr_format=2)),
    ),
    "v3-root-extension": (3, lambda p: _edit(p, "zarr.json", lambda d: d.update(ext={"x": 1}))),
    "v3-blosc-cname": (3, lambda p: _edit(p, T3, lambda d: _blosc(d).update(cname="bogus"))),
    "v3-blosc-shuffle": (3, lambda p: _edit(p, T3, lambda d: _blosc(d).update(shuffle="bogus"))),
    "v3-blosc-typesize-0": (3, lambda p: _edit(p, T3, lambda d: _blosc(d).update(typesize=0))),
    "v3-blosc-unknown-key": (3, lambda p: _edit(p, T3, lambda d: _blosc(d).update(foo=1))),
    "v3-bytes-unknown-key": (
        3,
        lambda p: _edit(
            p, T3, lambda d: d["codecs"][0].setdefault("configuration", {}).update(foo=1)
        ),
    ),
    "v3-grid-unknown-key": (
        3,
        lambda p: _edit(p, T3, lambda d: d["chunk_grid"]["configuration"].update(foo=1)),
    ),
    "v3-key-encoding-unknown-key": (
        3,
        lambda p: _edit(p, T3, lambda d: d["chunk_key_encoding"]["configuration"].update(foo=1)),
    ),
    "v3-key-encoding-null-configuration": (
        3,
        lambda p: _edit(p, T3, lambda d: d["chunk_key_encoding"].update(configuration=None)),
    ),
    "v3-key-encoding-null-separator": (
        3,
        lambda p: _edit(
            p, T3, lambda d: d["chunk_key_encoding"].update(configuration={"separator": None})
        ),
    ),
    "v3-fill-missing": (3, lambda p: _edit(p, T3, lambda d: d.pop("fill_value"))),
    "v3-fill-string": (3, lambda p: _edit(p, T3, lambda d: d.update(fill_value="hello"))),
    "v3-fill-negative": (3, lambda p: _edit(p, T3, lambda d: d.update(fill_value=-1))),
    "v3-dimension-names-2": (
        3,
        lambda p: _edit(p, T3, lambda d: d.update(dimension_names=["x", "y"])),
    ),
    "v3-dimension-names-int": (3, lambda p: _edit(p, T3, lambda d: d.update(dimension_names=5))),
    "v3-consolidated-not-an-object": (
        3,
        lambda p: _edit(p, G3, lambda d: d.update(consolidated_metadata=5)),
    ),
    "v2-fill-missing": (2, lambda p: _edit(p, T2, lambda d: d.pop("fill_value"))),
    "v2-fill-string": (2, lambda p: _edit(p, T2, lambda d: d.update(fill_value="hello"))),
    "v2-order-missing": (2, lambda p: _edit(p, T2, lambda d: d.pop("order"))),
    "v2-separator": (2, lambda p: _edit(p, T2, lambda d: d.update(dimension_separator="x"))),
    "v2-blosc-unknown-key": (2, lambda p: _edit(p, T2, lambda d: d["compressor"].update(foo=1))),
    "v2-root-zgroup-empty": (2, lambda p: (p / ".zgroup").write_text("{}")),
    "v2-root-zgroup-format-3": (2, lambda p: (p / ".zgroup").write_text('{"zarr_format": 3}')),
    "v2-split-is-also-an-array": (
        2,
        lambda p: (p / "train/.zarray").write_text((p / T2).read_text()),
    ),
    "v2-split-zgroup-format-3": (
        2,
        lambda p: (p / "train/.zgroup").write_text('{"zarr_format": 3}'),
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED_BY_ZARR))
def test_metadata_zarr_refuses_is_never_served_without_zarr(
    tmp_path: Path, sequences: list[np.ndarray], case: str
) -> None:
    """Whatever zarr's open refuses goes to zarr's open, on the plain path as through a URL."""
    zarr_format, damage = REFUSED_BY_ZARR[case]
    path = written(tmp_path, sequences, zarr_format=zarr_format)
    damage(path)
    assert parse_local_split(str(path), "train", "x") is None
    errors = []
    for where in (str(path), f"file://{path}"):  # plain, and zarr's path by construction
        with pytest.raises(AsyncflatError) as raised:
            with ShufflingLoader(
                "train", FlatTokensParams(where, 1, 4, 16, seed=3, sequence_packing=True), BATCH
            ) as ld:
                ld.load(0)
        errors.append(type(raised.value))
    assert errors[0] is errors[1]


def test_split_consolidated_metadata_is_left_to_zarr(
    tmp_path: Path, sequences: list[np.ndarray]
) -> None:
    """``zarr.consolidate_metadata`` on a split writes its arrays' documents into the split's;
    zarr's open may read those, stale or not: the zarr-free reader, which would read the arrays'
    own, leaves the split to zarr so a store serves the same batches however it is named."""
    path = written(tmp_path, sequences)
    with warnings.catch_warnings():  # "not part of the zarr 3 specification"
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path), path="train")
    assert json.loads((path / G3).read_text()).get("consolidated_metadata")
    assert parse_local_split(str(path), "train", "x") is None
    plain = assert_serves_oracle(path, True, [0, 3])
    assert plain is ZarrTokenSource


def test_a_huge_seq_starts_chunk_is_refused_without_allocating_it(
    tmp_path: Path, sequences: list[np.ndarray]
) -> None:
    """seqax's delta filter makes the size check of a ``seq_starts`` chunk inexact; a document
    claiming 2^40-item chunks once made the reader allocate 8 TiB (MemoryError) before reading
    the object. Now such a split goes to zarr, whose read of it fails as a library error."""
    path = written(tmp_path, sequences, zarr_format=2)
    _edit(path, "train/seq_starts/.zarray", lambda d: d.update(chunks=[2**40]))
    assert parse_local_split(str(path), "train", "x") is None
    with pytest.raises(AsyncflatError, match="seq_starts"):
        ShufflingLoader("train", params(path), BATCH)


@pytest.mark.parametrize("typesize", [3, 5])
def test_blosc_frames_whose_typesize_does_not_divide_the_chunk_are_read(
    tmp_path: Path, sequences: list[np.ndarray], typesize: int
) -> None:
    """A frame's last bytes short of a whole item of its typesize come only out of a decode of
    the whole frame: a ranged read reaching them must fetch every block (it once failed with
    "Blosc returned -1" on zarr-written stores, plain path and zarr's alike)."""
    source = written(tmp_path, sequences)
    codec = BloscCodec(typesize=typesize, shuffle="shuffle", blocksize=1000)
    path = zarr_written(tmp_path, source, f"ts{typesize}.zarr", chunks=(4096,), compressors=codec)
    reference = oracle(path, params(path), BATCH)
    for where in (str(path), f"file://{path}"):
        p = FlatTokensParams(where, 1, 4, 16, seed=3, sequence_packing=True)
        with ShufflingLoader("train", p, BATCH) as loader:
            for step in range(loader.step_count):
                targets, _ = reference.batch(step)
                np.testing.assert_array_equal(np.asarray(loader.load(step).targets), targets)


def test_a_bad_end_entry_is_reported_by_zarrs_open(
    tmp_path: Path, sequences: list[np.ndarray]
) -> None:
    path = written(tmp_path, sequences)
    starts: Any = zarr.open_array(str(path / "train" / "seq_starts"), mode="r+")
    starts[-1] = int(starts[-1]) + 5
    with pytest.raises(DatasetFormatError, match=r"seq_starts\[-1\] == len\(encoded_tokens\)"):
        ShufflingLoader("train", params(path), BATCH)


# -- hostile objects meet the zarr-free reader ---------------------------------------------------


def first_token_chunk(path: Path) -> Path:
    return path / "train" / "encoded_tokens" / "c" / "0"


@pytest.mark.parametrize("damage", ["truncated", "missing", "oversized", "fifo", "outside"])
def test_hostile_chunk_objects_are_refused_naming_the_file(
    tmp_path: Path, sequences: list[np.ndarray], damage: str
) -> None:
    path = written(tmp_path, sequences)
    chunk = first_token_chunk(path)
    data = chunk.read_bytes()
    chunk.unlink()
    if damage == "truncated":
        chunk.write_bytes(data[: len(data) // 2])
    elif damage == "oversized":
        chunk.write_bytes(data + bytes(4 * 4096 + 64))
    elif damage == "fifo":
        os.mkfifo(chunk)
    elif damage == "outside":
        outside = tmp_path / "elsewhere"
        outside.write_bytes(data)
        chunk.symlink_to(outside)
    loader = ShufflingLoader("train", params(path), BATCH)
    try:
        assert isinstance(loader.source, LocalTokenSource)
        with pytest.raises(CorruptChunkError) as raised:
            for step in range(loader.plan.step_count):
                loader.load(step)
        assert "encoded_tokens" in str(raised.value) and "c/0" in str(raised.value)
    finally:
        loader.close()


def test_a_damaged_seq_starts_chunk_is_refused_when_read(
    tmp_path: Path, sequences: list[np.ndarray]
) -> None:
    """Unpacked rows read ``seq_starts`` through the zarr-free reader: a chunk whose Blosc
    header lies about its size is refused before any decoder sees it."""
    path = written(tmp_path, sequences)
    with ShufflingLoader("train", params(path, packing=False), BATCH) as loader:
        assert isinstance(loader.source, LocalTokenSource)  # the loader's reader: this one

    async def main() -> None:
        source = await LocalTokenSource.open_plain(str(path), "train")
        assert isinstance(source, LocalTokenSource)
        chunk = path / "train" / "seq_starts" / "c" / "0"
        frame = bytearray(chunk.read_bytes())
        frame[4:8] = (1 << 30).to_bytes(4, "little")  # decodes to 1 GiB, it says
        chunk.write_bytes(bytes(frame))
        try:
            with pytest.raises(CorruptChunkError, match="refused before decoding"):
                await source.read_seq_starts(0, 10)
        finally:
            await source.aclose()

    asyncio.run(main())
