"""Every codec chain zarr can write for these arrays reads back exactly what zarr reads.

Stores are written with zarr itself (not asyncflat's writer): Blosc with each typesize and
shuffle mode (zarr writes typesize 1, 2 or 8 for uint32 when asked to), zstd, gzip, crc32c,
no compression, formats 2 and 3, sharded with odd inner chunks. The loader must serve the
oracle's batches from each, whichever read path it picks (the direct Blosc decoder, ranged raw
reads, zarr's decoder), including rows read before their blocks (a resume).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from conftest import oracle, random_sequences
from numcodecs import Blosc as V2Blosc
from numcodecs import GZip, Zstd
from zarr.codecs import BloscCodec, Crc32cCodec, GzipCodec, ZstdCodec

import asyncflat
from asyncflat import CorruptChunkError, FlatTokensParams, ShufflingLoader, TokenBatchParams

BATCH = TokenBatchParams(len=16, batch=8)
CHUNK = 4096


@pytest.fixture(scope="module")
def arrays(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, np.ndarray]:
    from reference_impl import load_split_arrays

    path = tmp_path_factory.mktemp("codecs") / "base.zarr"
    asyncflat.write_flat_tokens(path, {"train": random_sequences(3, 500, max_len=120)})
    return load_split_arrays(path, "train")


def write(path: Path, tokens: np.ndarray, starts: np.ndarray, **array: Any) -> Path:
    zarr_format = array.pop("zarr_format")
    root = zarr.open_group(str(path), mode="w", zarr_format=zarr_format)
    group = root.create_group("train")
    chunks = array.pop("chunks", (CHUNK,))
    group.create_array(
        "encoded_tokens", data=tokens, chunks=chunks, config={"write_empty_chunks": True}, **array
    )
    group.create_array("seq_starts", data=starts, chunks=(1024,))
    group.attrs["max_token_id"] = int(tokens.max() >> 1)
    return path


SHUFFLES_V3 = ["noshuffle", "shuffle", "bitshuffle"]
CHAINS: dict[str, dict[str, Any]] = {
    **{
        f"v3-blosc-ts{ts}-{shuffle}": dict(
            zarr_format=3, compressors=BloscCodec(cname="lz4", typesize=ts, shuffle=shuffle)
        )
        for ts in (1, 2, 4, 8, 16)
        for shuffle in SHUFFLES_V3
    },
    "v3-blosc-zstd-blocks": dict(
        zarr_format=3, compressors=BloscCodec(cname="zstd", typesize=8, blocksize=1000)
    ),
    "v3-zstd": dict(zarr_format=3, compressors=ZstdCodec()),
    "v3-gzip": dict(zarr_format=3, compressors=GzipCodec()),
    "v3-crc32c": dict(zarr_format=3, compressors=Crc32cCodec()),
    "v3-blosc-crc32c": dict(zarr_format=3, compressors=[BloscCodec(typesize=8), Crc32cCodec()]),
    "v3-none": dict(zarr_format=3, compressors=None),
    "v3-sharded-odd": dict(
        zarr_format=3, chunks=(1001,), shards=(4004,), compressors=BloscCodec(typesize=2)
    ),
    "v3-sharded-odd-none": dict(zarr_format=3, chunks=(999,), shards=(2997,), compressors=None),
    **{
        f"v2-blosc-{shuffle}": dict(zarr_format=2, compressors=V2Blosc(shuffle=shuffle))
        for shuffle in (V2Blosc.NOSHUFFLE, V2Blosc.SHUFFLE, V2Blosc.BITSHUFFLE)
    },
    "v2-blosc-ts8": dict(zarr_format=2, compressors=V2Blosc(cname="zstd", typesize=8)),
    "v2-zstd": dict(zarr_format=2, compressors=Zstd()),
    "v2-gzip": dict(zarr_format=2, compressors=GZip()),
    "v2-none": dict(zarr_format=2, compressors=None),
    "v2-odd-chunks": dict(zarr_format=2, chunks=(1001,), compressors=V2Blosc(typesize=1)),
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_every_codec_chain_reads_like_the_oracle(
    tmp_path: Path, arrays: tuple[np.ndarray, np.ndarray], chain: str
) -> None:
    tokens, starts = arrays
    path = write(tmp_path / f"{chain}.zarr", tokens, starts, **dict(CHAINS[chain]))
    params = FlatTokensParams(str(path), 2, 2, 4, 3, True)
    expected = oracle((tokens, starts), params, BATCH)
    with ShufflingLoader("train", params, BATCH) as loader:
        assert loader.step_count == expected.step_count
        # A late step first: its rows are read before their blocks (read_items), then in order.
        last = loader.step_count - 1
        for step in [3, last, 0, 1, 2, 4, 5, last - 1]:
            np.testing.assert_array_equal(
                _encoded(loader.load(step)),
                expected.encoded_batch(step),
                err_msg=f"{chain} step {step}",
            )


def _encoded(batch: asyncflat.TokenBatch) -> np.ndarray:
    targets = np.asarray(batch.targets)
    return (targets << 1) | np.asarray(batch.is_seq_start).astype(np.uint32)


@pytest.mark.parametrize("compressors", ["blosc", "none"])
def test_a_flipped_byte_in_a_checksummed_store_is_an_error_naming_the_object(
    tmp_path: Path, arrays: tuple[np.ndarray, np.ndarray], compressors: str
) -> None:
    tokens, starts = arrays
    chain: list[Any] = (
        [BloscCodec(cname="lz4", shuffle="bitshuffle")] if compressors == "blosc" else []
    )
    path = write(
        tmp_path / "sum.zarr", tokens, starts, zarr_format=3, compressors=[*chain, Crc32cCodec()]
    )
    params = FlatTokensParams(str(path), 2, 2, 4, 3, True)
    expected = oracle((tokens, starts), params, BATCH)
    chunk_files = sorted(
        (path / "train" / "encoded_tokens" / "c").iterdir(), key=lambda p: int(p.name)
    )
    for victim in chunk_files:  # a byte in the middle of the payload of every chunk
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    with ShufflingLoader("train", params, BATCH) as loader:
        for step in (0, 3):
            with pytest.raises(
                CorruptChunkError, match=r"train/encoded_tokens/c/\d+ fails its crc32c"
            ):
                loader.load(step)
        for victim in chunk_files:  # repaired: every load is correct again, nothing cached
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0x01
            victim.write_bytes(bytes(data))
        for step in range(loader.step_count):
            np.testing.assert_array_equal(
                _encoded(loader.load(step)), expected.encoded_batch(step), err_msg=f"step {step}"
            )


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
@pytest.mark.parametrize("chain", ["v3-zstd", "v2-zstd", "v3-gzip", "v2-gzip"])
def test_a_chunk_its_codec_cannot_decode_is_an_error_naming_the_object(
    tmp_path: Path, arrays: tuple[np.ndarray, np.ndarray], chain: str, damage: str
) -> None:
    """zstd and gzip say only that their input is bad: the error names the chunk object."""
    tokens, starts = arrays
    path = write(tmp_path / f"{chain}.zarr", tokens, starts, **dict(CHAINS[chain]))
    array_dir = path / "train" / "encoded_tokens"
    key = "c/1" if chain.startswith("v3") else "1"
    victim = array_dir / key
    data = bytearray(victim.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2 : len(data) // 2 + 8] = bytes(8)
    victim.write_bytes(bytes(data))
    params = FlatTokensParams(str(path), 2, 2, 4, 3, True)
    with ShufflingLoader("train", params, BATCH) as loader:
        with pytest.raises(CorruptChunkError, match=rf"encoded_tokens/{key}\b") as raised:
            for step in range(loader.step_count):
                loader.load(step)
    message = str(raised.value)
    assert f"encoded_tokens[{CHUNK}:{2 * CHUNK}]" in message, message  # and the token range
    assert "decode" in message, message
