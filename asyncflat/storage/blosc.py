"""Partial Blosc decoding: decode just the items a read block needs, straight into the buffer.

numcodecs (0.16) only decodes whole Blosc chunks, so reading a 1M-token block out of seqax's
4M-token chunks decodes four times what it uses (zarr does the same). c-blosc itself can decode
a range of items (``blosc_getitem``, what tensorstore uses), touching only the internal blocks
that hold them. The c-blosc that numcodecs links is exported from its extension module, so we
bind those two functions with ctypes, which also releases the GIL for the call. When the symbols
are missing (another numcodecs build), :data:`AVAILABLE` is False and readers fall back to zarr.

c-blosc reads lengths from the chunk header, so every frame is validated against the bytes that
actually arrived (``blosc_cbuffer_validate``) before it is decoded: a truncated or corrupt
object is an error, never an out-of-bounds read.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np

__all__ = ["AVAILABLE", "BloscError", "FrameLayout", "decode_into", "frame_problem"]

log = logging.getLogger(__name__)


class BloscError(ValueError):
    """A Blosc frame that does not match its bytes or does not decode."""


def _bind() -> tuple | None:
    try:
        import numcodecs.blosc

        lib = ctypes.CDLL(numcodecs.blosc.__file__)
        getitem = lib.blosc_getitem
        decompress = lib.blosc_decompress_ctx
        validate = lib.blosc_cbuffer_validate
        sizes = lib.blosc_cbuffer_sizes
    except (ImportError, OSError, AttributeError) as exc:
        log.info("partial Blosc decoding unavailable (%s); falling back to zarr's codecs", exc)
        return None
    getitem.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    getitem.restype = ctypes.c_int
    decompress.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    decompress.restype = ctypes.c_int
    validate.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    validate.restype = ctypes.c_int
    sizes.argtypes = [ctypes.c_void_p] + [ctypes.POINTER(ctypes.c_size_t)] * 3
    sizes.restype = None
    return getitem, decompress, validate, sizes


_FUNCS = _bind()
AVAILABLE = _FUNCS is not None
_HEADER = 16
_MEMCPYED = 0x2  # header flag: items stored uncompressed right after the header


def frame_problem(frame: np.ndarray) -> str | None:
    """Why ``frame`` (uint8) is not one whole Blosc frame (its header's length must match)."""
    size = len(frame)
    if size < _HEADER:
        return f"{size} bytes cannot hold a Blosc header"
    cbytes = int(frame[12:16].view("<u4")[0])
    return None if cbytes == size else f"header says {cbytes} compressed bytes, object has {size}"


class FrameLayout:
    """Where the items of a Blosc frame live, from its header and block-offset table.

    A c-blosc frame is a 16-byte header, then (unless stored uncompressed) one int32 offset per
    internal block, then the compressed blocks in order. Knowing that, a reader fetches just the
    compressed blocks that hold a range of items (plus these two small parts) instead of the
    whole object: what a resumed step needs for the handful of rows it reads.
    """

    def __init__(self, header: bytes) -> None:
        if len(header) < _HEADER:
            raise BloscError(f"{len(header)} bytes cannot hold a Blosc header")
        flags, self.typesize = header[2], header[3]
        self.nbytes, self.blocksize, self.cbytes = (
            int.from_bytes(header[i : i + 4], "little") for i in (4, 8, 12)
        )
        if not self.typesize or not self.blocksize or self.cbytes < _HEADER:
            raise BloscError("inconsistent Blosc header")
        self.memcpyed = bool(flags & _MEMCPYED)
        self.nblocks = -(-self.nbytes // self.blocksize)
        self.header = bytes(header[:_HEADER])
        self.offsets: np.ndarray | None = None  # int32 block offsets, once read

    @property
    def offsets_range(self) -> tuple[int, int]:
        """Byte range of the block-offset table (empty for an uncompressed frame)."""
        return _HEADER, _HEADER + (0 if self.memcpyed else 4 * self.nblocks)

    def items_range(self, first_item: int, n: int) -> tuple[int, int]:
        """Byte range of the frame holding items ``[first_item, first_item + n)``."""
        lo, hi = first_item * self.typesize, (first_item + n) * self.typesize
        if hi > self.nbytes:
            raise BloscError(f"items up to byte {hi} requested, the frame decodes to {self.nbytes}")
        if self.memcpyed:
            return _HEADER + lo, _HEADER + hi
        assert self.offsets is not None, "read offsets_range first"
        first, last = lo // self.blocksize, (hi - 1) // self.blocksize
        end = int(self.offsets[last + 1]) if last + 1 < self.nblocks else self.cbytes
        start = int(self.offsets[first])
        if not _HEADER <= start <= end <= self.cbytes:
            raise BloscError("block offsets point outside the frame")
        return start, end

    def sparse_frame(self, parts: list[tuple[int, bytes]]) -> np.ndarray:
        """A frame-sized buffer holding only ``parts`` ((offset, bytes)) and the header/table.

        Pages never written are never touched, by us or by ``blosc_getitem``, which reads only
        the header, the table and the blocks it decodes.
        """
        frame = np.empty(self.cbytes, np.uint8)
        frame[:_HEADER] = np.frombuffer(self.header, np.uint8)
        if self.offsets is not None:
            lo, hi = self.offsets_range
            frame[lo:hi] = self.offsets.view(np.uint8)
        for offset, data in parts:
            frame[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        return frame


def decode_into(frame: np.ndarray, first_item: int, out: np.ndarray) -> None:
    """Decode items ``[first_item, first_item + len(out))`` of a Blosc ``frame`` into ``out``.

    ``frame`` is the whole compressed object (uint8); ``out`` a C-contiguous array whose dtype
    has the frame's item size. Raises BloscError for frames that are truncated, inconsistent or
    too small for the request.
    """
    assert _FUNCS is not None, "check AVAILABLE first"
    getitem, decompress, validate, sizes = _FUNCS
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if frame.nbytes < _HEADER:
        raise BloscError(f"{frame.nbytes} bytes cannot hold a Blosc header")
    src = frame.ctypes.data
    nbytes, cbytes, blocksize = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
    sizes(src, ctypes.byref(nbytes), ctypes.byref(cbytes), ctypes.byref(blocksize))
    if cbytes.value != frame.nbytes:
        raise BloscError(f"header says {cbytes.value} compressed bytes, object has {frame.nbytes}")
    if validate(src, frame.nbytes, ctypes.byref(nbytes)) < 0:
        raise BloscError("inconsistent Blosc header")
    itemsize = out.itemsize
    end = (first_item + len(out)) * itemsize
    if end > nbytes.value:
        raise BloscError(f"request ends at byte {end}, the frame decodes to {nbytes.value}")
    if first_item == 0 and out.nbytes == nbytes.value:
        result = decompress(src, out.ctypes.data, out.nbytes, 1)
    else:
        result = getitem(src, first_item, len(out), out.ctypes.data)
    if result != out.nbytes:
        raise BloscError(f"Blosc returned {result} decoding {out.nbytes} bytes")
