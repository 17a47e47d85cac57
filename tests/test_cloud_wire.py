"""The wire through a real client: requests in flight, demand reads first, a fast open.

gcsfs against the GCS emulator and s3fs against moto (fixtures in conftest.py), behind the TCP
proxy of helpers/servers.py, which adds latency and counts the requests in flight (head sent
to response fully delivered) as the network would see them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers.servers import TcpProxy

import asyncflat
from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
from asyncflat.format.split import metadata_keys
from asyncflat.storage.filesystems import close_filesystem, filesystem
from asyncflat.storage.limiter import demand_headroom

pytestmark = pytest.mark.cloud

BUCKET = "asyncflat-test"
LEN, SPB, RBPSB = 32, 8, 32  # a block = one 256-token chunk; a fill reads 32 chunks
BATCH = TokenBatchParams(len=LEN, batch=8)
CONCURRENCY = 16


class Backend:
    def __init__(self, name: str, server: Any) -> None:
        self.name, self.server = name, server
        self.protocol = "gs" if name == "gcs" else "s3"

    def url(self, key: str) -> str:
        return f"{self.protocol}://{BUCKET}/{key}"

    def options(self, proxy: TcpProxy | None = None) -> dict[str, Any]:
        return dict(self.server.storage_options(proxy.endpoint if proxy is not None else None))

    def proxy(self, **kwargs: Any) -> TcpProxy:
        return TcpProxy(self.server.endpoint, dialect=self.name, **kwargs)


@pytest.fixture(scope="module", params=["gcs", "s3"])
def backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backend]:
    server = request.getfixturevalue("gcs_emulator" if request.param == "gcs" else "s3_server")
    backend = Backend(request.param, server)
    root = tmp_path_factory.mktemp("wire")
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 1000, 64 * SPB * LEN)
    sequences = np.split(tokens, np.arange(LEN, len(tokens), LEN))
    for fmt in (2, 3):
        asyncflat.write_flat_tokens(
            root / f"v{fmt}.zarr",
            {"train": sequences, "validation": sequences[:4]},
            zarr_format=fmt,
            chunk_tokens=SPB * LEN,
        )

    async def upload() -> None:
        fs, _ = filesystem(backend.url(""), backend.options())
        try:
            for fmt in (2, 3):
                await fs._put(
                    str(root / f"v{fmt}.zarr"), f"{BUCKET}/wire/v{fmt}.zarr", recursive=True
                )
        finally:
            await close_filesystem(fs)

    asyncio.run(upload())
    yield backend


def _params(url: str, options: dict[str, Any]) -> FlatTokensParams:
    return FlatTokensParams(url, 1, RBPSB, SPB, 0, True, storage_options=options)


@pytest.mark.parametrize("client", ["fsspec", "obstore"])
def test_a_fill_puts_the_configured_concurrency_on_the_wire(backend: Backend, client: str) -> None:
    """aiobotocore's pool (10) would cap S3 at 10 requests in flight: it is sized from
    ``max_concurrent_reads``, and a fill keeps that many requests on the wire (with either
    client)."""
    options = EngineOptions(prefetch=False, max_concurrent_reads=CONCURRENCY)
    with backend.proxy(latency_s=0.1) as proxy:
        storage = {**backend.options(proxy), "client": client}
        params = _params(backend.url("wire/v3.zarr"), storage)
        with ShufflingLoader("train", params, BATCH, options=options) as loader:
            proxy.reset_counts()
            loader.load(0)  # without prefetch: one fill of 32 chunks, nothing else
            assert loader.stats()["requests"] >= 2 * CONCURRENCY
            peak = proxy.peak_in_flight
    assert CONCURRENCY <= peak <= CONCURRENCY + demand_headroom(CONCURRENCY)


def test_small_chunks_get_more_reads_in_flight_by_default(backend: Backend) -> None:
    """A read waits out the latency whatever its size: by default a store of small chunks gets
    as many reads in flight as keep 4 MiB of chunks on the wire (at most 64), where 16 left
    a latency-bound store's fill at a quarter of its bandwidth."""
    default = EngineOptions().reads_in_flight(token_chunk=SPB * LEN, remote=True)
    assert default == 64  # 1 KiB chunks
    with backend.proxy(latency_s=0.1) as proxy:
        params = _params(backend.url("wire/v3.zarr"), backend.options(proxy))
        with ShufflingLoader("train", params, BATCH, options=EngineOptions(prefetch=False)) as ld:
            proxy.reset_counts()
            ld.load(0)  # without prefetch: one fill of 32 chunks, nothing else
            limit = ld.stats()["concurrency_limit"]
            peak = proxy.peak_in_flight
    assert limit == default
    assert 2 * CONCURRENCY <= peak <= default + demand_headroom(default)  # the whole fill at once


def test_the_pool_size_never_overrides_the_callers(backend: Backend) -> None:
    async def main() -> Any:
        opts = backend.options()
        if backend.name == "s3":
            opts["config_kwargs"] = {"max_pool_connections": 3}
        else:
            opts["session_kwargs"] = {"trust_env": False}
        fs, _ = filesystem(backend.url(""), opts, max_connections=400)
        try:
            if backend.name == "s3":
                client = await fs.set_session()
                return client.meta.config.max_pool_connections
            session = await fs._set_session()
            return session.connector.limit
        finally:
            await close_filesystem(fs)

    # S3: the caller's 3 stays. GCS: the caller's session options stay, the pool is raised.
    assert asyncio.run(main()) == (3 if backend.name == "s3" else 400)


def test_s3_filesystems_share_botocore_models_not_sessions(s3_server: Any) -> None:
    """Each loader's s3fs gets a session of its own (its credentials, its loop) over the
    process's one botocore data loader: the S3 service model is parsed once per process, not
    once per loader. A session the caller passes in is used as it is."""
    import aiobotocore.session

    backend = Backend("s3", s3_server)

    async def main() -> tuple[Any, Any, Any, Any]:
        made = [filesystem(backend.url(""), backend.options()) for _ in range(2)]
        own = aiobotocore.session.AioSession()
        mine, _ = filesystem(backend.url(""), {**backend.options(), "session": own})
        try:
            for fs, _ in made:
                await fs._ls(BUCKET)  # the client is made from the session, and works
            await mine._ls(BUCKET)
            (first, _), (second, _) = made
            return first.session, second.session, mine.session, own
        finally:
            for fs, _ in made:
                await close_filesystem(fs)
            await close_filesystem(mine)

    first, second, mine, own = asyncio.run(main())
    assert first is not second  # never one session (credentials, locks) for two loops
    loader = first.get_component("data_loader")
    assert second.get_component("data_loader") is loader
    assert loader.list_available_services("service-2")  # a real botocore loader
    assert mine is own  # the caller's session, untouched
    assert own.get_component("data_loader") is not loader


def test_s3_filesystems_share_botocore_models_per_data_path(
    s3_server: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that searches a custom data path (``AWS_DATA_PATH``: a user's own service
    models) gets a shared data loader of that path, never the default one."""
    backend = Backend("s3", s3_server)

    async def main() -> tuple[Any, Any]:
        plain, _ = filesystem(backend.url(""), backend.options())
        monkeypatch.setenv("AWS_DATA_PATH", str(tmp_path))
        custom, _ = filesystem(backend.url(""), backend.options())
        again, _ = filesystem(backend.url(""), backend.options())
        try:
            assert again.session.get_component("data_loader") is custom.session.get_component(
                "data_loader"
            )
            return plain.session.get_component("data_loader"), custom.session.get_component(
                "data_loader"
            )
        finally:
            for fs in (plain, custom, again):
                await close_filesystem(fs)

    default, custom = asyncio.run(main())
    assert custom is not default
    assert str(tmp_path) in custom.search_paths
    assert str(tmp_path) not in default.search_paths


def _open_requests(backend: Backend, fmt: str) -> tuple[list[Any], int]:
    with backend.proxy(latency_s=0.2) as proxy:
        params = _params(backend.url(f"wire/{fmt}.zarr"), backend.options(proxy))
        with ShufflingLoader("train", params, BATCH):
            opened = list(proxy.requests)
            peak = proxy.peak_in_flight
    return opened, peak


@pytest.mark.parametrize("fmt", ["v3", "v2"])
def test_a_fresh_open_costs_two_round_trips(backend: Backend, fmt: str) -> None:
    """Every metadata object either format may hold is requested at once (zarr's walk down the
    hierarchy is then served from them), then the ends of seq_starts: two round trips, and the
    chunk holding both ends is read once."""
    requests, peak = _open_requests(backend, fmt)
    keys = metadata_keys("train")
    paths = [r.path for r in requests]
    first = paths[: len(keys)]
    assert sorted(p.split(f"wire/{fmt}.zarr/", 1)[1] for p in first) == sorted(keys)
    # Requested together: zarr's walk, one level per round trip, never had more than 4 in
    # flight (a loaded machine may delay some connections, so not all 15 need overlap).
    assert peak >= 8
    rest = paths[len(keys) :]
    chunk0 = "train/seq_starts/c/0" if fmt == "v3" else "train/seq_starts/0"
    assert [p.split(f"wire/{fmt}.zarr/", 1)[1] for p in rest] == [chunk0]
