"""Local files of a store, read safely without zarr: what a plain local dataset needs.

Every object is opened without following a symlink (an in-store symlink is resolved and
checked first), never blocking (a FIFO opens at once and is then refused), checked to be a
regular file inside the store no larger than its caller allows, and read with ``preadv`` straight
into the caller's buffer. Errors name the file and the byte range. Nothing here imports zarr or
fsspec: opening a local dataset costs no more than the files it reads.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Callable

import numpy as np

from asyncflat.errors import CorruptChunkError, StorageError

__all__ = [
    "file_kind",
    "file_on_the_way",
    "has_glob",
    "is_remote",
    "is_url",
    "pread",
    "pread_into",
    "read_object",
]


def is_url(filespec: str) -> bool:
    return "://" in filespec


def has_glob(path: str) -> bool:
    """Whether fsspec's bulk calls (``rm``, ``cat``, ``find`` of several paths) would expand
    ``path`` as a pattern (``*``, ``?``, ``[``): such a path must go one literal request at a
    time, or a write path's delete of ``runs/exp[12]`` removes ``runs/exp1`` and ``runs/exp2``."""
    return any(c in path for c in "*?[")


def is_remote(filespec: str | os.PathLike[str]) -> bool:
    """Whether ``filespec`` is a URL of a non-local filesystem (``file://`` counts as local)."""
    text = os.fspath(filespec)
    return is_url(text) and not text.startswith("file://")


#: How a local chunk object is opened for a row read: never through a symlink (an in-store
#: symlink is resolved and checked first), never blocking (a FIFO opens at once and is then
#: refused), never inherited by a child process.
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
#: Where Linux shows the path of an open file descriptor (a containment check without a race).
_PROC_FD = "/proc/self/fd"


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words, for messages (``a FIFO``, ``a device``, ...)."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "not a regular file"


def file_on_the_way(root: str, key: str) -> str:
    """Why ``key`` cannot be opened under ``root`` when opening it says "not a directory", in
    words for a message: the first component of its path that is a file, where the layout has
    a directory (a split, an array, a chunk directory)."""
    path = root
    for part in key.split("/")[:-1]:
        path = os.path.join(path, part)
        if not os.path.isdir(path):
            return f"{path} is a file, where the dataset's layout has a directory"
    return "a component of its path is a file, where the dataset's layout has a directory"


@functools.lru_cache(maxsize=64)
def _real_root(root: str) -> str:
    return os.path.realpath(root)


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _open_local(root: str, path: str, where: str) -> int:
    """A descriptor of ``path`` (under the store directory ``root``) for reading, opened with
    :data:`_OPEN_FLAGS`. A symlink is followed only to a file inside the store."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise CorruptChunkError(f"{where}: chunk object is missing from the store") from None
    except NotADirectoryError:
        key = os.path.relpath(path, root)
        raise CorruptChunkError(f"{where}: {file_on_the_way(root, key)}") from None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EMLINK) or not os.path.islink(path):
            raise StorageError(f"reading {where} failed: {exc}") from None
        # An in-store symlink (documented to read): resolve it, check where it leads, and
        # open what it resolves to, again without following a symlink.
        real = os.path.realpath(path)
        if not _inside(real, _real_root(root)):
            raise CorruptChunkError(
                f"{where}: is a symlink to {real}, outside the store {_real_root(root)}"
            ) from None
        try:
            fd = os.open(real, _OPEN_FLAGS)
        except FileNotFoundError:
            raise CorruptChunkError(f"{where}: is a broken symlink (to {real})") from None
        except OSError as exc2:
            if exc2.errno in (errno.ELOOP, errno.EMLINK):
                # A symlink loop (realpath stops inside it): a damaged store, as the zarr path
                # says of the same object ("is a broken symlink"), never a transient failure.
                raise CorruptChunkError(f"{where}: is a symlink loop ({exc2.strerror})") from None
            raise StorageError(f"reading {where} failed: {exc2}") from None
    try:
        # A directory on the way may be a symlink too: check where the file really is. Linux
        # names the open file itself (no window between the check and the read).
        try:
            real = os.readlink(f"{_PROC_FD}/{fd}")
        except OSError:
            real = os.path.realpath(path)
        if not _inside(real, _real_root(root)):
            raise CorruptChunkError(f"{where}: resolves to {real}, outside the store {root}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def pread(
    root: str, key: str, lo: int, hi: int, *, name: str, max_object_bytes: int | None = None
) -> bytes:
    """Bytes ``[lo, hi)`` of object ``key`` (see :func:`pread_into`)."""
    out = bytearray(hi - lo)
    pread_into(root, key, lo, memoryview(out), name=name, max_object_bytes=max_object_bytes)
    return bytes(out)


def pread_into(
    root: str,
    key: str,
    lo: int,
    out: memoryview,
    *,
    name: str,
    max_object_bytes: int | None = None,
    expect_size: int | None = None,
    expect_prefix: bytes | None = None,
) -> None:
    """Bytes ``[lo, lo + len(out))`` of object ``key`` of the local store at ``root``, read
    right here into ``out`` (a writable byte buffer: no copy beyond the kernel's).

    Row reads are a few KiB from the page cache: a thread hop through the store would cost 100x
    the read itself. Errors name the file (``root/key``, a path that exists when the store is
    whole) and the range; ``name`` is the dataset as the user spelled it, for context.

    The object must be a regular file inside the store (a symlink may lead only inside it), at
    least ``hi`` bytes long and, when ``max_object_bytes`` is given (the largest legal encoding
    of its chunk), no larger: a FIFO, a device, a directory or an 8 GiB sparse file is a
    :class:`CorruptChunkError` naming the file, refused before a byte is read (never a hang).
    ``expect_size``: the object's size as its (cached) header says; another size means the
    object is not the one the header came from (replaced since) or not a whole frame.
    ``expect_prefix``: the object's first bytes as that cached header and block table were
    read, compared from the same open file: a replacement of the same size (another encoding of
    the chunk) is not read through a layout that describes its predecessor.
    """
    hi = lo + len(out)
    path = os.path.join(root, key)
    where = f"{path} (bytes={lo}-{hi - 1}; dataset {name})"
    fd = _open_local(root, path, where)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptChunkError(
                f"{where}: is {file_kind(st.st_mode)}, not a regular file: refused unread"
            )
        if max_object_bytes is not None and st.st_size > max_object_bytes:
            raise CorruptChunkError(
                f"{where}: object has {st.st_size} bytes, more than any legal encoding of its "
                f"chunk ({max_object_bytes} bytes): refused unread"
            )
        if expect_size is not None and st.st_size < expect_size:
            raise CorruptChunkError(
                f"{where}: chunk object is truncated: it has {st.st_size} bytes where its Blosc "
                f"header says {expect_size}"
            )
        if expect_size is not None and st.st_size != expect_size:
            raise CorruptChunkError(
                f"{where}: object has {st.st_size} bytes where its Blosc header says "
                f"{expect_size}: not a whole Blosc frame (or replaced since the header was read)"
            )
        if st.st_size < hi:
            raise CorruptChunkError(
                f"{where}: chunk object is truncated: got {max(0, st.st_size - lo)} bytes "
                f"(the object has {st.st_size})"
            )
        if expect_prefix is not None and os.pread(fd, len(expect_prefix), 0) != expect_prefix:
            raise CorruptChunkError(
                f"{where}: the object's Blosc header or block table changed since they were "
                "read (replaced or rewritten)"
            )
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], lo + done)
            if n == 0:  # it shrank since fstat
                raise CorruptChunkError(f"{where}: chunk object is truncated: got {done} bytes")
            done += n
    except OSError as exc:
        raise StorageError(f"reading {where} failed: {exc}") from exc
    finally:
        os.close(fd)


def read_object(
    root: str,
    key: str,
    *,
    name: str,
    max_bytes: int,
    missing_ok: bool = False,
    allocate: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray | None:
    """The whole object ``key`` of the local store at ``root`` (uint8), read with the checks of
    :func:`pread_into`: a regular file inside the store, at most ``max_bytes`` long (else
    refused unread), never empty. ``missing_ok``: an absent object is None instead of a
    :class:`CorruptChunkError` (metadata probes). ``allocate(nbytes)``: the uint8 array to read
    into (a :class:`~asyncflat.storage.recycled.RecycledBytes`'s), else a new one.
    """
    path = os.path.join(root, key)
    where = f"{path} (whole object; dataset {name})"
    try:
        fd = _open_local(root, path, where)
    except CorruptChunkError:
        if missing_ok and not os.path.lexists(path):
            return None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptChunkError(
                f"{where}: is {file_kind(st.st_mode)}, not a regular file: refused unread"
            )
        if st.st_size > max_bytes:
            raise CorruptChunkError(
                f"{where}: object has {st.st_size} bytes, more than the {max_bytes} bytes it may "
                "have: refused unread"
            )
        if st.st_size == 0:
            raise CorruptChunkError(f"{where}: chunk object is truncated: got 0 bytes")
        out = allocate(st.st_size) if allocate is not None else np.empty(st.st_size, np.uint8)
        view = memoryview(out)  # type: ignore[arg-type]  # numpy buffers
        done = 0
        while done < len(out):
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:  # it shrank since fstat
                raise CorruptChunkError(f"{where}: chunk object is truncated: got {done} bytes")
            done += n
        return out
    except OSError as exc:
        raise StorageError(f"reading {where} failed: {exc}") from exc
    finally:
        os.close(fd)
