"""One split of a flat-tokens store opened through zarr and checked against the format.

:func:`open_split` runs on the library's own event loop, so it uses only
``zarr.api.asynchronous``: zarr's sync API would block that loop while it waits on zarr's.
zarr is imported there, not with this module: encoding and decoding (:mod:`.codec`) never need it.
The layout itself is described in :mod:`asyncflat.format.codec`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import operator
from collections.abc import Awaitable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast, runtime_checkable

import numpy as np

from asyncflat.errors import (
    AsyncflatError,
    ConfigError,
    CorruptChunkError,
    DatasetFormatError,
    StorageError,
    carries_secret,
    install_log_redaction,
    redact,
)
from asyncflat.format.codec import MANY_CHUNKS, MIN_CHUNK_ELEMENTS, SPLITS, TOKEN_ID_LIMIT

if TYPE_CHECKING:
    import zarr
    from zarr.abc.store import Store

__all__ = ["SplitArrays", "StoreChecks", "metadata_keys", "open_split"]

_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------
# Opening a split
# --------------------------------------------------------------------------------------------


@runtime_checkable
class StoreChecks(Protocol):
    """What :func:`open_split` needs of its store beside zarr's interface: the guarded store's
    (:class:`asyncflat.storage.guarded.GuardedStore`) metadata prefetch and chunk checks."""

    def prefetching(
        self, keys: Iterable[str]
    ) -> AbstractContextManager[dict[str, asyncio.Future[Any]]]: ...

    def gate_arrays(self, arrays: Iterable[Any]) -> None: ...


@dataclasses.dataclass(frozen=True)
class SplitArrays:
    """One validated split of a flat-tokens store, with what a reader needs to plan its reads.

    ``token_chunk`` is the read granularity of ``encoded_tokens`` (a slice decodes whole chunks
    of this many tokens; for a sharded zarr-3 array, the inner chunk). ``tokens_per_object`` is
    how many tokens one stored object holds (the chunk, or the shard), which sets how many
    requests a range costs on an object store.
    """

    name: str  #: the store's display name and the split, e.g. ``gs://b/data.zarr/train``
    split: str
    encoded_tokens: zarr.AsyncArray[Any]
    seq_starts: zarr.AsyncArray[Any]
    max_token_id: int
    token_count: int
    sequence_count: int
    zarr_format: int
    token_chunk: int
    tokens_per_object: int


async def open_split(store: Store, split: str, *, name: str) -> SplitArrays:
    """Open ``split`` of the flat-tokens dataset in ``store`` and validate it cheaply.

    Reads metadata and just the first and last entries of ``seq_starts`` (no scan), so opening
    a multi-terabyte store costs a handful of small requests. ``name`` is how the store is shown
    in error messages (a path or URL). Zarr format 2 and 3 are detected automatically.

    ``store`` is a guarded store (:func:`asyncflat.storage.guarded.guard_store`, or the
    reader's own): every chunk byte is checked before a decoder sees it, whoever opens the
    split, and its ``prefetching`` requests the metadata documents at once. Any other store is
    a TypeError.

    Raises :class:`ConfigError` for a split other than ``"train"``/``"validation"``,
    :class:`DatasetFormatError` (or its subclass :class:`CorruptChunkError` for bytes that do
    not decode) for a store that is not a valid split, and :class:`StorageError` when the store
    itself fails with an I/O error; the message names the store, the split or array, and what
    was expected versus found.
    """
    install_log_redaction()
    name = redact(name)
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, got {split!r} (store {name})")
    where = f"{name.rstrip('/')}/{split}"
    if not isinstance(store, StoreChecks):  # a store whose bytes nobody checks before decoding
        raise TypeError(
            f"open_split reads through a guarded store (asyncflat.storage.guarded.guard_store), "
            f"got {type(store).__name__}"
        )
    # Every metadata object either format may hold, requested at once: zarr's walk down the
    # hierarchy (and its probes of the other format) is then served without a round trip.
    with store.prefetching(metadata_keys(split)) as fetched:
        return await _open_split(store, split, name, where, fetched)


def metadata_keys(split: str) -> list[str]:
    """The metadata objects opening ``split`` reads, in format 3 and format 2."""
    nodes = [split, f"{split}/encoded_tokens", f"{split}/seq_starts"]
    return [
        "zarr.json",
        *(f"{node}/zarr.json" for node in nodes),
        ".zgroup",
        ".zattrs",
        *(f"{node}/{name}" for node in nodes for name in (".zarray", ".zgroup", ".zattrs")),
    ]


async def _open_split(
    store: Store, split: str, name: str, where: str, fetched: dict[str, Any]
) -> SplitArrays:
    import zarr
    import zarr.api.asynchronous as zarr_async

    zarr_format = await _format_of(fetched)
    root = await translate_errors(
        zarr_async.open_group(
            store=store,
            mode="r",
            zarr_format=zarr_format,
            use_consolidated=False if zarr_format else None,
        ),
        name,
        "flat-tokens zarr group",
    )
    group = await translate_errors(root.getitem(split), where, "split group")
    if not isinstance(group, zarr.AsyncGroup):
        raise DatasetFormatError(f"{where}: expected a zarr group, found an array")

    # Both arrays' metadata at once (one round trip on an object store); a failure is reported
    # for encoded_tokens first whatever finished first, so the message is deterministic.
    encoded_tokens, seq_starts = await _gather_in_order(
        _open_array(group, where, "encoded_tokens", np.dtype(np.uint32)),
        _open_array(group, where, "seq_starts", np.dtype(np.uint64)),
    )

    for array, key in ((encoded_tokens, "encoded_tokens"), (seq_starts, "seq_starts")):
        _check_chunking(array, f"{where}/{key}")
    # From here on, chunk objects of both arrays are checked against their metadata (sizes,
    # Blosc headers and block tables, decoded sizes) before zarr decodes any of them.
    cast(StoreChecks, store).gate_arrays((encoded_tokens, seq_starts))

    if "max_token_id" not in group.attrs:
        raise DatasetFormatError(f"{where}: missing group attribute 'max_token_id'")
    max_token_id = _check_max_token_id(group.attrs["max_token_id"], where)

    token_count = int(encoded_tokens.shape[0])
    entries = int(seq_starts.shape[0])
    if entries < 1:
        raise DatasetFormatError(
            f"{where}/seq_starts: expected at least 1 entry (sequence_count + 1), got 0"
        )

    async def entry(i: int) -> Any:
        # zarr's coroutine is made inside the task: one made up front and handed to a task
        # cancelled before it starts (a deadline, a close) would never be awaited.
        return await translate_errors(
            seq_starts.getitem(i), f"{where}/seq_starts", f"entry {i}", read=True
        )

    ends = await _gather_in_order(*(entry(i) for i in sorted({0, entries - 1})))
    _check_ends(int(ends[0]), int(ends[-1]), token_count, where)

    token_chunk = int(encoded_tokens.chunks[0])
    shards = encoded_tokens.shards
    return SplitArrays(
        name=where,
        split=split,
        encoded_tokens=encoded_tokens,
        seq_starts=seq_starts,
        max_token_id=max_token_id,
        token_count=token_count,
        sequence_count=entries - 1,
        zarr_format=int(encoded_tokens.metadata.zarr_format),
        token_chunk=token_chunk,
        tokens_per_object=int(shards[0]) if shards else token_chunk,
    )


async def _format_of(fetched: dict[str, Any]) -> Literal[2, 3] | None:
    """The zarr format, known from the first round trip: no probe of .zmetadata, no second guess."""
    with contextlib.suppress(Exception):  # a failed read is reported by zarr's own open
        if await asyncio.shield(fetched["zarr.json"]) is not None:
            return 3
        if await asyncio.shield(fetched[".zgroup"]) is not None:
            return 2
    return None


def _check_ends(first: int, last: int, token_count: int, where: str) -> None:
    if first != 0:
        raise DatasetFormatError(f"{where}/seq_starts: expected seq_starts[0] == 0, got {first}")
    if last != token_count:
        raise DatasetFormatError(
            f"{where}/seq_starts: expected seq_starts[-1] == len(encoded_tokens) == {token_count}, "
            f"got {last}"
        )


def _check_chunking(array: Any, where: str) -> None:
    chunk = int(array.chunks[0])
    length = int(array.shape[0])
    if length == 0:
        return
    count = -(-length // chunk) if chunk > 0 else 0
    if chunk < 1:
        raise DatasetFormatError(f"{where}: chunk size must be >= 1, got {chunk}")
    if count > MANY_CHUNKS and chunk < MIN_CHUNK_ELEMENTS:
        raise DatasetFormatError(
            f"{where}: {count} chunks of {chunk} elements: an array of more than {MANY_CHUNKS} "
            f"chunks needs chunks of at least {MIN_CHUNK_ELEMENTS} elements (reads cost one "
            "object per chunk); rewrite it with larger chunks"
        )


async def _gather_in_order(*awaitables: Awaitable[Any]) -> list[Any]:
    """Run concurrently; if any failed, raise the first failure in argument order."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def _open_array(
    group: zarr.AsyncGroup, where: str, key: str, dtype: np.dtype
) -> zarr.AsyncArray[Any]:
    import zarr

    arr = await translate_errors(group.getitem(key), f"{where}/{key}", "array")
    if not isinstance(arr, zarr.AsyncArray):
        raise DatasetFormatError(f"{where}/{key}: expected a zarr array, found a group")
    if len(arr.shape) != 1:
        raise DatasetFormatError(
            f"{where}/{key}: expected a 1-D array, got {len(arr.shape)}-D shape {tuple(arr.shape)}"
        )
    # np.dtype(">u4") != uint32 on purpose: readers hand raw little-endian buffers around.
    actual = np.dtype(arr.dtype)
    if actual != dtype:
        raise DatasetFormatError(f"{where}/{key}: expected dtype {dtype}, got {actual}")
    return arr


def _check_max_token_id(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise DatasetFormatError(
            f"{where}: attribute max_token_id must be an integer, got {value!r}"
        )
    try:
        as_int = operator.index(value)
    except TypeError:
        raise DatasetFormatError(
            f"{where}: attribute max_token_id must be an integer, "
            f"got {type(value).__name__} {value!r}"
        ) from None
    if not 0 <= as_int < TOKEN_ID_LIMIT:
        raise DatasetFormatError(
            f"{where}: attribute max_token_id must be in [0, 2**31), got {as_int}"
        )
    return as_int


async def translate_errors(
    awaitable: Awaitable[_T], where: str, what: str, *, read: bool = False
) -> _T:
    """Await zarr opening (or, with ``read``, reading) ``what`` at ``where``, translating its
    failures into asyncflat's errors with the cause attached.

    Only ``Exception`` is caught: ``CancelledError`` and ``KeyboardInterrupt`` are
    ``BaseException`` and pass through untouched, as do asyncflat's own errors (for example a
    fault-injecting store raising :class:`TransientStorageError`).
    """
    try:
        return await awaitable
    except CorruptChunkError as exc:
        if not read:
            raise
        raise CorruptChunkError(
            f"{where}: reading {what} failed, its chunk does not decode: {exc}"
        ) from exc
    except AsyncflatError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised below, chained unless it holds a secret
        # A raw exception may show the store's URL with its credentials: redacted, and never
        # chained into a traceback when it does.
        cause = None if carries_secret(exc) else exc
        detail = f"{type(exc).__name__}: {redact(str(exc))}"
        if isinstance(exc, (KeyError, FileNotFoundError)):
            # zarr's Group/ArrayNotFoundError subclass FileNotFoundError; a missing child is
            # KeyError.
            raise DatasetFormatError(f"{where}: missing {what} ({detail})") from cause
        if isinstance(exc, OSError):
            raise StorageError(
                f"{where}: storage error {'reading' if read else 'opening'} {what}: {detail}"
            ) from cause
        if read:
            raise CorruptChunkError(
                f"{where}: reading {what} failed, its chunk does not decode: {detail}"
            ) from cause
        raise DatasetFormatError(f"{where}: invalid {what} metadata: {detail}") from cause
