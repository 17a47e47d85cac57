"""The reader of a plain local split, without zarr: a restart's first batch costs only its reads.

:class:`LocalTokenSource` reads a split opened by
:func:`~asyncflat.storage.local_split.parse_local_split` instead of zarr, its chunk objects read
straight from their files (:mod:`asyncflat.storage.local_files`). Everything above the object
reads (partial Blosc decoding, shared whole-chunk reads, crc32c, row reads) is the
:class:`~asyncflat.source.chunk_reader.ChunkReader` that
:class:`~asyncflat.source.zarr_source.ZarrTokenSource` uses too. Every object is checked as the
guarded store checks it: a regular file inside the store, no larger than a legal encoding of its
chunk, refused when missing or truncated, and its bytes checked by the array's
:class:`~asyncflat.storage.gate.ChunkGate` before any decoder.

:meth:`LocalTokenSource.open_plain` answers None for anything it does not recognise (another
layout, a store wrapper, an invalid split): the caller opens it through zarr instead, which
reports what is wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from asyncflat.config import RetryPolicy, redact_url
from asyncflat.errors import AsyncflatError, CorruptChunkError, TransientStorageError
from asyncflat.source.chunk_reader import ChunkReader
from asyncflat.source.protocol import Targets, UnitWriter
from asyncflat.storage import blosc as _blosc
from asyncflat.storage import local_files
from asyncflat.storage.chunks import split_crc32c, without_crc32c
from asyncflat.storage.counters import IOCounters
from asyncflat.storage.gate import ChunkRejected
from asyncflat.storage.local_split import LocalArray, LocalSplit, parse_local_split
from asyncflat.storage.recycled import RecycledBytes, shared

__all__ = ["LocalTokenSource"]

log = logging.getLogger(__name__)


class _LocalObjects:
    """The chunk objects of a plain local split, read from their files on a thread (a slow or
    hung disk must not stall the loop), checked and counted."""

    def __init__(self, split: LocalSplit, name: str, io: IOCounters, memory: RecycledBytes) -> None:
        self._split, self._name, self._io = split, name, io
        self.memory = memory
        # A whole object's crc32c is checked by the thread that read it, right after the read:
        # its bytes are still in that core's cache, where the decode job (another thread) would
        # find them cold (measured: half the cost of the checksum).
        self.verifies_crc32c = True

    def key(self, chunk_id: int) -> str:
        return self._split.encoded_tokens.key(chunk_id)

    def max_object_bytes(self, key: str) -> int | None:
        return self._split.encoded_tokens.gate.max_object_bytes

    async def fetch(self, key: str, byte_range: tuple[int, int] | None = None) -> np.ndarray:
        """Bytes of an ``encoded_tokens`` object: whole and checked, or ``[lo, hi)``."""
        if byte_range is None:
            return await self.whole(key, self._split.encoded_tokens)
        lo, hi = byte_range
        out = np.empty(hi - lo, np.uint8)
        read = functools.partial(
            local_files.pread_into,
            self._split.root,
            key,
            lo,
            memoryview(out),  # type: ignore[arg-type]  # numpy buffers
            name=self._name,
            max_object_bytes=self.max_object_bytes(key),
        )
        await self._counted(lambda: (read(), out)[1])
        return out

    async def whole(self, key: str, array: LocalArray) -> np.ndarray:
        """Object ``key`` of ``array``, whole, checked by its gate before any decoder sees it."""
        return await self._counted(functools.partial(self._read_whole, key, array))

    async def _counted(self, read: Callable[[], np.ndarray]) -> np.ndarray:
        io = self._io
        io.in_flight += 1
        io.peak_in_flight = max(io.peak_in_flight, io.in_flight)
        try:
            data = await asyncio.get_running_loop().run_in_executor(None, read)
        finally:
            io.in_flight -= 1
        io.requests += 1
        io.bytes_read += data.nbytes
        return data

    def _read_whole(self, key: str, array: LocalArray) -> np.ndarray:
        gate = array.gate
        root = self._split.root
        data = local_files.read_object(
            root, key, name=self._name, max_bytes=gate.max_object_bytes, allocate=self.memory.take
        )
        assert data is not None  # missing objects raise
        try:
            gate.check(memoryview(data))  # type: ignore[arg-type]  # numpy buffers
        except ChunkRejected as exc:
            raise CorruptChunkError(
                f"{os.path.join(root, key)} (whole object; dataset {self._name}): "
                f"chunk object of {gate.array} does not decode (refused before decoding: {exc})"
            ) from None
        if array.checksum:  # verified here, while the bytes just read are in cache
            where = f"chunk object {os.path.join(root, key)}"  # the caller names the rest
            without_crc32c(data, where)
        return data


class LocalTokenSource:
    """A :class:`~asyncflat.source.protocol.TokenSource` over a plain local split, read without
    zarr."""

    def __init__(self, split: LocalSplit, name: str) -> None:
        self._split = split
        tokens, starts = split.encoded_tokens, split.seq_starts
        self.io = IOCounters()
        self.name = f"{redact_url(name).rstrip('/')}/{split.split}"
        self.token_count = tokens.length
        self.sequence_count = starts.length - 1
        self.max_token_id = split.max_token_id
        self.token_chunk = tokens.chunk
        self.remote = False
        # What chunk objects and their ranges are read into, used again (by every loader of
        # the process): a fresh allocation's page faults were most of a first fill's reads
        # under a sandboxed kernel (see :mod:`asyncflat.storage.recycled`).
        self.memory = shared(tokens.gate.max_object_bytes)
        self._left_memory = False
        self._objects = _LocalObjects(split, self.name, self.io, self.memory)
        self._reader = ChunkReader(
            self._objects,
            name=self.name,
            io=self.io,
            token_count=self.token_count,
            token_chunk=self.token_chunk,
            codec=tokens.codec,
            checksum=tokens.checksum,
            remote=False,
            local_root=split.root,
            memory=self.memory,
        )
        self.partial_reads = self._reader.partial_reads

    @classmethod
    async def open_plain(
        cls, filespec: str, split: str, *, retry: RetryPolicy | None = None
    ) -> LocalTokenSource | None:
        """Open ``split`` of the local directory ``filespec`` without zarr, or None when it is
        not a plain, valid split (then open it with :meth:`ZarrTokenSource.open`).

        Bounded in time by ``retry.deadline_s``, as zarr's open is: a hung mount fails it.
        """
        retry = retry or RetryPolicy()
        root = os.fspath(filespec).rstrip(os.sep) or os.sep
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(retry.deadline_s) as budget:
                parsed = await loop.run_in_executor(None, parse_local_split, root, split, root)
                if parsed is None:
                    return None
                source = cls(parsed, root)
                try:
                    first, last = await source._ends()
                except AsyncflatError as exc:  # zarr's open reports it, with its messages
                    log.debug("%s: opening through zarr: %s", source.name, exc)
                    source._leave_memory()
                    return None
                except BaseException:  # a timeout, a cancel: no source, no claim on the memory
                    source._leave_memory()
                    raise
        except TimeoutError as exc:
            if not budget.expired():
                raise
            raise TransientStorageError(
                f"{redact_url(root)}/{split}: opening the dataset took longer than "
                f"RetryPolicy.deadline_s={retry.deadline_s:g} s"
            ) from exc
        if first != 0 or last != source.token_count:
            source._leave_memory()
            return None  # zarr's open names the bad entry
        return source

    async def _ends(self) -> tuple[int, int]:
        """``seq_starts[0]`` and ``seq_starts[-1]`` (what zarr's open checks too)."""
        count = self._split.seq_starts.length
        first, last = await asyncio.gather(
            self.read_seq_starts(0, 1), self.read_seq_starts(count - 1, count)
        )
        return int(first[0]), int(last[0])

    # -- reads ---------------------------------------------------------------------------------

    async def read_tokens(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(max(stop - start, 0), np.uint32)
        chunk = self.token_chunk
        reads = []
        for chunk_id in range(start // chunk, -(-stop // chunk)):
            lo, hi = max(start, chunk_id * chunk), min(stop, (chunk_id + 1) * chunk)
            reads.append(
                self.read_items(chunk_id, lo - chunk_id * chunk, out[lo - start : hi - start])
            )
        await asyncio.gather(*reads)
        self.io.bytes_decoded += out.nbytes
        return out

    async def read_into(self, start: int, stop: int, targets: Targets, writer: UnitWriter) -> None:
        await self._reader.read_into(start, stop, targets, writer)

    async def read_items(self, chunk_id: int, first_item: int, out: np.ndarray) -> None:
        await self._reader.read_items(chunk_id, first_item, out)

    def demand(self, needed: bool = True) -> AbstractContextManager[None]:
        """Nothing to mark: no limiter queues this reader's requests (each starts at once)."""
        return contextlib.nullcontext()

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray:
        array = self._split.seq_starts
        out = np.empty(max(stop - start, 0), np.uint64)
        chunk = array.chunk

        async def chunk_into(chunk_id: int) -> None:
            lo, hi = max(start, chunk_id * chunk), min(stop, (chunk_id + 1) * chunk)
            key = array.key(chunk_id)
            where = f"{self.name} seq_starts[{lo}:{hi}]"
            try:
                data = await self._objects.whole(key, array)
                values = await asyncio.get_running_loop().run_in_executor(
                    None, self._decode_starts, data, array, key
                )
            except AsyncflatError as exc:
                raise type(exc)(f"{where}: {exc}") from exc
            out[lo - start : hi - start] = values[lo - chunk_id * chunk : hi - chunk_id * chunk]

        if stop > start:
            await asyncio.gather(*map(chunk_into, range(start // chunk, -(-stop // chunk))))
        return out

    def _decode_starts(self, data: np.ndarray, array: LocalArray, key: str) -> np.ndarray:
        """A whole ``seq_starts`` chunk object, decoded (on a thread)."""
        where = f"{self.name} seq_starts: chunk object {key}"
        if array.checksum:  # verified by the read (_LocalObjects.whole)
            data, _ = split_crc32c(data, where)
        values = np.empty(array.chunk, "<u8")
        try:
            if array.codec == "blosc":
                _blosc.decode_into(data, 0, values, array.chunk_nbytes)
            elif data.nbytes != array.chunk_nbytes:
                raise _blosc.BloscError(
                    f"uncompressed chunk has {data.nbytes} bytes, expected {array.chunk_nbytes}"
                )
            else:
                values[:] = data.view("<u8")
        except _blosc.BloscError as exc:
            raise CorruptChunkError(f"{where} does not decode: {exc}") from exc
        if array.delta:  # seqax's Delta(dtype="<i8", astype="<i8"): stored as differences
            values = np.cumsum(values.view("<i8"), dtype="<i8").view("<u8")
        return values

    async def aclose(self) -> None:
        """Forget cached frames, layouts and the free read memory (no store to close;
        idempotent): a closed loader its caller still refers to holds none of them."""
        await self._reader.aclose()
        self._leave_memory()

    def _leave_memory(self) -> None:
        if not self._left_memory:
            self._left_memory = True
            self.memory.leave()
