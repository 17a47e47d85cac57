"""Row reads of a local store (``pread`` on the engine's thread) meet hostile objects.

A load that arrives before its blocks reads its few rows straight from the chunk file, without
the store layer. That path must refuse what the store layer refuses: a FIFO (which would block
the engine's thread forever), a device, a directory, a symlink out of the store, an object
larger than any legal encoding of its chunk, with a :class:`CorruptChunkError` naming the file,
and keep reading a symlink that stays inside the store.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from conftest import random_sequences

import asyncflat.storage.local_files
from asyncflat import CorruptChunkError, FlatTokensWriter
from asyncflat.format.codec import encode_sequences
from asyncflat.source.zarr_source import ZarrTokenSource

pytestmark = pytest.mark.timeout(30)  # a hang (a FIFO opened blocking) fails, not waits

CHUNK = 1024


def write(path: Path, codec: str) -> np.ndarray:
    sequences = random_sequences(11, 120)
    encoded, lengths = encode_sequences(sequences)
    if codec == "blosc":
        with FlatTokensWriter(path, zarr_format=2, chunk_tokens=CHUNK) as writer:
            writer.append("train", sequences)
    else:  # uncompressed: row reads are plain ranged reads of the chunk file
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64)
        group = zarr.open_group(str(path), mode="w", zarr_format=3).create_group("train")
        group.create_array(
            "encoded_tokens", shape=encoded.shape, chunks=(CHUNK,), dtype="uint32", compressors=None
        )[:] = encoded
        group.create_array("seq_starts", shape=starts.shape, chunks=(4096,), dtype="uint64")[:] = (
            starts
        )
        group.attrs["max_token_id"] = int((encoded >> 1).max())
    return encoded


def chunk_path(path: Path, index: int) -> Path:
    base = path / "train" / "encoded_tokens"
    return next(p for p in (base / "c" / str(index), base / str(index)) if p.exists())


def read_rows(
    path: Path, monkeypatch: pytest.MonkeyPatch, plant: Callable[[Path], None]
) -> tuple[list[tuple[str, str]], Any]:
    """Open the split, read rows of chunk 0, ``plant`` something at chunk 1's file, read rows
    of chunk 1. Returns the files ``pread`` was asked for and the rows read (or the error)."""
    calls: list[tuple[str, str]] = []
    real_pread, real_pread_into = (
        asyncflat.storage.local_files.pread,
        asyncflat.storage.local_files.pread_into,
    )

    def spy(root: str, key: str, *args: Any, **kwargs: Any) -> bytes:
        calls.append((root, key))
        return real_pread(root, key, *args, **kwargs)

    def spy_into(root: str, key: str, *args: Any, **kwargs: Any) -> None:
        calls.append((root, key))
        real_pread_into(root, key, *args, **kwargs)

    monkeypatch.setattr(asyncflat.storage.local_files, "pread", spy)
    monkeypatch.setattr(asyncflat.storage.local_files, "pread_into", spy_into)

    async def main() -> Any:
        source = await ZarrTokenSource.open(str(path), "train")
        try:
            first = np.empty(16, np.uint32)
            await source.read_items(0, 100, first)
            plant(chunk_path(path, 1))
            rows = np.empty(16, np.uint32)
            try:
                await source.read_items(1, 200, rows)
            except CorruptChunkError as exc:
                return first, exc
            return first, rows
        finally:
            await source.aclose()

    first, outcome = asyncio.run(asyncio.wait_for(main(), timeout=20))
    return calls, (first, outcome)


def make_fifo(target: Path) -> None:
    target.unlink()
    os.mkfifo(target)


def make_directory(target: Path) -> None:
    target.unlink()
    target.mkdir()
    (target / "inner").write_bytes(b"x" * 64)


def make_device(target: Path) -> None:
    target.unlink()
    try:
        os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is
    except PermissionError:
        pytest.skip("this machine does not let the tests make a device node (mknod)")


def make_sparse(target: Path) -> None:
    with open(target, "r+b") as f:
        f.truncate(8 << 30)  # 8 GiB, 0 bytes on disk


def link_out(target: Path) -> None:
    target.unlink()
    target.symlink_to("/dev/zero")


@pytest.mark.parametrize("codec", ["blosc", "raw"])
@pytest.mark.parametrize(
    "plant,words",
    [
        (make_fifo, ["is a FIFO, not a regular file", "refused unread"]),
        (make_directory, ["is a directory, not a regular file"]),
        (make_device, ["is a device, not a regular file"]),
        (make_sparse, ["8589934592 bytes", "more than any legal encoding", "refused unread"]),
        (link_out, ["symlink to /dev/zero, outside the store"]),
    ],
    ids=["fifo", "directory", "device", "sparse-8GiB", "symlink-out"],
)
def test_a_row_read_refuses_what_is_not_a_chunk_file(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    codec: str,
    plant: Callable[[Path], None],
    words: list[str],
) -> None:
    path = tmp_path / "d.zarr"
    encoded = write(path, codec)
    calls, (first, outcome) = read_rows(path, monkeypatch, plant)
    np.testing.assert_array_equal(first, encoded[100:116])
    assert calls and all(key.startswith("train/encoded_tokens/") for _, key in calls), calls
    assert any(key.endswith("1") for _, key in calls), calls  # chunk 1 went through pread
    assert isinstance(outcome, CorruptChunkError), f"expected a refusal, read {outcome}"
    message = str(outcome)
    assert str(chunk_path(path, 1)) in message, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("codec", ["blosc", "raw"])
def test_a_row_read_follows_a_symlink_inside_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    path = tmp_path / "d.zarr"
    encoded = write(path, codec)

    def link_in(target: Path) -> None:
        moved = path / "train" / "moved-chunk"
        target.rename(moved)
        target.symlink_to(moved)

    calls, (_, rows) = read_rows(path, monkeypatch, link_in)
    assert any(key.endswith("1") for _, key in calls), calls
    assert not isinstance(rows, Exception), rows
    np.testing.assert_array_equal(rows, encoded[CHUNK + 200 : CHUNK + 216])


def test_a_row_read_refuses_a_chunk_directory_linked_out_of_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file itself is regular, but a directory on its way leads out of the store."""
    path = tmp_path / "d.zarr"
    write(path, "raw")
    outside = tmp_path / "elsewhere"

    def move_out(target: Path) -> None:
        chunks = target.parent
        chunks.rename(outside)
        chunks.symlink_to(outside)

    _, (_, outcome) = read_rows(path, monkeypatch, move_out)
    assert isinstance(outcome, CorruptChunkError), outcome
    assert "outside the store" in str(outcome) and str(outside) in str(outcome), str(outcome)


class _Writer:
    """The engine's side of a fill unit, reduced to running the decode."""

    async def write(self, fill_targets: Callable[[], None]) -> bool:
        fill_targets()
        return True


async def read_chunk_1(source: ZarrTokenSource, path_kind: str) -> np.ndarray:
    """Tokens 200-215 of chunk 1, as a load's rows read them or as a fill's unit does."""
    out = np.empty(16, np.uint32)
    if path_kind == "rows":
        await source.read_items(1, 200, out)
    else:
        start = CHUNK + 200
        await source.read_into(start, start + 16, [(200, out)], _Writer())
    return out


@pytest.mark.parametrize("stand_in_kind", ["other-tokens", "same-tokens-uncompressed"])
@pytest.mark.parametrize("path_kind", ["rows", "fill"])
def test_a_chunk_replaced_and_restored_reads_as_restored(
    tmp_path: Path, path_kind: str, stand_in_kind: str
) -> None:
    """The frame layout cached for a chunk read while another object stood in its place (a
    repair, a rewrite in place) neither fails nor misreads the reads after the original is
    back: an uncompressed stand-in's layout would read compressed bytes as tokens, silently."""
    path = tmp_path / "d.zarr"
    encoded = write(path, "blosc")
    original = chunk_path(path, 1).read_bytes()
    if stand_in_kind == "other-tokens":
        other = tmp_path / "other.zarr"
        with FlatTokensWriter(other, zarr_format=2, chunk_tokens=CHUNK) as writer:
            writer.append("train", random_sequences(23, 300))
        stand_in = chunk_path(other, 1).read_bytes()
    else:
        from numcodecs import Blosc

        stand_in = bytes(Blosc(cname="lz4", clevel=0).encode(encoded[CHUNK : 2 * CHUNK]))
    assert len(stand_in) != len(original)  # a different layout, not just different tokens

    async def main() -> tuple[np.ndarray, np.ndarray]:
        source = await ZarrTokenSource.open(str(path), "train")
        try:
            chunk_path(path, 1).write_bytes(stand_in)
            during = await read_chunk_1(source, path_kind)
            chunk_path(path, 1).write_bytes(original)
            return during, await read_chunk_1(source, path_kind)
        finally:
            await source.aclose()

    during, after = asyncio.run(asyncio.wait_for(main(), timeout=20))
    same = np.array_equal(during, encoded[CHUNK + 200 : CHUNK + 216])
    assert same == (stand_in_kind == "same-tokens-uncompressed")  # the stand-in was read
    np.testing.assert_array_equal(after, encoded[CHUNK + 200 : CHUNK + 216])


@pytest.mark.parametrize("path_kind", ["rows", "fill"])
def test_a_chunk_replaced_by_another_encoding_of_the_same_size_is_read_as_it_is_now(
    tmp_path: Path, path_kind: str
) -> None:
    """A chunk rewritten in place with another Blosc encoding of the same tokens, padded to the
    very same size (so the size check of the cached layout cannot tell them apart), is read
    through its own header and block table, not the predecessor's: the same tokens, before and
    after (the predecessor's layout read compressed bytes as tokens, silently)."""
    import struct

    from numcodecs import Blosc

    path = tmp_path / "d.zarr"
    encoded = write(path, "blosc")
    tokens = encoded[CHUNK : 2 * CHUNK]
    # The chunk stored uncompressed first (a legal frame: clevel 0), then lz4 padded to its size.
    stored = bytes(Blosc(cname="lz4", clevel=0).encode(tokens))
    other = bytearray(Blosc(cname="lz4", clevel=5).encode(tokens))
    assert len(other) < len(stored)
    other += bytes(len(stored) - len(other))
    other[12:16] = struct.pack("<I", len(stored))  # the header's compressed size: the padded one
    assert np.array_equal(np.frombuffer(Blosc().decode(bytes(other)), np.uint32), tokens)
    chunk_path(path, 1).write_bytes(stored)

    async def main() -> tuple[np.ndarray, np.ndarray]:
        source = await ZarrTokenSource.open(str(path), "train")
        try:
            before = await read_chunk_1(source, path_kind)  # caches the uncompressed frame's layout
            chunk_path(path, 1).write_bytes(bytes(other))
            return before, await read_chunk_1(source, path_kind)
        finally:
            await source.aclose()

    before, after = asyncio.run(asyncio.wait_for(main(), timeout=20))
    np.testing.assert_array_equal(before, encoded[CHUNK + 200 : CHUNK + 216])
    np.testing.assert_array_equal(after, encoded[CHUNK + 200 : CHUNK + 216])


def read_chunk_1_outcome(path: Path, reader: str, how: str) -> BaseException | None:
    """What reading rows of chunk 1 (``how``: ``rows`` a row read, ``fill`` a fill's read)
    through ``reader`` (``zarr``, or ``plain``: the zarr-free reader) raises, if anything."""
    from asyncflat.source.local_source import LocalTokenSource

    async def main() -> BaseException | None:
        if reader == "zarr":
            source: Any = await ZarrTokenSource.open(str(path), "train")
        else:
            source = await LocalTokenSource.open_plain(str(path), "train")
            assert source is not None, "the zarr-free reader should open this layout"
        try:
            if how == "rows":
                await source.read_items(1, 200, np.empty(16, np.uint32))
            else:
                await source.read_tokens(CHUNK, CHUNK + 16)
        except Exception as exc:
            return exc
        finally:
            await source.aclose()
        return None

    return asyncio.run(asyncio.wait_for(main(), timeout=20))


@pytest.mark.parametrize(
    "codec,reader,how",
    [
        ("blosc", "zarr", "rows"),  # pread of the chunk file
        ("blosc", "zarr", "fill"),  # the store layer (zarr's local store)
        ("blosc", "plain", "rows"),  # the zarr-free reader
        ("blosc", "plain", "fill"),
        ("raw", "zarr", "rows"),
        ("raw", "zarr", "fill"),
    ],
)
@pytest.mark.parametrize("loop", ["self", "pair"])
def test_a_symlink_loop_is_a_corrupt_chunk_on_every_path(
    tmp_path: Path, codec: str, reader: str, how: str, loop: str
) -> None:
    """A chunk file that is a symlink loop is a damaged store on every read path: the same
    :class:`CorruptChunkError` naming the file (the row path raised StorageError, the store
    layer CorruptChunkError)."""
    path = tmp_path / "d.zarr"
    write(path, codec)
    target = chunk_path(path, 1)
    target.unlink()
    if loop == "self":
        target.symlink_to(target)
    else:
        other = target.parent / "other"
        other.symlink_to(target)
        target.symlink_to(other)

    outcome = read_chunk_1_outcome(path, reader, how)
    assert isinstance(outcome, CorruptChunkError), repr(outcome)
    assert str(target) in str(outcome), str(outcome)


@pytest.mark.parametrize("reader", ["zarr", "plain"])
@pytest.mark.parametrize("how", ["rows", "fill"])
def test_a_chunk_directory_that_is_a_file_is_a_corrupt_chunk_naming_it(
    tmp_path: Path, reader: str, how: str
) -> None:
    """A file where the layout has a directory (zarr 3's ``c/``) makes opening a chunk say
    "not a directory": a damaged store, named, on every read path (it was a bare
    ``StorageError`` quoting the errno)."""
    path = tmp_path / "d.zarr"
    with FlatTokensWriter(path, chunk_tokens=CHUNK) as writer:  # zarr 3: chunks under c/
        writer.append("train", random_sequences(11, 120))
    chunks = path / "train" / "encoded_tokens" / "c"
    for child in chunks.iterdir():
        child.unlink()
    chunks.rmdir()
    chunks.write_bytes(b"x")

    outcome = read_chunk_1_outcome(path, reader, how)
    assert isinstance(outcome, CorruptChunkError), repr(outcome)
    assert f"{chunks} is a file" in str(outcome), str(outcome)


@pytest.mark.parametrize("reader", ["zarr", "plain"])
def test_a_split_that_is_a_file_is_a_format_error_naming_it(tmp_path: Path, reader: str) -> None:
    """The same for metadata: a split that is a file is a dataset format error naming it."""
    from asyncflat import DatasetFormatError
    from asyncflat.source.local_source import LocalTokenSource

    path = tmp_path / "d.zarr"
    write(path, "blosc")
    split = path / "train"
    for child in sorted(split.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    split.rmdir()
    split.write_bytes(b"x")

    async def main() -> None:
        if reader == "plain":  # declines the layout, so a loader opens it with zarr (below)
            assert await LocalTokenSource.open_plain(str(path), "train") is None
        await ZarrTokenSource.open(str(path), "train")

    with pytest.raises(DatasetFormatError, match=f"{split} is a file"):
        asyncio.run(asyncio.wait_for(main(), timeout=20))
