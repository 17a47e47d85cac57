"""The reader of any split zarr opens: a zarr store, format 2 or 3, local or any fsspec URL.

:class:`ZarrTokenSource` opens the store *on the engine's loop* (aiohttp sessions are bound to the
loop that made them) and every object request passes through the guarded store
(:mod:`asyncflat.storage.guarded`). Chunks it can decode itself (Blosc, raw) are read by the
shared :class:`~asyncflat.source.chunk_reader.ChunkReader`; zarr decodes the others. This module
does not import zarr at import time: :class:`~asyncflat.source.local_source.LocalTokenSource`,
its sibling over a plain local split, costs a restart no zarr import.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncflat.config import REMOTE_READS_MAX, RetryPolicy, default_reads, redact_url
from asyncflat.errors import (
    AsyncflatError,
    CorruptChunkError,
    TransientStorageError,
    carries_secret,
    install_log_redaction,
    option_secrets,
    scrubbed,
)
from asyncflat.source.chunk_reader import ChunkReader
from asyncflat.source.protocol import StoreWrapper, Targets, UnitWriter
from asyncflat.storage.chunks import Frame, blosc_frame_prefixes, raw_codec
from asyncflat.storage.counters import IOCounters
from asyncflat.storage.limiter import AdaptiveLimiter, demand, pool_size

if TYPE_CHECKING:
    from zarr.abc.store import Store

    from asyncflat.format.split import SplitArrays
    from asyncflat.storage.guarded import GuardedStore

__all__ = ["ZarrTokenSource"]


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


class _ZarrObjects:
    """The ``encoded_tokens`` chunk objects of a zarr array, read through its (guarded) store."""

    verifies_crc32c = False  # the bytes arrive on the loop: verified beside the decode

    def __init__(self, array: Any, guard: GuardedStore | None) -> None:
        self._array = array
        self._guard = guard

    def key(self, chunk_id: int) -> str:
        return _object_key(self._array, chunk_id)

    def max_object_bytes(self, key: str) -> int | None:
        return self._guard.max_object_bytes(key) if self._guard is not None else None

    async def fetch(self, key: str, byte_range: tuple[int, int] | None = None) -> np.ndarray:
        """The bytes (uint8) of object ``key``, or of its ``[lo, hi)``, through the guarded
        store (which refuses a missing, truncated or malformed object)."""
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype

        request = None if byte_range is None else RangeByteRequest(*byte_range)
        buffer = await self._array.store_path.store.get(key, default_buffer_prototype(), request)
        assert buffer is not None  # the guarded store raises for a missing chunk
        return buffer.as_numpy_array().view(np.uint8).reshape(-1)


class ZarrTokenSource:
    """A :class:`~asyncflat.source.protocol.TokenSource` over a zarr store (format 2 or 3,
    local or fsspec)."""

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
        self.remote = False
        if store is not None:
            from asyncflat.storage.filesystems import local_root

            self.remote = local_root(store) is None
        self.io = io
        self.name = arrays.name
        self.token_count = arrays.token_count
        self.sequence_count = arrays.sequence_count
        self.max_token_id = arrays.max_token_id
        self.token_chunk = arrays.token_chunk
        codec, checksum = raw_codec(arrays.encoded_tokens)
        self._reader = ChunkReader(
            _ZarrObjects(arrays.encoded_tokens, guard),
            name=self.name,
            io=io,
            token_count=self.token_count,
            token_chunk=self.token_chunk,
            codec=codec,
            checksum=checksum,
            remote=self.remote,
            local_root=local,
            decoded=self._decoded_chunk,
        )
        self.partial_reads = self._reader.partial_reads

    @classmethod
    async def open(
        cls,
        filespec: str,
        split: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_concurrent_requests: int | None = None,
        retry: RetryPolicy | None = None,
        store_wrapper: StoreWrapper | None = None,
    ) -> ZarrTokenSource:
        """Open and validate ``split`` of the dataset at ``filespec`` (call on the engine loop).

        ``max_concurrent_requests`` None: :func:`~asyncflat.config.default_reads` of its chunks.

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
        io = IOCounters()
        maximum = REMOTE_READS_MAX if max_concurrent_requests is None else max_concurrent_requests
        limiter = AdaptiveLimiter(maximum, io)
        try:
            raw = make_store(
                filespec,
                storage_options,
                timeout_s=retry.attempt_timeout_s,
                max_connections=pool_size(limiter.maximum),
            )
        except Exception as exc:  # noqa: BLE001 - a filesystem constructor, credential exchange
            raise construction_error(exc, filespec, secrets) from (
                None if carries_secret(exc, secrets) else exc
            )
        budget = asyncio.timeout(retry.deadline_s)
        try:  # from here on, whatever fails (the caller's store_wrapper too) closes the store
            timed = bounded(raw, retry.attempt_timeout_s)
            guard = GuardedStore(
                timed if store_wrapper is None else store_wrapper(timed),
                name=filespec,
                limiter=limiter,
                retry=retry,
                io=io,
                secrets=secrets,
            )
            async with budget:
                arrays = await open_split(guard, split, name=filespec)
            local = local_root(raw) if store_wrapper is None else None
            source = cls(arrays, io, raw, guard=guard, local=local)
            if max_concurrent_requests is None:
                limiter.resize(default_reads(token_chunk=source.token_chunk, remote=source.remote))
            guard.check_blosc_frames(blosc_frame_prefixes(arrays))
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
        return source

    async def read_tokens(self, start: int, stop: int) -> np.ndarray:
        data = await self._read(self._arrays.encoded_tokens, "encoded_tokens", start, stop)
        self.io.bytes_decoded += data.nbytes
        return data

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray:
        return await self._read(self._arrays.seq_starts, "seq_starts", start, stop)

    async def read_into(self, start: int, stop: int, targets: Targets, writer: UnitWriter) -> None:
        await self._reader.read_into(start, stop, targets, writer)

    async def read_items(self, chunk_id: int, first_item: int, out: np.ndarray) -> None:
        await self._reader.read_items(chunk_id, first_item, out)

    def demand(self, needed: bool = True) -> AbstractContextManager[None]:
        return demand(needed)

    async def _decoded_chunk(self, chunk_id: int) -> Frame:
        """Chunk ``chunk_id`` decoded by zarr (a codec the reader does not decode itself)."""
        lo = chunk_id * self.token_chunk
        hi = min(lo + self.token_chunk, self.token_count)
        data = await self.read_tokens(lo, hi)
        key = _object_key(self._arrays.encoded_tokens, chunk_id)
        return Frame(np.ascontiguousarray(data, "<u4").view(np.uint8), 0, key)

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
        await self._reader.aclose()
        store, self._store = self._store, None
        if store is not None:
            from asyncflat.storage.filesystems import close_store

            await close_store(store)
        self._arrays.encoded_tokens.store_path.store.close()
