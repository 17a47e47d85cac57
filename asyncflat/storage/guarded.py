"""The one gate every object request passes: bounded, retried, counted and strict.

:class:`GuardedStore` wraps the raw store (and any user wrapper). It bounds concurrency over the
whole source (adaptively, see :mod:`.limiter`), retries transient failures (:mod:`.retry`),
counts bytes and requests, refuses silently-missing or truncated chunks (zarr would read them
as fill values, i.e. wrong data), checks Blosc frames before any decoder sees them, and names
the object and byte range in every error. Shard indexes are read once per shard through one
:class:`~asyncflat._single_flight.SingleFlight` cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

from .._single_flight import SingleFlight
from ..config import RetryPolicy
from ..errors import AsyncflatError, CorruptChunkError, StorageError
from .blosc import frame_problem
from .limiter import AdaptiveLimiter
from .retry import is_throttle, retrying

__all__ = [
    "METADATA_SUFFIXES",
    "GuardedStore",
    "IOCounters",
    "PerKeyWrapperStore",
    "describe_range",
]

METADATA_SUFFIXES = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")
#: Suffix reads up to this size (zarr-3 shard indexes) are cached: the index of a shard is read
#: once, not once per inner chunk. The dataset is read-only, so they cannot go stale.
_SUFFIX_CACHE_MAX_BYTES = 1 << 16
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
    #: Bytes decoded from stored chunks (whole chunks through zarr, items on the direct path).
    bytes_decoded: int = 0


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


@dataclasses.dataclass
class _Shared:
    """What a guarded store shares with the copies zarr makes of it (``with_read_only``)."""

    name: str
    limiter: AdaptiveLimiter
    retry: RetryPolicy
    io: IOCounters
    suffixes: SingleFlight[tuple[str, int], Buffer | None]
    #: Key prefixes of arrays whose chunk objects are single Blosc frames: checked before any
    #: decoder sees them.
    blosc_frames: set[str]


class GuardedStore(PerKeyWrapperStore):
    """Bounded, retried, counted, strict access to the objects of a store."""

    def __init__(
        self,
        store: Store,
        *,
        name: str,
        limiter: AdaptiveLimiter,
        retry: RetryPolicy,
        io: IOCounters,
        _shared: _Shared | None = None,
    ) -> None:
        super().__init__(store)
        self._shared = _shared or _Shared(
            name.rstrip("/"), limiter, retry, io, SingleFlight(_SUFFIX_CACHE_ENTRIES), set()
        )

    def _with_store(self, store: Store) -> GuardedStore:
        s = self._shared
        return GuardedStore(
            store, name=s.name, limiter=s.limiter, retry=s.retry, io=s.io, _shared=s
        )

    @property
    def io(self) -> IOCounters:
        return self._shared.io

    def check_blosc_frames(self, prefixes: Iterable[str]) -> None:
        """Check whole objects under these key prefixes as single Blosc frames from now on."""
        self._shared.blosc_frames.update(prefixes)

    def forget_indexes(self) -> None:
        """Drop the cached shard indexes: bytes under them failed to decode, re-read them."""
        self._shared.suffixes.clear()

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if (
            isinstance(byte_range, SuffixByteRequest)
            and byte_range.suffix <= _SUFFIX_CACHE_MAX_BYTES
        ):
            # Shard indexes: one request per shard, shared by every concurrent and later reader.
            cache = self._shared.suffixes
            cache_key = (key, byte_range.suffix)
            if cache_key in cache:
                self._shared.io.cached_reads += 1
            return await cache.get(cache_key, lambda: self._get(key, prototype, byte_range))
        return await self._get(key, prototype, byte_range)

    async def _get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None
    ) -> Buffer | None:
        shared, io = self._shared, self._shared.io

        def describe() -> str:
            return f"{shared.name}/{key} ({describe_range(byte_range)})"

        async def attempt() -> Buffer | None:
            epoch = await shared.limiter.acquire()
            io.in_flight += 1
            io.peak_in_flight = max(io.peak_in_flight, io.in_flight)
            ok = throttled = False
            try:
                result = await self._store.get(key, prototype, byte_range)
                ok = True
                return result
            except Exception as exc:
                throttled = is_throttle(exc)
                if throttled:
                    io.throttled += 1
                raise
            finally:
                io.in_flight -= 1
                shared.limiter.release(epoch, ok=ok, throttled=throttled)

        def count_retry(_: BaseException) -> None:
            io.retries += 1

        try:
            buffer = await retrying(attempt, shared.retry, describe=describe, on_retry=count_retry)
        except AsyncflatError:
            raise
        except Exception as exc:
            raise StorageError(f"reading {describe()} failed: {type(exc).__name__}: {exc}") from exc
        io.requests += 1
        if buffer is None:
            if not key.endswith(METADATA_SUFFIXES):
                # zarr would silently serve fill values for a lost chunk: refuse instead.
                raise CorruptChunkError(
                    f"{describe()}: chunk object is missing from the store (404 / not found)"
                )
            return None
        if not key.endswith(METADATA_SUFFIXES):
            self._check_chunk(key, byte_range, buffer, describe)
        io.bytes_read += len(buffer)
        return buffer

    def _check_chunk(
        self,
        key: str,
        byte_range: ByteRequest | None,
        buffer: Buffer,
        describe: Callable[[], str],
    ) -> None:
        where = describe()
        # A chunk object is never empty, and a range zarr asks for (from a shard index, or
        # the shard index itself) lies inside the object: fewer bytes mean a truncated
        # object. zarr would decode an empty shard as fill values, i.e. wrong data.
        wanted = _range_length(byte_range)
        if len(buffer) == 0 or (wanted is not None and len(buffer) < wanted):
            raise CorruptChunkError(
                f"{where}: chunk object is truncated: got {len(buffer)} bytes"
                + (f", expected {wanted}" if wanted is not None else "")
            )
        if byte_range is None and key.startswith(tuple(self._shared.blosc_frames)):
            # c-blosc trusts the length in the frame's header: a truncated frame would be
            # decoded by reading past the end of the object (garbage, or a crash).
            problem = frame_problem(buffer.as_numpy_array())
            if problem is not None:
                raise CorruptChunkError(
                    f"{where}: chunk object is not a whole Blosc frame: {problem}"
                )
