"""Checksums by default (issue 37): a store written with the writer's defaults carries zarr's
crc32c on every chunk, and a flipped bit in an ``encoded_tokens`` chunk object is a
``CorruptChunkError`` naming the object and both checksums, on the fill path and on the row
path, read by the zarr-free local reader and through zarr alike; a store without checksums
(seqax's layout) reads as before, and ``describe_split`` says which is which."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import google_crc32c
import numpy as np
import pytest
from conftest import oracle, random_sequences
from helpers.seqax_v2 import write_seqax_v2

from asyncflat import (
    CorruptChunkError,
    FlatTokensParams,
    ShufflingLoader,
    TokenBatchParams,
    write_flat_tokens,
)
from asyncflat.format.codec import encode_sequences
from asyncflat.inspection import describe_split
from asyncflat.source.local_source import LocalTokenSource
from asyncflat.source.zarr_source import ZarrTokenSource
from asyncflat.storage import chunks

CHUNK = 4096
BATCH = TokenBatchParams(64, 8)
#: What the error says: the chunk object, and the stored and computed checksums.
MISMATCH = r"encoded_tokens/c/1 fails its crc32c checksum \(stored 0x[0-9a-f]{8}, computed 0x"


class Writer:
    """A unit writer that runs the fill's decode right here and counts it."""

    def __init__(self) -> None:
        self.writes = 0

    async def write(self, fill_targets: Callable[[], None]) -> bool:
        fill_targets()
        self.writes += 1
        return True


@pytest.fixture(scope="module")
def sequences() -> list[np.ndarray]:
    return random_sequences(11, 120)


class Store:
    """A default-written store, on local disk or in fsspec's memory filesystem."""

    def __init__(self, where: str, tmp_path: Path, sequences: list[np.ndarray]) -> None:
        self.local = where == "local"
        if self.local:
            self.url = str(tmp_path / "d.zarr")
        else:
            self.url = f"memory://checksums-{uuid.uuid4().hex}/d.zarr"
        write_flat_tokens(self.url, {"train": sequences}, chunk_tokens=CHUNK)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def flip(self, chunk_id: int, bit: int = 0) -> None:
        """Flip one bit in the middle of ``encoded_tokens`` chunk object ``chunk_id``."""
        key = f"{self.root}/train/encoded_tokens/c/{chunk_id}"
        data = bytearray(self.fs.cat_file(key))
        data[len(data) // 2] ^= 1 << bit
        self.fs.pipe_file(key, bytes(data))

    async def open(self) -> Any:
        if self.local:
            source = await LocalTokenSource.open_plain(self.url, "train")
            assert isinstance(source, LocalTokenSource)  # the zarr-free reader, not zarr's
            return source
        return await ZarrTokenSource.open(self.url, "train")

    def remove(self) -> None:
        if not self.local:
            self.fs.rm(self.root.rsplit("/", 1)[0], recursive=True)


@pytest.fixture(params=["local", "memory"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, sequences: list[np.ndarray]
) -> Iterator[Store]:
    made = Store(request.param, tmp_path, sequences)
    yield made
    made.remove()


def test_crc32c_is_the_standard_one() -> None:
    rng = np.random.default_rng(0)
    for size in (0, 1, 9, 4099, 3 << 20):
        data = rng.integers(0, 256, size, np.uint8)
        assert chunks.crc32c(data) == google_crc32c.value(data.tobytes()), size
    assert chunks.crc32c(b"123456789") == 0xE3069283  # RFC 3720's check value


def test_the_first_checksum_starts_no_subprocess() -> None:
    """The first checksum of a process (on a cold start's way to its first batch) finds its C
    library without ``ldconfig``/``gcc``/``ld`` subprocesses (forks of the whole trainer
    process), from any of the threads that ask at once, whether google-crc32c's wheel has the
    library or not (then the system's is opened by name)."""
    code = (
        "import subprocess, threading\n"
        "def refuse(*args, **kwargs):\n"
        "    raise AssertionError(f'a subprocess was started: {args!r}')\n"
        "subprocess.Popen = refuse\n"
        "from asyncflat.storage import chunks\n"
        "values = []\n"
        "threads = [threading.Thread(target=lambda: values.append(chunks.crc32c(b'123456789')))\n"
        "           for _ in range(4)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "assert values == [0xE3069283] * 4, values\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_child_forked_during_the_first_lookup_can_checksum() -> None:
    """A fork while another thread holds the lookup's lock (its first checksum under way) must
    not leave the child's copy of the lock held forever."""
    code = (
        "import os, signal, threading, time\n"
        "from asyncflat.storage import chunks\n"
        "entered, release = threading.Event(), threading.Event()\n"
        "load = chunks._load_native_crc32c\n"
        "def slow():\n"
        "    entered.set(); release.wait(); return load()\n"
        "chunks._load_native_crc32c = slow\n"
        "first = threading.Thread(target=chunks.crc32c, args=(b'1',)); first.start()\n"
        "entered.wait()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(20)\n"
        "    chunks._load_native_crc32c = load\n"
        "    os._exit(0 if chunks.crc32c(b'123456789') == 0xE3069283 else 3)\n"
        "release.set(); first.join()\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "0", (done.stdout, done.stderr[-2000:])


def test_a_flipped_bit_fails_the_fill_path(store: Store, sequences: list[np.ndarray]) -> None:
    encoded, _ = encode_sequences(sequences)
    store.flip(1)

    async def main() -> None:
        source = await store.open()
        try:
            good = np.empty(300, np.uint32)
            await source.read_into(100, 400, [(100, good)], Writer())  # chunk 0: intact
            np.testing.assert_array_equal(good, encoded[100:400])
            out = np.zeros(300, np.uint32)
            with pytest.raises(CorruptChunkError, match=MISMATCH):
                await source.read_into(CHUNK + 100, CHUNK + 400, [(100, out)], Writer())
            assert not out.any()  # verified before the decode: nothing written
        finally:
            await source.aclose()

    asyncio.run(main())


def test_a_flipped_bit_fails_the_row_path(store: Store, sequences: list[np.ndarray]) -> None:
    encoded, _ = encode_sequences(sequences)
    store.flip(1, bit=5)

    async def main() -> None:
        source = await store.open()
        try:
            with pytest.raises(CorruptChunkError, match=MISMATCH) as caught:
                await source.read_items(1, 17, np.empty(64, np.uint32))
            # The row's tokens are named too, as any read error names them.
            assert f"encoded_tokens[{CHUNK + 17}:{CHUNK + 81}]" in str(caught.value)
            row = np.empty(64, np.uint32)
            await source.read_items(2, 17, row)  # another chunk: intact
            np.testing.assert_array_equal(row, encoded[2 * CHUNK + 17 : 2 * CHUNK + 81])
        finally:
            await source.aclose()

    asyncio.run(main())


def test_a_loader_raises_on_the_load_that_reads_a_flipped_bit(store: Store) -> None:
    """Every chunk damaged: the first load (rows read ahead of the fill, then the fill) raises,
    naming an object and both checksums; never wrong tokens."""
    fs, root = store.fs, store.root
    chunks = sorted(fs.ls(f"{root}/train/encoded_tokens/c", detail=False))
    for key in chunks:
        data = bytearray(fs.cat_file(key))
        data[len(data) // 3] ^= 0x10
        fs.pipe_file(key, bytes(data))
    params = FlatTokensParams(store.url, 1, 2, 8, 3, True)
    with ShufflingLoader("train", params, BATCH) as loader:
        for step in (loader.step_count - 1, 0):  # a late step first: its rows, then a fill
            with pytest.raises(CorruptChunkError) as caught:
                loader.load(step)
            message = str(caught.value)
            assert re.search(r"encoded_tokens/c/\d+ fails its crc32c checksum", message), message
            assert re.search(r"stored 0x[0-9a-f]{8}, computed 0x[0-9a-f]{8}", message), message


def test_describe_split_says_whether_checksums_are_present(
    tmp_path: Path, sequences: list[np.ndarray]
) -> None:
    write_flat_tokens(tmp_path / "default", {"train": sequences}, chunk_tokens=CHUNK)
    write_flat_tokens(tmp_path / "off", {"train": sequences}, chunk_tokens=CHUNK, checksum=False)
    write_flat_tokens(
        tmp_path / "sharded", {"train": sequences}, chunk_tokens=CHUNK, shard_tokens=4 * CHUNK
    )
    write_seqax_v2(tmp_path / "seqax", {"train": sequences, "validation": []})
    found = {
        name: describe_split(str(tmp_path / name), "train", scan_lengths=False)
        for name in ("default", "off", "sharded", "seqax")
    }
    assert {name: s.token_checksums for name, s in found.items()} == {
        "default": True,
        "off": False,
        "sharded": True,  # inside the shard, on every inner chunk
        "seqax": False,
    }
    assert found["default"].seq_starts_checksums and not found["seqax"].seq_starts_checksums
    assert found["default"].to_dict()["token_checksums"] is True


def test_a_seqax_store_without_checksums_still_reads(
    tmp_path: Path, sequences: list[np.ndarray]
) -> None:
    path = tmp_path / "seqax.zarr"
    write_seqax_v2(path, {"train": sequences, "validation": []})
    params = FlatTokensParams(str(path), 1, 2, 8, 3, True)
    expected = oracle(str(path), params, BATCH)
    with ShufflingLoader("train", params, BATCH) as loader:
        for step in (loader.step_count - 1, 0, 1):
            batch = loader.load(step)
            targets = np.asarray(batch.targets)
            got = (targets << 1) | np.asarray(batch.is_seq_start).astype(np.uint32)
            np.testing.assert_array_equal(got, expected.encoded_batch(step), err_msg=str(step))


class DroppedWriter:
    """The writer of a fill dropped before its unit decoded: nothing is written."""

    async def write(self, fill_targets: Callable[[], None]) -> bool:
        return False


def test_a_frame_read_before_a_repair_is_read_again(sequences: list[np.ndarray]) -> None:
    """A chunk object read while damaged, its fill dropped before the decode (so never
    verified), stays cached; once the object is repaired, the next read that finds the cached
    frame failing its checksum reads the object afresh instead of raising."""
    store = Store("memory", Path("."), sequences)  # through zarr: verified beside the decode
    encoded, _ = encode_sequences(sequences)
    key = f"{store.root}/train/encoded_tokens/c/1"
    clean = store.fs.cat_file(key)
    store.flip(1)

    async def main() -> None:
        source = await store.open()
        try:
            await source.read_into(
                CHUNK, CHUNK + 10, [(0, np.empty(10, np.uint32))], DroppedWriter()
            )
            store.fs.pipe_file(key, clean)  # repaired
            out = np.empty(300, np.uint32)
            await source.read_into(CHUNK + 100, CHUNK + 400, [(100, out)], Writer())
            np.testing.assert_array_equal(out, encoded[CHUNK + 100 : CHUNK + 400])
        finally:
            await source.aclose()

    try:
        asyncio.run(main())
    finally:
        store.remove()
