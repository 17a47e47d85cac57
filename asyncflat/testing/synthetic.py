"""A flat-tokens dataset of any size that is generated, not stored: an async fsspec filesystem.

:class:`SyntheticFileSystem` serves the zarr metadata and every chunk of a flat-tokens dataset
(:mod:`asyncflat.testing.corpus` says which sequences and tokens), computing a chunk when it is
requested, encoded with the codecs and checksums :class:`~asyncflat.writer.FlatTokensWriter`
writes by default: its bytes are the bytes the writer would store for the same sequences. Use
it to try a configuration at the scale of your corpus (10^14 tokens open as fast as 10^9) and
over a modelled network, before the corpus exists::

    import asyncflat.testing  # registers synthetic://

    params = FlatTokensParams(
        "synthetic://corpus", streams=8, read_blocks_per_shuffle_buffer=16,
        sequences_per_read_block=512, seed=0, sequence_packing=True,
        storage_options={"tokens": 10**13, "chunk_tokens": 1 << 22, "latency_s": 0.05,
                         "total_bandwidth": 2e9, "counts": counts},
    )

The URL's path is a label (``synthetic://`` or ``synthetic://<name>``); the dataset is what the
parameters (``storage_options``) say. ``counts`` (a :class:`SyntheticCounts`) collects the
requests and bytes of every filesystem made with it: the loader makes its own instance, so pass
one in to read them afterwards.

The network model (each off by default), applied with ``asyncio.sleep`` per request: a request
waits ``latency_s`` (time to first byte), then its bytes flow at ``connection_bandwidth``
(bytes/s per request) and share ``total_bandwidth`` (bytes/s over all requests of the
filesystem, first come first served); it ends when both its own transfer and its turn on the
shared link are done. A read of an absent object waits ``latency_s`` too (a bucket's 404 is a
round trip). A chunk's generation (tens of ms for 4M tokens, in a worker thread) comes
on top: the model describes the network, not the generator.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import inspect
import logging
import math
import operator
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import fsspec
import numpy as np
import zarr
from fsspec.asyn import AsyncFileSystem
from fsspec.callbacks import DEFAULT_CALLBACK
from zarr.core.array_spec import ArrayConfig
from zarr.storage import MemoryStore, StorePath

from asyncflat.errors import ConfigError
from asyncflat.format.codec import SPLITS, TOKEN_ID_LIMIT
from asyncflat.testing.corpus import SyntheticSplit, key_of
from asyncflat.writer.flat_tokens import SEQ_STARTS_CHUNK, create_split_arrays
from asyncflat.writer.options import chunk_tokens_arg

__all__ = ["PROTOCOL", "SyntheticCounts", "SyntheticFileSystem"]

log = logging.getLogger(__name__)

#: The URL protocol the filesystem is registered under (``synthetic://``).
PROTOCOL = "synthetic"

_ARRAYS = ("encoded_tokens", "seq_starts")
# A chunk's key is its index as zarr writes it: no leading zeros ("c/01" is no object).
_V3_CHUNK = re.compile(r"c/(0|[1-9]\d*)")
_V2_CHUNK = re.compile(r"(0|[1-9]\d*)")
#: Distinct token chunks kept encoded with ``repeat_tokens`` (chunks with random lengths differ).
_ALIKE_CHUNKS = 8
T = TypeVar("T")
#: threads that generate and encode chunks, shared by every synthetic filesystem (as many as
#: a loop's default executor has): not the calling loop's default executor, which may be
#: zarr's own, whose codec work the encoding (zarr's synchronous API) waits for: there every
#: worker could end up waiting for one
_WORKERS = min(32, (os.cpu_count() or 1) + 4)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the pool's threads did not come along, but the pool would still
    count them as idle and start none."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


async def _off_loop(call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` on the synthetic filesystems' own threads."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="synthetic-store")
    return await asyncio.get_running_loop().run_in_executor(_pool, call, *args)


#: Every chunk is stored, an all-zero one too (the writer's arrays' config).
_WRITE_EMPTY = ArrayConfig(order="C", write_empty_chunks=True)


@dataclasses.dataclass
class SyntheticCounts:
    """What the filesystems sharing it served so far (safe to share across threads; a copy or
    a pickle carries the figures, with a lock of its own)."""

    requests: int = 0  #: object reads (whole or ranged), of absent objects too
    bytes: int = 0  #: bytes returned
    chunk_requests: int = 0  #: reads of chunk objects (the rest are metadata)
    missing: int = 0  #: reads of objects that do not exist (a zarr open probes for some)
    in_flight: int = 0  #: reads started and not finished
    max_in_flight: int = 0  #: the most reads ever in flight at once
    modelled_wait_s: float = 0.0  #: seconds of latency and bandwidth the model made reads wait
    #: seconds spent generating and encoding the chunks served (each chunk's own; none for one
    #: another request encoded: a busy machine's wait for a core is in it)
    generate_s: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def start(self, chunk: bool, *, missing: bool = False) -> None:
        with self._lock:
            self.requests += 1
            self.chunk_requests += chunk
            self.missing += missing
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def finish(self, size: int, waited_s: float, generate_s: float) -> None:
        with self._lock:
            self.in_flight -= 1
            self.bytes += size
            self.modelled_wait_s += waited_s
            self.generate_s += generate_s


def _integer(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    try:
        valid = not isinstance(value, bool)
        number = operator.index(value)
    except TypeError:
        valid, number = False, 0
    if not valid or number < minimum or (maximum is not None and number > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ConfigError(
            f"SyntheticFileSystem.{name} must be an integer >= {minimum}{upper}, got {value!r}"
        )
    return number


def _rate(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(
            f"SyntheticFileSystem.{name} must be a number of bytes/s > 0 or None, got {value!r}"
        )
    return float(value)


#: fsspec's own keywords, which a filesystem hands on to it; any other unknown one is a mistake
_FSSPEC_KEYWORDS = frozenset(
    {
        "asynchronous",
        "loop",
        "batch_size",
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
    }
)


def _check_keywords(given: Mapping[str, Any], known: list[str]) -> None:
    """A misspelt option would silently give the default dataset: refuse it, naming it."""
    unknown = sorted(set(given) - _FSSPEC_KEYWORDS)
    if unknown:
        takes = ", ".join(name for name in known if name not in ("self", "kwargs"))
        raise ConfigError(
            f"SyntheticFileSystem: unknown option(s) {', '.join(map(repr, unknown))}; it takes "
            f"{takes} (and fsspec's {', '.join(sorted(_FSSPEC_KEYWORDS))})"
        )


class _Link:
    """The network model of one filesystem (module docstring): ``latency_s`` to first byte,
    ``connection`` bytes/s per request, ``total`` bytes/s shared first come, first served."""

    def __init__(self, latency_s: Any, connection: Any, total: Any) -> None:
        if (
            not isinstance(latency_s, (int, float))
            or isinstance(latency_s, bool)
            or not 0 <= latency_s < math.inf
        ):
            raise ConfigError(
                f"SyntheticFileSystem.latency_s must be a finite number >= 0, got {latency_s!r}"
            )
        self.latency_s = float(latency_s)
        self.connection = _rate("connection_bandwidth", connection)
        self.total = _rate("total_bandwidth", total)
        self._free = 0.0  # when the shared link is next free

    async def wait(self, size: int) -> float:
        """Sleep as long as a ``size``-byte response takes; the seconds. A request cancelled
        meanwhile (a client's timeout, a closed reader) gives back the shared link's time it
        did not use, unless a later request was already queued behind it."""
        if not (self.latency_s or self.connection or self.total):
            return 0.0
        loop = asyncio.get_running_loop()
        now = loop.time()
        first_byte = now + self.latency_s
        done = first_byte + (size / self.connection if self.connection else 0)
        before = reserved = self._free
        if self.total:
            self._free = reserved = max(first_byte, before) + size / self.total
            done = max(done, reserved)
        try:
            await asyncio.sleep(done - now)
        except asyncio.CancelledError:
            if self.total and self._free == reserved:
                self._free = max(before, min(reserved, loop.time()))
            raise
        return done - now


class _AlikeChunks:
    """Encoded token chunks by what makes them alike (``repeat_tokens``), the last ``kept``:
    each encoded once however many ask for it at once, different ones side by side."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._chunks: collections.OrderedDict[tuple[Any, ...], Future[bytes]] = (
            collections.OrderedDict()
        )

    def get(self, key: tuple[Any, ...], encode: Callable[[], bytes]) -> tuple[bytes, bool]:
        """The chunk's bytes, and whether this call encoded them (others waited, or found them)."""
        with self._lock:
            future = self._chunks.get(key)
            mine = future is None
            if future is None:
                future = self._chunks[key] = Future()
                while len(self._chunks) > self._kept:
                    self._chunks.popitem(last=False)
            else:
                self._chunks.move_to_end(key)
        if mine:
            try:
                future.set_result(encode())
            except BaseException as exc:
                with self._lock:  # not kept: the next request tries again
                    if self._chunks.get(key) is future:
                        del self._chunks[key]
                future.set_exception(exc)
                raise
        return future.result(), mine


class _Encoder:
    """Chunk bytes exactly as the writer stores them: the writer's own array definitions
    (:func:`~asyncflat.writer.flat_tokens.create_split_arrays`), one chunk long, written
    through zarr into a fresh in-memory store per chunk."""

    def __init__(self, layout: dict[str, Any]) -> None:
        self.zarr_format = layout["zarr_format"]
        self.metadata: dict[str, dict[str, Any]] = {}
        store: dict[str, Any] = {}
        group = zarr.open_group(MemoryStore(store), mode="w", zarr_format=self.zarr_format)
        arrays = create_split_arrays(group, (layout["chunk_tokens"], SEQ_STARTS_CHUNK), **layout)
        self.array_metadata: dict[str, Any] = {
            name: array.metadata for name, array in zip(_ARRAYS, arrays)
        }
        for name in _ARRAYS:
            self.metadata[name] = {k: v for k, v in store.items() if k.startswith(f"{name}/")}
        self.chunk_key = "c/0" if self.zarr_format == 3 else "0"

    def encode(self, name: str, data: np.ndarray) -> bytes:
        store = dict(self.metadata[name])
        # As the writer: a chunk equal to the fill value (all zeros) is stored, not left out. Set
        # on this array, not in zarr's process-wide config, which worker threads would race on.
        path = StorePath(MemoryStore(store), name)
        array = zarr.Array(zarr.AsyncArray(self.array_metadata[name], path, config=_WRITE_EMPTY))
        array[: data.size] = data
        return bytes(store[f"{name}/{self.chunk_key}"].to_bytes())


def _metadata(splits: Mapping[str, SyntheticSplit], layout: dict[str, Any]) -> dict[str, bytes]:
    """Every metadata document of the dataset, as the writer leaves them after its commit."""
    store: dict[str, Any] = {}
    root = zarr.open_group(MemoryStore(store), mode="w", zarr_format=layout["zarr_format"])
    for name, split in splits.items():
        group = root.create_group(name)
        create_split_arrays(group, (split.tokens, split.sequence_count + 1), **layout)
        group.attrs["max_token_id"] = split.max_token_id
    return {key: bytes(value.to_bytes()) for key, value in store.items()}


class SyntheticFileSystem(AsyncFileSystem):
    """A read-only fsspec filesystem serving a generated flat-tokens dataset (module docstring;
    a write raises ``NotImplementedError``).

    Data (a seed names the same bytes in every version; :mod:`asyncflat.testing.corpus`):

    * ``tokens``, ``validation_tokens``: the sizes of the ``train`` and ``validation`` splits.
    * ``sequence_length``: the mean sequence length; ``min_sequence_length`` (None: equal to it,
      every sequence that long) the shortest, for seeded random lengths.
    * ``vocab_size``: ids are below it (``max_token_id`` is ``vocab_size - 1``); ``seed``.

    Layout, as :class:`~asyncflat.writer.FlatTokensWriter`'s arguments of the same names (and
    the same defaults): ``zarr_format``, ``chunk_tokens``, ``checksum``, ``blosc_block_bytes``.

    ``repeat_tokens``: the ids repeat every chunk, so the token chunks whose sequence boundaries
    fall alike (all but the first and last, with a fixed length dividing ``chunk_tokens``) are
    one object, encoded once: serving costs no CPU, which measures a loader, not the
    generator (a 4M-token chunk otherwise takes ~50 ms to generate). The loader still reads
    and decodes every chunk it needs.

    Network model: ``latency_s``, ``connection_bandwidth``, ``total_bandwidth`` (bytes/s; None:
    unlimited). ``counts``: a :class:`SyntheticCounts` to add to (default: a new one, at
    :attr:`counts`).
    """

    protocol = PROTOCOL
    root_marker = ""
    # fsspec's instance cache keys on the arguments' text, in which two SyntheticCounts with the
    # same figures are alike: a cached filesystem would count into another run's counts.
    cachable = False

    def __init__(
        self,
        tokens: int = 1 << 30,
        *,
        validation_tokens: int = 0,
        sequence_length: int = 2048,
        min_sequence_length: int | None = None,
        vocab_size: int = 50_000,
        seed: int = 0,
        zarr_format: int = 3,
        chunk_tokens: int = 1 << 20,
        checksum: bool | None = None,
        blosc_block_bytes: int | None = None,
        repeat_tokens: bool = False,
        latency_s: float = 0.0,
        connection_bandwidth: float | None = None,
        total_bandwidth: float | None = None,
        counts: SyntheticCounts | None = None,
        **kwargs: Any,
    ) -> None:
        _check_keywords(kwargs, [*inspect.signature(SyntheticFileSystem.__init__).parameters])
        super().__init__(**kwargs)
        # 64 mean lengths (a group of sequences) must fit the uint64 positions with room to spare.
        length = _integer("sequence_length", sequence_length, 1, 1 << 56)
        shortest = length if min_sequence_length is None else min_sequence_length
        shortest = _integer("min_sequence_length", shortest, 1, length)
        vocab_size = _integer("vocab_size", vocab_size, 1, TOKEN_ID_LIMIT)
        seed = _integer("seed", seed, 0, (1 << 64) - 1)  # mixed as 64 bits: larger would alias
        self.layout = _layout(zarr_format, chunk_tokens, checksum, blosc_block_bytes)
        if not isinstance(repeat_tokens, bool):
            raise ConfigError(
                f"SyntheticFileSystem.repeat_tokens must be a bool, got {repeat_tokens!r}"
            )
        self.splits = {
            name: SyntheticSplit(
                tokens=_integer(field, size, 0, 1 << 62),
                length=length,
                min_length=shortest,
                vocab_size=vocab_size,
                key=key_of(seed, number),
                period=self.layout["chunk_tokens"] if repeat_tokens else 0,
            )
            for number, (name, field, size) in enumerate(
                zip(SPLITS, ("tokens", "validation_tokens"), (tokens, validation_tokens))
            )
        }
        self._link = _Link(latency_s, connection_bandwidth, total_bandwidth)
        if counts is not None and not isinstance(counts, SyntheticCounts):
            raise ConfigError(
                f"SyntheticFileSystem.counts must be a SyntheticCounts, got {type(counts).__name__}"
            )
        self.counts = counts if counts is not None else SyntheticCounts()
        self._built: tuple[dict[str, bytes], _Encoder] | None = None
        self._build_lock = threading.Lock()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop here: built now, as zarr's synchronous API allows
            self._prepare()
        #: with ``repeat_tokens``, chunks whose boundaries fall alike are one object
        self._alike = _AlikeChunks(_ALIKE_CHUNKS)

    def _prepare(self) -> tuple[dict[str, bytes], _Encoder]:
        """The metadata documents and the chunks' encoder, built once with zarr's synchronous
        API, which fails on zarr's own loop (``zarr.open_group`` of a URL constructs this
        there): constructed on a loop, this builds them off it at its first request."""
        with self._build_lock:
            if self._built is None:
                self._built = (_metadata(self.splits, self.layout), _Encoder(self.layout))
            return self._built

    async def _ready(self) -> None:
        if self._built is None:
            await _off_loop(self._prepare)

    @property
    def _documents(self) -> dict[str, bytes]:
        return self._prepare()[0]

    # -- what a key is -----------------------------------------------------------------------

    async def _key(self, path: str) -> str:
        """The dataset key of ``path``: the URL's label (one leading component that is not
        part of a dataset) dropped. Every request starts here, so the documents are built
        first (:meth:`_prepare`)."""
        await self._ready()
        key = self._strip_protocol(path).strip("/")
        first, _, rest = key.partition("/")
        if first and first not in SPLITS and first not in self._documents:
            return rest
        return key

    def _chunk(self, key: str) -> tuple[str, str, int] | None:
        """``(split, array, chunk index)`` of a chunk key within the array, else None."""
        parts = key.split("/", 2)
        if len(parts) < 3 or parts[0] not in self.splits or parts[1] not in _ARRAYS:
            return None
        pattern = _V3_CHUNK if self.layout["zarr_format"] == 3 else _V2_CHUNK
        found = pattern.fullmatch(parts[2])
        if found is None:
            return None
        index = int(found.group(1))
        return (parts[0], parts[1], index) if index < self._chunk_count(*parts[:2]) else None

    def _chunk_count(self, split: str, array: str) -> int:
        data = self.splits[split]
        if array == "encoded_tokens":
            return -(-data.tokens // self.layout["chunk_tokens"])
        return -(-(data.sequence_count + 1) // SEQ_STARTS_CHUNK)

    def _children(self, key: str) -> list[tuple[str, str]] | None:
        """``(name, "file" | "directory")`` under directory ``key``, or None if it is none."""
        prefix = f"{key}/" if key else ""
        found: dict[str, str] = {}
        for known in self._documents:
            if known.startswith(prefix):
                name, below, _ = known[len(prefix) :].partition("/")
                found[name] = "directory" if below else "file"
        parts = key.split("/") if key else []
        if len(parts) >= 2 and parts[0] in self.splits and parts[1] in _ARRAYS:
            count = self._chunk_count(parts[0], parts[1])
            v3 = self.layout["zarr_format"] == 3
            if len(parts) == 2 and v3 and count:
                found["c"] = "directory"
            elif (len(parts) == 2 and not v3) or (parts[2:] == ["c"] and v3):
                found.update((str(i), "file") for i in range(count))
        return sorted(found.items()) if found else None

    # -- bytes ---------------------------------------------------------------------------------

    def chunk_bytes(self, split: str, array: str, index: int) -> bytes:
        """Chunk ``index`` of ``split``'s ``array`` as stored (generated and encoded now, or
        taken from the chunks already encoded when ``repeat_tokens`` makes them alike)."""
        return self._produce(split, array, index)[0]

    def _produce(self, split: str, array: str, index: int) -> tuple[bytes, float]:
        """:meth:`chunk_bytes`, and the seconds this call spent generating and encoding (wall
        time: zarr encodes on its own threads; none when another call encoded it)."""
        data = self._split(split)
        if array not in _ARRAYS:
            raise ConfigError(f"SyntheticFileSystem: array must be one of {_ARRAYS}, got {array!r}")
        last = self._chunk_count(split, array) - 1
        index = _integer(f"chunk_bytes index of {split}/{array}", index, 0, last)
        began = time.perf_counter()
        encoder = self._prepare()[1]
        if array == "seq_starts":
            starts = data.seq_starts(index * SEQ_STARTS_CHUNK, (index + 1) * SEQ_STARTS_CHUNK)
            return encoder.encode(array, starts), time.perf_counter() - began
        begin = index * self.layout["chunk_tokens"]
        end = min(begin + self.layout["chunk_tokens"], data.tokens)
        starts = (data.starts_between(begin, end) - np.uint64(begin)).astype(np.intp)
        if not data.period:
            encoded = encoder.encode(array, self._codes(data, begin, end, starts))
            return encoded, time.perf_counter() - began
        key = (split, end - begin, begin == 0, hashlib.blake2b(starts.tobytes()).digest())
        encoded, here = self._alike.get(
            key, lambda: encoder.encode(array, self._codes(data, begin, end, starts))
        )
        return encoded, time.perf_counter() - began if here else 0.0

    @staticmethod
    def _codes(data: SyntheticSplit, begin: int, end: int, starts: np.ndarray) -> np.ndarray:
        codes = data.token_ids(begin, end)
        codes <<= np.uint32(1)
        codes[starts] |= np.uint32(1)
        return codes

    async def _object(self, key: str) -> tuple[bytes, float]:
        """The bytes of ``key`` (FileNotFoundError if none) and the seconds generating them
        took (a chunk is generated in a worker thread: the loop serves others meanwhile)."""
        chunk = self._chunk(key)
        if chunk is not None:
            return await _off_loop(self._produce, *chunk)
        if key not in self._documents:
            raise FileNotFoundError(f"{PROTOCOL}://{key}: no such object")
        return self._documents[key], 0.0

    # -- fsspec's asynchronous interface ------------------------------------------------------

    async def _cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        key = await self._key(path)
        chunk = self._chunk(key) is not None
        missing = not chunk and key not in self._documents
        self.counts.start(chunk, missing=missing)
        data, generate_s, waited_s = b"", 0.0, 0.0
        try:
            if missing:  # a round trip on a real store too, then the error
                waited_s = await self._link.wait(0)
                raise FileNotFoundError(f"{PROTOCOL}://{key}: no such object")
            whole, generate_s = await self._object(key)
            data = whole[start:end]
            waited_s = await self._link.wait(len(data))
        finally:
            self.counts.finish(len(data), waited_s, generate_s)
        return data

    async def _get_file(
        self, rpath: str, lpath: str, callback: Any = DEFAULT_CALLBACK, **kwargs: Any
    ) -> None:
        if os.path.isdir(lpath) or await self._isdir(rpath):  # a recursive get's directories
            os.makedirs(lpath, exist_ok=True)
            return
        data = await self._cat_file(rpath)
        callback.set_size(len(data))
        with open(lpath, "wb") as file:
            file.write(data)
        callback.relative_update(len(data))

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        key = await self._key(path)
        if key in self._documents or self._chunk(key) is not None:
            size = len((await self._object(key))[0])
            return {"name": path, "size": size, "type": "file"}
        if self._children(key) is not None:
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(f"{PROTOCOL}://{key}: no such object")

    async def _exists(self, path: str, **kwargs: Any) -> bool:
        key = await self._key(path)
        return (
            key in self._documents
            or self._chunk(key) is not None
            or self._children(key) is not None
        )

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        key = await self._key(path)
        children = self._children(key)
        if children is None:
            raise FileNotFoundError(f"{PROTOCOL}://{key}: no such directory")
        base = self._strip_protocol(path).strip("/")
        # A metadata object's size is known; a chunk's only once generated (info() generates it,
        # as a read would): None, as fsspec's filesystems say of a size they do not know.
        prefix = f"{key}/" if key else ""
        entries = [
            {
                "name": f"{base}/{name}".strip("/"),
                "size": (
                    0
                    if kind == "directory"
                    else len(self._documents[prefix + name])
                    if prefix + name in self._documents
                    else None
                ),
                "type": kind,
            }
            for name, kind in children
        ]
        return entries if detail else [entry["name"] for entry in entries]

    # -- for tests and users ------------------------------------------------------------------

    def sequences(self, split: str, first: int, stop: int) -> list[np.ndarray]:
        """Token ids of sequences ``[first, stop)`` of ``split`` (to write the same data with
        the writer, or to check what a loader served)."""
        data = self._split(split)
        first = _integer(f"sequences first of {split}", first, 0, data.sequence_count)
        stop = _integer(f"sequences stop of {split}", stop, first, data.sequence_count)
        return data.sequences(first, stop)

    def _split(self, split: str) -> SyntheticSplit:
        if split not in self.splits:
            raise ConfigError(f"SyntheticFileSystem: split must be one of {SPLITS}, got {split!r}")
        return self.splits[split]


def _layout(
    zarr_format: Any, chunk_tokens: Any, checksum: Any, blosc_block_bytes: Any
) -> dict[str, Any]:
    """The writer's layout arguments, checked as the writer checks them."""
    if isinstance(zarr_format, bool) or zarr_format not in (2, 3):
        raise ConfigError(f"SyntheticFileSystem.zarr_format must be 2 or 3, got {zarr_format!r}")
    if checksum is not None and (not isinstance(checksum, bool) or (checksum and zarr_format != 3)):
        raise ConfigError(
            "SyntheticFileSystem.checksum must be None or a bool, and True only with "
            f"zarr_format=3, got {checksum!r}"
        )
    if blosc_block_bytes is not None:
        blosc_block_bytes = _integer("blosc_block_bytes", blosc_block_bytes, 0, 1 << 30)
        if blosc_block_bytes % 4:
            raise ConfigError(
                "SyntheticFileSystem.blosc_block_bytes must be a multiple of 4, "
                f"got {blosc_block_bytes}"
            )
    return {
        "zarr_format": int(zarr_format),
        "chunk_tokens": chunk_tokens_arg("SyntheticFileSystem.chunk_tokens", chunk_tokens),
        "shard_tokens": None,
        "checksum": checksum,
        "blosc_block_bytes": blosc_block_bytes,
    }


fsspec.register_implementation(PROTOCOL, SyntheticFileSystem, clobber=True)
