"""Async reads of token ranges from a flat-tokens split, on local disk or behind any fsspec URL.

The engine needs only :class:`TokenSource`: sizes, and two coroutines reading
``encoded_tokens[a:b]`` and ``seq_starts[a:b]``. Tests inject fakes with latency and faults.

:class:`ZarrTokenSource` is the real one. It opens the store *on the engine's loop* (aiohttp
sessions are bound to the loop that made them) and reads through zarr's async API, whose codec
pipeline decodes on the loop's default executor (the engine's CPU pool), never on the loop.
Every object request passes through :class:`_GuardedStore`, which bounds concurrency over the
whole source, retries transient failures, counts bytes, refuses silently-missing chunks (zarr
would read them as fill values, i.e. wrong data) and names the object in every error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, Mapping, Protocol

import numpy as np
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from .config import RetryPolicy
from .errors import AsyncflatError, CorruptChunkError, DatasetFormatError, StorageError
from .format import SplitArrays, open_split
from .retry import retrying

__all__ = ["IOCounters", "StoreWrapper", "TokenSource", "ZarrTokenSource", "is_url"]

log = logging.getLogger(__name__)

#: A function the caller may use to wrap the raw store (fault injection, logging).
StoreWrapper = Callable[[Store], Store]

_METADATA_SUFFIXES = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")


@dataclasses.dataclass
class IOCounters:
    """Raw store traffic, for read-amplification figures and the retry count."""

    requests: int = 0
    bytes_read: int = 0
    retries: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0


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


class _GuardedStore(WrapperStore[Store]):
    """Bounded, retried, counted, strict access to the objects of a store."""

    def __init__(
        self,
        store: Store,
        *,
        name: str,
        limiter: asyncio.Semaphore,
        retry: RetryPolicy,
        io: IOCounters,
    ) -> None:
        super().__init__(store)
        self._name, self._limiter, self._retry, self._io = name, limiter, retry, io

    def _with_store(self, store: Store) -> "_GuardedStore":
        return _GuardedStore(store, name=self._name, limiter=self._limiter, retry=self._retry, io=self._io)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        def describe() -> str:
            what = f"{self._name}/{key}"
            return what if byte_range is None else f"{what} {byte_range}"

        async def attempt() -> Buffer | None:
            async with self._limiter:
                self._io.in_flight += 1
                self._io.peak_in_flight = max(self._io.peak_in_flight, self._io.in_flight)
                try:
                    return await self._store.get(key, prototype, byte_range)
                finally:
                    self._io.in_flight -= 1

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
                raise CorruptChunkError(f"{describe()}: chunk object is missing from the store")
            return None
        self._io.bytes_read += len(buffer)
        return buffer

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))


def _make_store(filespec: str, storage_options: Mapping[str, Any] | None) -> Store:
    if is_url(filespec) and not filespec.startswith("file://"):
        return FsspecStore.from_url(filespec, storage_options=dict(storage_options or {}), read_only=True)
    path = filespec.removeprefix("file://")
    if not os.path.isdir(path):
        raise DatasetFormatError(f"{filespec}: no flat-tokens dataset here (not a directory)")
    return LocalStore(path, read_only=True)


class ZarrTokenSource:
    """A :class:`TokenSource` over a zarr store (format 2 or 3, local or fsspec)."""

    def __init__(self, arrays: SplitArrays, io: IOCounters) -> None:
        self._arrays = arrays
        self.io = io
        self.name = arrays.name
        self.token_count = arrays.token_count
        self.sequence_count = arrays.sequence_count
        self.max_token_id = arrays.max_token_id
        self.token_chunk = arrays.token_chunk
        self.zarr_format = arrays.zarr_format

    @classmethod
    async def open(
        cls,
        filespec: str,
        split: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        max_concurrent_requests: int = 16,
        retry: RetryPolicy = RetryPolicy(),
        store_wrapper: StoreWrapper | None = None,
    ) -> "ZarrTokenSource":
        """Open and validate ``split`` of the dataset at ``filespec`` (call on the engine loop)."""
        store = _make_store(filespec, storage_options)
        if store_wrapper is not None:
            store = store_wrapper(store)
        io = IOCounters()
        guarded = _GuardedStore(
            store, name=filespec, limiter=asyncio.Semaphore(max_concurrent_requests), retry=retry, io=io
        )
        arrays = await open_split(guarded, split, name=filespec)
        return cls(arrays, io)

    async def read_tokens(self, start: int, stop: int) -> np.ndarray:
        return await self._read(self._arrays.encoded_tokens, "encoded_tokens", start, stop)

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray:
        return await self._read(self._arrays.seq_starts, "seq_starts", start, stop)

    async def _read(self, array: Any, array_name: str, start: int, stop: int) -> np.ndarray:
        try:
            return np.asarray(await array.getitem(slice(start, stop)))
        except AsyncflatError as exc:
            raise type(exc)(f"{self.name} {array_name}[{start}:{stop}]: {exc}") from exc
        except (RuntimeError, ValueError, TypeError) as exc:
            # Codec failures (blosc, zstd, checksum) on bytes that did arrive: corrupt data.
            raise CorruptChunkError(
                f"{self.name} {array_name}[{start}:{stop}]: chunk bytes do not decode: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    async def aclose(self) -> None:
        self._arrays.encoded_tokens.store_path.store.close()
