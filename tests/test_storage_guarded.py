"""The guarded store alone: strict about missing and truncated chunks, shard indexes read once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
from numcodecs import Blosc
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

from asyncflat import CorruptChunkError, RetryPolicy, StorageError, TransientStorageError
from asyncflat.errors import ObjectReplacedError
from asyncflat.storage import AdaptiveLimiter, GuardedStore, IOCounters
from asyncflat.storage.filesystems import PinnedStore
from asyncflat.storage.pins import Version, VersionMismatch, VersionPins
from asyncflat.testing.faults import FaultyStore

PROTO = default_buffer_prototype()


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(coro_fn(), timeout=20))


async def guarded(store: Any, **retry: Any) -> tuple[GuardedStore, IOCounters]:
    io = IOCounters()
    policy = RetryPolicy(**{"initial_backoff_s": 0.001, "max_backoff_s": 0.002, **retry})
    return GuardedStore(
        store, name="mem://data", limiter=AdaptiveLimiter(4, io), retry=policy, io=io
    ), io


async def memory_store(objects: dict[str, bytes]) -> MemoryStore:
    store = MemoryStore()
    for key, value in objects.items():
        await store.set(key, PROTO.buffer.from_bytes(value))
    return store


def test_a_missing_chunk_is_an_error_and_missing_metadata_is_not() -> None:
    async def main() -> None:
        store, _ = await guarded(await memory_store({}))
        with pytest.raises(CorruptChunkError, match=r"mem://data/t/c/0 \(whole object\).*missing"):
            await store.get("t/c/0", PROTO)
        assert await store.get("t/zarr.json", PROTO) is None

    run(main)


def test_a_short_or_empty_object_is_truncated() -> None:
    async def main() -> None:
        store, io = await guarded(await memory_store({"t/c/0": b"0123456789", "t/c/1": b""}))
        with pytest.raises(CorruptChunkError, match=r"bytes=5-19.*got 5 bytes, expected 15"):
            await store.get("t/c/0", PROTO, RangeByteRequest(5, 20))
        with pytest.raises(CorruptChunkError, match="truncated: got 0 bytes"):
            await store.get("t/c/1", PROTO)
        buffer = await store.get("t/c/0", PROTO, RangeByteRequest(2, 4))
        assert buffer is not None and buffer.to_bytes() == b"23"
        assert io.bytes_read == 2 and io.requests == 3

    run(main)


def test_a_blosc_frame_whose_header_disagrees_with_its_size_is_refused() -> None:
    frame = Blosc(cname="lz4").encode(np.arange(1000, dtype="<u4"))

    async def main() -> None:
        raw = await memory_store({"t/c/0": frame + b"extra", "t/c/1": frame, "u/c/0": b"x" * 3})
        store, _ = await guarded(raw)
        store.check_blosc_frames(["t/"])
        with pytest.raises(CorruptChunkError, match="not a whole Blosc frame"):
            await store.get("t/c/0", PROTO)
        assert (await store.get("t/c/1", PROTO)) is not None
        assert (await store.get("u/c/0", PROTO)) is not None  # not a Blosc array: not checked

    run(main)


def test_shard_indexes_are_read_once_and_failures_and_bad_ones_forgotten() -> None:
    async def main() -> None:
        faulty = FaultyStore(await memory_store({"t/c/0": b"a" * 64}))
        store, io = await guarded(faulty, max_attempts=1)
        faulty.configure(transient_rate=1.0)
        with pytest.raises(TransientStorageError):
            await store.get("t/c/0", PROTO, SuffixByteRequest(16))
        faulty.configure(transient_rate=0.0)  # healed: the failure was not cached
        results = await asyncio.gather(
            *(store.get("t/c/0", PROTO, SuffixByteRequest(16)) for _ in range(5))
        )
        assert all(r is not None and r.to_bytes() == b"a" * 16 for r in results)
        before = faulty.counts.requests
        await store.get("t/c/0", PROTO, SuffixByteRequest(16))
        assert faulty.counts.requests == before and io.cached_reads >= 1
        store.forget_indexes()  # bytes under the index failed to decode: read it again
        await store.get("t/c/0", PROTO, SuffixByteRequest(16))
        assert faulty.counts.requests == before + 1

    run(main)


def test_a_truncated_range_forgets_the_shard_index_it_came_from() -> None:
    """A shard rewritten in place (smaller) behind a cached index: the inner chunk's range
    from the stale index comes back short (CorruptChunkError), and the index is read afresh
    for the next read, which then finds the new shard's chunks."""
    import zarr
    from zarr.storage import LocalStore

    async def main(root: str) -> None:
        def write(values: np.ndarray) -> None:
            array = zarr.create_array(
                LocalStore(root), name="t", shape=(4096,), chunks=(1024,), shards=(4096,),
                dtype="<u4", overwrite=True, compressors=zarr.codecs.ZstdCodec(),
            )  # fmt: skip
            array[:] = values

        write(np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint32))
        store, _ = await guarded(LocalStore(root, read_only=True), max_attempts=1)
        array = await zarr.api.asynchronous.open_array(store=store, path="t")
        store.gate_arrays([array])
        await array.getitem(slice(3000, 3010))  # the shard's index, cached
        write(np.full(4096, 7, np.uint32))  # rewritten in place: a tiny shard
        with pytest.raises(CorruptChunkError, match="truncated"):
            await array.getitem(slice(3000, 3010))
        np.testing.assert_array_equal(await array.getitem(slice(3000, 3010)), np.full(10, 7))

    import tempfile

    with tempfile.TemporaryDirectory() as root:
        run(lambda: main(root))


def test_copies_share_counters_limits_and_checks() -> None:
    async def main() -> None:
        store, io = await guarded(await memory_store({"t/c/0": b"abc"}))
        store.check_blosc_frames(["t/"])
        copy = store.with_read_only(True)
        assert isinstance(copy, GuardedStore) and copy.io is io
        with pytest.raises(CorruptChunkError, match="Blosc"):
            await copy.get("t/c/0", PROTO)

    run(main)


# -- objects pinned to the version first read ------------------------------------------------


class VersionedBucket:
    """Objects with an ETag per version, read conditionally as S3 does (If-Match -> 412)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = {key: (value, '"v1"') for key, value in objects.items()}
        self.reads: list[tuple[str, str | None]] = []

    def replace(self, key: str, value: bytes, etag: str) -> None:
        self.objects[key] = (value, etag)

    async def read(self, key: str, byte_range: Any, pinned: Version | None) -> Any:
        self.reads.append((key, pinned.value if pinned is not None else None))
        if key not in self.objects:
            return None
        value, etag = self.objects[key]
        if pinned is not None and pinned.value != etag:
            raise VersionMismatch("412 Precondition Failed")
        if isinstance(byte_range, RangeByteRequest):
            value = value[byte_range.start : byte_range.end]
        return value, Version("ETag", etag)


def test_a_first_read_past_an_objects_end_neither_pins_nor_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A range past the end (the client raises the store's 416, which names no version) reads
    as empty: no warning that the store sends no versions, and the next read pins the object
    as usual."""

    class RangeNotSatisfiable(Exception):
        code = 416  # as gcsfs's HttpError carries it

    bucket = VersionedBucket({"t/c/0": b"0123456789"})

    async def read(key: str, byte_range: Any, pinned: Version | None) -> Any:
        if isinstance(byte_range, RangeByteRequest) and byte_range.start >= 10:
            raise RangeNotSatisfiable("The requested range cannot be satisfied.")
        return await bucket.read(key, byte_range, pinned)

    async def main() -> None:
        store = PinnedStore(await memory_store({}), read=read)
        buffer = await store.get("t/c/0", PROTO, RangeByteRequest(20, 30))
        assert buffer is not None and buffer.to_bytes() == b""
        assert (await store.get("t/c/0", PROTO)).to_bytes() == b"0123456789"  # type: ignore[union-attr]
        assert store.pins.pinned("t/c/0") == Version("ETag", '"v1"')

    with caplog.at_level("WARNING", logger="asyncflat"):
        run(main)
    assert "sent no version" not in caplog.text


def test_a_replaced_object_is_refused_once_without_retry_and_until_reopened() -> None:
    async def main() -> None:
        bucket = VersionedBucket({"t/c/0": b"0123456789", "t/c/1": b"abcdefghij"})
        pinned = PinnedStore(await memory_store({}), read=bucket.read)
        store, io = await guarded(pinned, max_attempts=5)
        assert (await store.get("t/c/0", PROTO)).to_bytes() == b"0123456789"  # type: ignore[union-attr]
        buffer = await store.get("t/c/0", PROTO, RangeByteRequest(2, 4))
        assert buffer is not None and buffer.to_bytes() == b"23"
        assert bucket.reads == [("t/c/0", None), ("t/c/0", '"v1"')]  # conditional once pinned
        bucket.replace("t/c/0", b"9876543210", '"v2"')  # same size, other bytes
        for _ in range(2):  # refused, and kept refused without asking the store again
            with pytest.raises(ObjectReplacedError) as info:
                await store.get("t/c/0", PROTO, RangeByteRequest(2, 4))
            message = str(info.value)
            assert "mem://data/t/c/0 (bytes=2-3)" in message
            assert 'pinned ETag "v1"' in message and "412" in message
        assert bucket.reads.count(("t/c/0", '"v1"')) == 2  # one refused read, not retried
        assert io.retries == 0
        assert isinstance(info.value, StorageError)
        assert not isinstance(info.value, TransientStorageError)
        # Other objects read on; a copy zarr makes shares the pins.
        copy = store.with_read_only(True)
        assert (await copy.get("t/c/1", PROTO)).to_bytes() == b"abcdefghij"  # type: ignore[union-attr]
        with pytest.raises(ObjectReplacedError):
            await copy.get("t/c/0", PROTO)
        # Reopened (a new loader: new pins), the new version reads.
        fresh, _ = await guarded(PinnedStore(await memory_store({}), read=bucket.read))
        assert (await fresh.get("t/c/0", PROTO)).to_bytes() == b"9876543210"  # type: ignore[union-attr]

    run(main)


def test_two_first_reads_across_a_replacement_name_both_versions() -> None:
    pins = VersionPins()
    pins.record("t/c/0", Version("generation", "11"))
    with pytest.raises(ObjectReplacedError, match="pinned generation 11, found generation 12"):
        pins.record("t/c/0", Version("generation", "12"))
    with pytest.raises(ObjectReplacedError, match="pinned generation 11"):
        pins.pinned("t/c/0")
    pins.record("t/c/1", Version("generation", "11"))
    assert pins.pinned("t/c/1") == Version("generation", "11")
