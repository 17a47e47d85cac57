"""Filesystems and stores: made on the engine's loop, with one retry loop, closed on that loop.

Object stores (``gs://``, ``s3://``, any fsspec URL): the filesystem is created here, on the
engine's loop, from ``storage_options``, never taken from fsspec's instance cache (a cached
instance may hold an aiohttp session bound to another, possibly dead, loop), and with the
filesystem's own retry loops turned off unless the caller configured them, so that attempts do
not multiply (gcsfs retries 6 times, s3fs 5 times, botocore 3-5 times, each around the other),
and with a connection pool large enough for the requests asyncflat keeps in flight
(``max_connections``: aiobotocore's default pool of 10 would otherwise cap every fill at 10
requests, whatever ``max_concurrent_reads`` says). Options the caller set are never overridden.
:func:`close_store` closes its HTTP sessions on the same loop.

:class:`PinnedStore` (under :func:`bounded`) issues every object read of s3fs, gcsfs and obstore
itself, pinned to the version first read and conditional on it afterwards (:mod:`.pins`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import threading
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from zarr.abc.store import (
    ByteRequest,
    RangeByteRequest,
    Store,
)
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from asyncflat.config import client_of
from asyncflat.errors import (
    AsyncflatError,
    ConfigError,
    DatasetFormatError,
    StorageError,
    carries_secret,
    option_secrets,
    redact,
    scrubbed,
)
from asyncflat.storage.guarded import PerKeyWrapperStore, describe_range
from asyncflat.storage.local_files import file_kind, is_remote, is_url, pread, pread_into
from asyncflat.storage.obstore_client import make_obstore_store, obstore_reader, without_client
from asyncflat.storage.pins import Version, VersionMismatch, VersionPins
from asyncflat.storage.retry import is_precondition_failure, is_range_past_end

__all__ = [
    "OWN_RETRIES_OPTION",
    "BoundedStore",
    "PinnedStore",
    "bounded",
    "close_filesystem",
    "close_store",
    "construction_error",
    "file_kind",
    "filesystem",
    "is_remote",
    "is_url",
    "local_root",
    "make_store",
    "pread",
    "pread_into",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


#: storage_options key (asyncflat's, popped before the filesystem sees it when the filesystem
#: does not take it itself): how many attempts the filesystem's *own* retry loop may make.
#: Absent: 1 (asyncflat retries instead). gcsfs and s3fs have no such constructor argument.
OWN_RETRIES_OPTION = "retries"


#: aiohttp's default connection pool (``TCPConnector(limit=100)``), which gcsfs uses.
AIOHTTP_DEFAULT_POOL = 100


def filesystem(
    url: str,
    storage_options: Mapping[str, Any] | None,
    *,
    timeout_s: float | None = None,
    max_connections: int | None = None,
) -> tuple[Any, str]:
    """An asynchronous fsspec filesystem for ``url``, made on the running loop, and the path.

    ``timeout_s`` (``RetryPolicy.attempt_timeout_s``) becomes the socket timeouts of gcsfs
    (``requests_timeout``; it sends every request with no timeout at all otherwise) and botocore
    (``connect_timeout``/``read_timeout``), unless ``storage_options`` sets them.

    ``max_connections`` (the requests asyncflat may keep in flight) sizes the HTTP connection
    pool: botocore's ``max_pool_connections`` for S3 (default 10), aiohttp's connector limit
    for GCS (default 100, raised only above that), unless ``storage_options`` sets them.
    """
    import fsspec
    from fsspec.core import split_protocol

    opts = without_client(storage_options)  # the reading client's choice: fsspec here
    protocol = split_protocol(url)[0] or "file"
    try:
        cls: Any = fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        raise ConfigError(
            f"{redact(url)}: the filesystem for {protocol}:// is not installed: {exc}"
        ) from None
    except ValueError:
        if "::" not in url:  # chained URLs (simplecache::gs://...) are resolved by url_to_fs
            raise ConfigError(
                f"{redact(url)}: unknown URL protocol {protocol!r} (no fsspec filesystem is "
                f"registered for {protocol}://; known: {', '.join(_known_protocols())})"
            ) from None
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
        _s3_options(opts, timeout_s, max_connections)
    elif protocol in ("gs", "gcs"):
        _gcs_options(opts, timeout_s, max_connections)
    try:
        fs, path = fsspec.url_to_fs(url, **opts)
    except Exception as exc:  # noqa: BLE001 - any constructor's error, re-raised scrubbed
        secrets = option_secrets(storage_options)
        raise construction_error(exc, url, secrets) from (
            None if carries_secret(exc, secrets) else exc
        )
    set_own_retries(fs, own_retries or 1)
    share_botocore_models(fs)
    return fs, path


def _s3_options(opts: dict[str, Any], timeout_s: float | None, max_connections: int | None) -> None:
    """s3fs's options: one attempt per request, the pool and the socket timeouts (in place)."""
    config = dict(opts.get("config_kwargs") or {})
    # botocore retries 3 (legacy) to 5 (standard) times on its own; one attempt each.
    config.setdefault("retries", {"total_max_attempts": 1})
    opts["config_kwargs"] = config
    if max_connections is not None:
        # botocore's pool (10) queues requests beyond it inside the client: the wire would
        # never see more than 10 in flight.
        config.setdefault("max_pool_connections", max_connections)
    # s3fs's default (10) sends a HEAD before every whole-object GET, to split big objects
    # into parallel parts; chunks are small: one GET each. Reads run concurrently anyway.
    opts.setdefault("max_concurrency", 1)
    if timeout_s is not None:
        config.setdefault("connect_timeout", timeout_s)
        config.setdefault("read_timeout", timeout_s)


def _gcs_options(
    opts: dict[str, Any], timeout_s: float | None, max_connections: int | None
) -> None:
    """gcsfs's options: the socket timeouts and the connection pool (in place)."""
    import aiohttp

    if timeout_s is not None and "requests_timeout" not in opts:
        # Per socket operation: a connection that accepts and never answers, or stalls
        # mid-body, fails after timeout_s instead of never (the attempt is bounded as a
        # whole by BoundedStore as well).
        opts["requests_timeout"] = aiohttp.ClientTimeout(
            sock_connect=timeout_s, sock_read=timeout_s
        )
    session = dict(opts.get("session_kwargs") or {})
    if (
        max_connections is not None
        and max_connections > AIOHTTP_DEFAULT_POOL
        and "connector" not in session
        and _loop_running()
    ):
        # gcsfs's session uses aiohttp's default pool (100 connections): raised above that.
        session["connector"] = aiohttp.TCPConnector(limit=max_connections)
        opts["session_kwargs"] = session


#: botocore's data loaders (the parsed JSON service models and endpoint rules), one per process
#: and data path (``AWS_DATA_PATH`` or a profile's ``data_path``: where custom models live).
_BOTOCORE_LOADERS: dict[Any, Any] = {}
_BOTOCORE_LOADER_LOCK = threading.Lock()


def share_botocore_models(fs: Any) -> None:
    """Give an s3fs filesystem's botocore session the process's data loader for its data path.

    Every loader makes its own filesystem (its HTTP sessions belong to its own event loop), and
    each new botocore session parses the S3 service model and endpoint rules again: ~90 ms of
    GIL-held JSON parsing per loader construction, paid again by every evaluation loader,
    epoch and mixture source. The data loader holds only those parsed files (no credentials,
    no connections, no loop), so one serves every session that searches the same data path;
    credentials stay per session. A session the caller passed in
    (``storage_options={"session": ...}``) is left alone, and so is any s3fs whose internals
    differ from the ones relied on here (a lost speed-up, not an error).
    """
    s3fs = sys.modules.get("s3fs")
    if s3fs is None or not isinstance(fs, s3fs.S3FileSystem):
        return
    if getattr(fs, "session", None) is not None or not isinstance(
        getattr(fs, "kwargs", None), dict
    ):
        return
    try:
        import aiobotocore.session
        import botocore.loaders

        # The session s3fs would make itself (its own kwargs: profile, ...), with the shared
        # data loader of the data path that session would search; s3fs still owns it (a
        # refresh makes a fresh one).
        session = aiobotocore.session.AioSession(**fs.kwargs)
        data_path = session.get_config_variable("data_path")
        key = data_path if isinstance(data_path, (str, type(None))) else repr(data_path)
        with _BOTOCORE_LOADER_LOCK:
            loader = _BOTOCORE_LOADERS.get(key)
            if loader is None:
                loader = _BOTOCORE_LOADERS[key] = botocore.loaders.create_loader(data_path)
        session.register_component("data_loader", loader)
    except Exception:  # an optimisation only: s3fs then makes its own session
        log.debug("cannot share botocore's data loader with %r", fs, exc_info=True)
        return
    fs.session = session


def construction_error(exc: BaseException, url: str, secrets: Iterable[str]) -> AsyncflatError:
    """What to raise for ``exc``, raised while making the filesystem or store of ``url``: the
    message names the URL (``user:***@``) and never shows a secret (URL userinfo, credential
    query parameters, any value of ``storage_options``). A constructor rejecting its arguments
    (``TypeError``, ``ValueError``, ``KeyError``, a missing package) is a :class:`ConfigError`;
    anything else (a credential exchange, the network) a :class:`StorageError`. Raise it
    ``from None`` when :func:`~asyncflat.errors.carries_secret`."""
    secrets = tuple(secrets)
    if isinstance(exc, AsyncflatError):
        scrubbed_exc = scrubbed(exc, url, secrets)
        assert isinstance(scrubbed_exc, AsyncflatError)
        return scrubbed_exc
    cls = (
        ConfigError
        if isinstance(exc, (TypeError, ValueError, KeyError, ImportError))
        else StorageError
    )
    return cls(
        f"{redact(url)}: cannot open this URL with these storage_options: "
        f"{type(exc).__name__}: {redact(str(exc), secrets)}"
    )


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _known_protocols() -> list[str]:
    from fsspec.registry import known_implementations

    common = ["gs", "s3", "az", "abfs", "http", "https", "file", "memory"]
    return [p for p in common if p in known_implementations]


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


def make_store(
    filespec: str,
    storage_options: Mapping[str, Any] | None,
    *,
    timeout_s: float | None = None,
    max_connections: int | None = None,
) -> Store:
    """The raw zarr store of ``filespec``: for a URL an fsspec store (or obstore's, when
    ``storage_options`` asks for ``client='obstore'``), else a LocalStore."""
    if is_remote(filespec):
        if client_of(storage_options) == "obstore":
            return make_obstore_store(
                filespec, storage_options, timeout_s=timeout_s, max_connections=max_connections
            )
        fs, path = filesystem(
            filespec, storage_options, timeout_s=timeout_s, max_connections=max_connections
        )
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


class BoundedStore(WrapperStore[Store]):
    """Every request to the wrapped store ends within ``timeout_s``: a ``TimeoutError`` (which
    the retry loop treats as transient) instead of waiting on a silent store forever.

    Sits right around the raw filesystem store, so the bound covers exactly one request
    (connecting, sending, reading the whole body), not the wait for a request slot.
    """

    def __init__(self, store: Store, timeout_s: float) -> None:
        super().__init__(store)
        self.timeout_s = timeout_s

    def _with_store(self, store: Store) -> BoundedStore:
        return BoundedStore(store, self.timeout_s)

    async def _bounded(self, what: str, call: Awaitable[T]) -> T:
        bound = asyncio.timeout(self.timeout_s)
        try:
            async with bound:
                return await call
        except TimeoutError:
            if not bound.expired():
                raise  # the client's own timeout (its connect timer, say): its message stands
            raise TimeoutError(
                f"{what}: no answer within RetryPolicy.attempt_timeout_s={self.timeout_s:g} s"
            ) from None

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        return await self._bounded(key, self._store.get(key, prototype, byte_range))

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return await self._bounded(
            "partial read", self._store.get_partial_values(prototype, key_ranges)
        )

    async def exists(self, key: str) -> bool:
        return await self._bounded(key, self._store.exists(key))

    async def getsize(self, key: str) -> int:
        return await self._bounded(key, self._store.getsize(key))


def bounded(store: Store, timeout_s: float) -> Store:
    """``store`` with each request bounded by ``timeout_s`` and every object it reads pinned to
    the version first read (:class:`PinnedStore`; object stores only: local disks as is)."""
    if isinstance(store, LocalStore):
        return store
    return BoundedStore(PinnedStore(store), timeout_s)


#: A client's conditional read of ``key`` (whole, or a byte range), conditional on the pinned
#: version when there is one: ``(bytes, the version the response names)``, or None when the
#: object is absent. Raises :class:`~asyncflat.storage.pins.VersionMismatch` on a 412, and
#: its client's own error on a range past the end (:class:`PinnedStore` reads that as empty).
ConditionalRead = Callable[
    [str, ByteRequest | None, Version | None], Awaitable[tuple[Any, Version | None] | None]
]


class PinnedStore(PerKeyWrapperStore):
    """Every object read through it is pinned to the version its first read saw, and every
    later read of it is conditional on that version (:mod:`.pins`): the read is issued here,
    by the client's own request function, with the precondition, in one request (s3fs:
    ``get_object(IfMatch=etag)``; gcsfs: a media GET with ``ifGenerationMatch``; obstore:
    ``get_async(options={"if_match": etag})``). A store whose client is none of these (an
    in-memory or HTTP filesystem) is read as is. The pins are shared by the copies zarr makes
    (``with_read_only``) and live as long as the loader that opened the store.

    ``read``: the conditional read to use instead of the client's (a test's fake store).
    """

    def __init__(
        self,
        store: Store,
        pins: VersionPins | None = None,
        *,
        read: ConditionalRead | None = None,
    ) -> None:
        super().__init__(store)
        self.pins = pins if pins is not None else VersionPins()
        self._read = read if read is not None else conditional_reader(store)

    def _with_store(self, store: Store) -> PinnedStore:
        return PinnedStore(store, self.pins, read=self._read)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        read = self._read
        if read is None:
            return await self._store.get(key, prototype, byte_range)
        pinned = self.pins.pinned(key)  # raises for an object refused before
        if isinstance(byte_range, RangeByteRequest) and byte_range.end <= byte_range.start:
            return prototype.buffer.from_bytes(b"")
        try:
            result = await read(key, byte_range, pinned)
        except VersionMismatch:
            if pinned is None:  # no condition was sent: the store's own refusal, named as is
                raise
            self.pins.mismatch(key, pinned)
        except Exception as exc:
            if not is_range_past_end(exc):
                raise
            # An empty read, as zarr's FsspecStore gives (the guard reports the object as
            # truncated); a 416 names no version: nothing to pin.
            return prototype.buffer.from_bytes(b"")
        if result is None:
            return None
        data, found = result
        self.pins.record(key, found)
        return prototype.buffer.from_bytes(data)


def conditional_reader(store: Store) -> ConditionalRead | None:
    """The conditional read of ``store``'s client (s3fs, gcsfs, obstore), or None."""
    if isinstance(store, FsspecStore):
        gcsfs = sys.modules.get("gcsfs")
        s3fs = sys.modules.get("s3fs")
        if s3fs is not None and isinstance(store.fs, s3fs.S3FileSystem):
            return _S3Reads(store).read
        if gcsfs is not None and isinstance(store.fs, gcsfs.GCSFileSystem):
            return _GcsReads(store).read
        return None
    return obstore_reader(store)


def http_range(byte_range: ByteRequest | None) -> str | None:
    """The HTTP ``Range`` header of a zarr byte request (None: the whole object)."""
    return None if byte_range is None else describe_range(byte_range)


def _object_path(root: str, key: str) -> str:
    """zarr's FsspecStore path of ``key`` under ``root`` (as its own ``get`` builds it)."""
    root = root.rstrip("/")
    return (f"{root}/{key}" if root else key).rstrip("/")


class _S3Reads:
    """s3fs: ``get_object`` through s3fs's own call (its session, credentials, error
    translation), with ``IfMatch`` once pinned; the ETag (and a versioned bucket's version id)
    come back with the same response."""

    def __init__(self, store: FsspecStore) -> None:
        self.store = store

    async def read(
        self, key: str, byte_range: ByteRequest | None, pinned: Version | None
    ) -> tuple[Any, Version | None] | None:
        fs = self.store.fs
        bucket, name, version_id = fs.split_path(_object_path(self.store.path, key))
        kwargs: dict[str, Any] = {}
        header = http_range(byte_range)
        if header is not None:
            kwargs["Range"] = header
        if version_id:
            kwargs["VersionId"] = version_id
        if pinned is not None:
            kwargs["IfMatch"] = pinned.value
        try:
            response = await fs._call_s3("get_object", Bucket=bucket, Key=name, **kwargs)
            try:
                data = await response["Body"].read()
            finally:
                response["Body"].close()
        except self.store.allowed_exceptions:
            return None
        except OSError as exc:
            if is_precondition_failure(exc):
                raise VersionMismatch(str(exc)) from exc
            raise
        etag = response.get("ETag")
        if not etag:
            return data, None
        note = f"version id {response['VersionId']}" if response.get("VersionId") else ""
        return data, Version("ETag", str(etag), note)


class _GcsReads:
    """gcsfs: the media GET gcsfs itself sends (its session and credentials), with
    ``ifGenerationMatch`` once pinned; the generation comes back in ``x-goog-generation``."""

    def __init__(self, store: FsspecStore) -> None:
        self.store = store

    async def read(
        self, key: str, byte_range: ByteRequest | None, pinned: Version | None
    ) -> tuple[Any, Version | None] | None:
        fs = self.store.fs
        path = _object_path(self.store.path, key)
        header = http_range(byte_range)
        headers = {"Range": header} if header is not None else {}
        params = {"ifGenerationMatch": pinned.value} if pinned is not None else {}
        try:
            found, data = await fs._call("GET", fs.url(path), headers=headers, **params)
        except FileExistsError as exc:  # gcsfs's translation of 412 Precondition Failed
            raise VersionMismatch(str(exc)) from exc
        except self.store.allowed_exceptions:
            return None
        generation = found.get("x-goog-generation")
        return data, Version("generation", str(generation)) if generation else None


def local_root(store: Store) -> str | None:
    """The directory of a plain local store (small reads may ``pread`` it directly), else None."""
    return str(store.root) if isinstance(store, LocalStore) else None
