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

__all__ = ["AVAILABLE", "BloscError", "decode_into"]

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
