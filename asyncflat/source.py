"""Async reads of token ranges from a flat-tokens split, on local disk or behind any fsspec URL.

The engine needs only :class:`TokenSource`: sizes, and two coroutines reading
``encoded_tokens[a:b]`` and ``seq_starts[a:b]``. Tests inject fakes with latency and faults.

:class:`ZarrTokenSource` is the real one. It opens the store *on the engine's loop* (aiohttp
sessions are bound to the loop that made them) and reads through zarr's async API, whose codec
pipeline decodes on the loop's default executor (the engine's CPU pool), never on the loop.
Every object request passes through :class:`_GuardedStore`, which bounds concurrency over the
whole source (adaptively: the limit halves when the store throttles and recovers additively),
retries transient failures, counts bytes, refuses silently-missing chunks (zarr would read them
as fill values, i.e. wrong data) and names the object and byte range in every error.

Object stores (``gs://``, ``s3://``, any fsspec URL): the filesystem is created here, on the
engine's loop, from ``storage_options``, never taken from fsspec's instance cache (a cached
instance may hold an aiohttp session bound to another, possibly dead, loop), and with the
filesystem's own retry loops turned off unless the caller configured them, so that attempts do
not multiply (gcsfs retries 6 times, s3fs 5 times, botocore 3-5 times, each around the other).
:meth:`ZarrTokenSource.aclose` closes its HTTP sessions on the same loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import os
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import numpy as np
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from . import _blosc
from .config import RetryPolicy
from .errors import (
    AsyncflatError,
    ConfigError,
    CorruptChunkError,
    DatasetFormatError,
    StorageError,
)
from .format import SplitArrays, open_split
from .retry import is_throttle, retrying

__all__ = [
    "AdaptiveLimiter",
    "IOCounters",
    "StoreWrapper",
    "TokenSource",
    "ZarrTokenSource",
    "is_url",
]

log = logging.getLogger(__name__)

#: A function the caller may use to wrap the raw store (fault injection, logging).
StoreWrapper = Callable[[Store], Store]

_METADATA_SUFFIXES = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")
#: Suffix reads up to this size (zarr-3 shard indexes) are cached: the index of a shard is read
#: once, not once per inner chunk. The dataset is read-only, so they cannot go stale.
_SUFFIX_CACHE_MAX_BYTES = 1 << 16
#: Largest range a row read of a local store reads directly on the loop thread (see _pread).
_PREAD_MAX_BYTES = 1 << 20
_SUFFIX_CACHE_ENTRIES = 4096


@dataclasses.dataclass
class IOCounters:
    """Raw store traffic, for read-amplification figures and the retry count."""

    requests: int = 0
    bytes_read: int = 0
    retries: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    #: Responses by which the store asked to slow down (429, 503, S3 SlowDown).
    throttled: int = 0
    #: The adaptive in-flight limit now (the configured maximum when never throttled).
    concurrency_limit: int = 0
    #: Shard-index reads answered from the cache instead of the store.
    cached_reads: int = 0


class TokenSource(Protocol):
    """What the engine reads from. All coroutines run on the engine's loop."""

    name: str
    token_count: int
    sequence_count: int
    max_token_id: int
    #: Tokens per decoded chunk: reads inside one chunk decode it once.
    token_chunk: int
    io: IOCounters

    async def read_tokens(self, start: int, stop: int) -> np.ndarray: ...

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray: ...

    async def aclose(self) -> None: ...


def is_url(filespec: str) -> bool:
    return "://" in filespec


class AdaptiveLimiter:
    """Bounds requests in flight; AIMD like TCP: the limit halves when the store throttles and
    grows by one per window of successful requests, back up to ``maximum``.

    A throttling response halves the limit only if its request started after the last decrease,
    so one burst of 429s from requests that were all in flight together halves it once.
    """

    def __init__(self, maximum: int, io: IOCounters) -> None:
        if maximum < 1:
            raise ValueError(f"maximum must be >= 1, got {maximum}")
        self.maximum = maximum
        self.limit = float(maximum)
        self.in_flight = 0
        self.epoch = 0
        self._io = io
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        io.concurrency_limit = maximum

    async def acquire(self) -> int:
        """Wait for a slot; returns the epoch to pass to :meth:`release`."""
        while self.in_flight >= int(self.limit):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif not waiter.cancelled():
                    self._wake()  # we were handed a slot we will not use: pass it on
                raise
        self.in_flight += 1
        return self.epoch

    def release(self, epoch: int, *, ok: bool, throttled: bool) -> None:
        self.in_flight -= 1
        if throttled:
            if epoch == self.epoch:
                self.limit = max(1.0, self.limit / 2)
                self.epoch += 1
                log.info("store throttled: concurrency limit now %d", int(self.limit))
        elif ok and self.limit < self.maximum:
            self.limit = min(float(self.maximum), self.limit + 1.0 / self.limit)
        self._io.concurrency_limit = int(self.limit)
        self._wake()

    def _wake(self) -> None:
        free = int(self.limit) - self.in_flight
        while free > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1


def describe_range(byte_range: ByteRequest | None) -> str:
    """An HTTP-style description of a byte range: ``bytes=0-99``, ``bytes=100-``, ``bytes=-16``."""
    if byte_range is None:
        return "whole object"
    if isinstance(byte_range, RangeByteRequest):
        return f"bytes={byte_range.start}-{byte_range.end - 1}"
    if isinstance(byte_range, OffsetByteRequest):
        return f"bytes={byte_range.offset}-"
    if isinstance(byte_range, SuffixByteRequest):
        return f"bytes=-{byte_range.suffix}"
    return repr(byte_range)  # pragma: no cover - zarr has no other kind


def _blosc_frame_problem(buffer: Buffer) -> str | None:
    """Why ``buffer`` is not one whole Blosc frame (its header's length must match), or None."""
    size = len(buffer)
    if size < 16:
        return f"{size} bytes cannot hold a Blosc header"
    cbytes = int(buffer.as_numpy_array()[12:16].view("<u4")[0])
    return None if cbytes == size else f"header says {cbytes} compressed bytes, object has {size}"


def _blosc_frame_prefixes(arrays: SplitArrays) -> set[str]:
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


def _range_length(byte_range: ByteRequest | None) -> int | None:
    """How many bytes ``byte_range`` asks for, when the request says (not for open ends)."""
    if isinstance(byte_range, RangeByteRequest):
        return byte_range.end - byte_range.start
    if isinstance(byte_range, SuffixByteRequest):
        return byte_range.suffix
    return None


class PerKeyWrapperStore(WrapperStore[Store]):
    """A store wrapper whose batched reads go through its own ``get``, one key at a time.

    zarr reads sharded arrays with ``get_partial_values``; routing it through ``get`` means a
    wrapper's checks (limits, retries, fault injection) apply to every read.
    """

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))


class _GuardedStore(PerKeyWrapperStore):
    """Bounded, retried, counted, strict access to the objects of a store."""

    def __init__(
        self,
        store: Store,
        *,
        name: str,
        limiter: AdaptiveLimiter,
        retry: RetryPolicy,
        io: IOCounters,
        suffix_cache: collections.OrderedDict[tuple[str, int], asyncio.Future[Buffer | None]]
        | None = None,
    ) -> None:
        super().__init__(store)
        self._name, self._limiter, self._retry, self._io = name.rstrip("/"), limiter, retry, io
        self._suffix_cache = collections.OrderedDict() if suffix_cache is None else suffix_cache
        #: Key prefixes of arrays whose chunk objects are single Blosc frames (set by
        #: ZarrTokenSource.open; shared with copies): checked before numcodecs decodes them.
        self.blosc_frames: set[str] = set()

    def _with_store(self, store: Store) -> _GuardedStore:
        copy = _GuardedStore(
            store,
            name=self._name,
            limiter=self._limiter,
            retry=self._retry,
            io=self._io,
            suffix_cache=self._suffix_cache,
        )
        copy.blosc_frames = self.blosc_frames
        return copy

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if (
            isinstance(byte_range, SuffixByteRequest)
            and byte_range.suffix <= _SUFFIX_CACHE_MAX_BYTES
        ):
            return await self._cached_suffix(key, prototype, byte_range)
        return await self._get(key, prototype, byte_range)

    async def _cached_suffix(
        self, key: str, prototype: BufferPrototype, byte_range: SuffixByteRequest
    ) -> Buffer | None:
        """Shard indexes: one request per shard, shared by every concurrent and later reader."""
        cache_key = (key, byte_range.suffix)
        future = self._suffix_cache.get(cache_key)
        if future is not None:
            self._suffix_cache.move_to_end(cache_key)
            self._io.cached_reads += 1
        else:
            future = asyncio.ensure_future(self._get(key, prototype, byte_range))
            self._suffix_cache[cache_key] = future
            if len(self._suffix_cache) > _SUFFIX_CACHE_ENTRIES:
                self._suffix_cache.popitem(last=False)

            def forget_failure(done: asyncio.Future[Buffer | None]) -> None:
                if (done.cancelled() or done.exception() is not None) and self._suffix_cache.get(
                    cache_key
                ) is done:
                    del self._suffix_cache[cache_key]  # the next reader tries afresh

            future.add_done_callback(forget_failure)
        # shield: a cancelled reader must not cancel the read other readers share.
        return await asyncio.shield(future)

    async def _get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None
    ) -> Buffer | None:
        def describe() -> str:
            return f"{self._name}/{key} ({describe_range(byte_range)})"

        async def attempt() -> Buffer | None:
            epoch = await self._limiter.acquire()
            self._io.in_flight += 1
            self._io.peak_in_flight = max(self._io.peak_in_flight, self._io.in_flight)
            ok = throttled = False
            try:
                result = await self._store.get(key, prototype, byte_range)
                ok = True
                return result
            except Exception as exc:
                throttled = is_throttle(exc)
                if throttled:
                    self._io.throttled += 1
                raise
            finally:
                self._io.in_flight -= 1
                self._limiter.release(epoch, ok=ok, throttled=throttled)

        def count_retry(_: BaseException) -> None:
            self._io.retries += 1

        try:
            buffer = await retrying(attempt, self._retry, describe=describe, on_retry=count_retry)
        except AsyncflatError:
            raise
        except Exception as exc:
            raise StorageError(f"reading {describe()} failed: {type(exc).__name__}: {exc}") from exc
        self._io.requests += 1
        if buffer is None:
            if not key.endswith(_METADATA_SUFFIXES):
                # zarr would silently serve fill values for a lost chunk: refuse instead.
                raise CorruptChunkError(
                    f"{describe()}: chunk object is missing from the store (404 / not found)"
                )
            return None
        if not key.endswith(_METADATA_SUFFIXES):
            # A chunk object is never empty, and a range zarr asks for (from a shard index, or
            # the shard index itself) lies inside the object: fewer bytes mean a truncated
            # object. zarr would decode an empty shard as fill values, i.e. wrong data.
            wanted = _range_length(byte_range)
            if len(buffer) == 0 or (wanted is not None and len(buffer) < wanted):
                raise CorruptChunkError(
                    f"{describe()}: chunk object is truncated: got {len(buffer)} bytes"
                    + (f", expected {wanted}" if wanted is not None else "")
                )
            if byte_range is None and key.startswith(tuple(self.blosc_frames)):
                # c-blosc trusts the length in the frame's header: a truncated frame would be
                # decoded by reading past the end of the object (garbage, or a crash).
                problem = _blosc_frame_problem(buffer)
                if problem is not None:
                    raise CorruptChunkError(
                        f"{describe()}: chunk object is not a whole Blosc frame: {problem}"
                    )
        self._io.bytes_read += len(buffer)
        return buffer


# -- filesystems ------------------------------------------------------------------------------

#: storage_options key (asyncflat's, popped before the filesystem sees it when the filesystem
#: does not take it itself): how many attempts the filesystem's *own* retry loop may make.
#: Absent: 1 (asyncflat retries instead). gcsfs and s3fs have no such constructor argument.
OWN_RETRIES_OPTION = "retries"


def _filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
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
    _set_own_retries(fs, own_retries or 1)
    return fs, path


def _set_own_retries(fs: Any, attempts: int) -> None:
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


async def _close_filesystem(fs: Any) -> None:
    """Close the HTTP sessions of ``fs`` on this loop (the one that made them)."""
    session = getattr(fs, "_session", None)  # gcsfs, fsspec's http: an aiohttp.ClientSession
    if session is not None and hasattr(session, "close") and not getattr(session, "closed", True):
        await session.close()
    creator = getattr(fs, "_s3creator", None)  # s3fs: the aiobotocore client's context manager
    if creator is not None:
        fs._s3creator = None
        fs._s3 = None
        await creator.__aexit__(None, None, None)


def _make_store(filespec: str, storage_options: Mapping[str, Any] | None) -> Store:
    if is_url(filespec) and not filespec.startswith("file://"):
        fs, path = _filesystem(filespec, storage_options)
        if not fs.async_impl:  # e.g. memory://: run the sync filesystem's calls in threads
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            fs = AsyncFileSystemWrapper(fs, asynchronous=True)
        return FsspecStore(fs=fs, path=path, read_only=True)
    path = filespec.removeprefix("file://")
    if not os.path.isdir(path):
        raise DatasetFormatError(f"{filespec}: no flat-tokens dataset here (not a directory)")
    return LocalStore(path, read_only=True)


class ZarrTokenSource:
    """A :class:`TokenSource` over a zarr store (format 2 or 3, local or fsspec)."""

    def __init__(self, arrays: SplitArrays, io: IOCounters, store: Store | None = None) -> None:
        self._arrays = arrays
        self._store = store  # the raw store (before any wrapper), closed by aclose()
        self.io = io
        self.name = arrays.name
        self.token_count = arrays.token_count
        self.sequence_count = arrays.sequence_count
        self.max_token_id = arrays.max_token_id
        self.token_chunk = arrays.token_chunk
        self.zarr_format = arrays.zarr_format
        #: Behind a network: latency is hidden by keeping many reads in flight.
        self.remote = False
        #: The guard's shard-index cache (set by open()): cleared when bytes fail to decode.
        self._suffix_cache: collections.OrderedDict[Any, Any] | None = None
        #: "blosc" or "raw" when chunk objects can be decoded directly (see read_frame).
        self.raw_codec = _raw_codec(arrays.encoded_tokens)
        #: Blosc frame layouts (header + block table) of chunks read row by row
        self._layouts: collections.OrderedDict[str, asyncio.Future[_blosc.FrameLayout]] = (
            collections.OrderedDict()
        )
        self._layout_prefix = 16  # bytes to read for a frame's header (+ table, once known)
        self._local_root: str | None = None  # set for plain local stores: small reads pread

    @classmethod
    async def open(
        cls,
        filespec: str,
        split: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_concurrent_requests: int = 16,
        retry: RetryPolicy | None = None,
        store_wrapper: StoreWrapper | None = None,
    ) -> ZarrTokenSource:
        """Open and validate ``split`` of the dataset at ``filespec`` (call on the engine loop)."""
        raw = _make_store(filespec, storage_options)
        store = raw if store_wrapper is None else store_wrapper(raw)
        io = IOCounters()
        guarded = _GuardedStore(
            store,
            name=filespec,
            limiter=AdaptiveLimiter(max_concurrent_requests, io),
            retry=retry or RetryPolicy(),
            io=io,
        )
        try:
            arrays = await open_split(guarded, split, name=filespec)
        except BaseException:
            await _close_store(raw)
            raise
        source = cls(arrays, io, raw)
        source.remote = not isinstance(raw, LocalStore)
        if isinstance(raw, LocalStore) and store_wrapper is None:
            source._local_root = str(raw.root)
        source._suffix_cache = guarded._suffix_cache
        guarded.blosc_frames.update(_blosc_frame_prefixes(arrays))
        return source

    async def read_tokens(self, start: int, stop: int) -> np.ndarray:
        return await self._read(self._arrays.encoded_tokens, "encoded_tokens", start, stop)

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray:
        return await self._read(self._arrays.seq_starts, "seq_starts", start, stop)

    # -- direct chunk access (the fast path; see asyncflat/_blosc.py) --------------------------

    def _chunk_key(self, chunk_id: int) -> str:
        array = self._arrays.encoded_tokens
        return f"{array.store_path.path}/{array.metadata.encode_chunk_key((chunk_id,))}"

    async def _read_range(self, key: str, lo: int, hi: int) -> bytes:
        if self._local_root is not None and hi - lo <= _PREAD_MAX_BYTES:
            return self._pread(key, lo, hi)
        store = self._arrays.encoded_tokens.store_path.store
        buffer = await store.get(key, default_buffer_prototype(), RangeByteRequest(lo, hi))
        assert buffer is not None  # the guarded store raises for a missing chunk
        return buffer.to_bytes()

    def _pread(self, key: str, lo: int, hi: int) -> bytes:
        """A small read of a local chunk file, right here on the loop thread.

        Row reads are a few KiB from the page cache: a thread hop through the store would cost
        100x the read itself. Only for plain local stores (no wrapper to honour).
        """
        where = f"{self.name}/{key} (bytes={lo}-{hi - 1})"
        try:
            fd = os.open(os.path.join(self._local_root, key), os.O_RDONLY)
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
        self.io.requests += 1
        self.io.bytes_read += len(data)
        return data

    async def read_items(self, chunk_id: int, first_item: int, out: np.ndarray) -> None:
        """Chunk-relative items ``[first_item, first_item + len(out))`` into ``out``, fetching
        only the bytes that hold them: a ranged read for an uncompressed chunk; for Blosc, the
        frame's header and block table (cached per chunk) and the compressed blocks in range.

        This is how a load that arrives before its blocks (a resume, a late fill) gets its few
        rows without waiting for whole blocks.
        """
        key = self._chunk_key(chunk_id)
        start = chunk_id * self.token_chunk + first_item
        where = f"{self.name} encoded_tokens[{start}:{start + len(out)}]"
        try:
            if self.raw_codec == "raw":
                data = await self._read_range(key, first_item * 4, (first_item + len(out)) * 4)
                out[:] = np.frombuffer(data, "<u4")
                return
            layout = await self._frame_layout(key)
            lo, hi = layout.items_range(first_item, len(out))
            frame = Frame(layout.sparse_frame([(lo, await self._read_range(key, lo, hi))]), 0, key)
        except _blosc.BloscError as exc:
            raise CorruptChunkError(f"{where}: chunk object {key}: {exc}") from exc
        except AsyncflatError as exc:  # name the token range, as _read does
            raise type(exc)(f"{where}: {exc}") from exc
        await asyncio.get_running_loop().run_in_executor(
            None, self.decode_into, frame, first_item, out
        )

    async def _frame_layout(self, key: str) -> _blosc.FrameLayout:
        """The header and block table of chunk object ``key``: read once, shared by every row
        read of that chunk (concurrent ones included), failures forgotten."""
        future = self._layouts.get(key)
        if future is None or (future.done() and (future.cancelled() or future.exception())):
            future = asyncio.ensure_future(self._read_layout(key))
            self._layouts[key] = future
            while len(self._layouts) > _SUFFIX_CACHE_ENTRIES:
                self._layouts.popitem(last=False)
        return await asyncio.shield(future)

    async def _read_layout(self, key: str) -> _blosc.FrameLayout:
        # Chunks of one array share a Blosc block size, so after the first frame the header
        # and the block table come in one request (checked against what the header says).
        prefix = await self._read_range(key, 0, self._layout_prefix)
        layout = _blosc.FrameLayout(prefix)
        lo, hi = layout.offsets_range
        if hi > len(prefix):
            prefix += await self._read_range(key, len(prefix), hi)
        if hi > lo:
            layout.offsets = np.frombuffer(prefix[lo:hi], "<i4").copy()
        if layout.nbytes == self.token_chunk * 4:
            self._layout_prefix = hi
        return layout

    async def read_frame(self, chunk_id: int, items: tuple[int, int] | None = None) -> Frame:
        """The stored bytes of ``encoded_tokens`` chunk ``chunk_id``, bypassing zarr's decoder.

        Blosc chunks are fetched whole (the frame is needed to decode any part of it). An
        uncompressed chunk is fetched as just the byte range of ``items`` (chunk-relative).
        """
        array = self._arrays.encoded_tokens
        key = f"{array.store_path.path}/{array.metadata.encode_chunk_key((chunk_id,))}"
        first, request = 0, None
        if self.raw_codec == "raw" and items is not None:
            first, request = items[0], RangeByteRequest(items[0] * 4, items[1] * 4)
        try:
            buffer = await array.store_path.store.get(key, default_buffer_prototype(), request)
        except AsyncflatError as exc:  # name the token range, as _read does
            lo = chunk_id * self.token_chunk
            hi = min(lo + self.token_chunk, self.token_count)
            raise type(exc)(f"{self.name} encoded_tokens[{lo}:{hi}]: {exc}") from exc
        assert buffer is not None  # the guarded store raises for a missing chunk
        return Frame(buffer.as_numpy_array().view(np.uint8), first, key)

    def decode_into(self, frame: Frame, first_item: int, out: np.ndarray) -> None:
        """Decode chunk-relative items ``[first_item, first_item + len(out))`` into ``out``.

        CPU-bound and GIL-free for Blosc: call it on the engine's thread pool.
        """
        try:
            if self.raw_codec == "blosc":
                _blosc.decode_into(frame.data, first_item, out)
                return
            start = (first_item - frame.first_item) * 4
            if start < 0 or start + out.nbytes > frame.data.nbytes:
                raise _blosc.BloscError(
                    f"object has {frame.data.nbytes} bytes, needed {start + out.nbytes}"
                )
            out[:] = frame.data[start : start + out.nbytes].view("<u4")
        except _blosc.BloscError as exc:
            raise CorruptChunkError(
                f"{self.name} encoded_tokens: chunk object {frame.key} does not decode: {exc}"
            ) from exc

    async def _read(self, array: Any, array_name: str, start: int, stop: int) -> np.ndarray:
        try:
            return np.asarray(await array.getitem(slice(start, stop)))
        except AsyncflatError as exc:
            raise type(exc)(f"{self.name} {array_name}[{start}:{stop}]: {exc}") from exc
        except (RuntimeError, ValueError, TypeError) as exc:
            # Codec failures (blosc, zstd, checksum) on bytes that did arrive: corrupt data.
            if self._suffix_cache is not None:
                # The bad bytes may be a cached shard index: re-read it next time, not forever.
                self._suffix_cache.clear()
            raise CorruptChunkError(
                f"{self.name} {array_name}[{start}:{stop}]: chunk bytes do not decode: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    async def aclose(self) -> None:
        """Close the store and its filesystem's HTTP sessions (idempotent; on the engine loop)."""
        for pending in self._layouts.values():
            pending.cancel()
        self._layouts.clear()
        store, self._store = self._store, None
        if store is not None:
            await _close_store(store)
        self._arrays.encoded_tokens.store_path.store.close()


@dataclasses.dataclass(frozen=True)
class Frame:
    """Bytes of one stored chunk (or of a range of it, starting at chunk item ``first_item``)."""

    data: np.ndarray  # uint8
    first_item: int
    key: str


def _raw_codec(array: Any) -> str | None:
    """ "blosc" or "raw" when chunks of ``array`` can be read and decoded without zarr, else None.

    That is a plain chunk grid (no sharding, filters or transposes) of little-endian items whose
    only compressor, if any, is Blosc. Everything else goes through zarr's codec pipeline.
    """
    from zarr.core.metadata import ArrayV2Metadata

    meta = array.metadata
    if isinstance(meta, ArrayV2Metadata):
        if meta.filters or meta.order != "C":
            return None
        compressor = meta.compressor
        if compressor is None:
            return "raw"
        name = getattr(compressor, "codec_id", None)
    else:
        from zarr.codecs import BloscCodec, BytesCodec
        from zarr.codecs.bytes import Endian

        codecs = list(meta.codecs)
        if not isinstance(codecs[0], BytesCodec) or codecs[0].endian not in (None, Endian.little):
            return None
        if len(codecs) == 1:
            return "raw"
        if len(codecs) != 2 or not isinstance(codecs[1], BloscCodec):
            return None
        name = "blosc"
    return "blosc" if name == "blosc" and _blosc.AVAILABLE else None


async def _close_store(store: Store) -> None:
    try:
        if isinstance(store, FsspecStore):
            await _close_filesystem(store.fs)
    except Exception:  # closing must not mask the error that led here
        log.warning("closing the filesystem of %r failed", store, exc_info=True)
    finally:
        store.close()
