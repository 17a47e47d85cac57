"""Chunk objects the reader decodes itself, bypassing zarr's codec pipeline.

:func:`raw_codec` says whether an array's chunks can be read and decoded here (a plain Blosc
frame or raw little-endian items, optionally with zarr's crc32c trailer);
:func:`blosc_frame_prefixes` names the arrays whose objects are exactly one Blosc frame (for the
guarded store's checks); a :class:`Frame` holds the bytes of one chunk (or of a range of it) and
decodes items from it, verifying the chunk's crc32c first when one was stored;
:func:`split_crc32c` takes the crc32c trailer off an object, :func:`without_crc32c` checks and
strips it, :func:`crc32c` computes one.

The crc32c is computed by the hardware-accelerated C library that ``google-crc32c`` (a
dependency of zarr) wraps, called through :mod:`ctypes`, which releases the GIL for the call:
``google_crc32c.value`` itself holds the GIL for anything but a ``bytes`` object of at least
1 MiB, so on the decode threads it would stall the loop and the trainer for as long as it runs.
Where that library cannot be found, ``google_crc32c.value`` (or zarr 3.0's ``crc32c``) is used.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from asyncflat.errors import CorruptChunkError
from asyncflat.format.split import SplitArrays
from asyncflat.storage import blosc as _blosc

__all__ = [
    "Frame",
    "blosc_frame_prefixes",
    "crc32c",
    "numpy_dtype",
    "raw_codec",
    "split_crc32c",
    "without_crc32c",
]

log = logging.getLogger(__name__)

#: CRC-32C of b"123456789" (RFC 3720's check value): a library found is checked against it.
_CHECK_VALUE = 0xE3069283


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
    #: The crc32c stored with the chunk (its object's trailer, see :func:`split_crc32c`),
    #: verified against ``data`` before the first decode; None: the chunk has none.
    crc32c: int | None = None
    _verified: bool = dataclasses.field(default=False, compare=False, repr=False)
    _verifying: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, compare=False, repr=False
    )

    def verify(self) -> None:
        """Check ``data`` against the stored crc32c (once: a cached frame serves many fills and
        rows, and a second decode waits for the first check rather than repeating it), else
        :class:`CorruptChunkError` naming the chunk object and both checksums.

        CPU-bound and GIL-free: run it off the loop, in the job that decodes the chunk."""
        if self.crc32c is None or self._verified:
            return
        with self._verifying:
            if self._verified:
                return
            computed = crc32c(self.data)
            if computed != self.crc32c:
                where = f"chunk object {self.key}"
                raise CorruptChunkError(_mismatch(where, self.crc32c, computed))
            object.__setattr__(self, "_verified", True)

    def decode_into(self, first_item: int, out: np.ndarray) -> None:
        """Items ``[first_item, first_item + len(out))`` of the chunk into ``out``, the chunk's
        crc32c verified first when it has one (:meth:`verify`).

        CPU-bound and GIL-free for Blosc: run it off the loop. Raises BloscError, or
        CorruptChunkError when the checksum does not match.
        """
        self.verify()
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


def split_crc32c(data: np.ndarray, where: str) -> tuple[np.ndarray, int]:
    """``data`` (an object of a chunk written with zarr's ``crc32c`` codec) without its 4-byte
    trailer, and the checksum stored there; not verified yet (see :meth:`Frame.verify`)."""
    if data.nbytes < 4:
        raise CorruptChunkError(f"{where} is too short for its crc32c ({data.nbytes} bytes)")
    stored = int(data[-4:].view("<u4")[0])
    return np.ascontiguousarray(data[:-4]), stored


def without_crc32c(data: np.ndarray, where: str) -> np.ndarray:
    """``data`` without its crc32c trailer, once the checksum matches, else CorruptChunkError
    naming ``where`` (the chunk object) and both checksums. CPU-bound: run it off the loop."""
    body, stored = split_crc32c(data, where)
    computed = crc32c(body)
    if computed != stored:
        raise CorruptChunkError(_mismatch(where, stored, computed))
    return body


def _mismatch(where: str, stored: int, computed: int) -> str:
    return (
        f"{where} fails its crc32c checksum (stored {stored:#010x}, computed {computed:#010x}): "
        "the object is damaged"
    )


def crc32c(data: np.ndarray | bytes) -> int:
    """CRC-32C of ``data`` (a contiguous buffer), the GIL released while it runs (see the
    module docstring)."""
    array = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    native = _native_crc32c()
    if native is not None:
        return int(native(0, array.ctypes.data, array.nbytes))
    view = array.view(np.uint8).reshape(-1).view()
    view.flags.writeable = False  # google_crc32c takes read-only buffers only
    return _python_crc32c(view)


def _python_crc32c(data: np.ndarray) -> int:
    """CRC-32C through the Python binding zarr installed: ``google-crc32c`` (zarr >= 3.1) or
    ``crc32c`` (zarr 3.0). Holds the GIL (google-crc32c releases it only for large ``bytes``)."""
    try:
        import google_crc32c
    except ImportError:
        import crc32c as crc32c_module

        return int(crc32c_module.crc32c(data))
    return int(google_crc32c.value(data))


def _native_crc32c() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, address, length)`` of the C library google-crc32c wraps (its wheel's
    copy, else the system's), called through ctypes, which releases the GIL; None when none is
    found or one found does not give the standard check value.

    The system's is opened by its file name (the dynamic loader searches its usual paths), not
    found with ``ctypes.util.find_library``, which runs ``ldconfig``, ``gcc`` and ``ld`` in
    subprocesses (~10 ms here, forks of the whole trainer process under a sandboxed kernel):
    the first checksum, which asks for this, is on the way to a cold start's first batch.
    Resolved once per process, by whichever thread asks first (a fill's first checksums run on
    several at once), the others waiting for its answer."""
    if _native.resolved:
        return _native.function
    with _native.lock:
        if not _native.resolved:
            _native.function = _load_native_crc32c()
            _native.resolved = True
    return _native.function


class _Native:
    """The resolved library function, and the lock its first lookup holds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.resolved = False
        self.function: Callable[[int, int, int], int] | None = None

    def after_fork(self) -> None:
        # A thread of the parent may have held the lock at fork: the child's copy would stay
        # held forever (that thread does not exist there).
        self.lock = threading.Lock()


_native = _Native()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_native.after_fork)


def _load_native_crc32c() -> Callable[[int, int, int], int] | None:
    candidates: list[str] = []
    try:
        import google_crc32c
    except ImportError:
        pass
    else:
        site = Path(google_crc32c.__file__).resolve().parent.parent
        for folder in ("google_crc32c.libs", "google_crc32c/.dylibs", "google_crc32c"):
            candidates += sorted(str(p) for p in (site / folder).glob("libcrc32c*"))
    function = _first_native([*candidates, *_SYSTEM_NAMES])
    if function is None:
        log.info("no native crc32c library found: checksums are computed holding the GIL")
    return function


#: The system's crc32c library (Linux, macOS), opened by name: the dynamic loader's own search.
_SYSTEM_NAMES = ("libcrc32c.so.1", "libcrc32c.so", "libcrc32c.dylib")


def _first_native(candidates: list[str]) -> Callable[[int, int, int], int] | None:
    """The first of ``candidates`` (library paths) that has ``crc32c_extend`` and gives the
    standard check value."""
    for candidate in candidates:
        try:
            function = ctypes.CDLL(candidate).crc32c_extend
        except (OSError, AttributeError):
            continue
        function.restype = ctypes.c_uint32
        function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        if function(0, b"123456789", 9) == _CHECK_VALUE:
            return function
    return None
