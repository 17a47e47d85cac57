"""Object stores through fsspec: gcsfs against the GCS emulator, s3fs against moto's S3 server.

The servers run on 127.0.0.1 (fixtures in conftest.py, pieces in helpers/servers.py). Datasets
are written locally with asyncflat's writer, uploaded with fsspec, and the batches read from the
bucket must equal those read from the local copy and the oracle, bit for bit. A TCP proxy in
front of a server logs every request (to check that reads are ranged per chunk) and injects HTTP
errors and connection resets (to check retries, throttling back-off and fail-fast errors).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import random_sequences
from helpers.resources import open_fds
from helpers.servers import ProxiedRequest, TcpProxy
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat
from asyncflat import (
    CorruptChunkError,
    DatasetFormatError,
    EngineOptions,
    FlatTokensParams,
    RetryPolicy,
    ShufflingLoader,
    StorageError,
    TokenBatchParams,
    TransientStorageError,
)
from asyncflat.storage.counters import IOCounters
from asyncflat.storage.filesystems import close_filesystem, filesystem
from asyncflat.storage.limiter import AdaptiveLimiter
from asyncflat.storage.retry import is_throttle, is_transient

BUCKET = "asyncflat-test"
CHUNK = 4096
SHARD = 16384
INDEX_BYTES = (SHARD // CHUNK) * 16 + 4  # (offset, nbytes) uint64 pairs + crc32c
FORMATS: dict[str, dict[str, Any]] = {
    "v2": {"zarr_format": 2, "chunk_tokens": CHUNK},
    "v3": {"zarr_format": 3, "chunk_tokens": CHUNK},
    "v3_sharded": {"zarr_format": 3, "chunk_tokens": CHUNK, "shard_tokens": SHARD},
}
BATCH = TokenBatchParams(len=32, batch=8)
# streams 2, 3 blocks of 8 rows per buffer, 4 rows per stream per step: a minipoch every 6 steps.
STREAMS, RBPSB, SPB, SEED = 2, 3, 8, 5
FAST_RETRY = RetryPolicy(max_attempts=8, initial_backoff_s=0.005, max_backoff_s=0.05, deadline_s=30)


# -- datasets and backends ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cloud")
    train, validation = random_sequences(7, 1200), random_sequences(8, 300)
    paths = {}
    for name, kwargs in FORMATS.items():
        paths[name] = root / f"{name}.zarr"
        asyncflat.write_flat_tokens(
            paths[name], {"train": train, "validation": validation}, **kwargs
        )
    return paths


class Backend:
    """One object store and the client that reads it: how to reach it, directly or through a
    proxy. Datasets are uploaded through fsspec whatever the client."""

    def __init__(self, name: str, server: Any, client: str = "fsspec") -> None:
        self.name, self.server, self.client = name, server, client
        self.protocol = "gs" if name == "gcs" else "s3"
        self.dialect = name if name == "gcs" else "s3"

    def url(self, key: str) -> str:
        return f"{self.protocol}://{BUCKET}/{key}"

    def options(self, proxy: TcpProxy | None = None) -> dict[str, Any]:
        """The loader's storage_options."""
        options = self.server.storage_options(proxy.endpoint if proxy is not None else None)
        return {**options, "client": self.client} if self.client != "fsspec" else options

    def proxy(self, **kwargs: Any) -> TcpProxy:
        return TcpProxy(self.server.endpoint, dialect=self.dialect, **kwargs)

    def run(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``await fn(fs)`` with a fresh asynchronous filesystem, closed afterwards."""

        async def main() -> Any:
            fs, _ = filesystem(self.url(""), self.server.storage_options())
            try:
                return await fn(fs)
            finally:
                await close_filesystem(fs)

        return asyncio.run(main())


@pytest.fixture(scope="module", params=["gcs", "s3", "gcs+obstore", "s3+obstore"])
def backend(request: pytest.FixtureRequest, local_datasets: dict[str, Path]) -> Iterator[Backend]:
    name, _, client = str(request.param).partition("+")
    server = request.getfixturevalue("gcs_emulator" if name == "gcs" else "s3_server")
    backend = Backend(name, server, client or "fsspec")

    async def upload(fs: Any) -> None:
        for name, path in local_datasets.items():
            await fs._put(str(path), f"{BUCKET}/data/{name}.zarr", recursive=True)

    backend.run(upload)
    yield backend


def _params(
    filespec: str,
    options: dict[str, Any] | None = None,
    *,
    packing: bool = True,
    streams: int = STREAMS,
) -> FlatTokensParams:
    return FlatTokensParams(filespec, streams, RBPSB, SPB, SEED, packing, storage_options=options)


_ORACLES: dict[tuple[str, str, bool, int], ReferenceLoader] = {}


def _oracle(path: Path, split: str, packing: bool, streams: int = STREAMS) -> ReferenceLoader:
    key = (str(path), split, packing, streams)
    if key not in _ORACLES:
        tokens, starts = load_split_arrays(path, split)
        _ORACLES[key] = ReferenceLoader(
            tokens,
            starts,
            seq_len=BATCH.len,
            batch=BATCH.batch,
            streams=streams,
            read_blocks_per_shuffle_buffer=RBPSB,
            sequences_per_read_block=SPB,
            seed=SEED,
            sequence_packing=packing,
        )
    return _ORACLES[key]


def _encoded(batch: asyncflat.TokenBatch) -> np.ndarray:
    targets = np.asarray(batch.targets)
    return (targets << 1) | np.asarray(batch.is_seq_start).astype(np.uint32)


def _data_request(request: ProxiedRequest) -> bool:
    """A request for chunk bytes of encoded_tokens (not metadata)."""
    path = request.path
    return "/encoded_tokens/" in path and not path.endswith(
        ("zarr.json", ".zarray", ".zattrs", ".zgroup")
    )


# -- bit-identical batches ----------------------------------------------------------------------


@pytest.mark.cloud
@pytest.mark.parametrize(
    ("fmt", "packing"),
    [
        ("v2", True),
        ("v3", True),
        ("v3_sharded", True),
        ("v2", False),
        ("v3_sharded", False),
    ],
)
def test_bucket_batches_equal_local_and_oracle(
    backend: Backend, local_datasets: dict[str, Path], fmt: str, packing: bool
) -> None:
    local = local_datasets[fmt]
    oracle = _oracle(local, "train", packing)
    remote_params = _params(backend.url(f"data/{fmt}.zarr"), backend.options(), packing=packing)
    with (
        ShufflingLoader("train", remote_params, BATCH) as remote,
        ShufflingLoader("train", _params(str(local), packing=packing), BATCH) as here,
    ):
        assert remote.step_count == here.step_count == oracle.step_count
        assert remote.max_token_id == here.max_token_id
        # Steps 0-13 cross the minipoch boundaries at steps 6 and 12; then a jump and the end.
        steps = list(range(14)) + [40, 41, remote.step_count - 1]
        for step in steps:
            got = _encoded(remote.load(step))
            np.testing.assert_array_equal(got, _encoded(here.load(step)), err_msg=f"step {step}")
            np.testing.assert_array_equal(got, oracle.encoded_batch(step), err_msg=f"step {step}")
        stats = remote.stats()
        assert stats["retries"] == 0 and stats["requests"] > 0 and stats["bytes_read"] > 0


def test_memory_url_equals_local(local_datasets: dict[str, Path]) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.put(str(local_datasets["v3_sharded"]), "/asyncflat-cloud-test/v3s.zarr", recursive=True)
    try:
        remote = _params("memory://asyncflat-cloud-test/v3s.zarr")
        with (
            ShufflingLoader("validation", remote, BATCH) as loader,
            ShufflingLoader(
                "validation", _params("file://" + str(local_datasets["v3_sharded"])), BATCH
            ) as here,
        ):
            for step in range(0, loader.step_count, 7):
                np.testing.assert_array_equal(
                    _encoded(loader.load(step)), _encoded(here.load(step))
                )
    finally:
        fs.rm("/asyncflat-cloud-test", recursive=True)


# -- ranged reads ---------------------------------------------------------------------------------


def _shard_index(local: Path, shard: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of each inner chunk of one local shard file."""
    data = (local / "train" / "encoded_tokens" / "c" / str(shard)).read_bytes()
    pairs = np.frombuffer(data[-INDEX_BYTES:-4], "<u8").reshape(-1, 2)
    return [(int(o), int(n)) for o, n in pairs]


@pytest.mark.cloud
@pytest.mark.parametrize("fmt", ["v3", "v3_sharded"])
def test_one_ranged_read_per_chunk(
    backend: Backend, local_datasets: dict[str, Path], fmt: str
) -> None:
    """A fill reads exactly the chunks its blocks live in, once each; a sharded array is read
    with one ranged GET per inner chunk plus one (cached) index read per shard."""
    with backend.proxy() as proxy:
        params = _params(backend.url(f"data/{fmt}.zarr"), backend.options(proxy), streams=1)
        with ShufflingLoader(
            "train", params, BATCH, options=EngineOptions(prefetch=False)
        ) as loader:
            before = len(proxy.requests)
            loader.load(0)  # without prefetch: exactly one fill, minipoch 0 of stream 0
            blocks = loader.plan.buffer_blocks(0, 0)
            stats = loader.stats()
        requests = [r for r in proxy.requests[before:] if _data_request(r)]
    block_tokens = SPB * BATCH.len
    chunks = sorted(
        {
            t // CHUNK
            for b in blocks.tolist()
            for t in (b * block_tokens, (b + 1) * block_tokens - 1)
        }
    )
    assert all(r.method == "GET" for r in requests)
    if fmt == "v3":
        # Whole chunk objects (each is the unit of decoding), each exactly once.
        assert all(r.range is None for r in requests), requests
        got = collections.Counter(int(r.path.rsplit("/", 1)[1]) for r in requests)
        assert got == collections.Counter(chunks)
        return
    # Sharded: never a whole shard; the index once per shard, then each inner chunk's bytes.
    assert all(r.range is not None for r in requests), requests
    index_reads = collections.Counter(
        r.path for r in requests if r.range == f"bytes=-{INDEX_BYTES}"
    )
    assert set(index_reads.values()) == {1}
    shards = sorted({c // (SHARD // CHUNK) for c in chunks})
    assert sorted(int(p.rsplit("/", 1)[1]) for p in index_reads) == shards
    expected = collections.Counter()
    for chunk in chunks:
        shard, inner = divmod(chunk, SHARD // CHUNK)
        offset, nbytes = _shard_index(local_datasets[fmt], shard)[inner]
        expected[(shard, f"bytes={offset}-{offset + nbytes - 1}")] += 1
    got = collections.Counter(
        (int(r.path.rsplit("/", 1)[1]), r.range)
        for r in requests
        if r.range != f"bytes=-{INDEX_BYTES}"
    )
    assert got == expected
    assert stats["requests"] >= len(requests)


# -- transient faults ------------------------------------------------------------------------------


def _every_nth_fault(kinds: list[str], every: int) -> Callable[[ProxiedRequest], str | None]:
    """Fail every ``every``-th data request, cycling through ``kinds``, but never the retry of a
    request just failed (so each fault costs exactly one retry)."""
    just_failed: set[tuple[str, str | None]] = set()
    count = [0, 0]

    def policy(request: ProxiedRequest) -> str | None:
        key = (request.target, request.range)
        if not _data_request(request):
            return None
        if key in just_failed:
            just_failed.discard(key)
            return None
        count[0] += 1
        if count[0] % every:
            return None
        just_failed.add(key)
        count[1] += 1
        return kinds[count[1] % len(kinds)]

    return policy


@pytest.mark.cloud
@pytest.mark.parametrize("fmt", ["v2", "v3_sharded"])
def test_transient_faults_are_retried_and_batches_unchanged(
    backend: Backend, local_datasets: dict[str, Path], fmt: str
) -> None:
    kinds = ["503", "429", "reset", "500", "502", "504"]
    options = EngineOptions(retry=FAST_RETRY)
    with backend.proxy(latency_s=0.004, fault=_every_nth_fault(kinds, every=3)) as proxy:
        remote = _params(backend.url(f"data/{fmt}.zarr"), backend.options(proxy))
        with (
            ShufflingLoader("validation", remote, BATCH, options=options) as loader,
            ShufflingLoader("validation", _params(str(local_datasets[fmt])), BATCH) as here,
        ):
            oracle = _oracle(local_datasets[fmt], "validation", True)
            for step in range(loader.step_count):  # the whole split: every fill completes
                got = _encoded(loader.load(step))
                np.testing.assert_array_equal(
                    got, _encoded(here.load(step)), err_msg=f"step {step}"
                )
                if step % 8 == 0:
                    np.testing.assert_array_equal(
                        got, oracle.encoded_batch(step), err_msg=f"step {step}"
                    )
            stats = loader.stats()
        faults = proxy.faults()
    assert len(faults) >= 5, "the policy should have injected faults"
    # One retry per injected HTTP error: neither gcsfs/s3fs nor botocore retried on their own.
    # A reset connection is re-sent once by aiohttp itself, at once (RFC 9112 allows it for
    # idempotent requests; aiohttp has no option to turn it off), so it costs no retry of ours.
    resets = sum(f.fault == "reset" for f in faults)
    if backend.client == "obstore":  # its client re-sends nothing: every fault is one retry
        assert resets and stats["retries"] == len(faults)
    else:
        assert resets and stats["retries"] == len(faults) - resets
    assert stats["throttled"] == sum(f.fault in ("429", "503") for f in faults)


@pytest.mark.cloud
def test_attempts_do_not_multiply(backend: Backend) -> None:
    """A chunk that always answers 503 is requested exactly max_attempts times, not 3 x 6."""
    policy = RetryPolicy(
        max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.002, deadline_s=30
    )
    with backend.proxy(fault=lambda r: "503" if _data_request(r) else None) as proxy:
        params = _params(backend.url("data/v3.zarr"), backend.options(proxy))
        # Without prefetch the load waits for the fill: one read per chunk object (a load's row
        # reads would read small chunks whole too, a second read of the same object).
        options = EngineOptions(retry=policy, prefetch=False)
        with ShufflingLoader("train", params, BATCH, options=options) as loader:
            with pytest.raises(TransientStorageError) as info:
                loader.load(0)
            stats = loader.stats()
        attempts = collections.Counter((r.target, r.range) for r in proxy.faults())
    assert max(attempts.values()) == 3
    default = EngineOptions().reads_in_flight(token_chunk=CHUNK, remote=True)
    assert stats["throttled"] >= 3 and stats["concurrency_limit"] < default
    message = str(info.value)
    assert backend.url("data/v3.zarr/train/encoded_tokens/") in message
    assert "after 3 attempts" in message


# -- permanent failures -------------------------------------------------------------------------


@pytest.mark.cloud
def test_forbidden_fails_fast_naming_url_and_range(backend: Backend) -> None:
    with backend.proxy(fault=lambda r: "403" if _data_request(r) else None) as proxy:
        params = _params(backend.url("data/v3_sharded.zarr"), backend.options(proxy))
        with ShufflingLoader(
            "train", params, BATCH, options=EngineOptions(retry=FAST_RETRY)
        ) as loader:
            t0 = time.perf_counter()
            with pytest.raises(StorageError) as info:
                loader.load(0)
            elapsed = time.perf_counter() - t0
            stats = loader.stats()
        assert proxy.faults()
    message = str(info.value)
    assert backend.url("data/v3_sharded.zarr/train/encoded_tokens/c/") in message
    assert "bytes=" in message
    assert "Forbidden" in message or "Access" in message or "PermissionError" in message
    assert not isinstance(info.value, TransientStorageError)
    assert stats["retries"] == 0
    assert elapsed < 5


@pytest.mark.cloud
def test_missing_chunk_object_fails_fast_naming_url(
    backend: Backend, local_datasets: dict[str, Path]
) -> None:
    where = f"missing-{backend.client}/v3.zarr"  # the servers are shared by the clients' runs
    prefix = f"{BUCKET}/{where}"

    async def upload_without_chunks(fs: Any) -> None:
        await fs._put(str(local_datasets["v3"]), prefix, recursive=True)
        chunks = [p for p in await fs._find(f"{prefix}/train/encoded_tokens") if "/c/" in p]
        assert chunks
        await fs._rm(chunks)

    backend.run(upload_without_chunks)
    params = _params(backend.url(where), backend.options())
    with ShufflingLoader("train", params, BATCH, options=EngineOptions(retry=FAST_RETRY)) as loader:
        t0 = time.perf_counter()
        with pytest.raises(CorruptChunkError) as info:
            loader.load(0)
        assert time.perf_counter() - t0 < 5
        assert loader.stats()["retries"] == 0
    assert backend.url(f"{where}/train/encoded_tokens/c/") in str(info.value)
    assert "missing" in str(info.value)


@pytest.mark.cloud
def test_missing_dataset_names_url(backend: Backend) -> None:
    params = _params(backend.url("no-such-dataset.zarr"), backend.options())
    with pytest.raises(DatasetFormatError, match=backend.url("no-such-dataset.zarr")):
        ShufflingLoader("train", params, BATCH)


# -- sessions -----------------------------------------------------------------------------------


def _open_http_sessions() -> int:
    """aiohttp sessions alive in this process and not closed (gcsfs holds one; s3fs's
    aiobotocore client holds one per client)."""
    import aiohttp

    return sum(isinstance(o, aiohttp.ClientSession) and not o.closed for o in gc.get_objects())


@pytest.mark.cloud
def test_close_releases_http_sessions(backend: Backend) -> None:
    params = _params(backend.url("data/v3.zarr"), backend.options())
    if backend.client == "obstore":
        # No aiohttp session at all; the Rust client's connections go with the loader. A first
        # loader starts what lives for the process (zarr's and tokio's threads and their
        # pipes): the baseline is taken after it, so only what a loader keeps is counted.
        with ShufflingLoader("train", params, BATCH) as first:
            first.load(0)
        gc.collect()
        sessions, fds = _open_http_sessions(), open_fds()
        loader = ShufflingLoader("train", params, BATCH)
        loader.load(0)
        assert open_fds() > fds, "the loader opened no connection"
        loader.close()
        del loader
        gc.collect()
        deadline = time.monotonic() + 10
        while open_fds() > fds and time.monotonic() < deadline:
            time.sleep(0.05)  # the server side of a closed connection closes on its thread
        assert open_fds() <= fds
        assert _open_http_sessions() == sessions
        return
    before = _open_http_sessions()
    loader = ShufflingLoader("train", params, BATCH)
    loader.load(0)
    assert _open_http_sessions() > before, "the loader opened no HTTP session"
    loader.close()
    # The filesystem's sessions are closed with the loader, not left to the garbage collector.
    assert _open_http_sessions() == before
    del loader
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught


# -- filesystem options and error classification (no server needed) ------------------------------


@pytest.mark.cloud
def test_filesystems_own_retries_are_off_unless_configured() -> None:
    import gcsfs
    import s3fs

    async def make(url: str, options: dict[str, Any]) -> Any:
        fs, _ = filesystem(url, options)
        await close_filesystem(fs)
        return fs

    raw = gcsfs.GCSFileSystem._request.__wrapped__
    gs = asyncio.run(make("gs://b/x.zarr", {"token": "anon", "endpoint_url": "http://127.0.0.1:9"}))
    assert isinstance(gs, gcsfs.GCSFileSystem) and gs.asynchronous
    assert gs._request.__func__ is raw
    again = asyncio.run(
        make("gs://b/x.zarr", {"token": "anon", "endpoint_url": "http://127.0.0.1:9"})
    )
    assert again is not gs  # never fsspec's cached instance (its session may be on a dead loop)
    gs6 = asyncio.run(
        make("gs://b/x.zarr", {"token": "anon", "endpoint_url": "http://127.0.0.1:9", "retries": 6})
    )
    assert gs6._request.__func__ is not raw

    s3 = asyncio.run(make("s3://b/x.zarr", {"endpoint_url": "http://127.0.0.1:9", "anon": True}))
    assert isinstance(s3, s3fs.S3FileSystem) and s3.retries == 1
    assert s3.config_kwargs["retries"] == {"total_max_attempts": 1}
    mine = {"retries": {"mode": "adaptive", "max_attempts": 4}}
    s3b = asyncio.run(
        make(
            "s3://b/x.zarr",
            {
                "endpoint_url": "http://127.0.0.1:9",
                "anon": True,
                "config_kwargs": mine,
                "retries": 2,
            },
        )
    )
    assert s3b.config_kwargs["retries"] == mine["retries"] and s3b.retries == 2

    with pytest.raises(asyncflat.ConfigError, match="retries"):
        asyncio.run(make("gs://b/x.zarr", {"token": "anon", "retries": 0}))


def test_error_classification() -> None:
    import aiohttp

    pytest.importorskip("gcsfs")
    pytest.importorskip("s3fs")
    import requests
    from botocore.exceptions import ClientError
    from gcsfs.retry import HttpError
    from s3fs.errors import translate_boto_error

    def client_error(status: int, code: str) -> ClientError:
        return ClientError(
            {
                "Error": {"Code": code, "Message": "m"},
                "ResponseMetadata": {"HTTPStatusCode": status},
            },
            "GetObject",
        )

    gcs_503 = HttpError({"code": 503, "message": "unavailable"})
    assert is_transient(gcs_503) and is_throttle(gcs_503)
    assert is_transient(HttpError({"code": 500, "message": "x"})) and not is_throttle(
        HttpError({"code": 500})
    )
    assert not is_transient(HttpError({"code": 400, "message": "bad"}))
    assert is_transient(requests.exceptions.ProxyError())  # gcsfs's 502
    assert not is_transient(OSError("Forbidden: b/o"))  # gcsfs's 403
    assert not is_transient(FileNotFoundError("b/o"))  # 404, both
    slow = translate_boto_error(client_error(503, "SlowDown"))
    assert isinstance(slow, OSError) and is_transient(slow) and is_throttle(slow)
    assert is_transient(translate_boto_error(client_error(500, "InternalError")))
    assert not is_transient(translate_boto_error(client_error(403, "AccessDenied")))
    assert is_transient(aiohttp.ServerDisconnectedError())
    assert is_transient(ConnectionResetError(104, "reset"))
    assert is_transient(TimeoutError())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # .code of aiohttp's error is deprecated: never touched
        assert is_throttle(aiohttp.ClientResponseError(None, (), status=429))  # type: ignore[arg-type]
        assert not is_transient(aiohttp.ClientResponseError(None, (), status=404))  # type: ignore[arg-type]


def test_adaptive_limiter_halves_on_throttle_and_recovers() -> None:
    async def main() -> None:
        io = IOCounters()
        limiter = AdaptiveLimiter(8, io)
        epochs = [await limiter.acquire() for _ in range(8)]
        waiter = asyncio.ensure_future(limiter.acquire())
        await asyncio.sleep(0)
        assert not waiter.done()  # at the limit
        # A burst of throttles from requests that were in flight together halves once.
        for epoch in epochs[:4]:
            limiter.release(epoch, ok=False, throttled=True)
        assert io.concurrency_limit == 4 and limiter.in_flight == 4
        await asyncio.sleep(0)
        assert not waiter.done()  # 4 in flight, limit 4
        limiter.release(epochs[4], ok=True, throttled=False)
        await asyncio.sleep(0)
        assert waiter.done()
        for epoch in epochs[5:] + [waiter.result()]:
            limiter.release(epoch, ok=True, throttled=False)
        assert limiter.in_flight == 0 and io.concurrency_limit == 5
        # Throttles of requests started after the decrease halve again, never below 1.
        for _ in range(6):
            epoch = await limiter.acquire()
            limiter.release(epoch, ok=False, throttled=True)
        assert limiter.limit == 1.0
        # Additive increase: +1/limit per success, i.e. about one slot per window of successes.
        for _ in range(10):
            epoch = await limiter.acquire()
            limiter.release(epoch, ok=True, throttled=False)
        assert 3 <= io.concurrency_limit <= 5
        for _ in range(200):
            epoch = await limiter.acquire()
            limiter.release(epoch, ok=True, throttled=False)
        assert io.concurrency_limit == 8

    asyncio.run(main())


# -- silent stores: every operation bounded in time -----------------------------------------------

#: Small bounds so these tests take seconds: each request 2 s, each object read 6 s in all
#: (moto on a busy 2-core machine answers a healthy request in up to ~1 s).
SHORT = RetryPolicy(
    max_attempts=4,
    initial_backoff_s=0.01,
    max_backoff_s=0.05,
    deadline_s=6.0,
    attempt_timeout_s=2.0,
)
#: What a load may take beyond the deadline (the loop, the fill's bookkeeping, a busy machine).
SLACK_S = 4.0


class _Switch:
    """A proxy fault policy that can be turned off (the partition heals)."""

    def __init__(self, kind: str, which: Callable[[ProxiedRequest], bool]) -> None:
        self.kind, self.which, self.on = kind, which, False

    def __call__(self, request: ProxiedRequest) -> str | None:
        return self.kind if self.on and self.which(request) else None


@pytest.mark.cloud
@pytest.mark.parametrize("kind", ["blackhole", "stall"])
def test_silent_store_fails_a_load_within_the_deadline_then_recovers(
    backend: Backend, local_datasets: dict[str, Path], kind: str
) -> None:
    """A store that accepts requests and never answers (or stalls mid-body) fails the load
    that needs it within deadline + slack with a clear error; once healed, loads succeed."""
    switch = _Switch(kind, _data_request)
    oracle = _oracle(local_datasets["v3"], "train", True)
    with backend.proxy(fault=switch) as proxy:
        params = _params(backend.url("data/v3.zarr"), backend.options(proxy))
        with ShufflingLoader("train", params, BATCH, options=EngineOptions(retry=SHORT)) as loader:
            switch.on = True
            t0 = time.monotonic()
            with pytest.raises(TransientStorageError) as info:
                loader.load(0)
            elapsed = time.monotonic() - t0
            assert proxy.faults(), "the proxy should have swallowed requests"
            switch.on = False  # the partition heals: the next load starts the fill afresh
            # An attempt sent into the partition ends by its own timeout; the reads it belongs
            # to then retry through the healed proxy or, past their deadline, fail (and leave
            # the single flight a later fill's read of the same object would join).
            time.sleep(SHORT.attempt_timeout_s + 0.5)
            for step in (0, 1, 6, 7):
                np.testing.assert_array_equal(
                    _encoded(loader.load(step)), oracle.encoded_batch(step), err_msg=f"step {step}"
                )
    assert elapsed < SHORT.deadline_s + SLACK_S, elapsed
    message = str(info.value)
    assert backend.url("data/v3.zarr/train/encoded_tokens/") in message, message


@pytest.mark.cloud
@pytest.mark.parametrize("kind", ["blackhole", "stall"])
def test_silent_store_fails_construction_within_the_deadline(
    backend: Backend, local_datasets: dict[str, Path], kind: str
) -> None:
    switch = _Switch(kind, lambda request: True)
    switch.on = True
    with backend.proxy(fault=switch) as proxy:
        params = _params(backend.url("data/v3.zarr"), backend.options(proxy))
        t0 = time.monotonic()
        with pytest.raises(StorageError) as info:
            ShufflingLoader("train", params, BATCH, options=EngineOptions(retry=SHORT))
        elapsed = time.monotonic() - t0
        switch.on = False
        with ShufflingLoader(
            "train", params, BATCH, options=EngineOptions(retry=FAST_RETRY)
        ) as loader:
            np.testing.assert_array_equal(
                _encoded(loader.load(0)),
                _oracle(local_datasets["v3"], "train", True).encoded_batch(0),
            )
    assert elapsed < SHORT.deadline_s + SLACK_S, elapsed
    assert backend.url("data/v3.zarr") in str(info.value)


# -- replaced objects: every object pinned to the version first read ------------------------------


def _replaceable(root: Path, name: str, change: Callable[[Any], Any], *, sharded: bool) -> Path:
    """A v3 dataset whose validation tokens are passed through ``change`` (which keeps every
    sequence start). Unsharded, its ``encoded_tokens`` chunks are stored as uncompressed Blosc
    frames, so that other tokens make an object of exactly the same size; sharded, zarr writes
    the changed tokens (read with ranged requests: the index, then each inner chunk)."""
    import numcodecs
    import zarr

    path = root / name
    asyncflat.write_flat_tokens(
        path,
        {"train": random_sequences(7, 60), "validation": random_sequences(8, 300)},
        zarr_format=3,
        chunk_tokens=CHUNK,
        shard_tokens=SHARD if sharded else None,
        checksum=False,  # the objects are rewritten below as bare Blosc frames, no crc32c
    )
    array = zarr.open_array(path / "validation" / "encoded_tokens", mode="r+")
    if sharded:
        array[:] = change(np.asarray(array[:]))
        return path
    count = -(-array.shape[0] // CHUNK)
    tokens = np.zeros(count * CHUNK, np.uint32)  # the last chunk whole, as zarr stores it
    tokens[: array.shape[0]] = array[:]
    codec = numcodecs.Blosc(cname="lz4", clevel=0, shuffle=numcodecs.Blosc.BITSHUFFLE)
    for index in range(count):
        chunk = tokens[index * CHUNK : (index + 1) * CHUNK]
        (path / "validation" / "encoded_tokens" / "c" / str(index)).write_bytes(
            codec.encode(change(chunk))
        )
    return path


@pytest.mark.cloud
@pytest.mark.parametrize("fmt", ["v3", "v3_sharded"])
def test_replaced_objects_are_refused_until_the_loader_is_reopened(
    backend: Backend, tmp_path: Path, fmt: str
) -> None:
    """A loader reads a pass; every encoded_tokens chunk object is then replaced by one of the
    same size (same sequence starts, other tokens). Loading again never serves the new bytes:
    a load that reads a replaced object raises a StorageError naming it and the version pinned,
    and keeps raising for it; a loader opened afterwards reads the new data. Sharded, the
    conditional reads are ranged ones."""
    sharded = fmt == "v3_sharded"
    old = _replaceable(tmp_path, "old.zarr", lambda chunk: chunk, sharded=sharded)
    new = _replaceable(tmp_path, "new.zarr", lambda chunk: chunk ^ np.uint32(2), sharded=sharded)
    chunks = sorted((old / "validation" / "encoded_tokens" / "c").iterdir())
    for path in chunks:  # other bytes (of the same size, unsharded)
        other = new / path.relative_to(old)
        assert sharded or other.stat().st_size == path.stat().st_size
        assert other.read_bytes() != path.read_bytes()
    where = f"replaced-{backend.name}-{backend.client}/{fmt}.zarr"
    prefix = f"{BUCKET}/{where}"

    async def upload(fs: Any) -> None:
        await fs._put(str(old), prefix, recursive=True)

    async def replace(fs: Any) -> None:
        for path in chunks:
            key = f"{prefix}/{path.relative_to(old).as_posix()}"
            await fs._pipe_file(key, (new / path.relative_to(old)).read_bytes())

    backend.run(upload)
    steps = range(18)  # the first three minipochs
    old_oracle = _oracle(old, "validation", True)
    params = _params(backend.url(where), backend.options())
    options = EngineOptions(retry=FAST_RETRY)
    with ShufflingLoader("validation", params, BATCH, options=options) as loader:
        for step in range(loader.step_count):  # a whole pass: the first buffers are gone
            np.testing.assert_array_equal(
                _encoded(loader.load(step)), old_oracle.encoded_batch(step), err_msg=f"{step}"
            )
        backend.run(replace)
        refused: dict[int, str] = {}
        for step in steps:
            try:
                got = _encoded(loader.load(step))
            except StorageError as exc:
                refused[step] = str(exc)
                continue
            # Served from bytes read before the replacement: the old data, never the new.
            np.testing.assert_array_equal(got, old_oracle.encoded_batch(step), err_msg=f"{step}")
        assert refused, "every load served old bytes: no replaced object was read again"
        step, message = next(iter(refused.items()))
        assert backend.url(f"{where}/validation/encoded_tokens/c/") in message, message
        assert "replaced" in message and "pinned" in message, message
        assert "ETag" in message or "generation" in message, message
        with pytest.raises(StorageError, match="replaced"):  # and again: kept until reopened
            loader.load(step)
        assert loader.stats()["retries"] == 0  # a refused precondition is never retried
    here = _oracle(new, "validation", True)
    with ShufflingLoader("validation", params, BATCH, options=options) as fresh:
        for step in steps:
            np.testing.assert_array_equal(
                _encoded(fresh.load(step)), here.encoded_batch(step), err_msg=f"{step}"
            )
