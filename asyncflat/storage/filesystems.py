"""Filesystems and stores: made on the engine's loop, with one retry loop, closed on that loop.

Object stores (``gs://``, ``s3://``, any fsspec URL): the filesystem is created here, on the
engine's loop, from ``storage_options``, never taken from fsspec's instance cache (a cached
instance may hold an aiohttp session bound to another, possibly dead, loop), and with the
filesystem's own retry loops turned off unless the caller configured them, so that attempts do
not multiply (gcsfs retries 6 times, s3fs 5 times, botocore 3-5 times, each around the other).
:func:`close_store` closes its HTTP sessions on the same loop.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import types
from collections.abc import Mapping
from typing import Any

from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore

from ..errors import ConfigError, CorruptChunkError, DatasetFormatError, StorageError

__all__ = [
    "OWN_RETRIES_OPTION",
    "close_filesystem",
    "close_store",
    "filesystem",
    "is_url",
    "local_root",
    "make_store",
    "pread",
]

log = logging.getLogger(__name__)


def is_url(filespec: str) -> bool:
    return "://" in filespec


#: storage_options key (asyncflat's, popped before the filesystem sees it when the filesystem
#: does not take it itself): how many attempts the filesystem's *own* retry loop may make.
#: Absent: 1 (asyncflat retries instead). gcsfs and s3fs have no such constructor argument.
OWN_RETRIES_OPTION = "retries"


def filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """An asynchronous fsspec filesystem for ``url``, made on the running loop, and the path."""
    import fsspec
    from fsspec.core import split_protocol

    opts = dict(storage_options or {})
    protocol = split_protocol(url)[0] or "file"
    try:
        cls: Any = fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError):  # chained URLs; a missing backend fails in url_to_fs below
        cls = None
    own_retries = None
    if OWN_RETRIES_OPTION in opts and (
        cls is None or OWN_RETRIES_OPTION not in inspect.signature(cls.__init__).parameters
    ):
        own_retries = opts.pop(OWN_RETRIES_OPTION)
        if isinstance(own_retries, bool) or not isinstance(own_retries, int) or own_retries < 1:
            raise ConfigError(
                f"storage_options[{OWN_RETRIES_OPTION!r}] must be an integer >= 1 (attempts of the "
                f"filesystem's own retry loop), got {own_retries!r}"
            )
    # A cached instance may carry a session bound to another (dead) loop: always make our own.
    opts.setdefault("skip_instance_cache", True)
    opts["asynchronous"] = True
    if protocol in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        # botocore retries 3 (legacy) to 5 (standard) times on its own; one attempt each.
        config.setdefault("retries", {"total_max_attempts": 1})
        opts["config_kwargs"] = config
        # s3fs's default (10) sends a HEAD before every whole-object GET, to split big objects
        # into parallel parts; chunks are small: one GET each. Reads run concurrently anyway.
        opts.setdefault("max_concurrency", 1)
    fs, path = fsspec.url_to_fs(url, **opts)
    set_own_retries(fs, own_retries or 1)
    return fs, path


def set_own_retries(fs: Any, attempts: int) -> None:
    """Cap the filesystem's own retry loop at ``attempts`` (per instance, never globally)."""
    gcsfs = sys.modules.get("gcsfs")
    s3fs = sys.modules.get("s3fs")
    if gcsfs is not None and isinstance(fs, gcsfs.GCSFileSystem):
        # gcsfs wraps _request in retry_request(retries=6) when the class is defined; there is
        # no option. Rebind this instance's _request to the undecorated coroutine (or re-wrap it).
        raw = getattr(type(fs)._request, "__wrapped__", None)
        if raw is None:
            log.warning(
                "gcsfs %s: cannot turn off its own retries; attempts may multiply",
                getattr(gcsfs, "__version__", "?"),
            )
            return
        if attempts > 1:
            from gcsfs.retry import retry_request

            raw = retry_request(retries=attempts)(raw)
        fs._request = types.MethodType(raw, fs)
    elif s3fs is not None and isinstance(fs, s3fs.S3FileSystem):
        fs.retries = attempts  # s3fs's _error_wrapper loop (a class attribute, 5 by default)


async def close_filesystem(fs: Any) -> None:
    """Close the HTTP sessions of ``fs`` on this loop (the one that made them)."""
    session = getattr(fs, "_session", None)  # gcsfs, fsspec's http: an aiohttp.ClientSession
    if session is not None and hasattr(session, "close") and not getattr(session, "closed", True):
        await session.close()
    creator = getattr(fs, "_s3creator", None)  # s3fs: the aiobotocore client's context manager
    if creator is not None:
        fs._s3creator = None
        fs._s3 = None
        await creator.__aexit__(None, None, None)


def make_store(filespec: str, storage_options: Mapping[str, Any] | None) -> Store:
    if is_url(filespec) and not filespec.startswith("file://"):
        fs, path = filesystem(filespec, storage_options)
        if not fs.async_impl:  # e.g. memory://: run the sync filesystem's calls in threads
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            fs = AsyncFileSystemWrapper(fs, asynchronous=True)
        return FsspecStore(fs=fs, path=path, read_only=True)
    path = filespec.removeprefix("file://")
    if not os.path.isdir(path):
        raise DatasetFormatError(f"{filespec}: no flat-tokens dataset here (not a directory)")
    return LocalStore(path, read_only=True)


async def close_store(store: Store) -> None:
    try:
        if isinstance(store, FsspecStore):
            await close_filesystem(store.fs)
    except Exception:  # closing must not mask the error that led here
        log.warning("closing the filesystem of %r failed", store, exc_info=True)
    finally:
        store.close()


def local_root(store: Store) -> str | None:
    """The directory of a plain local store (small reads may ``pread`` it directly), else None."""
    return str(store.root) if isinstance(store, LocalStore) else None


def pread(root: str, key: str, lo: int, hi: int, *, name: str) -> bytes:
    """Bytes ``[lo, hi)`` of object ``key`` of the local store at ``root``, read right here.

    Row reads are a few KiB from the page cache: a thread hop through the store would cost 100x
    the read itself. Errors name ``name/key`` and the range, like the guarded store's.
    """
    where = f"{name}/{key} (bytes={lo}-{hi - 1})"
    try:
        fd = os.open(os.path.join(root, key), os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptChunkError(f"{where}: chunk object is missing from the store") from None
    except OSError as exc:
        raise StorageError(f"reading {where} failed: {exc}") from exc
    try:
        data = os.pread(fd, hi - lo, lo)
    except OSError as exc:
        raise StorageError(f"reading {where} failed: {exc}") from exc
    finally:
        os.close(fd)
    if len(data) < hi - lo:
        raise CorruptChunkError(f"{where}: chunk object is truncated: got {len(data)} bytes")
    return data
