"""The reader: exactly what the engine reads from a flat-tokens split, and nothing more.

:class:`TokenSource` is the interface the engine uses: sizes, and four reads.

* ``read_into(start, stop, targets, writer)``: tokens ``[start, stop)`` (inside one stored
  chunk) into views of a shuffle buffer. The reader picks the strategy (partial Blosc decode
  straight into the views, a ranged read of an uncompressed chunk, or zarr's decoder and a copy),
  shares one fetch per chunk among the fills that need it, and hands the CPU work to ``writer``,
  the engine's side, which decides when a buffer may be written and on which threads.
* ``read_items(chunk_id, first_item, out)``: a few rows, fetching only the bytes that hold them
  (when ``partial_reads``): how a load that arrives before its blocks gets its rows.
* ``read_tokens`` / ``read_seq_starts``: plain ranges (unpacked rows, ``inspect``).

:class:`ZarrTokenSource` is the real one, over a zarr store (format 2 or 3, local or any fsspec
URL). It opens the store *on the engine's loop* (aiohttp sessions are bound to the loop that made
them) and every object request passes through the guarded store (:mod:`asyncflat.storage`).
The storage layers below it live in :mod:`asyncflat.storage`; their old names stay importable
from here (resolved on first use: this module does not import zarr, so that
:class:`~asyncflat.source.local_source.LocalTokenSource`, the same reader over a plain local split
opened without zarr, costs a restart no zarr import).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from asyncflat.config import RetryPolicy, redact_url
from asyncflat.errors import (
    AsyncflatError,
    CorruptChunkError,
    TransientStorageError,
    carries_secret,
    install_log_redaction,
    option_secrets,
    scrubbed,
)
from asyncflat.storage import blosc as _blosc
from asyncflat.storage.chunks import Frame, blosc_frame_prefixes, raw_codec, without_crc32c
from asyncflat.storage.counters import IOCounters
from asyncflat.storage.limiter import AdaptiveLimiter, pool_size
from asyncflat.storage.local_files import is_url, pread, pread_into
from asyncflat.storage.single_flight import SingleFlight

if TYPE_CHECKING:
    from zarr.abc.store import Store

    from asyncflat.format.split import SplitArrays
    from asyncflat.storage.filesystems import OWN_RETRIES_OPTION
    from asyncflat.storage.guarded import GuardedStore, PerKeyWrapperStore, describe_range

__all__ = [
    "OWN_RETRIES_OPTION",
    "AdaptiveLimiter",
    "Frame",
    "IOCounters",
    "PerKeyWrapperStore",
    "StoreWrapper",
    "TokenSource",
    "UnitWriter",
    "ZarrTokenSource",
    "describe_range",
    "is_url",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: A function the caller may use to wrap the raw store (fault injection, logging).
StoreWrapper = Callable[["Store"], "Store"]

_raw_codec = raw_codec  # an old private name, kept for code that imported it from here
# Names of the zarr and fsspec layers, kept importable from here but resolved on first use:
# this module must not import zarr (0.3 s) for a plain local dataset, which never uses it.
_LAZY = {
    "OWN_RETRIES_OPTION": ("storage.filesystems", "OWN_RETRIES_OPTION"),
    "PerKeyWrapperStore": ("storage.guarded", "PerKeyWrapperStore"),
    "describe_range": ("storage.guarded", "describe_range"),
    "_filesystem": ("storage.filesystems", "filesystem"),
    "_close_filesystem": ("storage.filesystems", "close_filesystem"),
    "_make_store": ("storage.filesystems", "make_store"),
    "_close_store": ("storage.filesystems", "close_store"),
    "_blosc_frame_prefixes": ("storage.chunks", "blosc_frame_prefixes"),
}


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(f"asyncflat.{module}"), attribute)


#: Largest range a row read of a local store reads directly on the loop thread (see pread).
_PREAD_MAX_BYTES = 1 << 20
#: Frame layouts kept (one per chunk object read row by row).
_LAYOUTS_KEPT = 4096
#: Behind a network, a row of a Blosc chunk this small (decoded) is read with the whole object
#: (one round trip; the transfer costs less than a second request's latency) instead of its
#: frame's layout and then its blocks (two round trips).
WHOLE_ROW_CHUNK = 1 << 20
#: Whole chunks kept after their fills used them: consecutive fills often share a chunk.
_CHUNKS_KEPT = 2
#: A row read whose Blosc blocks decode to at most this many bytes is decoded on the loop (tens
#: of microseconds, the GIL released): cheaper than a hop to the decode threads, and never queued
#: there behind a fill's whole-chunk reads and decodes (a resume's first load waited for them).
INLINE_DECODE_BYTES = 1 << 17

#: (chunk-relative first item, view to fill) pairs of one read.
Targets = Sequence[tuple[int, np.ndarray]]


class UnitWriter(Protocol):
    """The engine's side of a read into its buffer."""

    async def write(self, fill_targets: Callable[[], None]) -> bool:
        """Run ``fill_targets`` (CPU work writing into the targets) once the buffer may be
        written, off the loop; False (and not run) when the fill was dropped meanwhile."""
        ...


class TokenSource(Protocol):
    """What the engine reads from. All coroutines run on the engine's loop."""

    name: str
    token_count: int
    sequence_count: int
    max_token_id: int
    #: Tokens per stored chunk: the engine plans one ``read_into`` per chunk a fill touches.
    token_chunk: int
    #: Behind a network: latency is hidden by keeping many reads in flight.
    remote: bool
    #: ``read_items`` fetches only the bytes holding the items (a few rows cost a few KiB).
    partial_reads: bool
    io: IOCounters

    async def read_tokens(self, start: int, stop: int) -> np.ndarray: ...

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray: ...

    async def read_into(self, start: int, stop: int, targets: Targets, writer: UnitWriter) -> None:
        """Tokens of ``[start, stop)`` (inside one chunk) into ``targets`` through ``writer``."""
        ...

    async def read_items(self, chunk_id: int, first_item: int, out: np.ndarray) -> None:
        """Chunk-relative items ``[first_item, first_item + len(out))`` into ``out``."""
        ...

    async def aclose(self) -> None: ...


def _object_key(array: Any, index: int) -> str:
    """The store key of chunk (or shard) ``index`` of a 1-d zarr array."""
    return f"{array.store_path.path}/{array.metadata.encode_chunk_key((index,))}"


def _objects_of(array: Any, start: int, stop: int) -> str:
    """The stored object(s) (chunks, or shards) holding items ``[start, stop)`` of a 1-d zarr
    array, for an error whose codec (zstd, gzip, ...) does not say which one it was given."""
    try:
        meta = array.metadata
        grid = getattr(meta, "chunk_grid", None)
        size = int(grid.chunk_shape[0] if grid is not None else meta.chunks[0])
        first, last = start // size, max(start, stop - 1) // size
        keys = _object_key(array, first), _object_key(array, last)
    except (AttributeError, TypeError, ValueError, IndexError, ZeroDivisionError):
        return "its chunk objects"  # an array layout this does not know: no guess
    if first == last:
        return f"chunk object {keys[0]}"
    return f"one of the chunk objects {keys[0]} to {keys[1]}"


class ZarrTokenSource:
    """A :class:`TokenSource` over a zarr store (format 2 or 3, local or fsspec)."""

    def __init__(
        self,
        arrays: SplitArrays,
        io: IOCounters,
        store: Store | None = None,
        *,
        guard: GuardedStore | None = None,
        local: str | None = None,
    ) -> None:
        self._arrays = arrays
        self._store = store  # the raw store (before any wrapper), closed by aclose()
        self._guard = guard
        remote = False
        if store is not None:
            from asyncflat.storage.filesystems import local_root

            remote = local_root(store) is None
        codec, checksum = raw_codec(arrays.encoded_tokens)
        self._setup(
            arrays.name,
            arrays.token_count,
            arrays.sequence_count,
            arrays.max_token_id,
            arrays.token_chunk,
            io,
            codec=codec,
            checksum=checksum,
            remote=remote,
            local=local,
        )

    def _setup(
        self,
        name: str,
        token_count: int,
        sequence_count: int,
        max_token_id: int,
        token_chunk: int,
        io: IOCounters,
        *,
        codec: str | None,
        checksum: bool,
        remote: bool,
        local: str | None,
    ) -> None:
        """What every reader of chunk objects holds, however the split was opened."""
        self._local_root = local  # set for plain local stores: small reads pread
        self.io = io
        self.name = name
        self.token_count = token_count
        self.sequence_count = sequence_count
        self.max_token_id = max_token_id
        self.token_chunk = token_chunk
        self.remote = remote
        #: "blosc" or "raw" when chunk objects can be decoded here, else None (zarr decodes);
        #: checksummed: each object ends with zarr's crc32c of the rest, verified here too.
        self._codec, self._checksum = codec, checksum
        self._chunk_nbytes = self.token_chunk * 4
        # Rows of a checksummed chunk, or of a small Blosc chunk behind a network, are read with
        # their whole object (see read_items): no cheaper than the fill's unit for that chunk,
        # which a waiting load moves to the front of the fill, so the engine waits for that
        # unit instead of fetching the object twice (on a slow bucket the rows read ahead after
        # a resume re-fetched most of the fill's objects beside it).
        whole = self._checksum or (
            self.remote and self._codec == "blosc" and self._chunk_nbytes <= WHOLE_ROW_CHUNK
        )
        self.partial_reads = self._codec is not None and not whole
        self._chunks: SingleFlight[int, Frame] = SingleFlight(_CHUNKS_KEPT)
        #: Blosc frame layouts (header + block table) of chunks read row by row
        self._layouts: SingleFlight[str, _blosc.FrameLayout] = SingleFlight(_LAYOUTS_KEPT)
        self._layout_prefix = 16  # bytes to read for a frame's header (+ table, once known)

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
        """Open and validate ``split`` of the dataset at ``filespec`` (call on the engine loop).

        Bounded in time as a whole by ``retry.deadline_s`` (each request also by
        ``retry.attempt_timeout_s``): a silent store fails construction, it does not hang it.
        """
        from asyncflat.format.split import open_split
        from asyncflat.storage.filesystems import (
            bounded,
            close_store,
            construction_error,
            local_root,
            make_store,
        )
        from asyncflat.storage.guarded import GuardedStore

        retry = retry or RetryPolicy()
        secrets = option_secrets(storage_options)
        install_log_redaction(secrets)
        try:
            raw = make_store(
                filespec,
                storage_options,
                timeout_s=retry.attempt_timeout_s,
                max_connections=pool_size(max_concurrent_requests),
            )
        except Exception as exc:  # noqa: BLE001 - a filesystem constructor, credential exchange
            raise construction_error(exc, filespec, secrets) from (
                None if carries_secret(exc, secrets) else exc
            )
        timed = bounded(raw, retry.attempt_timeout_s)
        store = timed if store_wrapper is None else store_wrapper(timed)
        io = IOCounters()
        guard = GuardedStore(
            store,
            name=filespec,
            limiter=AdaptiveLimiter(max_concurrent_requests, io),
            retry=retry,
            io=io,
            secrets=secrets,
        )
        try:
            async with asyncio.timeout(retry.deadline_s) as budget:
                arrays = await open_split(guard, split, name=filespec)
        except TimeoutError as exc:
            await close_store(raw)
            if not budget.expired():
                raise
            raise TransientStorageError(
                f"{redact_url(filespec)}/{split}: opening the dataset took longer than "
                f"RetryPolicy.deadline_s={retry.deadline_s:g} s"
            ) from exc
        except AsyncflatError as exc:
            await close_store(raw)
            if not carries_secret(exc, secrets):
                raise
            raise scrubbed(exc, filespec, secrets) from None
        except BaseException:
            await close_store(raw)
            raise
        local = local_root(raw) if store_wrapper is None else None
        source = cls(arrays, io, raw, guard=guard, local=local)
        guard.check_blosc_frames(blosc_frame_prefixes(arrays))
        return source

    async def read_tokens(self, start: int, stop: int) -> np.ndarray:
        data = await self._read(self._arrays.encoded_tokens, "encoded_tokens", start, stop)
        self.io.bytes_decoded += data.nbytes
        return data

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray:
        return await self._read(self._arrays.seq_starts, "seq_starts", start, stop)

    async def read_into(self, start: int, stop: int, targets: Targets, writer: UnitWriter) -> None:
        chunk_id = start // self.token_chunk
        if self._reads_blosc_ranges(targets):
            if await self._read_range_into(chunk_id, targets, writer) is not None:
                return
        await self._read_into(chunk_id, start, stop, targets, writer)

    async def _read_into(
        self, chunk_id: int, start: int, stop: int, targets: Targets, writer: UnitWriter
    ) -> None:
        lo = chunk_id * self.token_chunk
        if self._codec == "raw" and not self._checksum:  # fetch just the bytes we use, uncached
            frame = await self._read_frame(chunk_id, (start - lo, stop - lo))
        elif self._codec is not None:  # the whole object (a Blosc frame, or checksummed)
            frame = await self._chunks.get(chunk_id, lambda: self._read_frame(chunk_id))
        else:  # zarr decodes the whole chunk once for every fill that needs it; we copy
            frame = await self._chunks.get(chunk_id, lambda: self._decoded_chunk(chunk_id))

        def fill_targets() -> None:
            for first_item, out in targets:
                self._decode(frame, first_item, out)

        try:
            wrote = await writer.write(fill_targets)
        except AsyncflatError:
            # Bad bytes must not stay cached for the fills that come after: fetch them afresh.
            self._chunks.forget(chunk_id, frame)
            raise
        if wrote and self._codec is not None:
            self.io.bytes_decoded += sum(out.nbytes for _, out in targets)

    async def _read_range_into(
        self, chunk_id: int, targets: Targets, writer: UnitWriter
    ) -> bool | None:
        """Read just the compressed blocks of ``targets`` from chunk ``chunk_id`` of a local
        store and decode them into place, both in one job on the CPU pool; None when the frame's
        layout is one the fast path does not read (then the whole object is read and zarr
        decodes it), else whether the unit was written (not: its fill was dropped).

        One job, not a read and then a decode: each thread hop wakes a pool thread and then the
        loop, and each wake-up takes the GIL from whoever holds it. With the trainer's thread
        among them, a GIL hand-over cost ~0.4 ms on a sandboxed 13-core host.
        """
        key = self._chunk_key(chunk_id)
        first = min(first_item for first_item, _ in targets)
        end = max(first_item + len(out) for first_item, out in targets)
        base = chunk_id * self.token_chunk
        tokens = f"{base + first}:{base + end}"
        read_done = False  # in the latest attempt: a decode error names its chunk itself

        async def use(layout: _blosc.FrameLayout) -> bool:
            nonlocal read_done
            read_done = False
            lo, hi = layout.items_range(first, end - first)
            chunk, _, read = self._range_read(key, layout, lo, hi)
            assert read is not None  # ranges of fills are read from local stores only

            def read_and_decode() -> None:
                nonlocal read_done
                read()
                read_done = True
                for first_item, out in targets:
                    self._decode(chunk, first_item, out)

            wrote = await writer.write(read_and_decode)
            if wrote:
                self.io.requests += 1
                self.io.bytes_read += hi - lo
                self.io.bytes_decoded += sum(out.nbytes for _, out in targets)
            return wrote

        try:
            try:
                return await self._with_layout(key, use)
            except _blosc.Unsupported:
                return None
        except _blosc.BloscError as exc:
            where = f"{self.name} encoded_tokens[{tokens}]: chunk object {key}"
            raise CorruptChunkError(f"{where}: {exc}") from exc
        except AsyncflatError as exc:  # a truncated or replaced object: name the token range
            if read_done:
                raise  # the bytes arrived and do not decode: the error names the chunk object
            raise type(exc)(f"{self.name} encoded_tokens[{tokens}]: {exc}") from exc

    def _reads_blosc_ranges(self, targets: Targets) -> bool:
        """Whether a fill's unit reads just the Blosc blocks of its targets: on a local store,
        from a chunk of which it needs at most half (seqax's layout: a 512K-token read block of a
        4M-token chunk). The whole frame would be 8x the bytes read and held in memory; a range
        costs no extra round trip there (the frame's layout is cached per chunk)."""
        if self._local_root is None or self._codec != "blosc" or self._checksum:
            return False
        return 2 * sum(len(out) for _, out in targets) <= self.token_chunk

    async def _with_layout(self, key: str, use: Callable[[_blosc.FrameLayout], Awaitable[T]]) -> T:
        """``use(layout)`` with object ``key``'s Blosc layout (header and block table, cached
        per chunk). Raises Unsupported for a frame the fast path does not read.

        A failure forgets the layout (parsed from bad bytes, or describing another object), so
        the next read takes it afresh. A cached one may describe an object replaced since (a
        repair, a rewrite in place): where ``use`` finds bad or changed bytes through it, the
        layout is read again and ``use`` tried once more."""
        while True:
            cached = key in self._layouts
            layout = await self._layouts.get(key, lambda: self._read_layout(key))
            try:
                return await use(layout)
            except (_blosc.BloscError, CorruptChunkError):
                self._layouts.forget(key, layout)
                if not cached:
                    raise
            except AsyncflatError:
                self._layouts.forget(key, layout)
                raise

    async def _decoded_chunk(self, chunk_id: int) -> Frame:
        lo = chunk_id * self.token_chunk
        hi = min(lo + self.token_chunk, self.token_count)
        data = await self.read_tokens(lo, hi)
        return Frame(np.ascontiguousarray(data, "<u4").view(np.uint8), 0, self._chunk_key(chunk_id))

    # -- direct chunk access (the fast path; see asyncflat/storage/blosc.py) --------------------

    def _chunk_key(self, chunk_id: int) -> str:
        return _object_key(self._arrays.encoded_tokens, chunk_id)

    async def _read_range(self, key: str, lo: int, hi: int) -> bytes:
        if self._local_root is not None and hi - lo <= _PREAD_MAX_BYTES:
            # Row reads of a plain local store: a few KiB from the page cache, read right here.
            cap = self._max_object_bytes(key)
            data = pread(self._local_root, key, lo, hi, name=self.name, max_object_bytes=cap)
            self.io.requests += 1
            self.io.bytes_read += len(data)
            return data
        return (await self._fetch(key, (lo, hi))).tobytes()

    def _range_read(
        self, key: str, layout: _blosc.FrameLayout, lo: int, hi: int
    ) -> tuple[Frame, int, Callable[[], None] | None]:
        """A frame of object ``key`` for its bytes ``[lo, hi)`` (compressed blocks) beside the
        header and block table (:meth:`~asyncflat.storage.blosc.FrameLayout.range_frame`),
        where in it they go, and (for a local store) the read that puts them there straight
        from the file: no copy in between (a fill of seqax's layout has ~16 such ranges of
        ~1 MiB in flight).

        Raises :class:`~asyncflat.storage.blosc.BloscError` when the frame's header claims more
        bytes than any legal encoding of the chunk (nothing is allocated for it)."""
        cap = self._max_object_bytes(key)
        if cap is not None and layout.cbytes > cap:
            raise _blosc.BloscError(
                f"the header claims {layout.cbytes} bytes, more than any legal encoding of the "
                f"chunk ({cap} bytes)"
            )
        frame, at = layout.range_frame(lo, hi)
        chunk = Frame(frame, 0, key, blosc=True, nbytes=self._chunk_nbytes)
        if self._local_root is None:
            return chunk, at, None
        read = functools.partial(
            pread_into,
            self._local_root,
            key,
            lo,
            memoryview(frame[at : at + hi - lo]),  # type: ignore[arg-type]  # numpy buffers
            name=self.name,
            max_object_bytes=cap,
            # A layout cached from an object since replaced would read the wrong bytes,
            # silently where it describes an uncompressed frame: the size tells most apart,
            # the header and block table the rest (another encoding of the same size).
            expect_size=layout.cbytes,
            expect_prefix=layout.prefix,
        )
        return chunk, at, read

    async def _blocks_frame(self, key: str, layout: _blosc.FrameLayout, lo: int, hi: int) -> Frame:
        """A load's rows: the frame of object ``key`` holding its bytes ``[lo, hi)``, read on
        the loop when small (a few KiB from the page cache: cheaper than a thread hop), else on
        a thread (a slow or hung mount must not stall the loop, whose timeouts bound every
        read); from a remote store, fetched."""
        chunk, at, read = self._range_read(key, layout, lo, hi)
        if read is not None:
            if hi - lo <= _PREAD_MAX_BYTES:
                read()
            else:
                await asyncio.get_running_loop().run_in_executor(None, read)
            self.io.requests += 1
            self.io.bytes_read += hi - lo
        else:
            data = (await self._fetch(key, (lo, hi)))[: hi - lo]
            if len(data) < hi - lo:  # the frame's buffer is not zeroed: never decode past it
                raise _blosc.BloscError(
                    f"the object ends at byte {lo + len(data)}, its blocks need bytes up to {hi}"
                )
            chunk.data[at : at + hi - lo] = data
        return chunk

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
        loop = asyncio.get_running_loop()
        try:
            if self._checksum or (
                self.remote and self._codec == "blosc" and self._chunk_nbytes <= WHOLE_ROW_CHUNK
            ):
                # Only the whole object can be verified; a small one costs one round trip where
                # its layout and blocks cost two: read it (shared with the fills and other rows).
                frame = await self._chunks.get(chunk_id, lambda: self._read_frame(chunk_id))
                await loop.run_in_executor(None, self._decode, frame, first_item, out)
                return
            if self._codec != "blosc":
                data = await self._read_range(key, first_item * 4, (first_item + len(out)) * 4)
                out[:] = np.frombuffer(data, "<u4")
                return
            try:
                await self._with_layout(
                    key, lambda layout: self._read_blocks_into(key, layout, first_item, out)
                )
            except _blosc.Unsupported:
                # A frame the fast path does not fully understand: zarr's codec, whole object.
                frame = await self._chunks.get(chunk_id, lambda: self._read_frame(chunk_id))
                await loop.run_in_executor(None, self._decode, frame, first_item, out)
        except _blosc.BloscError as exc:
            raise CorruptChunkError(f"{where}: chunk object {key}: {exc}") from exc
        except CorruptChunkError as exc:
            raise CorruptChunkError(f"{where}: {exc}") from exc
        except AsyncflatError as exc:  # name the token range, as _read does
            raise type(exc)(f"{where}: {exc}") from exc

    async def _read_blocks_into(
        self, key: str, layout: _blosc.FrameLayout, first_item: int, out: np.ndarray
    ) -> None:
        """Items ``[first_item, first_item + len(out))`` of object ``key`` decoded from just
        the Blosc blocks that hold them; small spans decode right here on the loop."""
        lo, hi = layout.items_range(first_item, len(out))
        frame = await self._blocks_frame(key, layout, lo, hi)
        if layout.decoded_span(first_item, len(out)) <= INLINE_DECODE_BYTES:
            self._decode(frame, first_item, out)
        else:
            await asyncio.get_running_loop().run_in_executor(
                None, self._decode, frame, first_item, out
            )

    async def _read_layout(self, key: str) -> _blosc.FrameLayout:
        # Chunks of one array share a Blosc block size, so after the first frame the header
        # and the block table come in one request (checked against what the header says).
        prefix = await self._read_range(key, 0, self._layout_prefix)
        layout = _blosc.FrameLayout(prefix, self._chunk_nbytes)
        lo, hi = layout.offsets_range
        if hi > len(prefix):
            prefix += await self._read_range(key, len(prefix), hi)
        if hi > lo:
            layout.offsets = np.frombuffer(prefix[lo:hi], "<i4").copy()
        if layout.nbytes == self.token_chunk * 4:
            self._layout_prefix = hi
        return layout

    async def _read_frame(self, chunk_id: int, items: tuple[int, int] | None = None) -> Frame:
        """The stored bytes of ``encoded_tokens`` chunk ``chunk_id``, bypassing zarr's decoder.

        Blosc chunks are fetched whole (the frame is needed to decode any part of it). An
        uncompressed chunk is fetched as just the byte range of ``items`` (chunk-relative).
        """
        key = self._chunk_key(chunk_id)
        first, request = 0, None
        if self._codec == "raw" and items is not None and not self._checksum:
            first, request = items[0], (items[0] * 4, items[1] * 4)
        try:
            data = await self._fetch(key, request)
        except AsyncflatError as exc:  # name the token range, as _read does
            lo = chunk_id * self.token_chunk
            hi = min(lo + self.token_chunk, self.token_count)
            raise type(exc)(f"{self.name} encoded_tokens[{lo}:{hi}]: {exc}") from exc
        if self._checksum:
            where = f"{self.name} encoded_tokens: chunk object {key}"
            data = await asyncio.get_running_loop().run_in_executor(
                None, without_crc32c, data, where
            )
        return Frame(data, first, key, blosc=self._codec == "blosc", nbytes=self._chunk_nbytes)

    async def _fetch(self, key: str, byte_range: tuple[int, int] | None = None) -> np.ndarray:
        """The bytes (uint8) of object ``key``, or of its ``[lo, hi)``, through the guarded
        store (which refuses a missing, truncated or malformed object)."""
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype

        request = None if byte_range is None else RangeByteRequest(*byte_range)
        store = self._arrays.encoded_tokens.store_path.store
        buffer = await store.get(key, default_buffer_prototype(), request)
        assert buffer is not None  # the guarded store raises for a missing chunk
        return buffer.as_numpy_array().view(np.uint8).reshape(-1)

    def _max_object_bytes(self, key: str) -> int | None:
        """The largest legal encoding of chunk object ``key`` (None: not known)."""
        return self._guard.max_object_bytes(key) if self._guard is not None else None

    def _decode(self, frame: Frame, first_item: int, out: np.ndarray) -> None:
        try:
            frame.decode_into(first_item, out)
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
            if self._guard is not None:
                # The bad bytes may be a cached shard index: re-read it next time, not forever.
                self._guard.forget_indexes()
            raise CorruptChunkError(
                f"{self.name} {array_name}[{start}:{stop}]: {_objects_of(array, start, stop)}: "
                f"chunk bytes do not decode: {type(exc).__name__}: {exc}"
            ) from exc

    async def aclose(self) -> None:
        """Close the store and its filesystem's HTTP sessions (idempotent; on the engine loop)."""
        await self._layouts.aclose()
        await self._chunks.aclose()
        store, self._store = self._store, None
        if store is not None:
            from asyncflat.storage.filesystems import close_store

            await close_store(store)
        self._arrays.encoded_tokens.store_path.store.close()
