"""Tests of asyncflat.writer.flat_tokens: round trips, stored layout, bounded buffering and crash safety."""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import subprocess
import sys
import tempfile
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
    DatasetFormatError,
    LoaderClosedError,
    StorageError,
)
from asyncflat.format.codec import decode
from asyncflat.format.split import SplitArrays, open_split
from asyncflat.storage.guarded import guard_store
from asyncflat.writer.flat_tokens import FlatTokensWriter, write_flat_tokens

# (zarr_format, chunk_tokens, shard_tokens)
LAYOUTS = [
    (2, 7, None),
    (2, 64, None),
    (3, 1, None),
    (3, 7, None),
    (3, 64, None),
    (3, 8, 32),
    (3, 5, 15),
]


def open_local(path: Path, split: str = "train") -> SplitArrays:
    raw = zarr.storage.LocalStore(str(path), read_only=True)
    store = guard_store(raw, str(path), allow_missing=True)
    return asyncio.run(open_split(store, split, name=str(path)))


def read_back(path: Path, split: str) -> list[np.ndarray]:
    """Read a split through plain zarr and cut it into sequences by seq_starts."""
    group = zarr.open_group(str(path), mode="r")[split]
    encoded = group["encoded_tokens"][:]
    starts = group["seq_starts"][:]
    targets, is_start = decode(encoded)
    # The start bits and seq_starts must agree with each other.
    np.testing.assert_array_equal(np.flatnonzero(is_start), starts[:-1].astype(np.int64))
    return [targets[starts[i] : starts[i + 1]] for i in range(len(starts) - 1)]


def assert_same_sequences(actual: list[np.ndarray], expected: list[Any]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, np.asarray(e))


def random_sequences(
    rng: np.random.Generator, count: int, max_len: int, max_id: int = 50_000
) -> list[np.ndarray]:
    return [rng.integers(0, max_id + 1, int(n)) for n in rng.integers(1, max_len + 1, count)]


def leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if ".partial-" in p.name or ".old-" in p.name)


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "chunk", "shard"), LAYOUTS)
def test_round_trip(tmp_path: Path, fmt: int, chunk: int, shard: int | None) -> None:
    rng = np.random.default_rng(chunk)
    # Many sequences span chunk boundaries (fewer with tiny chunks: one file per chunk is slow).
    train = random_sequences(rng, 300 if chunk >= 5 else 30, 40)
    validation = [[0], [2**31 - 1, 5], list(range(3 * chunk + 1))]  # one longer than 3 chunks
    path = tmp_path / "d.zarr"
    with FlatTokensWriter(path, zarr_format=fmt, chunk_tokens=chunk, shard_tokens=shard) as w:
        # Uneven append sizes: single sequences, small batches and one batch of many chunks.
        w.append("train", train[:1])
        w.append("train", train[1:10])
        w.append("validation", validation)
        w.append("train", train[10:])
        w.append("train", [])
    assert_same_sequences(read_back(path, "train"), train)
    assert_same_sequences(read_back(path, "validation"), validation)

    sa = open_local(path)
    token_count = sum(len(s) for s in train)
    assert (sa.zarr_format, sa.token_chunk, sa.tokens_per_object) == (fmt, chunk, shard or chunk)
    assert (sa.token_count, sa.sequence_count) == (token_count, len(train))
    assert token_count % (shard or chunk) != 0 or chunk == 1  # a final partial object is covered
    assert sa.max_token_id == max(int(s.max()) for s in train)
    assert open_local(path, "validation").max_token_id == 2**31 - 1
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(("fmt", "chunk", "shard"), [(2, 16, None), (3, 16, None), (3, 4, 16)])
def test_exact_multiple_of_chunk(tmp_path: Path, fmt: int, chunk: int, shard: int | None) -> None:
    seqs = [np.arange(1, 9)] * 8  # 64 tokens: whole chunks and shards, no partial one
    write_flat_tokens(
        tmp_path / "d", {"train": seqs}, zarr_format=fmt, chunk_tokens=chunk, shard_tokens=shard
    )
    assert_same_sequences(read_back(tmp_path / "d", "train"), seqs)
    assert open_local(tmp_path / "d").token_count == 64


def test_seq_starts_spanning_several_chunks(tmp_path: Path) -> None:
    # seq_starts is chunked by 65,536 entries; cross two chunk boundaries with a partial tail.
    seqs = np.arange(140_000, dtype=np.int64).reshape(70_000, 2) % 1000
    write_flat_tokens(tmp_path / "d", {"train": seqs}, chunk_tokens=1000)
    sa = open_local(tmp_path / "d")
    assert (sa.sequence_count, sa.token_count) == (70_000, 140_000)
    starts = zarr.open_group(str(tmp_path / "d"), mode="r")["train/seq_starts"][:]
    np.testing.assert_array_equal(starts, np.arange(0, 140_001, 2, dtype=np.uint64))
    assert_same_sequences(read_back(tmp_path / "d", "train"), list(seqs))


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12), max_size=25),
    chunk=st.integers(1, 20),
    shard_factor=st.sampled_from([None, 1, 3]),
    fmt=st.sampled_from([2, 3]),
    batch=st.integers(1, 7),
)
def test_round_trip_property(
    seqs: list[list[int]], chunk: int, shard_factor: int | None, fmt: int, batch: int
) -> None:
    shard = chunk * shard_factor if shard_factor and fmt == 3 else None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.zarr"
        with FlatTokensWriter(path, zarr_format=fmt, chunk_tokens=chunk, shard_tokens=shard) as w:
            for i in range(0, len(seqs), batch):
                w.append("validation", seqs[i : i + batch])
        assert_same_sequences(read_back(path, "validation"), seqs)
        assert_same_sequences(read_back(path, "train"), [])
        sa = open_local(path, "validation")
        assert sa.max_token_id == max((max(s) for s in seqs), default=0)


def test_untouched_splits_are_written_empty(tmp_path: Path) -> None:
    with FlatTokensWriter(tmp_path / "d"):
        pass
    for split in ("train", "validation"):
        sa = open_local(tmp_path / "d", split)
        assert (sa.token_count, sa.sequence_count, sa.max_token_id) == (0, 0, 0)
        assert zarr.open_group(str(tmp_path / "d"), mode="r")[split]["seq_starts"][:].tolist() == [
            0
        ]


def test_write_flat_tokens_lazy_and_2d(tmp_path: Path) -> None:
    gen = (np.full(n % 5 + 1, n, np.int32) for n in range(1000))
    packed = np.arange(60, dtype=np.uint16).reshape(6, 10)
    write_flat_tokens(tmp_path / "d", {"train": gen, "validation": packed}, chunk_tokens=32)
    assert_same_sequences(
        read_back(tmp_path / "d", "train"), [np.full(n % 5 + 1, n) for n in range(1000)]
    )
    assert_same_sequences(read_back(tmp_path / "d", "validation"), list(packed))
    assert open_local(tmp_path / "d", "validation").max_token_id == 59


def test_seqax_v2_helper_reads_like_writer_output(tmp_path: Path) -> None:
    seqs = random_sequences(np.random.default_rng(5), 50, 30)
    write_seqax_v2(tmp_path / "ref", {"train": seqs, "validation": seqs[:5]})
    write_flat_tokens(
        tmp_path / "ours",
        {"train": seqs, "validation": seqs[:5]},
        zarr_format=2,
        chunk_tokens=4_194_304,
    )
    for split in ("train", "validation"):
        ref = zarr.open_group(str(tmp_path / "ref"), mode="r")[split]
        ours = zarr.open_group(str(tmp_path / "ours"), mode="r")[split]
        for key in ("encoded_tokens", "seq_starts"):
            np.testing.assert_array_equal(ref[key][:], ours[key][:])
        assert ref.attrs["max_token_id"] == ours.attrs["max_token_id"]


# ---------------------------------------------------------------------------------------------
# Stored layout
# ---------------------------------------------------------------------------------------------

# What seqax's tools (zarr 2.x) wrote; copied by hand from a real seqax store's .zarray files.
SEQAX_BLOSC = {"blocksize": 0, "clevel": 5, "cname": "lz4", "id": "blosc", "shuffle": 2}
SEQAX_ENCODED_TOKENS_ZARRAY = {
    "chunks": [4194304],
    "compressor": SEQAX_BLOSC,
    "dtype": "<u4",
    "fill_value": None,
    "filters": None,
    "order": "C",
    "zarr_format": 2,
}
SEQAX_SEQ_STARTS_ZARRAY = {
    "chunks": [65536],
    "compressor": SEQAX_BLOSC,
    "dtype": "<u8",
    "fill_value": 0,
    "filters": [{"astype": "<i8", "dtype": "<i8", "id": "delta"}],
    "order": "C",
    "zarr_format": 2,
}


def assert_seqax_layout(
    path: Path, split: str, token_count: int, seq_count: int, max_token_id: int
) -> None:
    def load(*parts: str) -> dict[str, Any]:
        return json.loads(path.joinpath(*parts).read_text())

    assert load(".zgroup") == {"zarr_format": 2}
    assert load(split, ".zgroup") == {"zarr_format": 2}
    assert load(split, ".zattrs") == {"max_token_id": max_token_id}
    for key, expected, length in (
        ("encoded_tokens", SEQAX_ENCODED_TOKENS_ZARRAY, token_count),
        ("seq_starts", SEQAX_SEQ_STARTS_ZARRAY, seq_count + 1),
    ):
        meta = load(split, key, ".zarray")
        # zarr 3 always writes dimension_separator; "." is what zarr 2 meant by leaving it out.
        assert meta.pop("dimension_separator", ".") == "."
        assert meta == {**expected, "shape": [length]}


def test_seqax_v2_helper_matches_seqax_layout(tmp_path: Path) -> None:
    seqs = [np.array([5, 6]), np.array([7])]
    write_seqax_v2(
        tmp_path / "d",
        {"train": seqs, "validation": []},
        max_token_id={"train": 1017, "validation": 0},
    )
    assert_seqax_layout(tmp_path / "d", "train", 3, 2, 1017)
    assert_seqax_layout(tmp_path / "d", "validation", 0, 0, 0)


def test_writer_format2_matches_seqax_layout(tmp_path: Path) -> None:
    write_flat_tokens(
        tmp_path / "d", {"train": [[5, 6], [7]]}, zarr_format=2, chunk_tokens=4_194_304
    )
    assert_seqax_layout(tmp_path / "d", "train", 3, 2, 7)
    assert_seqax_layout(tmp_path / "d", "validation", 0, 0, 0)


def test_writer_format3_codecs(tmp_path: Path) -> None:
    write_flat_tokens(tmp_path / "summed", {"train": [[1]]}, chunk_tokens=1024)
    write_flat_tokens(tmp_path / "sharded", {"train": [[1]]}, chunk_tokens=1024, shard_tokens=4096)
    blosc = {
        "name": "blosc",
        "configuration": {
            "typesize": 4,
            "cname": "lz4",
            "clevel": 5,
            "shuffle": "bitshuffle",
            "blocksize": 32768,  # small blocks: a row read decodes a few KiB (test_source)
        },
    }
    crc = {"name": "crc32c"}

    # By default a crc32c after Blosc (which has none), so damage at rest is an error, not
    # wrong tokens: on every chunk of both arrays.
    summed = json.loads((tmp_path / "summed/train/encoded_tokens/zarr.json").read_text())
    assert summed["data_type"] == "uint32"
    assert summed["chunk_grid"]["configuration"]["chunk_shape"] == [1024]
    little = {"name": "bytes", "configuration": {"endian": "little"}}
    assert summed["codecs"] == [little, blosc, crc]
    starts = json.loads((tmp_path / "summed/train/seq_starts/zarr.json").read_text())
    assert starts["data_type"] == "uint64"
    assert starts["codecs"][1]["configuration"]["blocksize"] == 0
    assert starts["codecs"][2:] == [crc]
    assert starts["chunk_grid"]["configuration"]["chunk_shape"] == [65536]

    # checksum=False: the format-3 layout without them.
    write_flat_tokens(tmp_path / "plain", {"train": [[1]]}, chunk_tokens=1024, checksum=False)
    plain = json.loads((tmp_path / "plain/train/encoded_tokens/zarr.json").read_text())
    assert plain["codecs"] == [little, blosc]
    plain_starts = json.loads((tmp_path / "plain/train/seq_starts/zarr.json").read_text())
    assert [c["name"] for c in plain_starts["codecs"]] == ["bytes", "blosc"]
    with pytest.raises(ConfigError, match="checksum"):
        write_flat_tokens(tmp_path / "v2", {"train": [[1]]}, zarr_format=2, checksum=True)

    sharded = json.loads((tmp_path / "sharded/train/encoded_tokens/zarr.json").read_text())
    assert sharded["chunk_grid"]["configuration"]["chunk_shape"] == [4096]
    (codec,) = sharded["codecs"]
    assert codec["name"] == "sharding_indexed"
    assert codec["configuration"]["chunk_shape"] == [1024]
    assert codec["configuration"]["codecs"][1:] == [blosc, crc]  # each inner chunk has its own


def test_format2_stays_seqax_exact_without_checksums(tmp_path: Path) -> None:
    """Format 2 is seqax's exact layout: the default writes no checksum (docs/format.md)."""
    write_flat_tokens(tmp_path / "v2", {"train": [[1, 2]]}, zarr_format=2, chunk_tokens=1024)
    meta = json.loads((tmp_path / "v2/train/encoded_tokens/.zarray").read_text())
    assert meta["compressor"]["id"] == "blosc"
    assert meta["filters"] is None


# ---------------------------------------------------------------------------------------------
# Bounded buffering
# ---------------------------------------------------------------------------------------------


def staged_token_objects(tmp_path: Path, fmt: int) -> list[str]:
    (staging,) = [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    tokens = staging / "train" / "encoded_tokens"
    if fmt == 3:
        tokens = tokens / "c"
        return sorted(p.name for p in tokens.iterdir()) if tokens.exists() else []
    return sorted(p.name for p in tokens.iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize(("fmt", "shard"), [(2, None), (3, None), (3, 20)])
def test_whole_objects_are_written_as_they_fill(
    tmp_path: Path, fmt: int, shard: int | None
) -> None:
    unit = shard or 10
    with FlatTokensWriter(
        tmp_path / "d", zarr_format=fmt, chunk_tokens=10, shard_tokens=shard
    ) as w:
        w.append("train", [list(range(1, unit))])  # one token short of an object: still buffered
        assert staged_token_objects(tmp_path, fmt) == []
        w.append("train", [[1, 2]])  # fills the first object and starts the second
        assert staged_token_objects(tmp_path, fmt) == ["0"]
        w.append("train", [list(range(1, 2 * unit + 1))])  # passes the second and third
        assert staged_token_objects(tmp_path, fmt) == ["0", "1", "2"]
        assert not (tmp_path / "d").exists()
    assert open_local(tmp_path / "d").token_count == 3 * unit + 1


# ---------------------------------------------------------------------------------------------
# Staging, commit and crash safety
# ---------------------------------------------------------------------------------------------


def test_exception_inside_with_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with FlatTokensWriter(tmp_path / "d", chunk_tokens=4) as w:
            w.append("train", [[1, 2, 3, 4, 5, 6, 7, 8, 9]])
            raise RuntimeError("boom")
    assert not (tmp_path / "d").exists()
    assert leftovers(tmp_path) == []


def test_bad_append_inside_with_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token id -3"):
        with FlatTokensWriter(tmp_path / "d") as w:
            w.append("train", [[1, 2]])
            w.append("train", [[-3]])
    assert list(tmp_path.iterdir()) == []


def test_existing_path_without_overwrite_is_config_error(tmp_path: Path) -> None:
    write_flat_tokens(tmp_path / "d", {"train": [[1]]})
    with pytest.raises(ConfigError, match=r"already exists.*overwrite=True") as info:
        FlatTokensWriter(tmp_path / "d")
    assert isinstance(info.value, AsyncflatError)
    assert open_local(tmp_path / "d").token_count == 1  # untouched
    assert leftovers(tmp_path) == []


def test_path_appearing_before_commit_is_refused(tmp_path: Path) -> None:
    w = FlatTokensWriter(tmp_path / "d")
    w.append("train", [[1, 2]])
    (tmp_path / "d").mkdir()  # someone else got there first
    with pytest.raises(ConfigError, match="already exists"):
        w.close()
    assert list((tmp_path / "d").iterdir()) == []
    assert leftovers(tmp_path) == []


def test_overwrite_replaces_dataset(tmp_path: Path) -> None:
    write_flat_tokens(tmp_path / "d", {"train": [[1, 2, 3]]}, zarr_format=2)
    write_flat_tokens(tmp_path / "d", {"train": [[9]]}, overwrite=True)
    sa = open_local(tmp_path / "d")
    assert (sa.zarr_format, sa.token_count, sa.max_token_id) == (3, 1, 9)
    assert not (tmp_path / "d" / ".zgroup").exists()  # nothing of the old store survives
    assert leftovers(tmp_path) == []


def test_overwrite_refuses_a_file_and_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "d").write_text("not a dataset")
    with pytest.raises(ConfigError, match=r"d exists and is a file, not a flat-tokens store"):
        write_flat_tokens(tmp_path / "d", {"train": [[4]]}, overwrite=True)
    assert (tmp_path / "d").read_text() == "not a dataset"
    write_flat_tokens(tmp_path / "real", {"train": [[1]]})
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match=r"link exists and is a symlink"):
        write_flat_tokens(tmp_path / "link", {"train": [[4]]}, overwrite=True)
    assert open_local(tmp_path / "real").token_count == 1
    assert leftovers(tmp_path) == []


def test_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("mine")
    (project / "train").mkdir()
    with pytest.raises(ConfigError, match=r"not a flat-tokens store \(it holds README.md, src\)"):
        write_flat_tokens(project, {"train": [[4]]}, overwrite=True)
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "src", "train"]
    # A flat-tokens name at the top with a foreign file below it is refused too, naming it.
    (project / "README.md").unlink()
    (project / "src").rmdir()
    (project / "train" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"it holds train/notes.txt"):
        write_flat_tokens(project, {"train": [[4]]}, overwrite=True)
    assert leftovers(tmp_path) == []


def test_overwrite_replaces_an_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    write_flat_tokens(tmp_path / "d", {"train": [[4]]}, overwrite=True)
    assert open_local(tmp_path / "d").token_count == 1


def test_failed_overwrite_keeps_old_dataset(tmp_path: Path) -> None:
    write_flat_tokens(tmp_path / "d", {"train": [[1, 2, 3]]})
    with pytest.raises(KeyError):
        with FlatTokensWriter(tmp_path / "d", overwrite=True) as w:
            w.append("train", [[7]])
            raise KeyError("interrupted")
    assert_same_sequences(read_back(tmp_path / "d", "train"), [[1, 2, 3]])
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("interrupt", ["ctrl-c after the rename", "ctrl-c before", "eio after"])
def test_an_overwrites_commit_interrupted_leaves_one_dataset_and_no_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: str
) -> None:
    """The commit moves the previous dataset aside, renames the new one in, then flushes the
    parent directory. A Ctrl-C in that last flush comes after the commit: the new dataset is
    in place and the previous one, moved aside, is removed (it was left behind as an orphan
    ``<path>.old-*``). One in a flush before the rename leaves the previous dataset as it was.
    A disk error in the last flush says the commit happened but may not be durable, and keeps
    the previous dataset where it names it (it was removed, under "cannot commit")."""
    write_flat_tokens(tmp_path / "d", {"train": [[1, 2, 3]]})
    fsync = os.fsync
    parent = str(tmp_path)

    def interrupted(fd: int) -> None:
        where = os.readlink(f"/proc/self/fd/{fd}")
        if interrupt == "ctrl-c before" and ".partial-" in where:
            raise KeyboardInterrupt
        if where == parent and interrupt == "ctrl-c after the rename":
            raise KeyboardInterrupt
        if where == parent and interrupt == "eio after":
            raise OSError(errno.EIO, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupted)
    error = StorageError if interrupt == "eio after" else KeyboardInterrupt
    with pytest.raises(error) as info:
        write_flat_tokens(tmp_path / "d", {"train": [[7]]}, overwrite=True)
    monkeypatch.setattr(os, "fsync", fsync)
    expected = [[1, 2, 3]] if interrupt == "ctrl-c before" else [[7]]
    assert_same_sequences(read_back(tmp_path / "d", "train"), expected)
    if interrupt == "eio after":
        (kept,) = leftovers(tmp_path)
        assert str(info.value).startswith(f"committed {tmp_path / 'd'}, but flushing")
        assert f"the previous dataset is kept at {tmp_path / kept}" in str(info.value)
        assert_same_sequences(read_back(tmp_path / kept, "train"), [[1, 2, 3]])
    else:
        assert leftovers(tmp_path) == []


def test_close_is_idempotent_and_append_after_close_fails(tmp_path: Path) -> None:
    w = FlatTokensWriter(tmp_path / "d")
    w.append("train", [[1]])
    w.close()
    w.close()
    with pytest.raises(LoaderClosedError, match="is closed"):
        w.append("train", [[2]])
    assert open_local(tmp_path / "d").token_count == 1


def test_abort_discards(tmp_path: Path) -> None:
    w = FlatTokensWriter(tmp_path / "d")
    w.append("train", [[1]])
    w.abort()
    w.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(LoaderClosedError):
        w.append("train", [[2]])


def test_dropped_writer_removes_staging(tmp_path: Path) -> None:
    w = FlatTokensWriter(tmp_path / "d")
    w.append("train", [[1]])
    assert leftovers(tmp_path) != []
    del w
    gc.collect()
    assert list(tmp_path.iterdir()) == []


CRASHING_WRITER = """
import os, sys
from asyncflat.writer.flat_tokens import FlatTokensWriter
w = FlatTokensWriter(sys.argv[1], chunk_tokens=4, overwrite=True)
w.append("train", [list(range(1, 50))] * 10)
os._exit(0)  # as if killed: no close(), no __exit__, no finalizers
"""


@pytest.mark.parametrize("previous", [False, True])
def test_killed_writer_leaves_previous_state_or_nothing(tmp_path: Path, previous: bool) -> None:
    path = tmp_path / "d"
    if previous:
        write_flat_tokens(path, {"train": [[1, 2, 3]]})
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run(
        [sys.executable, "-c", CRASHING_WRITER, str(path)], check=True, env=env, timeout=120
    )
    if previous:
        assert_same_sequences(read_back(path, "train"), [[1, 2, 3]])
    else:
        assert not path.exists()
        with pytest.raises(DatasetFormatError, match="missing flat-tokens zarr group"):
            open_local(path)
    (partial,) = leftovers(tmp_path)  # the crash leaves only its staging directory behind
    assert partial.startswith("d.partial-")


# ---------------------------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_tokens": 0}, r"chunk_tokens must be >= 1, got 0"),
        ({"chunk_tokens": -4}, r"chunk_tokens must be >= 1, got -4"),
        ({"chunk_tokens": 4.0}, r"chunk_tokens must be an integer, got 4.0"),
        ({"chunk_tokens": True}, r"chunk_tokens must be an integer, got True"),
        # more than Blosc encodes: refused here, not at the first chunk's encoding
        ({"chunk_tokens": 1 << 29}, r"chunk_tokens must be at most 536870907 .*got 536870912"),
        ({"zarr_format": 1}, r"zarr_format must be 2 or 3, got 1"),
        ({"zarr_format": True}, r"zarr_format must be 2 or 3, got True"),
        (
            {"zarr_format": 2, "shard_tokens": 8, "chunk_tokens": 4},
            r"shard_tokens needs zarr_format=3",
        ),
        (
            {"shard_tokens": 10, "chunk_tokens": 4},
            r"shard_tokens \(10\) must be a multiple of chunk_tokens \(4\)",
        ),
        ({"shard_tokens": 0}, r"shard_tokens must be >= 1, got 0"),
        ({"overwrite": "yes"}, r"overwrite must be a bool"),
    ],
)
def test_invalid_arguments(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FlatTokensWriter(tmp_path / "d", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_missing_parent_directories_are_created(tmp_path: Path) -> None:
    write_flat_tokens(tmp_path / "no" / "such" / "d", {"train": [[5, 6]]})
    assert open_local(tmp_path / "no" / "such" / "d").token_count == 2
    assert [p.name for p in (tmp_path / "no" / "such").iterdir()] == ["d"]


def test_unwritable_parent_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match=r"cannot create the parent directory .*file/sub"):
        FlatTokensWriter(tmp_path / "file" / "sub" / "d")


@pytest.mark.parametrize(
    ("split", "seqs", "match"),
    [
        ("test", [[1]], r"split must be one of \('train', 'validation'\), got 'test'"),
        ("train", [[1, -1]], r"token id -1 is outside \[0, 2\*\*31\)"),
        ("train", [[2**31]], r"token id 2147483648 is outside"),
        ("train", [[1], []], r"sequence 1 is empty"),
        ("train", [0.5], r"must be 1-D"),
    ],
)
def test_invalid_append(tmp_path: Path, split: str, seqs: Any, match: str) -> None:
    with FlatTokensWriter(tmp_path / "d") as w:
        with pytest.raises(ConfigError, match=match):
            w.append(split, seqs)
        w.append("train", [[3]])  # a rejected append changes nothing; the writer stays usable
    assert_same_sequences(read_back(tmp_path / "d", "train"), [[3]])
