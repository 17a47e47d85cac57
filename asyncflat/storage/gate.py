"""The chunk gate: every chunk object's bytes are checked against their array's metadata before
any decoder (c-blosc, zstd, zlib, zarr's sharding codec) sees them.

A decoder trusts what a frame says about itself: c-blosc reads block offsets and sizes from the
header (a frame whose header claims more bytes than the object holds is read past its end: a
crash), numcodecs allocates whatever decoded size a Blosc or zstd header declares, and zlib/gzip
inflate without a bound (a 128 KiB object may inflate to 4 GiB). A chunk of an array is never
larger than ``prod(chunk shape) * itemsize`` decoded, and never larger than its codec's worst
case encoded, so both are known before a byte is read. :class:`ChunkGate` holds those limits for
one array and checks an object's bytes against them:

* Blosc: the 16-byte header (type size, block size, decoded size equal to the chunk's, the
  compressed size equal to the object's real length) and the block-offset table (every block
  starts inside the object, after the table).
* zstd: the frame must declare its content size (every zarr writer does), at most the chunk's.
* gzip / zlib / bz2 / lzma: inflated in bounded steps here, stopping one byte past the limit.
* lz4 (numcodecs' framing): the declared size, at most the chunk's.
* crc32c (zarr 3): stripped; what it wraps is checked.
* sharding (zarr 3): the shard index's entries against the shard's length, then every inner
  chunk with the inner codecs' gate (whole shards), or one inner chunk per ranged read.

Anything else cannot be bounded and is refused when the array is opened
(:func:`gate_for`). :class:`ChunkRejected` carries the reason; the guarded store turns it into a
:class:`~asyncflat.errors.CorruptChunkError` naming the object.
"""

from __future__ import annotations

import bz2
import dataclasses
import lzma
import math
import zlib
from typing import Any

import numpy as np

__all__ = [
    "METADATA_MAX_BYTES",
    "ChunkGate",
    "ChunkRejected",
    "Compressor",
    "UnsupportedCodec",
    "check_blosc",
    "gate_for",
]

#: Largest metadata document (``zarr.json``, ``.zarray``, ``.zattrs``...) read from a store.
METADATA_MAX_BYTES = 64 << 20
_BLOSC_HEADER = 16
_BLOSC_MAX_OVERHEAD = 16  # c-blosc stores a frame it cannot shrink as header + raw bytes
_BLOSC_MEMCPYED = 0x2
_ZSTD_MAGIC = 0xFD2FB528
#: Step of bounded inflation: memory for a check stays at the limit plus this.
_INFLATE_STEP = 1 << 20
_EMPTY = (1 << 64) - 1  # shard index entry of an inner chunk that was never written


class ChunkRejected(ValueError):
    """Bytes of a chunk object that its array's metadata does not allow."""


class UnsupportedCodec(ValueError):
    """A codec whose decoded size cannot be bounded before decoding."""


def check_blosc(frame: np.ndarray, limit: int, *, exact: bool) -> None:
    """Check a Blosc frame (uint8) against its real length and the decoded-size ``limit``.

    ``exact``: the frame must decode to exactly ``limit`` bytes (a whole chunk, no filters).
    """
    size = len(frame)
    if size < _BLOSC_HEADER:
        raise ChunkRejected(f"{size} bytes cannot hold a Blosc header")
    flags, typesize = int(frame[2]), int(frame[3])
    nbytes, blocksize, cbytes = (int(v) for v in frame[4:16].view("<u4"))
    if cbytes != size:
        raise ChunkRejected(f"Blosc header says {cbytes} compressed bytes, object has {size}")
    if nbytes > limit or (exact and nbytes != limit):
        raise ChunkRejected(
            f"Blosc header says it decodes to {nbytes} bytes, the chunk holds "
            f"{'exactly' if exact else 'at most'} {limit}"
        )
    if nbytes == 0:
        return
    if typesize == 0 or blocksize <= 0 or blocksize > max(nbytes, typesize):
        raise ChunkRejected(
            f"Blosc header is inconsistent: typesize {typesize}, blocksize {blocksize}, "
            f"nbytes {nbytes}"
        )
    if flags & _BLOSC_MEMCPYED:
        if cbytes != nbytes + _BLOSC_HEADER:
            raise ChunkRejected(
                f"uncompressed Blosc frame of {nbytes} bytes must be {nbytes + 16} long, is {cbytes}"
            )
        return
    nblocks = -(-nbytes // blocksize)
    table_end = _BLOSC_HEADER + 4 * nblocks
    if table_end > size:
        raise ChunkRejected(
            f"Blosc block table of {nblocks} blocks ends at byte {table_end}, object has {size}"
        )
    starts = frame[_BLOSC_HEADER:table_end].view("<i4").astype(np.int64)
    bad = (starts < table_end) | (starts > size - 4)
    if bad.any():
        k = int(np.argmax(bad))
        raise ChunkRejected(
            f"Blosc block {k} starts at byte {int(starts[k])}, outside the object's compressed "
            f"blocks [{table_end}, {size - 4}]"
        )


def _check_zstd(data: memoryview, limit: int) -> None:
    if len(data) < 5:
        raise ChunkRejected(f"{len(data)} bytes cannot hold a zstd frame header")
    magic = int.from_bytes(data[:4], "little")
    if magic != _ZSTD_MAGIC:
        raise ChunkRejected(f"not a zstd frame (magic {magic:#010x})")
    fhd = data[4]
    fcs_flag, single_segment, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[dict_flag]
    fcs_size = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    if fcs_size == 0:
        raise ChunkRejected("zstd frame does not declare its decoded size")
    if len(data) < pos + fcs_size:
        raise ChunkRejected("zstd frame header is truncated")
    declared = int.from_bytes(data[pos : pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    if declared > limit:
        raise ChunkRejected(
            f"zstd frame says it decodes to {declared} bytes, the chunk holds {limit}"
        )


def _inflate_bounded(data: memoryview, limit: int, make: Any, what: str, *, members: bool) -> None:
    """Decode with ``make()`` decompressors in steps of at most ``_INFLATE_STEP`` bytes, counting
    the output and dropping it; refuse at one byte past ``limit``. With ``members``, streams
    back to back (gzip members, bz2/xz streams) are decoded as the codec would."""
    total = 0
    rest = bytes(data)
    while rest:
        dec = make()
        pending = rest
        while True:
            try:
                out = dec.decompress(pending, min(_INFLATE_STEP, limit - total + 1))
            except (zlib.error, OSError, EOFError, lzma.LZMAError) as exc:
                raise ChunkRejected(f"{what} stream does not decode: {exc}") from None
            total += len(out)
            if total > limit:
                raise ChunkRejected(f"{what} stream decodes to more than the chunk's {limit} bytes")
            if dec.eof:
                rest = dec.unused_data
                break
            pending = getattr(dec, "unconsumed_tail", b"")
            if not pending and not out and getattr(dec, "needs_input", True):
                raise ChunkRejected(f"{what} stream is truncated")
        if not members or rest.strip(b"\0") == b"":  # gzip may pad members with zeros
            return


def _bz2() -> Any:
    return bz2.BZ2Decompressor()


def _lzma() -> Any:
    return lzma.LZMADecompressor()


@dataclasses.dataclass(frozen=True)
class Compressor:
    """What a chunk's compressor may produce, checked on its encoded bytes before it runs
    (one per array; the zarr-free parser of a local split builds its own)."""

    name: str
    #: Decoded bytes the compressor may produce (the chunk, plus inner checksums).
    limit: int
    exact: bool

    def check(self, data: memoryview) -> None:
        if self.name == "blosc":
            check_blosc(np.frombuffer(data, np.uint8), self.limit, exact=self.exact)
        elif self.name == "zstd":
            _check_zstd(data, self.limit)
        elif self.name == "gzip":
            _inflate_bounded(data, self.limit, lambda: zlib.decompressobj(31), "gzip", members=True)
        elif self.name == "zlib":
            _inflate_bounded(
                data, self.limit, lambda: zlib.decompressobj(15), "zlib", members=False
            )
        elif self.name == "bz2":
            _inflate_bounded(data, self.limit, _bz2, "bz2", members=True)
        elif self.name == "lzma":
            _inflate_bounded(data, self.limit, _lzma, "lzma", members=True)
        elif self.name == "lz4":
            if len(data) < 4:
                raise ChunkRejected(f"{len(data)} bytes cannot hold an lz4 size header")
            declared = int.from_bytes(data[:4], "little")
            if declared > self.limit:
                raise ChunkRejected(
                    f"lz4 header says it decodes to {declared} bytes, the chunk holds {self.limit}"
                )
        elif self.name == "raw":
            if len(data) > self.limit or (self.exact and len(data) != self.limit):
                raise ChunkRejected(
                    f"uncompressed chunk has {len(data)} bytes, expected {self.limit}"
                )

    @property
    def max_encoded(self) -> int:
        """The largest object a legal encoding of ``limit`` bytes can be."""
        n = self.limit
        if self.name == "raw":
            return n
        if self.name == "blosc":
            return n + _BLOSC_MAX_OVERHEAD
        # zstd / deflate / lz4 worst cases are n + n/255 + a few dozen bytes; bz2 and lzma
        # a little more on tiny inputs. One generous bound for all of them.
        return n + n // 64 + (64 << 10)


@dataclasses.dataclass(frozen=True)
class ChunkGate:
    """What one chunk object of an array may be: checked before any decoder runs."""

    array: str
    #: Decoded bytes of one chunk (``prod(chunk shape) * itemsize``).
    chunk_nbytes: int
    compressor: Compressor
    #: Trailing crc32c checksums (zarr 3) around the compressed bytes.
    checksums: int = 0
    #: For a sharded array: the inner chunks' gate, their count, and where the index is.
    inner: ChunkGate | None = None
    inner_count: int = 0
    index_at_end: bool = True
    index_checksum: bool = True

    @property
    def index_bytes(self) -> int:
        return 16 * self.inner_count + (4 if self.index_checksum else 0)

    @property
    def max_object_bytes(self) -> int:
        """The largest a legal object of this array can be (refused unread when larger)."""
        if self.inner is not None:
            return self.inner.max_object_bytes * self.inner_count + self.index_bytes
        return self.compressor.max_encoded + 4 * self.checksums

    def check(self, data: memoryview) -> None:
        """Check a whole object's bytes; raise :class:`ChunkRejected`."""
        if self.inner is not None:
            self._check_shard(data)
            return
        if len(data) > self.max_object_bytes:
            raise ChunkRejected(
                f"object has {len(data)} bytes, more than any encoding of a "
                f"{self.chunk_nbytes}-byte chunk ({self.max_object_bytes})"
            )
        if self.checksums:
            if len(data) < 4 * self.checksums:
                raise ChunkRejected(f"{len(data)} bytes cannot hold its crc32c checksum")
            data = data[: len(data) - 4 * self.checksums]
        self.compressor.check(data)

    def is_index_request(self, byte_range: Any) -> bool:
        from zarr.abc.store import RangeByteRequest, SuffixByteRequest

        if self.index_at_end:
            return (
                isinstance(byte_range, SuffixByteRequest) and byte_range.suffix == self.index_bytes
            )
        return (
            isinstance(byte_range, RangeByteRequest)
            and byte_range.start == 0
            and byte_range.end == self.index_bytes
        )

    def check_range(self, byte_range: Any, data: memoryview, object_size: int | None) -> None:
        """Check the bytes of a ranged read: a shard's index, or one inner chunk."""
        assert self.inner is not None
        if self.is_index_request(byte_range):
            self.check_index(data, object_size)
        else:
            self.inner.check(data)

    def check_index(self, index: memoryview, object_size: int | None) -> np.ndarray:
        """Check a shard index's entries; return them as (offset, nbytes) rows (uint64)."""
        body = index[: 16 * self.inner_count]
        if len(body) != 16 * self.inner_count:
            raise ChunkRejected(f"shard index has {len(index)} bytes, expected {self.index_bytes}")
        entries = np.frombuffer(body, "<u8").reshape(-1, 2)
        empty = (entries[:, 0] == _EMPTY) & (entries[:, 1] == _EMPTY)
        used = entries[~empty]
        offsets, lengths = used[:, 0], used[:, 1]
        limit = self.inner.max_object_bytes if self.inner is not None else 0
        if (lengths > limit).any() or (lengths == 0).any():
            k = int(np.argmax((lengths > limit) | (lengths == 0)))
            raise ChunkRejected(
                f"shard index entry gives an inner chunk of {int(lengths[k])} bytes, "
                f"a legal one has 1 to {limit}"
            )
        if object_size is not None and used.size:
            lo = self.index_bytes if not self.index_at_end else 0
            hi = object_size - (self.index_bytes if self.index_at_end else 0)
            # offsets are < 2**64 - 1 and lengths small: compare without wrapping
            bad = (offsets < lo) | (offsets > hi) | (lengths > hi - np.minimum(offsets, hi))
            if bad.any():
                k = int(np.argmax(bad))
                raise ChunkRejected(
                    f"shard index entry points at bytes {int(offsets[k])}+{int(lengths[k])}, "
                    f"outside the shard's chunk data [{lo}, {hi})"
                )
        return entries

    def _check_shard(self, data: memoryview) -> None:
        assert self.inner is not None
        if len(data) > self.max_object_bytes:
            raise ChunkRejected(
                f"shard has {len(data)} bytes, more than any encoding of its chunks "
                f"({self.max_object_bytes})"
            )
        if len(data) < self.index_bytes:
            raise ChunkRejected(f"{len(data)} bytes cannot hold the shard index")
        index = data[-self.index_bytes :] if self.index_at_end else data[: self.index_bytes]
        entries = self.check_index(index, len(data))
        for offset, length in entries:
            if int(offset) == _EMPTY:
                continue
            self.inner.check(data[int(offset) : int(offset) + int(length)])


# --------------------------------------------------------------------------------------------
# From array metadata to a gate
# --------------------------------------------------------------------------------------------

_V2_COMPRESSORS = {"blosc", "zstd", "gzip", "zlib", "bz2", "lzma", "lz4"}


def gate_for(array: Any) -> ChunkGate:
    """The gate of a zarr ``AsyncArray``; :class:`UnsupportedCodec` when its chunks cannot be
    bounded before decoding."""
    from zarr.core.metadata import ArrayV2Metadata

    meta = array.metadata
    name = array.store_path.path
    itemsize = np.dtype(array.dtype).itemsize
    if isinstance(meta, ArrayV2Metadata):
        nbytes = math.prod(meta.chunks) * itemsize
        filtered = bool(meta.filters)
        codec = meta.compressor
        if codec is None:
            comp = Compressor("raw", nbytes * (2 if filtered else 1), not filtered)
        else:
            cid = str(getattr(codec, "codec_id", type(codec).__name__)).lower()
            if cid not in _V2_COMPRESSORS:
                raise UnsupportedCodec(f"{name}: compressor {cid!r} cannot be bounded")
            comp = Compressor(cid, nbytes * (2 if filtered else 1), not filtered)
        return ChunkGate(name, nbytes, comp)
    shape = tuple(meta.chunk_grid.chunk_shape)  # the shard's, for a sharded array
    return _v3_gate(name, list(meta.codecs), shape, itemsize)


def _v3_gate(
    name: str, codecs: list[Any], chunk_shape: tuple[int, ...], itemsize: int
) -> ChunkGate:
    from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec
    from zarr.codecs.bytes import Endian

    nbytes = math.prod(chunk_shape) * itemsize
    array_to_bytes = [i for i, c in enumerate(codecs) if isinstance(c, (BytesCodec, ShardingCodec))]
    if len(array_to_bytes) != 1:
        raise UnsupportedCodec(f"{name}: codec chain {codecs!r} cannot be bounded")
    k = array_to_bytes[0]
    filtered = k > 0  # array-to-array codecs (transpose) keep the size
    middle, after = codecs[k], codecs[k + 1 :]
    if isinstance(middle, ShardingCodec):
        if after:
            raise UnsupportedCodec(f"{name}: codecs after sharding cannot be bounded")
        inner_shape = tuple(middle.chunk_shape)
        inner = _v3_gate(name, list(middle.codecs), inner_shape, itemsize)
        if inner.inner is not None:
            raise UnsupportedCodec(f"{name}: nested sharding is not supported")
        index_codecs = list(middle.index_codecs)
        if not (
            index_codecs
            and isinstance(index_codecs[0], BytesCodec)
            and index_codecs[0].endian in (None, Endian.little)
            and all(isinstance(c, Crc32cCodec) for c in index_codecs[1:])
            and len(index_codecs) <= 2
        ):
            raise UnsupportedCodec(f"{name}: shard index codecs {index_codecs!r} not supported")
        count = math.prod(c // i for c, i in zip(chunk_shape, inner_shape, strict=True))
        location = getattr(middle.index_location, "value", middle.index_location)
        return ChunkGate(
            name,
            nbytes,
            Compressor("raw", 0, False),
            inner=inner,
            inner_count=count,
            index_at_end=location == "end",
            index_checksum=len(index_codecs) == 2,
        )
    compressors = [c for c in after if not isinstance(c, Crc32cCodec)]
    if len(compressors) > 1:
        raise UnsupportedCodec(f"{name}: more than one compressor cannot be bounded")
    if not compressors:
        return ChunkGate(name, nbytes, Compressor("raw", nbytes, not filtered), len(after))
    comp = compressors[0]
    position = after.index(comp)
    inner_crcs, outer_crcs = position, len(after) - position - 1
    cname = _v3_compressor_name(comp)
    if cname is None:
        raise UnsupportedCodec(f"{name}: codec {type(comp).__name__} cannot be bounded")
    limit = nbytes + 4 * inner_crcs
    return ChunkGate(
        name, nbytes, Compressor(cname, limit, not filtered and not inner_crcs), outer_crcs
    )


def _v3_compressor_name(codec: Any) -> str | None:
    from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

    if isinstance(codec, BloscCodec):
        return "blosc"
    if isinstance(codec, ZstdCodec):
        return "zstd"
    if isinstance(codec, GzipCodec):
        return "gzip"
    cid = str(getattr(codec, "codec_name", "")).rsplit(".", 1)[-1].lower()
    return cid if cid in _V2_COMPRESSORS else None
