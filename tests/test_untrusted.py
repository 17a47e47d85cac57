"""Datasets from someone else: hostile artefacts made here, each read in a child process.

Every scenario writes a small valid store, plants one hostile object in it (a crafted Blosc
frame, a decompression bomb, a sparse file, a FIFO, a symlink out of the store, metadata whose
shapes ask for huge plans) and reads it through a public entry point (loader construction,
``load``, ``describe_split``, ``verify_split``) in a child process whose address space may grow
by at most 1 GiB once jax has started. The child must exit normally (no signal, no hang) and report the right
``AsyncflatError`` naming the object, with its peak RSS close to a clean read's.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import asyncflat

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parent.parent
#: Address space a child may add to what jax reserves when it starts (its thread pools' stacks).
AS_LIMIT = 1 << 30
#: A hostile read may cost at most this much RSS above a clean read of the same store.
RSS_SLACK_KIB = 160 * 1024

CHILD = r"""
import json, resource, sys
import jax
jax.numpy.sum(jax.numpy.arange(10)).block_until_ready()  # XLA's thread pools exist from here
# Address space: what jax reserved at start-up, plus the cap for everything the read does.
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[3]), vm + int(sys.argv[3])))
action, path = sys.argv[1], sys.argv[2]
out = {}
try:
    import asyncflat
    from asyncflat.inspection import describe_split, verify_split, loader_figures
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    blen, batch = extra.get("len", 8), extra.get("batch", 4)
    streams, rbpsb, spb = extra.get("streams", 2), extra.get("rbpsb", 2), extra.get("spb", 2)
    params = asyncflat.FlatTokensParams(path, streams, rbpsb, spb, 3, True)
    bparams = asyncflat.TokenBatchParams(len=blen, batch=batch)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    options = asyncflat.EngineOptions(
        load_timeout_s=30,
        retry=asyncflat.RetryPolicy(max_attempts=1, initial_backoff_s=0.001),
    )
    if action in ("open", "load"):
        with asyncflat.ShufflingLoader("train", params, bparams, sharding, options=options) as ld:
            if action == "load":
                digest = 0
                for step in range(ld.step_count):
                    b = ld.load(step)
                    digest = (digest * 31 + int(jax.numpy.sum(b.targets))) % (1 << 61)
                out["digest"] = digest
    elif action == "describe":
        describe_split(path, "train")
    elif action == "verify":
        verify_split(path, "train")
    elif action == "figures":
        summary = describe_split(path, "train", scan_lengths=False)
        loader_figures(summary, params, bparams)
    out["ok"] = True
except BaseException as exc:
    out["error"] = type(exc).__name__
    out["mro"] = [c.__name__ for c in type(exc).__mro__]
    out["message"] = str(exc)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the (large) pytest parent.
out["maxrss_kib"] = int(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')))
print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(
    action: str, path: str | os.PathLike[str], timeout: float = 120, **extra: Any
) -> dict[str, Any]:
    """Run ``action`` on the store at ``path`` in a child process; its report (a dict).

    Fails the test on a signal (a crash in a decoder) or a hang.
    """
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, action, str(path), str(AS_LIMIT), json.dumps(extra)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{action} on {path} hung for {timeout} s")
    assert proc.returncode == 0, (
        f"{action} on {path} died with {proc.returncode} (signal {-proc.returncode})\n"
        f"{proc.stderr[-3000:]}"
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def assert_refused(
    report: dict[str, Any], cls: str, *parts: str, baseline_kib: int | None = None
) -> None:
    assert "error" in report, f"expected {cls}, the read succeeded: {report}"
    assert cls in report["mro"], report
    for part in parts:
        assert part in report["message"], report["message"]
    if baseline_kib is not None:
        assert report["maxrss_kib"] <= baseline_kib + RSS_SLACK_KIB, (report, baseline_kib)


# -- stores and artefacts ---------------------------------------------------------------------


def sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 50, size=int(n)) for n in rng.integers(4, 24, size=40)]


def write_store(path: Path, **kwargs: Any) -> Path:
    seqs = sequences()
    asyncflat.write_flat_tokens(path, {"train": seqs, "validation": seqs[:12]}, **kwargs)
    return path


def write_zarr_store(path: Path, codec: Any, *, zarr_format: int = 3, chunk: int = 64) -> Path:
    """A flat-tokens store written with plain zarr and the given compressor on both arrays."""
    from asyncflat.format.codec import encode_sequences

    encoded, lengths = encode_sequences(sequences())
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64)
    root = zarr.open_group(str(path), mode="w", zarr_format=zarr_format)
    for split in ("train", "validation"):
        g = root.create_group(split)
        kw = {"compressors": [codec]}
        g.create_array(
            "encoded_tokens", shape=encoded.shape, chunks=(chunk,), dtype="uint32", **kw
        )[:] = encoded
        g.create_array("seq_starts", shape=starts.shape, chunks=(chunk,), dtype="uint64", **kw)[
            :
        ] = starts
        g.attrs["max_token_id"] = int((encoded >> 1).max())
    return path


def chunk_file(path: Path, array: str, index: int = 0) -> Path:
    base = path / "train" / array
    for candidate in (base / "c" / str(index), base / str(index)):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(base)


def crafted_blosc_frame(nbytes: int, size: int = 600) -> bytes:
    """A ``size``-byte Blosc frame whose header claims 1 GiB of compressed bytes and whose
    only block starts 512 MiB in: c-blosc reads far past the object (SIGSEGV)."""
    header = bytes([2, 1, 0x11, 8]) + struct.pack("<III", nbytes, nbytes, 1 << 30)
    return header + struct.pack("<i", 1 << 29) + bytes(size - 20)


def blosc_bomb_frame(nbytes: int) -> bytes:
    """A valid-looking 57 KiB Blosc frame that says it decodes to ``nbytes``."""
    blocksize = 1 << 20
    nblocks = -(-nbytes // blocksize)
    header_len = 16 + 4 * nblocks
    total = max(header_len + 8 * nblocks, 57 << 10)
    header = bytes([2, 1, 0x01, 8]) + struct.pack("<III", nbytes, blocksize, total)
    starts = np.full(nblocks, header_len, "<i4").tobytes()
    return header + starts + bytes(total - len(header) - len(starts))


def zstd_bomb(total: int, *, declare: bool) -> bytes:
    """A zstd frame of RLE blocks: 4 bytes per 128 KiB of output (128 KiB -> 4 GiB)."""
    block = 1 << 17
    n = -(-total // block)
    if declare:  # single segment, 8-byte frame content size
        head = struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", n * block)
    else:  # no content size; a 128 KiB window
        head = struct.pack("<IBB", 0xFD2FB528, 0x00, 7 << 3)
    body = bytearray()
    for i in range(n):
        body += ((1 if i == n - 1 else 0) | (1 << 1) | (block << 3)).to_bytes(3, "little") + b"\0"
    return head + bytes(body)


def gzip_bomb(total: int) -> bytes:
    """A gzip member of ``total`` zero bytes (about 1000:1)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 22)
    parts = [comp.compress(zeros) for _ in range(total // len(zeros))]
    return b"".join(parts) + comp.flush()


def rewrite_inner_chunk(shard: Path, inner: int, data: bytes, n: int = 4) -> None:
    """Rebuild a zarr-3 shard of ``n`` inner chunks (index at the end, crc32c) with inner chunk
    ``inner`` replaced by ``data``, index and checksum consistent, as a writer would."""
    import google_crc32c

    raw = shard.read_bytes()
    index_len = 16 * n + 4
    entries = np.frombuffer(raw[-index_len:-4], "<u8").reshape(-1, 2)
    body, index = b"", []
    for k, (offset, length) in enumerate(entries):
        if int(offset) == (1 << 64) - 1:
            index.append((offset, length))
            continue
        piece = data if k == inner else raw[int(offset) : int(offset + length)]
        index.append((len(body), len(piece)))
        body += piece
    table = np.array(index, "<u8").tobytes()
    shard.write_bytes(body + table + struct.pack("<I", google_crc32c.value(table)))


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Peak RSS of clean reads, per action, to bound what a hostile read may cost."""
    path = write_store(tmp_path_factory.mktemp("clean") / "d.zarr", zarr_format=2, chunk_tokens=64)
    out = {}
    for action in ("open", "load", "describe", "verify"):
        report = run_child(action, path)
        assert report.get("ok"), report
        out[action] = report["maxrss_kib"]
    return out


# -- 1. the gate: crafted frames never reach c-blosc ------------------------------------------


@pytest.mark.parametrize("action", ["open", "describe", "verify"])
def test_a_crafted_blosc_seq_starts_chunk_is_refused_not_a_crash(
    tmp_path: Path, action: str
) -> None:
    path = write_store(tmp_path / "d.zarr", zarr_format=2, chunk_tokens=64)
    target = chunk_file(path, "seq_starts")
    nbytes = int(zarr.open_array(str(path / "train" / "seq_starts")).chunks[0]) * 8
    target.write_bytes(crafted_blosc_frame(nbytes))
    report = run_child(action, path)
    assert_refused(report, "CorruptChunkError", "seq_starts/0", "1073741824 compressed bytes")


@pytest.mark.parametrize("action", ["load", "verify"])
def test_a_crafted_blosc_inner_chunk_of_a_shard_is_refused_not_a_crash(
    tmp_path: Path, action: str
) -> None:
    path = write_store(tmp_path / "d.zarr", chunk_tokens=32, shard_tokens=128)
    shard = chunk_file(path, "encoded_tokens", 1)
    rewrite_inner_chunk(shard, 2, crafted_blosc_frame(32 * 4, size=120))
    report = run_child(action, path)
    assert_refused(report, "CorruptChunkError", "encoded_tokens/c/1", "compressed bytes")


def test_a_shard_index_pointing_past_the_shard_is_refused(tmp_path: Path) -> None:
    import google_crc32c

    path = write_store(tmp_path / "d.zarr", chunk_tokens=32, shard_tokens=128)
    shard = chunk_file(path, "encoded_tokens", 0)
    raw = shard.read_bytes()
    entries = np.frombuffer(raw[-68:-4], "<u8").reshape(-1, 2).copy()
    entries[1] = (1 << 40, 100)
    index = entries.tobytes()
    shard.write_bytes(raw[:-68] + index + struct.pack("<I", google_crc32c.value(index)))
    report = run_child("verify", path)
    assert_refused(report, "CorruptChunkError", "encoded_tokens/c/0")


# -- 1b. decompression bombs: nothing decodes past its chunk's size ---------------------------


@pytest.mark.parametrize("action", ["describe", "verify"])
def test_a_blosc_bomb_is_refused_before_allocating(
    tmp_path: Path, action: str, baselines: dict[str, int]
) -> None:
    path = write_store(tmp_path / "d.zarr", zarr_format=2, chunk_tokens=64)
    frame = blosc_bomb_frame(3 << 29)  # says 1.5 GiB
    assert len(frame) <= 64 << 10
    chunk_file(path, "seq_starts").write_bytes(frame)
    report = run_child(action, path)
    assert_refused(
        report, "CorruptChunkError", "seq_starts/0", "decodes to", baseline_kib=baselines[action]
    )


@pytest.mark.parametrize("declare", [True, False], ids=["declared-size", "streamed"])
@pytest.mark.parametrize("array,action", [("seq_starts", "open"), ("encoded_tokens", "load")])
def test_a_zstd_bomb_is_refused_before_decoding(
    tmp_path: Path, declare: bool, array: str, action: str, baselines: dict[str, int]
) -> None:
    from zarr.codecs import ZstdCodec

    path = write_zarr_store(tmp_path / "d.zarr", ZstdCodec(level=3))
    bomb = zstd_bomb(4 << 30 if declare else 2 << 30, declare=declare)
    assert len(bomb) <= 132 << 10
    chunk_file(path, array).write_bytes(bomb)
    report = run_child(action, path)
    assert_refused(
        report, "CorruptChunkError", f"{array}/c/0", "zstd", baseline_kib=baselines[action]
    )


@pytest.mark.parametrize("action", ["load", "verify"])
def test_a_gzip_bomb_is_refused_in_bounded_memory(
    tmp_path: Path, action: str, baselines: dict[str, int]
) -> None:
    from numcodecs import GZip

    # One 256 KiB chunk: a bomb small enough to pass the size cap (about 300 KiB) must be
    # inflated to be judged, in bounded steps.
    path = write_zarr_store(tmp_path / "d.zarr", GZip(level=1), zarr_format=2, chunk=1 << 16)
    bomb = gzip_bomb(300 << 20)
    chunk_file(path, "encoded_tokens").write_bytes(bomb)
    report = run_child(action, path)
    assert_refused(
        report,
        "CorruptChunkError",
        "encoded_tokens/0",
        "gzip stream decodes to more than the chunk's 262144 bytes",
        baseline_kib=baselines[action],
    )


def test_stores_with_other_codecs_still_read_right(tmp_path: Path) -> None:
    """The gate does not refuse what honest writers produce (zstd, gzip, zlib, lz4, bz2)."""
    from numcodecs import BZ2, LZ4, GZip, Zlib, Zstd
    from zarr.codecs import GzipCodec, ZstdCodec

    from asyncflat.format.split import open_split
    from asyncflat.storage.guarded import guard_store

    for i, (codec, fmt) in enumerate(
        [
            (ZstdCodec(level=3), 3),
            (GzipCodec(level=5), 3),
            (Zstd(level=3), 2),
            (GZip(level=5), 2),
            (Zlib(level=5), 2),
            (LZ4(), 2),
            (BZ2(level=5), 2),
        ]
    ):
        path = write_zarr_store(tmp_path / f"d{i}.zarr", codec, zarr_format=fmt)
        expected = zarr.open_array(str(path / "train" / "encoded_tokens"))[:]

        async def read(path: Path = path) -> np.ndarray:
            store = guard_store(zarr.storage.LocalStore(str(path), read_only=True), str(path))
            arrays = await open_split(store, "train", name=str(path))
            return np.asarray(await arrays.encoded_tokens.getitem(slice(None)))

        import asyncio

        np.testing.assert_array_equal(asyncio.run(read()), expected, err_msg=repr(codec))


# -- 2. objects that are not what they claim --------------------------------------------------


@pytest.mark.parametrize(
    "array,action",
    [("seq_starts", "open"), ("seq_starts", "describe"), ("encoded_tokens", "verify")],
)
def test_an_8_gib_sparse_chunk_is_refused_unread(
    tmp_path: Path, array: str, action: str, baselines: dict[str, int]
) -> None:
    path = write_store(tmp_path / "d.zarr", zarr_format=2, chunk_tokens=64)
    target = chunk_file(path, array)
    with open(target, "r+b") as f:
        f.truncate(8 << 30)
    report = run_child(action, path)
    assert_refused(
        report,
        "CorruptChunkError",
        f"{array}/0",
        "8589934592 bytes",
        "refused unread",
        baseline_kib=baselines.get(action, baselines["open"]),
    )


@pytest.mark.parametrize("array,action", [("seq_starts", "open"), ("encoded_tokens", "verify")])
def test_a_symlink_out_of_the_store_is_refused(tmp_path: Path, array: str, action: str) -> None:
    path = write_store(tmp_path / "d.zarr", zarr_format=2, chunk_tokens=64)
    target = chunk_file(path, array)
    target.unlink()
    target.symlink_to("/dev/zero")
    report = run_child(action, path)
    assert_refused(report, "CorruptChunkError", f"{array}/0", "outside the store")


def test_a_symlinked_directory_out_of_the_store_is_refused(tmp_path: Path) -> None:
    path = write_store(tmp_path / "d.zarr", zarr_format=2, chunk_tokens=64)
    outside = tmp_path / "elsewhere"
    (path / "train" / "encoded_tokens").rename(outside)
    (path / "train" / "encoded_tokens").symlink_to(outside)
    report = run_child("load", path)
    assert_refused(report, "DatasetFormatError", "outside the store")


def test_a_symlink_inside_the_store_still_reads(tmp_path: Path) -> None:
    clean = write_store(tmp_path / "clean.zarr", zarr_format=2, chunk_tokens=64)
    path = write_store(tmp_path / "d.zarr", zarr_format=2, chunk_tokens=64)
    target = chunk_file(path, "encoded_tokens", 1)
    moved = path / "train" / "moved-chunk"
    target.rename(moved)
    target.symlink_to(moved)
    assert run_child("load", path)["digest"] == run_child("load", clean)["digest"]


@pytest.mark.parametrize("array,action", [("seq_starts", "open"), ("encoded_tokens", "verify")])
def test_a_fifo_chunk_is_refused_not_a_hang(tmp_path: Path, array: str, action: str) -> None:
    path = write_store(tmp_path / "d.zarr", zarr_format=2, chunk_tokens=64)
    target = chunk_file(path, array)
    target.unlink()
    os.mkfifo(target)
    report = run_child(action, path, timeout=90)
    assert_refused(report, "CorruptChunkError", f"{array}/0", "FIFO")


def test_a_fifo_as_metadata_is_refused_not_a_hang(tmp_path: Path) -> None:
    path = write_store(tmp_path / "d.zarr", zarr_format=2, chunk_tokens=64)
    target = path / "train" / "seq_starts" / ".zarray"
    target.unlink()
    os.mkfifo(target)
    report = run_child("describe", path, timeout=90)
    assert_refused(report, "DatasetFormatError", "seq_starts/.zarray", "FIFO")


# -- 3. sizes chosen by the metadata ----------------------------------------------------------


def write_shapes_only(path: Path, tokens: int, *, chunk: int) -> Path:
    """Metadata for ``tokens`` tokens (one sequence) and no token chunks at all."""
    root = zarr.open_group(str(path), mode="w", zarr_format=3)
    for split in ("train", "validation"):
        g = root.create_group(split)
        g.create_array("encoded_tokens", shape=(tokens,), chunks=(chunk,), dtype="uint32")
        g.create_array("seq_starts", shape=(2,), chunks=(2,), dtype="uint64")[:] = [0, tokens]
        g.attrs["max_token_id"] = 1
    return path


@pytest.mark.parametrize("action", ["open", "figures"])
def test_shapes_giving_2_32_minus_1_blocks_are_refused_before_allocating(
    tmp_path: Path, action: str
) -> None:
    path = write_shapes_only(tmp_path / "d.zarr", (1 << 32) - 1, chunk=1 << 22)
    report = run_child(action, path, len=1, batch=1, streams=1, rbpsb=1, spb=1)
    assert_refused(report, "DatasetTooLargeError", "4294967295 read blocks", "budget")
    assert "DatasetFormatError" in report["mro"] and "ConfigError" in report["mro"]


def test_tiny_chunks_over_a_large_array_are_refused_at_open(tmp_path: Path) -> None:
    path = write_shapes_only(tmp_path / "d.zarr", 1 << 24, chunk=1)
    report = run_child("describe", path)
    assert_refused(report, "DatasetFormatError", "encoded_tokens", "chunks of 1 elements")


def test_an_unboundable_codec_is_refused_at_open(tmp_path: Path) -> None:
    from numcodecs import Shuffle

    path = write_zarr_store(tmp_path / "d.zarr", Shuffle(elementsize=4), zarr_format=2)
    report = run_child("describe", path)
    assert_refused(report, "DatasetFormatError", "cannot be bounded")


# -- the gate's units --------------------------------------------------------------------------


def test_gate_accepts_every_real_blosc_frame_and_refuses_each_lie() -> None:
    from numcodecs import Blosc

    from asyncflat.storage.gate import ChunkRejected, check_blosc

    rng = np.random.default_rng(0)
    for cname in ("lz4", "zstd", "blosclz", "zlib"):
        for shuffle in (0, 1, 2):
            for n in (1, 7, 100, 4096, 70_000):
                raw = rng.integers(0, 1000, size=n).astype("<u4")
                frame = np.frombuffer(
                    Blosc(cname=cname, clevel=5, shuffle=shuffle).encode(raw), np.uint8
                )
                check_blosc(frame, raw.nbytes, exact=True)
                with pytest.raises(ChunkRejected):
                    check_blosc(frame[:-1], raw.nbytes, exact=True)
                with pytest.raises(ChunkRejected):
                    check_blosc(frame, raw.nbytes + 4, exact=True)
    with pytest.raises(ChunkRejected, match="compressed bytes"):
        check_blosc(np.frombuffer(crafted_blosc_frame(512), np.uint8), 512, exact=True)
