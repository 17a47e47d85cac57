"""obstore as the reading client (``storage_options={"client": "obstore"}``): its options,
refusals and errors, without a server. Reading buckets with it (batches, faults, silent stores,
sessions) is tested in tests/test_cloud.py, whose backends include ``gcs+obstore`` and
``s3+obstore``."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflat import ConfigError, FlatTokensParams, FlatTokensWriter
from asyncflat.config import client_of
from asyncflat.storage.filesystems import filesystem, make_store
from asyncflat.storage.retry import is_throttle, is_transient

obstore = pytest.importorskip("obstore")


def test_the_client_is_fsspec_unless_asked() -> None:
    assert client_of(None) == client_of({}) == "fsspec"
    assert client_of({"client": "obstore"}) == "obstore"
    with pytest.raises(ConfigError, match=r"storage_options\['client'\] must be one of .*'rust'"):
        client_of({"client": "rust"})
    with pytest.raises(ConfigError, match=r"storage_options\['client'\]"):  # at construction
        FlatTokensParams("s3://bucket/d.zarr", 1, 2, 4, 0, True, storage_options={"client": "rust"})


def test_options_are_translated_or_refused_by_name() -> None:
    s3 = make_store(
        "s3://bucket/data.zarr",
        {"client": "obstore", "endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"},
        timeout_s=5,
        max_connections=16,
    )
    assert type(s3).__name__ == "ObjectStore"  # made without a request: nothing is contacted
    gcs = make_store("gs://bucket/data.zarr", {"client": "obstore", "token": "anon"})
    assert type(gcs).__name__ == "ObjectStore"
    with pytest.raises(ConfigError, match=r"\['requester_pays'\] have no obstore equivalent"):
        make_store("s3://bucket/d.zarr", {"client": "obstore", "requester_pays": True})
    with pytest.raises(ConfigError, match="path to a service-account JSON file or 'anon'"):
        make_store("gs://bucket/d.zarr", {"client": "obstore", "token": {"type": "x"}})
    with pytest.raises(ConfigError, match="reads s3:// and gs:// URLs, not memory://"):
        make_store("memory://bucket/d.zarr", {"client": "obstore"})


def test_writing_goes_through_fsspec_whichever_client_reads(tmp_path: Path) -> None:
    """One options dict serves the converter and the loader: the filesystem that writes (and
    lists) is fsspec's, never handed asyncflat's ``client`` key."""
    import s3fs

    fs, path = filesystem(
        "s3://bucket/d.zarr",
        {"client": "obstore", "endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"},
    )
    assert isinstance(fs, s3fs.S3FileSystem) and path == "bucket/d.zarr"
    with pytest.raises(ConfigError, match=r"storage_options\['client'\] must be one of"):
        filesystem("s3://bucket/d.zarr", {"client": "rust"})
    import fsspec

    url = f"memory://obstore-client-test/{tmp_path.name}.zarr"
    with FlatTokensWriter(url, storage_options={"client": "obstore"}) as writer:
        writer.append("train", [[1, 2, 3]])
    assert fsspec.filesystem("memory").exists(f"{url}/train")


def test_the_client_choice_is_not_a_secret() -> None:
    """storage_options values are redacted from errors as possible credentials; the client
    name is not one (an error saying "*** refused" would hide which client spoke)."""
    params = FlatTokensParams(
        "s3://bucket/d.zarr",
        1,
        2,
        4,
        0,
        True,
        storage_options={"client": "obstore", "secret": "hunter22"},
    )
    from asyncflat.errors import option_secrets

    secrets = option_secrets(params.storage_options)
    assert "hunter22" in secrets and "obstore" not in secrets


def test_obstore_errors_are_classified() -> None:
    from obstore.exceptions import GenericError, NotFoundError, PermissionDeniedError

    def generic(status: str) -> GenericError:
        return GenericError(
            "Generic S3 error: Error performing GET http://127.0.0.1/b/k in 1ms - Server "
            f"returned non-2xx status code: {status}: "
        )

    assert is_transient(generic("503 Service Unavailable"))
    assert is_throttle(generic("503 Service Unavailable"))
    assert is_throttle(generic("429 Too Many Requests"))
    assert is_transient(generic("500 Internal Server Error"))
    assert not is_throttle(generic("500 Internal Server Error"))
    assert not is_transient(generic("400 Bad Request"))
    # Without a status: the request failed on the way (connect, reset, timeout).
    assert is_transient(GenericError("Generic GCS error: error sending request: timed out"))
    assert not is_transient(PermissionDeniedError("403 Forbidden"))
    assert not is_transient(NotFoundError("no such object"))


@pytest.mark.parametrize(
    ("url", "options", "words"),
    [
        # obstore panics on its first request for these (Rust traces on stderr, a message naming
        # nothing): refused up front, naming the parameter.
        ("s3://bucket/d.zarr", {"endpoint_url": "127.0.0.1:9000"}, "['endpoint_url'] must be"),
        ("gs://bucket/d.zarr", {"endpoint_url": "localhost"}, "['endpoint_url'] must be"),
        ("s3://b kt/d.zarr", {}, "'b kt' is not a bucket name"),
        ("s3://bucket/d.zarr", {"anon": "false"}, "['anon'] must be True or False"),
        ("s3://bucket/d.zarr", {"key": 12345}, "['key'] must be a string"),
        (
            "s3://bucket/d.zarr",
            {"client_kwargs": {"region_name": 1}},
            "['region_name'] must be a string",
        ),
    ],
)
def test_malformed_options_are_refused_naming_them(
    url: str, options: dict[str, object], words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        make_store(url, {"client": "obstore", **options})
    assert words in str(info.value), str(info.value)


def test_obstore_debug_dumps_stay_out_of_messages() -> None:
    """obstore appends a ~1,300-character Rust ``Debug`` dump of the error chain to every
    message; asyncflat's errors keep the first part, which says it all."""
    from obstore.exceptions import GenericError

    from asyncflat.errors import error_text, scrubbed

    exc = GenericError(
        "Generic S3 error: Error performing GET http://127.0.0.1:1/b/k in 1ms - connection "
        'refused\n\nDebug source:\nGeneric {\n    store: "S3",\n' + "    x,\n" * 200 + "}"
    )
    assert error_text(exc).endswith("connection refused")
    message = str(scrubbed(exc, "s3://bucket/d.zarr", ()))
    assert "Debug source" not in message and "connection refused" in message


@pytest.mark.parametrize("client", ["fsspec", "obstore"])
@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_a_range_past_an_objects_end_is_a_truncated_chunk_at_once(  # type: ignore[no-untyped-def]
    request, backend, client
) -> None:
    """Past the end of a short object (S3 answers 416; object_store checks a GCS emulator's
    answer itself) and a suffix of an empty one (answered with the whole, empty object, or a
    Content-Range object_store cannot parse): every client reports a truncated chunk, or for
    the empty object a permanent error, at once, never retried."""
    import asyncio

    import fsspec
    from zarr.abc.store import RangeByteRequest, SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype

    from asyncflat import CorruptChunkError, RetryPolicy, StorageError, TransientStorageError
    from asyncflat.storage import AdaptiveLimiter, GuardedStore, IOCounters
    from asyncflat.storage.filesystems import bounded, close_store

    pytest.importorskip("s3fs" if backend == "s3" else "gcsfs")  # the writing client
    server = request.getfixturevalue("s3_server" if backend == "s3" else "gcs_emulator")
    scheme = "s3" if backend == "s3" else "gs"
    fs = fsspec.filesystem(scheme, **server.storage_options(), skip_instance_cache=True)
    root = f"{server.bucket}/past-end-{client}"
    fs.pipe(f"{root}/t/c/0", b"0123456789")
    fs.pipe(f"{root}/t/c/1", b"")

    async def main() -> None:
        options = dict(server.storage_options(), client=client)
        raw = make_store(f"{scheme}://{root}", options, timeout_s=5, max_connections=8)
        io = IOCounters()
        policy = RetryPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, deadline_s=10)
        store = GuardedStore(
            bounded(raw, 5), name=f"{scheme}://{root}", limiter=AdaptiveLimiter(4, io),
            retry=policy, io=io,
        )  # fmt: skip
        try:
            with pytest.raises(CorruptChunkError, match="truncated"):
                await store.get("t/c/0", default_buffer_prototype(), RangeByteRequest(20, 30))
            with pytest.raises((CorruptChunkError, StorageError)) as info:
                await store.get("t/c/1", default_buffer_prototype(), SuffixByteRequest(4))
            assert not isinstance(info.value, TransientStorageError)
            assert io.retries == 0
        finally:
            await close_store(raw)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_range_past_the_end_is_told_apart_from_other_errors() -> None:
    """gcsfs's 416 (the GCS emulator answers ranges past the end itself, so only here) and
    object_store's own past-end check are ranges past the end; a 404 or a timeout are not."""
    HttpError = pytest.importorskip("gcsfs.retry").HttpError
    from obstore.exceptions import GenericError

    from asyncflat.storage.retry import is_range_past_end

    assert is_range_past_end(HttpError({"code": 416, "message": "range cannot be satisfied"}))
    assert is_range_past_end(
        GenericError("Generic GCS error: Wanted range starting at 20, but object was only 10")
    )
    assert not is_range_past_end(HttpError({"code": 404, "message": "No such object"}))
    assert not is_range_past_end(GenericError("Generic GCS error: error sending request"))
    unusable = GenericError("Generic GCS error: Failed to parse value for CONTENT_RANGE header")
    assert not is_transient(unusable)  # every retry gets the same answer


def test_gcsfs_answering_416_reads_as_a_truncated_chunk(gcs_emulator, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """GCS answers a range past the end with 416, which gcsfs raises as ``HttpError`` (the
    emulator checks ranges itself, so its answer is made here as gcsfs makes it)."""
    import asyncio
    import json

    gcsfs = pytest.importorskip("gcsfs")
    from gcsfs.retry import validate_response
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import default_buffer_prototype

    from asyncflat import CorruptChunkError, RetryPolicy
    from asyncflat.storage import AdaptiveLimiter, GuardedStore, IOCounters
    from asyncflat.storage.filesystems import bounded, close_store

    body = json.dumps(
        {"error": {"code": 416, "message": "The requested range cannot be satisfied."}}
    )
    real = gcsfs.GCSFileSystem._call

    async def call(self, method, path, *args, headers=None, **kwargs):  # type: ignore[no-untyped-def]
        if headers and headers.get("Range", "").startswith("bytes=20-"):
            validate_response(416, body.encode(), path)
        return await real(self, method, path, *args, headers=headers, **kwargs)

    monkeypatch.setattr(gcsfs.GCSFileSystem, "_call", call)
    fs = gcsfs.GCSFileSystem(**gcs_emulator.storage_options(), skip_instance_cache=True)
    root = f"{gcs_emulator.bucket}/past-end-416"
    fs.pipe(f"{root}/t/c/0", b"0123456789")

    async def main() -> None:
        raw = make_store(f"gs://{root}", gcs_emulator.storage_options(), timeout_s=5)
        io = IOCounters()
        store = GuardedStore(
            bounded(raw, 5), name=f"gs://{root}", limiter=AdaptiveLimiter(4, io),
            retry=RetryPolicy(initial_backoff_s=0.05, deadline_s=10), io=io,
        )  # fmt: skip
        try:
            with pytest.raises(CorruptChunkError, match="truncated"):
                await store.get("t/c/0", default_buffer_prototype(), RangeByteRequest(20, 30))
            assert io.retries == 0
        finally:
            await close_store(raw)

    asyncio.run(asyncio.wait_for(main(), 60))
