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
import importlib.machinery
import importlib.util
import logging
import mmap
import os
from collections.abc import Callable

import numpy as np

__all__ = [
    "AVAILABLE",
    "BloscError",
    "FrameLayout",
    "Header",
    "Unsupported",
    "check_frame",
    "decode_into",
    "frame_problem",
    "zarr_decode",
]

log = logging.getLogger(__name__)


class BloscError(ValueError):
    """A Blosc frame that does not match its bytes or does not decode."""


def _extension_path() -> str:
    """The file of numcodecs' Blosc extension, found without importing numcodecs (its package
    imports every codec and reads entry points: tens of milliseconds at start-up)."""
    spec = importlib.util.find_spec("numcodecs")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("numcodecs is not installed")
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "blosc" + suffix)
            if os.path.isfile(path):
                return path
    raise ImportError("numcodecs has no Blosc extension module")


def _bind() -> tuple | None:
    try:
        # c-blosc's context functions used here keep no global state: the library needs no
        # blosc_init(), which numcodecs' module runs when it is imported (later, by zarr).
        lib = ctypes.CDLL(_extension_path())
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
_DOSHUFFLE, _MEMCPYED, _DOBITSHUFFLE, _RESERVED, _DONT_SPLIT = 0x1, 0x2, 0x4, 0x8, 0x10
#: Blosc1 format versions (header byte 0) whose layout this module knows (c-blosc 1.x writes 2).
_VERSIONS = (1, 2)
#: Compressor codes (flags >> 5) c-blosc 1.x knows: blosclz, lz4/lz4hc, snappy, zlib, zstd.
_COMPRESSORS = (0, 1, 2, 3, 4)
#: Largest buffer c-blosc handles (its int32 sizes, less the header).
_MAX_NBYTES = 2**31 - 1 - _HEADER


class Unsupported(BloscError):
    """A frame the fast path does not fully understand: decode it with zarr's codec instead."""


def frame_problem(frame: np.ndarray) -> str | None:
    """Why ``frame`` (uint8) is not one whole Blosc frame (its header's length must match)."""
    size = len(frame)
    if size < _HEADER:
        return f"{size} bytes cannot hold a Blosc header"
    cbytes = int(frame[12:16].view("<u4")[0])
    return None if cbytes == size else f"header says {cbytes} compressed bytes, object has {size}"


class Header:
    """The 16-byte Blosc1 header, checked field by field before c-blosc sees the frame.

    Raises :class:`Unsupported` for a frame this module does not fully understand (another
    format version, reserved flags, an unknown compressor, a decoded size other than the one
    expected): it goes to zarr's decoder instead. Raises :class:`BloscError` for one that is
    impossible (sizes that contradict each other).
    """

    def __init__(
        self,
        header: bytes | np.ndarray,
        expected_nbytes: int | None = None,
        *,
        defer_unsupported: bool = False,
    ) -> None:
        raw = bytes(header[:_HEADER])
        if len(raw) < _HEADER:
            raise BloscError(f"{len(raw)} bytes cannot hold a Blosc header")
        self.raw = raw
        self.version, flags, self.typesize = raw[0], raw[2], raw[3]
        self.flags = flags
        self.nbytes, self.blocksize, self.cbytes = (
            int.from_bytes(raw[i : i + 4], "little") for i in (4, 8, 12)
        )
        # What this module does not know is decided here but raised last: even a frame for
        # zarr's decoder must first pass every size check (c-blosc trusts the header there too).
        self.unsupported: str | None = None
        if self.version not in _VERSIONS:
            self.unsupported = f"Blosc format version {self.version}"
        elif flags & _RESERVED or (flags & _DOSHUFFLE and flags & _DOBITSHUFFLE):
            self.unsupported = f"Blosc flags {flags:#04x}"
        elif flags >> 5 not in _COMPRESSORS:
            self.unsupported = f"Blosc compressor code {flags >> 5}"
        if expected_nbytes is not None and self.nbytes != expected_nbytes:
            # Never let a header size a buffer: a chunk decodes to the chunk's size, or is bad.
            raise BloscError(
                f"frame decodes to {self.nbytes} bytes, the chunk has {expected_nbytes}"
            )
        if not self.typesize:
            raise BloscError("inconsistent Blosc header: typesize 0")
        if (
            self.nbytes > _MAX_NBYTES
            or self.cbytes < _HEADER
            or self.cbytes > _MAX_NBYTES + _HEADER
        ):
            raise BloscError(f"inconsistent Blosc header: {self.nbytes} bytes in {self.cbytes}")
        self.memcpyed = bool(flags & _MEMCPYED)
        if self.memcpyed:
            if self.cbytes != _HEADER + self.nbytes:
                raise BloscError(
                    f"inconsistent Blosc header: stored uncompressed, yet {self.cbytes} bytes "
                    f"hold {self.nbytes}"
                )
            self.nblocks = 0
            self._done(defer_unsupported)
            return
        if not self.blocksize or (self.blocksize > self.nbytes and self.nbytes):
            raise BloscError(
                f"inconsistent Blosc header: block size {self.blocksize} for {self.nbytes} bytes"
            )
        self.nblocks = -(-self.nbytes // self.blocksize)
        if _HEADER + 4 * self.nblocks > self.cbytes:
            raise BloscError(
                f"inconsistent Blosc header: {self.nblocks} blocks cannot fit in {self.cbytes} bytes"
            )
        self._done(defer_unsupported)

    def _done(self, defer_unsupported: bool) -> None:
        if self.unsupported is not None and not defer_unsupported:
            raise Unsupported(self.unsupported)

    @property
    def table_end(self) -> int:
        return _HEADER + 4 * self.nblocks

    def check_offsets(self, offsets: np.ndarray) -> None:
        """Every block starts after the table and at least 4 bytes before the frame's end (a
        block begins with its compressed size; c-blosc would follow any offset): the bound
        the gate puts on a whole object (:func:`~asyncflat.storage.gate.check_blosc`), here for
        a ranged read, whose layout comes from the header and table alone."""
        if len(offsets) and (
            int(offsets.min()) < self.table_end or int(offsets.max()) > self.cbytes - 4
        ):
            raise BloscError(
                f"block offsets point outside the frame (blocks start in "
                f"[{self.table_end}, {self.cbytes - 4}], frame has {self.cbytes} bytes)"
            )


class FrameLayout:
    """Where the items of a Blosc frame live, from its header and block-offset table.

    A c-blosc frame is a 16-byte header, then (unless stored uncompressed) one int32 offset per
    internal block, then the compressed blocks. Knowing that, a reader fetches just the
    compressed blocks that hold a range of items (plus these two small parts) instead of the
    whole object: what a resumed step needs for the handful of rows it reads. Items are the
    caller's (``itemsize`` bytes each), whatever item size the frame was written with.
    """

    def __init__(
        self, header: bytes, expected_nbytes: int | None = None, itemsize: int = 4
    ) -> None:
        self.head = Header(header, expected_nbytes)
        self.itemsize = itemsize
        self.typesize = self.head.typesize
        self.nbytes, self.blocksize, self.cbytes = (
            self.head.nbytes,
            self.head.blocksize,
            self.head.cbytes,
        )
        self.memcpyed = self.head.memcpyed
        self.nblocks = self.head.nblocks
        self.header = self.head.raw
        self._offsets: np.ndarray | None = None  # int32 block offsets, once read
        self._ends: np.ndarray | None = None
        self._prefix = self.header

    @property
    def offsets(self) -> np.ndarray | None:
        return self._offsets

    @offsets.setter
    def offsets(self, value: np.ndarray | None) -> None:
        if value is not None:
            value = np.asarray(value, "<i4")
            if len(value) != self.nblocks:
                raise BloscError(f"{len(value)} block offsets for {self.nblocks} blocks")
            self.head.check_offsets(value)
            # Where each block ends: the next block start after it, or the frame's end (blocks
            # need not be stored in order: c-blosc's threads write them as they finish).
            ordered = np.unique(value)
            following = np.searchsorted(ordered, value, side="right")
            ends = np.append(ordered, self.cbytes)[following]
            self._ends = ends.astype(np.int64)
        self._offsets = value
        self._prefix = self.header + (b"" if value is None else value.tobytes())

    @property
    def prefix(self) -> bytes:
        """The frame's first bytes as this layout read them (header, then the block table as far
        as it was read): an object whose first bytes differ is not the one it describes."""
        return self._prefix

    @property
    def offsets_range(self) -> tuple[int, int]:
        """Byte range of the block-offset table (empty for an uncompressed frame)."""
        return _HEADER, self.head.table_end

    def items_range(self, first_item: int, n: int) -> tuple[int, int]:
        """Byte range of the frame holding items ``[first_item, first_item + n)``."""
        lo, hi = first_item * self.itemsize, (first_item + n) * self.itemsize
        if lo < 0 or n <= 0 or hi > self.nbytes:
            raise BloscError(f"items up to byte {hi} requested, the frame decodes to {self.nbytes}")
        if self.memcpyed:
            return _HEADER + lo, _HEADER + hi
        assert self._offsets is not None and self._ends is not None, "read offsets_range first"
        if self._whole_frame(hi):
            return int(self._offsets.min()), int(self._ends.max())  # every block
        first, last = lo // self.blocksize, (hi - 1) // self.blocksize
        start = int(self._offsets[first : last + 1].min())
        end = int(self._ends[first : last + 1].max())
        return start, end

    def decoded_span(self, first_item: int, n: int) -> int:
        """Bytes Blosc decodes to serve items ``[first_item, first_item + n)``: their whole
        blocks (just the items for an uncompressed frame; the whole frame for its tail)."""
        lo, hi = first_item * self.itemsize, (first_item + n) * self.itemsize
        if self._whole_frame(hi):
            return self.nbytes
        if self.memcpyed or self.blocksize <= 0:
            return hi - lo
        return ((hi - 1) // self.blocksize - lo // self.blocksize + 1) * self.blocksize

    def _whole_frame(self, hi: int) -> bool:
        """Whether a request ending at byte ``hi`` reaches the frame's trailing bytes short of a
        whole item of its typesize: those come out of a decode of the whole frame only
        (:func:`decode_into`), which needs every block."""
        return hi > self.nbytes - self.nbytes % self.typesize

    def range_frame(
        self, lo: int, hi: int, allocate: Callable[[int], np.ndarray] | None = None
    ) -> tuple[np.ndarray, int]:
        """A frame to decode from with only the object's bytes ``[lo, hi)`` (its compressed
        blocks, from :meth:`items_range`), and where in it those bytes go.

        The frame is compact: the header (its compressed size rewritten to the frame's), the
        block table (the offsets of blocks inside the range moved to where they now lie, every
        other block pointing at the first byte after the table, never decoded: c-blosc reads
        only the blocks that hold the requested items), then the range. Its buffer is
        ``allocate``'s (a slab used before, where the reader keeps them), else ordinary heap
        memory the size of what was read: never a frame-sized anonymous mapping per read (what
        :meth:`sparse_frame` makes), a map and an unmap per read block, which under a
        sandboxed kernel (gVisor) stalled the trainer's thread for a millisecond at a time.

        An uncompressed frame keeps its items at their own offsets: it gets a sparse frame.
        ``allocate(nbytes)``: the uint8 array of a compact frame (see
        :class:`~asyncflat.storage.recycled.RecycledBytes`), else a new one.
        """
        if self.memcpyed or self._offsets is None:
            return self.sparse_frame([]), lo
        table_end = self.head.table_end
        if not table_end <= lo < hi <= self.cbytes:
            raise BloscError(f"bytes {lo}-{hi - 1} are not compressed blocks of this frame")
        size = table_end + hi - lo
        frame = allocate(size) if allocate is not None else np.empty(size, np.uint8)
        frame[:_HEADER] = np.frombuffer(self.header, np.uint8)
        frame[12:16] = np.frombuffer(size.to_bytes(4, "little"), np.uint8)
        offsets = self._offsets.astype(np.int64)
        inside = (offsets >= lo) & (offsets < hi)
        moved = np.where(inside, offsets - lo + table_end, table_end).astype("<i4")
        frame[_HEADER:table_end] = moved.view(np.uint8)
        return frame, table_end

    def sparse_frame(self, parts: list[tuple[int, bytes]]) -> np.ndarray:
        """A frame-sized buffer holding only ``parts`` ((offset, bytes)) and the header/table.

        Pages never written are never touched, by us or by ``blosc_getitem``, which reads only
        the header, the table and the blocks it decodes: the buffer is an anonymous mapping of
        its own, so those pages are never resident and all of it goes back to the system when
        the frame is dropped. (``np.zeros`` would not do: once glibc's adaptive mmap threshold
        has grown past a frame's size, ``calloc`` serves it from the heap, zeroing every page,
        and the heap keeps them after: a fresh loader's first load, reading its rows directly,
        left ~one compressed chunk of resident memory per row.)
        """
        frame = np.frombuffer(mmap.mmap(-1, max(self.cbytes, 1)), np.uint8)[: self.cbytes]
        frame[:_HEADER] = np.frombuffer(self.header, np.uint8)
        if self._offsets is not None:
            lo, hi = self.offsets_range
            frame[lo:hi] = self._offsets.view(np.uint8)
        for offset, data in parts:
            frame[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        return frame


def check_frame(frame: np.ndarray, expected_nbytes: int | None = None) -> Header:
    """The checked header of a whole ``frame`` (uint8): lengths, fields and block table.

    Raises :class:`Unsupported` (decode with zarr) or :class:`BloscError` (corrupt).
    """
    problem = frame_problem(frame)
    if problem is not None:
        raise BloscError(problem)
    head = Header(frame[:_HEADER].tobytes(), expected_nbytes, defer_unsupported=True)
    if not head.memcpyed:
        head.check_offsets(frame[_HEADER : head.table_end].view("<i4"))
    if head.unsupported is not None:
        raise Unsupported(head.unsupported)
    return head


def zarr_decode(frame: np.ndarray, expected_nbytes: int | None) -> np.ndarray:
    """Decode a whole frame with numcodecs (zarr's Blosc codec), as uint8; BloscError if not."""
    from numcodecs import Blosc

    try:
        data = np.frombuffer(Blosc().decode(frame), np.uint8)
    except Exception as exc:  # numcodecs raises RuntimeError/ValueError/TypeError
        raise BloscError(f"zarr's Blosc codec cannot decode it: {exc}") from exc
    if expected_nbytes is not None and data.nbytes != expected_nbytes:
        raise BloscError(f"decodes to {data.nbytes} bytes, the chunk has {expected_nbytes}")
    return data


def decode_into(
    frame: np.ndarray,
    first_item: int,
    out: np.ndarray,
    expected_nbytes: int | None = None,
    *,
    head: Header | None = None,
) -> Header | None:
    """Decode items ``[first_item, first_item + len(out))`` of a Blosc ``frame`` into ``out``.

    ``frame`` is the whole compressed object (uint8); ``out`` a C-contiguous array (its items
    are the caller's, whatever typesize the frame was written with). ``expected_nbytes``: what
    the frame must decode to (the chunk's size). Every header field is checked first; a frame
    this module does not fully understand is decoded by zarr's codec instead, and c-blosc only
    ever writes into buffers sized here, in the frame's own item units. Raises BloscError for
    frames that are truncated, inconsistent or too small for the request.

    Returns the checked header, or None where zarr's codec decoded the frame. A caller decoding
    many ranges of one immutable frame passes it back as ``head`` for the next (with the same
    ``expected_nbytes``): the check is Python work under the GIL, the decode is not.
    """
    assert _FUNCS is not None, "check AVAILABLE first"
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    lo = first_item * out.itemsize
    hi = lo + out.nbytes
    if head is None:
        try:
            head = check_frame(frame, expected_nbytes)
        except Unsupported:
            data = zarr_decode(frame, expected_nbytes)
            if first_item < 0 or hi > data.nbytes:
                raise BloscError(
                    f"request ends at byte {hi}, the frame decodes to {data.nbytes}"
                ) from None
            out.view(np.uint8).reshape(-1)[:] = data[lo:hi]
            return None
    _decode_checked(frame, head, lo, hi, out)
    return head


def _decode_checked(frame: np.ndarray, head: Header, lo: int, hi: int, out: np.ndarray) -> None:
    """Bytes ``[lo, hi)`` of the decoded ``frame`` (its ``head`` checked) into ``out``."""
    assert _FUNCS is not None
    getitem, decompress, _validate, _sizes = _FUNCS
    if lo < 0 or hi > head.nbytes:
        raise BloscError(f"request ends at byte {hi}, the frame decodes to {head.nbytes}")
    if out.nbytes == 0:
        return
    src = frame.ctypes.data
    if lo == 0 and hi == head.nbytes:
        result = decompress(src, out.ctypes.data, out.nbytes, 1)
        if result != out.nbytes:
            raise BloscError(f"Blosc returned {result} decoding {out.nbytes} bytes")
        return
    ts = head.typesize
    if lo % ts == 0 and hi % ts == 0:  # whole items of the frame: straight into out
        result = getitem(src, lo // ts, (hi - lo) // ts, out.ctypes.data)
        if result != out.nbytes:
            raise BloscError(f"Blosc returned {result} decoding {out.nbytes} bytes")
        return
    # The range cuts the frame's items: decode the covering items into a buffer of our own.
    a, b = lo // ts * ts, -(-hi // ts) * ts
    if b <= head.nbytes:
        tmp = np.empty(b - a, np.uint8)
        result = getitem(src, a // ts, (b - a) // ts, tmp.ctypes.data)
    else:  # a trailing partial item: decode the whole frame
        a, tmp = 0, np.empty(head.nbytes, np.uint8)
        result = decompress(src, tmp.ctypes.data, tmp.nbytes, 1)
    if result != tmp.nbytes:
        raise BloscError(f"Blosc returned {result} decoding {tmp.nbytes} bytes")
    out.view(np.uint8).reshape(-1)[:] = tmp[lo - a : hi - a]
