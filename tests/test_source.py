"""The reader alone, on real zarr stores: the interface the engine uses, and no stale cache."""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import random_sequences

import asyncflat.storage.local_files
from asyncflat import CorruptChunkError, FlatTokensWriter
from asyncflat.format.codec import encode_sequences
from asyncflat.source.protocol import TokenSource
from asyncflat.source.zarr_source import ZarrTokenSource

CHUNK = 4096


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), timeout=60))


class Writer:
    """The engine's side of ``read_into``: runs the copy at once, counts writes."""

    def __init__(self, allow: bool = True) -> None:
        self.allow, self.writes = allow, 0

    async def write(self, fill_targets: Callable[[], None]) -> bool:
        if not self.allow:
            return False
        fill_targets()
        self.writes += 1
        return True


@pytest.fixture(scope="module", params=["v2-blosc", "v3-blosc", "v3-crc32c", "v3-sharded"])
def dataset(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    kind = request.param
    path = str(tmp_path_factory.mktemp(kind) / "data.zarr")
    kwargs: dict[str, Any] = {
        "v2-blosc": dict(zarr_format=2, chunk_tokens=CHUNK),
        "v3-blosc": dict(zarr_format=3, chunk_tokens=CHUNK, checksum=False),
        "v3-crc32c": dict(zarr_format=3, chunk_tokens=CHUNK),  # the default: checksummed
        "v3-sharded": dict(zarr_format=3, chunk_tokens=CHUNK, shard_tokens=4 * CHUNK),
    }[kind]
    sequences = random_sequences(7, 200)
    with FlatTokensWriter(path, **kwargs) as writer:
        writer.append("train", sequences)
    encoded, _ = encode_sequences(sequences)
    return kind, path, encoded


def open_source(path: str) -> Coroutine[Any, Any, ZarrTokenSource]:
    return ZarrTokenSource.open(path, "train")


def test_read_into_fills_the_views_it_is_given(dataset: tuple) -> None:
    kind, path, encoded = dataset

    async def main() -> None:
        source: TokenSource = await open_source(path)
        # Direct Blosc reads just the bytes it needs; a checksummed chunk is verified whole, and
        # a sharded one is zarr's to decode.
        assert source.partial_reads is (kind in ("v2-blosc", "v3-blosc"))
        assert not source.remote and source.token_chunk == CHUNK
        start, stop = CHUNK + 100, 2 * CHUNK - 50
        a, b = np.empty(300, np.uint32), np.empty(17, np.uint32)
        writer = Writer()
        await source.read_into(start, stop, [(100, a), (1000, b)], writer)
        np.testing.assert_array_equal(a, encoded[CHUNK + 100 : CHUNK + 400])
        np.testing.assert_array_equal(b, encoded[CHUNK + 1000 : CHUNK + 1017])
        assert writer.writes == 1 and source.io.bytes_decoded > 0
        untouched = np.zeros(10, np.uint32)
        await source.read_into(0, 10, [(0, untouched)], Writer(allow=False))
        assert not untouched.any()  # a dropped fill's views are never written
        await source.aclose()

    run(main)


def test_read_items_reads_a_few_rows(dataset: tuple) -> None:
    kind, path, encoded = dataset

    async def main() -> None:
        source = await open_source(path)
        if kind == "v3-sharded":  # zarr decodes these: the engine never asks it for rows
            assert not source.partial_reads
            await source.aclose()
            return
        out = np.empty(64, np.uint32)
        await source.read_items(2, 777, out)
        np.testing.assert_array_equal(out, encoded[2 * CHUNK + 777 : 2 * CHUNK + 841])
        await source.aclose()

    run(main)


def _chunk_file(path: str, index: int) -> str:
    files = sorted(
        f
        for f in glob.glob(os.path.join(path, "train", "encoded_tokens", "**"), recursive=True)
        if os.path.isfile(f) and not f.endswith((".json", ".zarray", ".zattrs"))
    )
    return next(f for f in files if f.replace("/", ".").endswith(f".{index}"))


@pytest.mark.parametrize("damage", ["garbage-blocks", "garbage-header"])
def test_nothing_read_from_bad_bytes_outlives_the_repair(tmp_path: Path, damage: str) -> None:
    # A chunk replaced by bad bytes gives a clear error; once the file is restored, every read
    # (whole-chunk and row reads, whose frame layout is cached) is right again.
    path = str(tmp_path / "data.zarr")
    sequences = random_sequences(3, 200)
    with FlatTokensWriter(path, zarr_format=3, chunk_tokens=CHUNK) as writer:
        writer.append("train", sequences)
    encoded, _ = encode_sequences(sequences)
    target = _chunk_file(path, 1)
    good = Path(target).read_bytes()
    bad = bytearray(good)
    if damage == "garbage-blocks":
        bad[len(bad) // 2 :] = os.urandom(len(bad) - len(bad) // 2)
        bad[16:20] = (10**8).to_bytes(4, "little")  # the first block offset, out of bounds
    else:
        bad[4:16] = os.urandom(12)
    rows = [(1, 5, 40), (1, 3000, 64)]

    async def read_all(source: ZarrTokenSource) -> None:
        whole = np.empty(CHUNK, np.uint32)
        await source.read_into(CHUNK, 2 * CHUNK, [(0, whole)], Writer())
        np.testing.assert_array_equal(whole, encoded[CHUNK : 2 * CHUNK])
        for chunk_id, first, n in rows:
            out = np.empty(n, np.uint32)
            await source.read_items(chunk_id, first, out)
            start = chunk_id * CHUNK + first
            np.testing.assert_array_equal(out, encoded[start : start + n])

    async def main() -> None:
        source = await open_source(path)
        await read_all(source)  # layouts and the chunk cached from good bytes
        Path(target).write_bytes(bytes(bad))
        for chunk_id, first, n in rows:
            # a cached layout over damaged blocks, or a layout parsed from a damaged header
            try:
                await source.read_items(chunk_id, first, np.empty(n, np.uint32))
            except CorruptChunkError as exc:
                assert "encoded_tokens" in str(exc)
        source2 = await open_source(path)  # a fresh reader meets the damage first
        with pytest.raises(CorruptChunkError):
            await source2.read_into(CHUNK, 2 * CHUNK, [(0, np.empty(CHUNK, np.uint32))], Writer())
        with pytest.raises(CorruptChunkError):
            await source2.read_items(1, 5, np.empty(40, np.uint32))
        Path(target).write_bytes(good)  # the repair
        await read_all(source)
        await read_all(source2)
        await source.aclose()
        await source2.aclose()

    run(main)


def test_unknown_url_protocol_is_a_config_error_naming_the_url() -> None:
    from asyncflat import AsyncflatError, ConfigError

    async def main() -> None:
        await ZarrTokenSource.open("foo://bucket/data.zarr", "train")

    with pytest.raises(ConfigError, match=r"foo://bucket/data\.zarr: unknown URL protocol 'foo'"):
        run(main)
    assert issubclass(ConfigError, AsyncflatError)


def test_local_read_errors_name_a_path_that_exists(tmp_path: Path) -> None:
    """Row reads of a local store read the file directly; the error names that file (the
    split used to appear twice: ``.../train/train/encoded_tokens/...``)."""
    path = tmp_path / "d.zarr"
    with FlatTokensWriter(path, chunk_tokens=CHUNK, checksum=False) as writer:
        writer.append("train", random_sequences(1, 200))
    victim = path / "train" / "encoded_tokens" / "c" / "1"
    victim.write_bytes(victim.read_bytes()[:20])  # truncated: the header is there, blocks not

    async def main() -> None:
        source = await ZarrTokenSource.open(str(path), "train")
        try:
            await source.read_items(1, 3000, np.empty(8, np.uint32))
        finally:
            await source.aclose()

    with pytest.raises(CorruptChunkError) as info:
        run(main)
    message = str(info.value)
    assert "train/train" not in message, message
    assert str(victim) in message, message
    assert victim.exists()


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_row_read_costs_its_blosc_blocks_not_half_a_chunk(
    tmp_path: Path, zarr_format: int
) -> None:
    # The writer's small Blosc blocks (32 KiB by default) are what make a resume cheap: a
    # 2048-token row of a 1M-token chunk reads its one or two blocks, where Blosc's own block
    # size (what seqax's tools write, blosc_block_bytes=0) reads half a MiB of tokens for it.
    chunk = 1 << 20
    rng = np.random.default_rng(0)
    sequences = [rng.zipf(1.15, 2_000_000) % 50_000 for _ in range(2)]  # text-like ids
    encoded, _ = encode_sequences(sequences)
    read: dict[int | None, int] = {}
    for block_bytes in (0, 1 << 15, None):
        path = str(tmp_path / f"data-{block_bytes}.zarr")
        with FlatTokensWriter(  # no checksum: one is verified over its whole object
            path,
            zarr_format=zarr_format,
            chunk_tokens=chunk,
            blosc_block_bytes=block_bytes,
            checksum=False if zarr_format == 3 else None,
        ) as writer:
            writer.append("train", sequences)

        async def main(path: str = path) -> int:
            source = await open_source(path)
            out = np.empty(2048, np.uint32)
            await source.read_items(1, 5000, out)  # the layout (header, block table) first
            before = source.io.bytes_read
            await source.read_items(1, 300_001, out)
            np.testing.assert_array_equal(out, encoded[chunk + 300_001 : chunk + 302_049])
            after = source.io.bytes_read
            await source.aclose()
            return after - before

        read[block_bytes] = run(main)
    assert read[1 << 15] <= 2 * (1 << 15), read  # at most two blocks, compressed or not
    assert read[0] > 4 * read[1 << 15], read
    # the default: small blocks in format 3; seqax's exact metadata (Blosc's choice) in format 2
    assert read[None] == read[1 << 15 if zarr_format == 3 else 0], read


def test_blosc_block_bytes_is_checked() -> None:
    from asyncflat import ConfigError

    for bad in (-4, 6, True, 1.5, 1 << 31, "4096"):
        with pytest.raises(ConfigError, match="blosc_block_bytes"):
            FlatTokensWriter("memory://never", blosc_block_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got True"):  # the value given, not int(True)
        FlatTokensWriter("memory://never", blosc_block_bytes=True)
    FlatTokensWriter("memory://numpy-int", blosc_block_bytes=np.int64(1 << 14)).abort()


def test_a_fill_unit_reads_just_its_blocks_of_a_larger_local_chunk(tmp_path: Path) -> None:
    # seqax's layout: a read block is an eighth of a chunk. A fill's unit reads the compressed
    # Blosc blocks holding its read block (after the frame's layout), not the whole object, and
    # decodes them into place; a chunk it needs more than half of is still read whole.
    chunk = 1 << 20  # 4 MiB: eight of Blosc's own 512 KiB blocks
    rng = np.random.default_rng(1)
    sequences = [rng.zipf(1.15, 1_700_000) % 50_000 for _ in range(2)]
    encoded, _ = encode_sequences(sequences)
    path = str(tmp_path / "seqax-like.zarr")
    with FlatTokensWriter(path, zarr_format=2, chunk_tokens=chunk) as writer:
        writer.append("train", sequences)
    stored = os.path.getsize(_chunk_file(path, 2))

    async def main() -> None:
        source = await open_source(path)
        block = chunk // 8
        for first in (3 * block, 0, 7 * block):
            out = np.empty(block, np.uint32)
            before = source.io.bytes_read
            await source.read_into(
                2 * chunk + first, 2 * chunk + first + block, [(first, out)], Writer()
            )
            np.testing.assert_array_equal(
                out, encoded[2 * chunk + first : 2 * chunk + first + block]
            )
            assert source.io.bytes_read - before < stored / 3, (
                source.io.bytes_read - before,
                stored,
            )
        whole = np.empty(chunk, np.uint32)
        before = source.io.bytes_read
        await source.read_into(chunk, 2 * chunk, [(0, whole)], Writer())
        np.testing.assert_array_equal(whole, encoded[chunk : 2 * chunk])
        assert source.io.bytes_read - before >= os.path.getsize(_chunk_file(path, 1))
        await source.aclose()

    run(main)


def test_damaged_blocks_read_by_range_are_a_corrupt_chunk_error(tmp_path: Path) -> None:
    chunk = 1 << 18
    rng = np.random.default_rng(2)
    sequences = [rng.zipf(1.15, 600_000) % 50_000 for _ in range(2)]
    path = str(tmp_path / "seqax-like.zarr")
    with FlatTokensWriter(path, zarr_format=2, chunk_tokens=chunk) as writer:
        writer.append("train", sequences)
    target = _chunk_file(path, 1)
    data = bytearray(Path(target).read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = b"\xff" * 4096  # inside some block
    Path(target).write_bytes(bytes(data))

    ranged: list[str] = []
    real_pread_into = asyncflat.storage.local_files.pread_into

    def spy(root: str, key: str, *args: Any, **kwargs: Any) -> None:
        ranged.append(key)
        real_pread_into(root, key, *args, **kwargs)

    async def main() -> None:
        source = await open_source(path)
        block = chunk // 8
        with pytest.raises(CorruptChunkError, match="encoded_tokens"):
            for first in range(0, chunk, block):
                out = np.empty(block, np.uint32)
                await source.read_into(
                    chunk + first, chunk + first + block, [(first, out)], Writer()
                )
        await source.aclose()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(asyncflat.storage.local_files, "pread_into", spy)
        run(main)
    assert ranged and all(key.endswith(("/1", ".1")) for key in ranged)  # read by range


def test_a_header_claiming_more_than_a_legal_encoding_maps_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "data.zarr")
    sequences = random_sequences(3, 200)
    with FlatTokensWriter(path, zarr_format=3, chunk_tokens=CHUNK) as writer:
        writer.append("train", sequences)
    target = _chunk_file(path, 1)
    data = bytearray(Path(target).read_bytes())
    data[12:16] = (0x7FFF0000).to_bytes(4, "little")  # cbytes: ~2 GiB
    Path(target).write_bytes(bytes(data))

    async def main() -> None:
        source = await open_source(path)
        with pytest.raises(CorruptChunkError, match="encoded_tokens"):
            await source.read_items(1, 5, np.empty(40, np.uint32))
        await source.aclose()

    run(main)
