"""Chunk objects the reader decodes itself, bypassing zarr's codec pipeline.

:func:`raw_codec` says whether an array's chunks can be read and decoded here (a plain Blosc
frame or raw little-endian items, optionally with zarr's crc32c trailer);
:func:`blosc_frame_prefixes` names the arrays whose objects are exactly one Blosc frame (for the
guarded store's checks); a :class:`Frame` holds the bytes of one chunk (or of a range of it) and
decodes items from it; :func:`without_crc32c` checks and strips the crc32c trailer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from asyncflat.errors import CorruptChunkError
from asyncflat.format.split import SplitArrays
from asyncflat.storage import blosc as _blosc

__all__ = ["Frame", "blosc_frame_prefixes", "numpy_dtype", "raw_codec", "without_crc32c"]


@dataclasses.dataclass(frozen=True)
class Frame:
    """Bytes of one stored chunk (or of a range of it, starting at chunk item ``first_item``):
    a Blosc frame when ``blosc``, else little-endian items as stored (or as zarr decoded them)."""

    data: np.ndarray  # uint8
    first_item: int
    key: str
    blosc: bool = False
    #: What a whole Blosc frame must decode to (the chunk's size in bytes), when known.
    nbytes: int | None = None
    #: The Blosc header, once checked: a fill decodes several read blocks of one frame, and a
    #: cached frame serves many fills; its bytes never change, so one check holds for all.
    _head: _blosc.Header | None = dataclasses.field(default=None, compare=False, repr=False)

    def decode_into(self, first_item: int, out: np.ndarray) -> None:
        """Items ``[first_item, first_item + len(out))`` of the chunk into ``out``.

        CPU-bound and GIL-free for Blosc: run it off the loop. Raises BloscError.
        """
        if self.blosc:
            head = _blosc.decode_into(self.data, first_item, out, self.nbytes, head=self._head)
            if head is not None and self._head is None:
                # Two decode threads may both check it first: the same result either way.
                object.__setattr__(self, "_head", head)
            return
        start = (first_item - self.first_item) * 4
        if start < 0 or start + out.nbytes > self.data.nbytes:
            raise _blosc.BloscError(
                f"object has {self.data.nbytes} bytes, needed {start + out.nbytes}"
            )
        out[:] = self.data[start : start + out.nbytes].view("<u4")


def blosc_frame_prefixes(arrays: SplitArrays) -> set[str]:
    """Key prefixes of the split's arrays whose chunk objects are exactly one Blosc frame."""
    from zarr.codecs import BloscCodec, ShardingCodec
    from zarr.core.metadata import ArrayV2Metadata

    prefixes = set()
    for array in (arrays.encoded_tokens, arrays.seq_starts):
        meta = array.metadata
        if isinstance(meta, ArrayV2Metadata):
            blosc = getattr(meta.compressor, "codec_id", None) == "blosc"
        else:
            codecs = list(meta.codecs)
            blosc = isinstance(codecs[-1], BloscCodec) and not isinstance(codecs[0], ShardingCodec)
        if blosc:
            prefixes.add(f"{array.store_path.path}/")
    return prefixes


def numpy_dtype(dtype: Any) -> np.dtype[Any]:
    """The numpy dtype of a v2 array's metadata: zarr 3.1 wraps it (``to_native_dtype()``), zarr
    3.0 stores the numpy dtype itself."""
    to_native = getattr(dtype, "to_native_dtype", None)
    return np.dtype(to_native() if to_native is not None else dtype)


def raw_codec(array: Any) -> tuple[str | None, bool]:
    """How chunks of ``array`` can be read and decoded without zarr: ("blosc" or "raw", whether
    each object ends with a crc32c), or (None, False) when zarr must decode them.

    That is a plain chunk grid (no sharding, filters or transposes) of little-endian items whose
    only compressor, if any, is Blosc, optionally followed by zarr's ``crc32c`` codec (format 3).
    Everything else goes through zarr's codec pipeline.
    """
    from zarr.core.metadata import ArrayV2Metadata

    meta = array.metadata
    checksum = False
    if isinstance(meta, ArrayV2Metadata):
        dtype = numpy_dtype(meta.dtype)
        if meta.filters or meta.order != "C" or dtype.itemsize != 4 or dtype.byteorder == ">":
            return None, False
        compressor = meta.compressor
        if compressor is None:
            return "raw", False
        name = getattr(compressor, "codec_id", None)
    else:
        from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec
        from zarr.codecs.bytes import Endian

        codecs = list(meta.codecs)
        if not isinstance(codecs[0], BytesCodec) or codecs[0].endian not in (None, Endian.little):
            return None, False
        if isinstance(codecs[-1], Crc32cCodec):
            codecs, checksum = codecs[:-1], True
        if len(codecs) == 1:
            return "raw", checksum
        if len(codecs) != 2 or not isinstance(codecs[1], BloscCodec):
            return None, False
        name = "blosc"
    return ("blosc", checksum) if name == "blosc" and _blosc.AVAILABLE else (None, False)


def without_crc32c(data: np.ndarray, where: str) -> np.ndarray:
    """``data`` without its crc32c trailer, once the checksum matches, else CorruptChunkError
    naming ``where`` (the chunk object). CPU-bound: run it off the loop."""
    if data.nbytes < 4:
        raise CorruptChunkError(f"{where} is too short for its crc32c")
    stored = int(data[-4:].view("<u4")[0])
    body = np.ascontiguousarray(data[:-4])
    view = body.view()
    view.flags.writeable = False  # google_crc32c takes read-only buffers only
    computed = _crc32c(view)
    if computed != stored:
        raise CorruptChunkError(
            f"{where} fails its crc32c checksum "
            f"(stored {stored:#010x}, computed {computed:#010x}): the object is damaged"
        )
    return body


def _crc32c(data: memoryview | np.ndarray) -> int:
    """CRC-32C of ``data`` with whichever implementation zarr installed: ``google-crc32c``
    (zarr >= 3.1) or ``crc32c`` (zarr 3.0)."""
    try:
        import google_crc32c
    except ImportError:
        import crc32c

        return int(crc32c.crc32c(data))
    return int(google_crc32c.value(data))
