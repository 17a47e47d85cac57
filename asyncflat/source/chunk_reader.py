"""What both readers share: chunk objects decoded straight into the engine's buffers.

:class:`ChunkReader` reads ``encoded_tokens`` chunks however their objects are reached (a
:class:`ChunkObjects`: zarr's store, or the files of a plain local split): whole Blosc frames
shared by the fills that need them, ranged reads of uncompressed chunks, crc32c checks, and a
load's few rows. :class:`BlockReader` reads a Blosc frame's blocks by range, through its layout
(header and block table, cached per chunk object).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import numpy as np

from asyncflat.errors import AsyncflatError, CorruptChunkError
from asyncflat.source.protocol import Targets, UnitWriter
from asyncflat.storage import blosc as _blosc
from asyncflat.storage import local_files
from asyncflat.storage.chunks import Frame, split_crc32c
from asyncflat.storage.counters import IOCounters
from asyncflat.storage.recycled import RecycledBytes
from asyncflat.storage.single_flight import SingleFlight

__all__ = [
    "INLINE_DECODE_BYTES",
    "WHOLE_ROW_CHUNK",
    "BlockReader",
    "ChunkObjects",
    "ChunkReader",
    "decode",
]

T = TypeVar("T")

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


class ChunkObjects(Protocol):
    """Where the ``encoded_tokens`` chunk objects of a split are read from."""

    #: Whole objects of a checksummed array come back with their crc32c already verified, in
    #: the job that read them while their bytes were in that core's cache (a plain local
    #: split's files); else the reader verifies it in the job that decodes the chunk.
    verifies_crc32c: bool

    def key(self, chunk_id: int) -> str:
        """The store key of chunk ``chunk_id``."""
        ...

    def max_object_bytes(self, key: str) -> int | None:
        """The largest legal encoding of chunk object ``key`` (None: not known)."""
        ...

    async def fetch(self, key: str, byte_range: tuple[int, int] | None = None) -> np.ndarray:
        """The bytes (uint8) of object ``key``, or of its ``[lo, hi)``: checked, counted."""
        ...


def decode(name: str, frame: Frame, first_item: int, out: np.ndarray) -> None:
    """Items of ``frame`` into ``out``, its crc32c (if any) verified first in the same job; a
    frame that does not decode, or fails its checksum, is a CorruptChunkError."""
    try:
        frame.decode_into(first_item, out)
    except _blosc.BloscError as exc:
        raise CorruptChunkError(
            f"{name} encoded_tokens: chunk object {frame.key} does not decode: {exc}"
        ) from exc
    except CorruptChunkError as exc:  # the checksum: name the dataset too
        raise CorruptChunkError(f"{name} encoded_tokens: {exc}") from exc


class BlockReader:
    """Blosc frames read block range by block range, through their layouts (cached per object).

    ``local_root``: the store is a local directory, whose small ranges are read on the loop and
    larger ones straight into the frame's buffer (no copy in between). ``memory``: where the
    frames of ranges are read (used again; else each is a new allocation).
    """

    def __init__(
        self,
        objects: ChunkObjects,
        *,
        name: str,
        io: IOCounters,
        chunk_nbytes: int,
        local_root: str | None,
        memory: RecycledBytes | None = None,
    ) -> None:
        self._objects = objects
        self._memory = memory
        self._name = name
        self._io = io
        self._chunk_nbytes = chunk_nbytes
        self._local_root = local_root
        #: Blosc frame layouts (header + block table) of chunks read row by row
        self._layouts: SingleFlight[str, _blosc.FrameLayout] = SingleFlight(_LAYOUTS_KEPT)
        self._layout_prefix = 16  # bytes to read for a frame's header (+ table, once known)

    async def with_layout(self, key: str, use: Callable[[_blosc.FrameLayout], Awaitable[T]]) -> T:
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

    async def read_range(self, key: str, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)`` of object ``key``."""
        if self._local_root is not None and hi - lo <= _PREAD_MAX_BYTES:
            # Row reads of a plain local store: a few KiB from the page cache, read right here.
            cap = self._objects.max_object_bytes(key)
            data = local_files.pread(
                self._local_root, key, lo, hi, name=self._name, max_object_bytes=cap
            )
            self._io.requests += 1
            self._io.bytes_read += len(data)
            return data
        return (await self._objects.fetch(key, (lo, hi))).tobytes()

    def range_read(
        self, key: str, layout: _blosc.FrameLayout, lo: int, hi: int
    ) -> tuple[Frame, int, Callable[[], None] | None]:
        """A frame of object ``key`` for its bytes ``[lo, hi)`` (compressed blocks) beside the
        header and block table (:meth:`~asyncflat.storage.blosc.FrameLayout.range_frame`),
        where in it they go, and (for a local store) the read that puts them there straight
        from the file: no copy in between (a fill of seqax's layout has ~16 such ranges of
        ~1 MiB in flight).

        Raises :class:`~asyncflat.storage.blosc.BloscError` when the frame's header claims more
        bytes than any legal encoding of the chunk (nothing is allocated for it)."""
        cap = self._objects.max_object_bytes(key)
        if cap is not None and layout.cbytes > cap:
            raise _blosc.BloscError(
                f"the header claims {layout.cbytes} bytes, more than any legal encoding of the "
                f"chunk ({cap} bytes)"
            )
        frame, at = layout.range_frame(lo, hi, self._memory.take if self._memory else None)
        chunk = Frame(frame, 0, key, blosc=True, nbytes=self._chunk_nbytes)
        if self._local_root is None:
            return chunk, at, None
        read = functools.partial(
            local_files.pread_into,
            self._local_root,
            key,
            lo,
            memoryview(frame[at : at + hi - lo]),  # type: ignore[arg-type]  # numpy buffers
            name=self._name,
            max_object_bytes=cap,
            # A layout cached from an object since replaced would read the wrong bytes,
            # silently where it describes an uncompressed frame: the size tells most apart,
            # the header and block table the rest (another encoding of the same size).
            expect_size=layout.cbytes,
            expect_prefix=layout.prefix,
        )
        return chunk, at, read

    async def read_blocks_into(
        self, key: str, layout: _blosc.FrameLayout, first_item: int, out: np.ndarray
    ) -> None:
        """Items ``[first_item, first_item + len(out))`` of object ``key`` decoded from just
        the Blosc blocks that hold them; small spans decode right here on the loop."""
        lo, hi = layout.items_range(first_item, len(out))
        frame = await self._blocks_frame(key, layout, lo, hi)
        if layout.decoded_span(first_item, len(out)) <= INLINE_DECODE_BYTES:
            decode(self._name, frame, first_item, out)
        else:
            await asyncio.get_running_loop().run_in_executor(
                None, decode, self._name, frame, first_item, out
            )

    async def _blocks_frame(self, key: str, layout: _blosc.FrameLayout, lo: int, hi: int) -> Frame:
        """A load's rows: the frame of object ``key`` holding its bytes ``[lo, hi)``, read on
        the loop when small (a few KiB from the page cache: cheaper than a thread hop), else on
        a thread (a slow or hung mount must not stall the loop, whose timeouts bound every
        read); from a remote store, fetched."""
        chunk, at, read = self.range_read(key, layout, lo, hi)
        if read is not None:
            if hi - lo <= _PREAD_MAX_BYTES:
                read()
            else:
                await asyncio.get_running_loop().run_in_executor(None, read)
            self._io.requests += 1
            self._io.bytes_read += hi - lo
        else:
            data = await self._objects.fetch(key, (lo, hi))
            if len(data) != hi - lo:  # the frame's buffer is not zeroed: never decode past it
                raise _blosc.BloscError(
                    f"asked for the object's bytes [{lo}, {hi}) (its blocks), got {len(data)}"
                )
            chunk.data[at : at + hi - lo] = data
        return chunk

    async def _read_layout(self, key: str) -> _blosc.FrameLayout:
        # Chunks of one array share a Blosc block size, so after the first frame the header
        # and the block table come in one request (checked against what the header says).
        prefix = await self.read_range(key, 0, self._layout_prefix)
        layout = _blosc.FrameLayout(prefix, self._chunk_nbytes)
        lo, hi = layout.offsets_range
        if hi > len(prefix):
            prefix += await self.read_range(key, len(prefix), hi)
        if hi > lo:
            layout.offsets = np.frombuffer(prefix[lo:hi], "<i4").copy()
        if layout.nbytes == self._chunk_nbytes:
            self._layout_prefix = hi
        return layout

    async def aclose(self) -> None:
        """Forget the cached layouts (idempotent)."""
        await self._layouts.aclose()


class ChunkReader:
    """``encoded_tokens`` chunks into the engine's buffers, and a load's rows, decoded here
    (``codec`` "blosc" or "raw"; ``checksum``: each object ends with zarr's crc32c, verified
    once per object read, by the job that read it where a thread reads it (see
    :attr:`ChunkObjects.verifies_crc32c`), else by the job that decodes the chunk, before its
    first decode) or, when ``codec`` is None, by ``decoded`` (zarr: the whole chunk, copied).
    ``memory``: where a local store's ranges of Blosc blocks are read (see :class:`BlockReader`)."""

    def __init__(
        self,
        objects: ChunkObjects,
        *,
        name: str,
        io: IOCounters,
        token_count: int,
        token_chunk: int,
        codec: str | None,
        checksum: bool,
        remote: bool,
        local_root: str | None,
        decoded: Callable[[int], Awaitable[Frame]] | None = None,
        memory: RecycledBytes | None = None,
    ) -> None:
        self._objects = objects
        self._name, self._io = name, io
        self._token_count, self._token_chunk = token_count, token_chunk
        self._codec, self._checksum = codec, checksum
        self._local_root = local_root  # set for plain local stores: small reads pread
        self._decoded = decoded
        self._chunk_nbytes = token_chunk * 4
        # Rows of a checksummed chunk, or of a small Blosc chunk behind a network, are read with
        # their whole object (see read_items): no cheaper than the fill's unit for that chunk,
        # which a waiting load moves to the front of the fill, so the engine waits for that
        # unit instead of fetching the object twice (on a slow bucket the rows read ahead after
        # a resume re-fetched most of the fill's objects beside it).
        self._whole_rows = checksum or (
            remote and codec == "blosc" and self._chunk_nbytes <= WHOLE_ROW_CHUNK
        )
        #: ``read_items`` fetches only the bytes holding the items
        self.partial_reads = codec is not None and not self._whole_rows
        self._chunks: SingleFlight[int, Frame] = SingleFlight(_CHUNKS_KEPT)
        self._blocks = BlockReader(
            objects,
            name=name,
            io=io,
            chunk_nbytes=self._chunk_nbytes,
            local_root=local_root,
            memory=memory,
        )

    async def read_into(self, start: int, stop: int, targets: Targets, writer: UnitWriter) -> None:
        """Tokens of ``[start, stop)`` (inside one chunk) into ``targets`` through ``writer``."""
        chunk_id = start // self._token_chunk
        if self._reads_blosc_ranges(targets):
            if await self._read_range_into(chunk_id, targets, writer) is not None:
                return
        lo = chunk_id * self._token_chunk

        async def write(frame: Frame) -> bool:
            def fill_targets() -> None:
                for first_item, out in targets:
                    decode(self._name, frame, first_item, out)

            return await writer.write(fill_targets)

        if self._codec == "raw" and not self._checksum:  # fetch just the bytes we use, uncached
            wrote = await write(await self._read_frame(chunk_id, (start - lo, stop - lo)))
        else:  # the whole object (a Blosc frame, or checksummed), or zarr's decoded chunk
            wrote = await self._with_frame(chunk_id, write)
        if wrote and self._codec is not None:
            self._io.bytes_decoded += sum(out.nbytes for _, out in targets)

    async def _with_frame(self, chunk_id: int, use: Callable[[Frame], Awaitable[T]]) -> T:
        """``use(frame)`` with the whole frame of chunk ``chunk_id``, shared by the fills and
        rows that need it (zarr decodes it once when this reader has no codec).

        Bad bytes must not stay cached for the reads that come after: a failure forgets the
        frame. A frame taken from the cache may have been read before its object was repaired
        or replaced (and never decoded, its fill dropped): where it fails its checksum or its
        decode, it is read afresh and ``use`` tried once more."""
        if self._codec is not None:
            read: Callable[[], Awaitable[Frame]] = lambda: self._read_frame(chunk_id)  # noqa: E731
        else:
            assert self._decoded is not None, "a reader without a codec decodes through zarr"
            decoded = self._decoded
            read = lambda: decoded(chunk_id)  # noqa: E731
        for attempt in range(2):
            cached = chunk_id in self._chunks
            frame = await self._chunks.get(chunk_id, read)
            try:
                return await use(frame)
            except CorruptChunkError:
                self._chunks.forget(chunk_id, frame)
                if not cached or attempt:
                    raise
            except AsyncflatError:
                self._chunks.forget(chunk_id, frame)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

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
        key = self._objects.key(chunk_id)
        first = min(first_item for first_item, _ in targets)
        end = max(first_item + len(out) for first_item, out in targets)
        base = chunk_id * self._token_chunk
        tokens = f"{base + first}:{base + end}"
        read_done = False  # in the latest attempt: a decode error names its chunk itself

        async def use(layout: _blosc.FrameLayout) -> bool:
            nonlocal read_done
            read_done = False
            lo, hi = layout.items_range(first, end - first)
            chunk, _, read = self._blocks.range_read(key, layout, lo, hi)
            assert read is not None  # ranges of fills are read from local stores only

            def read_and_decode() -> None:
                nonlocal read_done
                read()
                read_done = True
                for first_item, out in targets:
                    decode(self._name, chunk, first_item, out)

            wrote = await writer.write(read_and_decode)
            if wrote:
                self._io.requests += 1
                self._io.bytes_read += hi - lo
                self._io.bytes_decoded += sum(out.nbytes for _, out in targets)
            return wrote

        try:
            try:
                return await self._blocks.with_layout(key, use)
            except _blosc.Unsupported:
                return None
        except _blosc.BloscError as exc:
            where = f"{self._name} encoded_tokens[{tokens}]: chunk object {key}"
            raise CorruptChunkError(f"{where}: {exc}") from exc
        except AsyncflatError as exc:  # a truncated or replaced object: name the token range
            if read_done:
                raise  # the bytes arrived and do not decode: the error names the chunk object
            raise type(exc)(f"{self._name} encoded_tokens[{tokens}]: {exc}") from exc

    def _reads_blosc_ranges(self, targets: Targets) -> bool:
        """Whether a fill's unit reads just the Blosc blocks of its targets: on a local store,
        from a chunk of which it needs at most half (seqax's layout: a 512K-token read block of a
        4M-token chunk). The whole frame would be 8x the bytes read and held in memory; a range
        costs no extra round trip there (the frame's layout is cached per chunk)."""
        if self._local_root is None or self._codec != "blosc" or self._checksum:
            return False
        return 2 * sum(len(out) for _, out in targets) <= self._token_chunk

    async def read_items(self, chunk_id: int, first_item: int, out: np.ndarray) -> None:
        """Chunk-relative items ``[first_item, first_item + len(out))`` into ``out``, fetching
        only the bytes that hold them: a ranged read for an uncompressed chunk; for Blosc, the
        frame's header and block table (cached per chunk) and the compressed blocks in range.

        This is how a load that arrives before its blocks (a resume, a late fill) gets its few
        rows without waiting for whole blocks.
        """
        key = self._objects.key(chunk_id)
        start = chunk_id * self._token_chunk + first_item
        where = f"{self._name} encoded_tokens[{start}:{start + len(out)}]"
        try:
            if self._whole_rows:
                # Only the whole object can be verified; a small one costs one round trip where
                # its layout and blocks cost two: read it (shared with the fills and other rows).
                await self._decode_whole(chunk_id, first_item, out)
                return
            if self._codec != "blosc":
                data = await self._blocks.read_range(
                    key, first_item * 4, (first_item + len(out)) * 4
                )
                out[:] = np.frombuffer(data, "<u4")
                return
            try:
                await self._blocks.with_layout(
                    key, lambda layout: self._blocks.read_blocks_into(key, layout, first_item, out)
                )
            except _blosc.Unsupported:
                # A frame the fast path does not fully understand: zarr's codec, whole object.
                await self._decode_whole(chunk_id, first_item, out)
        except _blosc.BloscError as exc:
            raise CorruptChunkError(f"{where}: chunk object {key}: {exc}") from exc
        except CorruptChunkError as exc:
            raise CorruptChunkError(f"{where}: {exc}") from exc
        except AsyncflatError as exc:  # name the token range, as a zarr read does
            raise type(exc)(f"{where}: {exc}") from exc

    async def _decode_whole(self, chunk_id: int, first_item: int, out: np.ndarray) -> None:
        """Items of chunk ``chunk_id`` from its whole object (shared with the fills)."""
        loop = asyncio.get_running_loop()

        async def use(frame: Frame) -> None:
            await loop.run_in_executor(None, decode, self._name, frame, first_item, out)

        await self._with_frame(chunk_id, use)

    async def _read_frame(self, chunk_id: int, items: tuple[int, int] | None = None) -> Frame:
        """The stored bytes of ``encoded_tokens`` chunk ``chunk_id``, bypassing zarr's decoder.

        Blosc chunks are fetched whole (the frame is needed to decode any part of it). An
        uncompressed chunk is fetched as just the byte range of ``items`` (chunk-relative).
        """
        key = self._objects.key(chunk_id)
        first, request = 0, None
        if self._codec == "raw" and items is not None and not self._checksum:
            first, request = items[0], (items[0] * 4, items[1] * 4)
        try:
            data = await self._objects.fetch(key, request)
        except AsyncflatError as exc:  # name the token range, as a zarr read does
            lo = chunk_id * self._token_chunk
            hi = min(lo + self._token_chunk, self._token_count)
            raise type(exc)(f"{self._name} encoded_tokens[{lo}:{hi}]: {exc}") from exc
        stored = None
        if self._checksum:
            # Verified by the frame's first decode, in the same job on the CPU pool (no thread
            # hop of its own, no pass over the bytes before the decode can start), unless the
            # job that read the object verified it already.
            where = f"{self._name} encoded_tokens: chunk object {key}"
            data, stored = split_crc32c(data, where)
            if self._objects.verifies_crc32c:
                stored = None
        return Frame(
            data,
            first,
            key,
            blosc=self._codec == "blosc",
            nbytes=self._chunk_nbytes,
            crc32c=stored,
        )

    async def aclose(self) -> None:
        """Forget cached frames and layouts (idempotent)."""
        await self._blocks.aclose()
        await self._chunks.aclose()
