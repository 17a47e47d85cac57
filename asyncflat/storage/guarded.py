"""The one gate every object request passes: bounded, retried, counted and strict.

:class:`GuardedStore` wraps the raw store (and any user wrapper). It bounds concurrency over the
whole source (adaptively, see :mod:`.limiter`), retries transient failures (:mod:`.retry`),
counts bytes and requests, refuses silently-missing or truncated chunks (zarr would read them
as fill values, i.e. wrong data), checks Blosc frames before any decoder sees them, and names
the object and byte range in every error (an object replaced since the loader first read it is
refused by the conditional reads beneath, :mod:`.pins`, and named here). Shard indexes are read once per shard through one
:class:`~asyncflat.storage.single_flight.SingleFlight` cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import LocalStore, WrapperStore

from asyncflat.config import RetryPolicy
from asyncflat.errors import (
    AsyncflatError,
    CorruptChunkError,
    DatasetFormatError,
    ObjectReplacedError,
    StorageError,
    carries_secret,
    error_text,
    redact,
    scrubbed,
)
from asyncflat.format.codec import METADATA_FILES
from asyncflat.storage.blosc import frame_problem
from asyncflat.storage.counters import IOCounters
from asyncflat.storage.gate import (
    METADATA_MAX_BYTES,
    ChunkGate,
    ChunkRejected,
    UnsupportedCodec,
    gate_for,
)
from asyncflat.storage.limiter import AdaptiveLimiter
from asyncflat.storage.local_files import file_kind, file_on_the_way
from asyncflat.storage.retry import is_throttle, retrying
from asyncflat.storage.single_flight import SingleFlight

__all__ = [
    "GuardedStore",
    "PerKeyWrapperStore",
    "describe_range",
    "guard_store",
    "is_metadata",
]


def is_metadata(key: str) -> bool:
    """Whether store key ``key`` names a zarr metadata document (not a chunk object)."""
    return key.rpartition("/")[2] in METADATA_FILES


#: Suffix reads up to this size (zarr-3 shard indexes) are cached: the index of a shard is read
#: once, not once per inner chunk. The dataset is read-only, so they cannot go stale.
_SUFFIX_CACHE_MAX_BYTES = 1 << 16
_SUFFIX_CACHE_ENTRIES = 4096


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
    #: Key prefix of each gated array -> what its chunk objects may be (see :mod:`.gate`).
    gates: dict[str, ChunkGate] = dataclasses.field(default_factory=dict)
    #: The real directory of a local store under the wrappers: objects are checked with
    #: ``lstat`` before they are opened (regular files inside the store, not too large).
    local_root: str | None = None
    #: Serve a missing chunk as zarr would (fill values) instead of refusing it: for readers
    #: of metadata and end entries that zarr's writer may have left unwritten (empty splits).
    allow_missing: bool = False
    #: Values of ``storage_options`` (:func:`~asyncflat.errors.option_secrets`): never shown in
    #: an error, like URL userinfo.
    secrets: tuple[str, ...] = ()
    #: While opening (:meth:`GuardedStore.prefetching`): whole-object reads by key, started
    #: ahead and shared, so zarr's sequential walk of the hierarchy costs no round trips.
    opening: dict[str, asyncio.Future[Buffer | None]] | None = None


def _local_root(store: Store) -> str | None:
    """The directory of the LocalStore at the bottom of a chain of wrappers, if any."""
    for _ in range(16):
        if isinstance(store, LocalStore):
            return os.path.realpath(str(store.root))
        inner = getattr(store, "_store", None)
        if not isinstance(inner, Store):
            return None
        store = inner
    return None


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
        secrets: tuple[str, ...] = (),
        _shared: _Shared | None = None,
    ) -> None:
        super().__init__(store)
        self._shared = _shared or _Shared(
            redact(name).rstrip("/"),
            limiter,
            retry,
            io,
            SingleFlight(_SUFFIX_CACHE_ENTRIES),
            set(),
            local_root=_local_root(store),
            secrets=secrets,
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

    def gate_arrays(self, arrays: Iterable[Any]) -> None:
        """Check every chunk object of these zarr arrays with their :class:`ChunkGate` from now
        on. Raises :class:`DatasetFormatError` for an array whose codecs cannot be bounded."""
        for array in arrays:
            try:
                gate = gate_for(array)
            except UnsupportedCodec as exc:
                raise DatasetFormatError(
                    f"{self._shared.name}/{array.store_path.path}: {exc}: asyncflat reads only "
                    "codecs whose decoded size it can bound before decoding (Blosc, zstd, gzip, "
                    "zlib, bz2, lzma, lz4, crc32c, sharding)"
                ) from None
            self._shared.gates[f"{array.store_path.path}/"] = gate

    def max_object_bytes(self, key: str) -> int | None:
        """The largest legal encoding of the chunk object ``key`` (None: not a gated array)."""
        gate = self._gate(key)
        return gate.max_object_bytes if gate is not None else None

    def _gate(self, key: str) -> ChunkGate | None:
        """The gate of the array ``key`` belongs to (the longest registered prefix)."""
        best: tuple[int, ChunkGate] | None = None
        for prefix, gate in self._shared.gates.items():
            if key.startswith(prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), gate)
        return best[1] if best else None

    def _check_local(
        self, key: str, gate: ChunkGate | None, describe: Callable[[], str]
    ) -> int | None:
        """``lstat`` a local object before anything opens it: it must be a regular file inside
        the store (a symlink may point only inside it), no larger than a legal encoding of its
        chunk. A FIFO, a device or an 8 GiB sparse file is refused unread. Returns its size."""
        root = self._shared.local_root
        if root is None:
            return None
        path = os.path.join(root, key)
        metadata = is_metadata(key)
        error = DatasetFormatError if metadata else CorruptChunkError
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None  # the store reports it (missing chunk, or absent metadata)
        except NotADirectoryError:  # a file where the layout has a directory (a group, an array)
            raise error(f"{describe()}: {file_on_the_way(root, key)}") from None
        except OSError as exc:
            raise StorageError(f"reading {describe()} failed: {exc}") from None
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            real = os.path.realpath(path)
            if os.path.commonpath([real, root]) != root:
                raise error(f"{describe()}: is a symlink to {real}, outside the store {root}")
            try:
                st = os.stat(real)
            except OSError as exc:
                raise error(f"{describe()}: is a broken symlink: {exc}") from None
        else:
            real = os.path.realpath(path)  # a directory on the way may be a symlink
            if os.path.commonpath([real, root]) != root:
                raise error(f"{describe()}: resolves to {real}, outside the store {root}")
        if not stat.S_ISREG(st.st_mode):
            kind = file_kind(st.st_mode)
            raise error(f"{describe()}: is {kind}, not a regular file: refused unread")
        cap = METADATA_MAX_BYTES if metadata else gate.max_object_bytes if gate else None
        if cap is not None and st.st_size > cap:
            raise error(
                f"{describe()}: object has {st.st_size} bytes, more than "
                + (
                    f"the {cap}-byte limit for metadata"
                    if metadata
                    else f"any legal encoding of its chunk ({cap} bytes)"
                )
                + ": refused unread"
            )
        return st.st_size

    @contextlib.contextmanager
    def prefetching(self, keys: Iterable[str]) -> Iterator[dict[str, asyncio.Future[Any]]]:
        """Start reading the whole objects ``keys`` now, all at once, and serve every
        whole-object read of the same key from that one request until the block ends (also
        keys read meanwhile that were not named: read once, however often zarr asks).

        Opening a dataset walks the hierarchy (group, split, arrays) one level at a time: with
        the metadata fetched ahead, the walk costs one round trip instead of one per level.
        A key that is absent reads as None, as it would from the store.
        """
        shared = self._shared
        cache: dict[str, asyncio.Future[Buffer | None]] = {}
        shared.opening = cache
        try:
            for key in keys:
                self._opening_read(cache, key, default_buffer_prototype())
            yield cache
        finally:
            shared.opening = None
            for future in cache.values():
                future.cancel()  # done ones ignore it

    def _opening_read(
        self,
        cache: dict[str, asyncio.Future[Buffer | None]],
        key: str,
        prototype: BufferPrototype,
    ) -> asyncio.Future[Buffer | None]:
        future = cache.get(key)
        if future is None:
            future = cache[key] = asyncio.ensure_future(self._get(key, prototype, None))
            # Read by nobody (a key of the other format): its error is not worth a warning.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return future

    def forget_indexes(self) -> None:
        """Drop the cached shard indexes: bytes under them failed to decode, re-read them."""
        self._shared.suffixes.clear()

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        opening = self._shared.opening
        if opening is not None and byte_range is None:
            return await asyncio.shield(self._opening_read(opening, key, prototype))
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

        gate = self._gate(key)
        object_size = self._check_local(key, gate, describe)

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
        except ObjectReplacedError as exc:  # never retried; named here, with its range
            raise ObjectReplacedError(f"reading {describe()}: {exc}") from None
        except AsyncflatError as exc:  # e.g. the last transient error, its message included
            if not carries_secret(exc, shared.secrets):
                raise
            raise scrubbed(exc, describe(), shared.secrets) from None
        except Exception as exc:  # noqa: BLE001 - re-raised, chained unless it holds a secret
            raise StorageError(
                f"reading {describe()} failed: {type(exc).__name__}: "
                f"{redact(error_text(exc), shared.secrets)}"
            ) from (None if carries_secret(exc, shared.secrets) else exc)
        io.requests += 1
        if buffer is None:
            if not is_metadata(key) and not shared.allow_missing:
                # zarr would silently serve fill values for a lost chunk: refuse instead.
                raise CorruptChunkError(
                    f"{describe()}: chunk object is missing from the store (404 / not found)"
                )
            return None
        if is_metadata(key):
            if len(buffer) > METADATA_MAX_BYTES:
                raise DatasetFormatError(
                    f"{describe()}: metadata has {len(buffer)} bytes, more than the "
                    f"{METADATA_MAX_BYTES}-byte limit"
                )
        else:
            self._check_chunk(key, byte_range, buffer, describe)
            if gate is not None:
                self._check_gate(gate, byte_range, buffer, object_size, describe)
        io.bytes_read += len(buffer)
        return buffer

    def _check_gate(
        self,
        gate: ChunkGate,
        byte_range: ByteRequest | None,
        buffer: Buffer,
        object_size: int | None,
        describe: Callable[[], str],
    ) -> None:
        """Check the bytes against what the array's metadata allows, before any decoder."""
        data = memoryview(buffer.as_numpy_array().view("u1").data)
        try:
            if byte_range is None:
                gate.check(data)
            elif gate.inner is not None:
                gate.check_range(byte_range, data, object_size)
        except ChunkRejected as exc:
            if byte_range is not None:
                self.forget_indexes()  # an inner chunk's range came from a cached index
            raise CorruptChunkError(
                f"{describe()}: chunk object of {gate.array} does not decode (refused before "
                f"decoding: {exc})"
            ) from None

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
        if wanted is not None and len(buffer) > wanted:
            # An HTTP server that ignores the Range header answers with the whole object: its
            # first bytes are not the range asked for, whatever reads them next.
            raise StorageError(
                f"{where}: the store answered a range of {wanted} bytes with {len(buffer)} (it "
                "ignores byte ranges?): refused, never read as the range"
            )
        if len(buffer) == 0 or (wanted is not None and len(buffer) < wanted):
            if byte_range is not None:
                self.forget_indexes()  # the range may come from the index of a replaced shard
            raise CorruptChunkError(
                f"{where}: chunk object is truncated: got {len(buffer)} bytes"
                + (f", expected {wanted}" if wanted is not None else "")
            )
        if (
            byte_range is None
            and key.startswith(tuple(self._shared.blosc_frames))
            and self._gate(key) is None
        ):
            # c-blosc trusts the length in the frame's header: a truncated frame would be
            # decoded by reading past the end of the object (garbage, or a crash).
            problem = frame_problem(buffer.as_numpy_array())
            if problem is not None:
                raise CorruptChunkError(
                    f"{where}: chunk object is not a whole Blosc frame: {problem}"
                )


def guard_store(
    store: Store, name: str, *, max_concurrent_requests: int = 16, allow_missing: bool = False
) -> GuardedStore:
    """``store`` behind a guarded store with default limits (for one-off readers).

    ``allow_missing``: a missing chunk reads as zarr's fill values (the chunks zarr leaves
    unwritten) instead of raising; every chunk that exists is still checked.
    """
    io = IOCounters()
    guarded = GuardedStore(
        store,
        name=name,
        limiter=AdaptiveLimiter(max_concurrent_requests, io),
        retry=RetryPolicy(),
        io=io,
    )
    guarded._shared.allow_missing = allow_missing
    return guarded
