"""The writer on object stores: memory://, the GCS emulator and moto's S3, all on 127.0.0.1.

A dataset written to a URL must hold the same objects, byte for byte, as the same dataset
written locally, and read back through asyncflat's format module to the same arrays. Until the
commit a reader finds no dataset there (the metadata objects are written last); an overwrite
removes the old root metadata before anything else; a failed write leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import random_sequences
from zarr.core.buffer import default_buffer_prototype

from asyncflat.errors import ConfigError, DatasetFormatError, StorageError
from asyncflat.format.codec import SPLITS
from asyncflat.format.split import open_split
from asyncflat.storage.filesystems import close_store, make_store
from asyncflat.storage.guarded import guard_store
from asyncflat.writer.flat_tokens import FlatTokensWriter, OutputExistsError, write_flat_tokens

BUCKET = "asyncflat-test"
LAYOUTS: dict[str, dict[str, Any]] = {
    "v2": {"zarr_format": 2, "chunk_tokens": 512},
    "v3_sharded": {"zarr_format": 3, "chunk_tokens": 512, "shard_tokens": 2048},
}
TRAIN = random_sequences(11, 200, max_len=60)
VALIDATION = random_sequences(12, 30, max_len=60)


class Remote:
    """One object store: a URL prefix and the storage_options that reach it."""

    def __init__(self, protocol: str, options: dict[str, Any] | None) -> None:
        self.protocol, self.options = protocol, options

    def url(self, name: str) -> str:
        bucket = "asyncflat-writer-test" if self.protocol == "memory" else BUCKET
        return f"{self.protocol}://{bucket}/{name}-{uuid.uuid4().hex[:8]}.zarr"


@pytest.fixture(params=["memory", "gcs", "s3"])
def remote(request: pytest.FixtureRequest) -> Iterator[Remote]:
    if request.param == "memory":
        yield Remote("memory", None)
        return
    server = request.getfixturevalue("gcs_emulator" if request.param == "gcs" else "s3_server")
    yield Remote("gs" if request.param == "gcs" else "s3", server.storage_options())


async def _with_store(url: str, options: dict[str, Any] | None, fn: Any) -> Any:
    store = make_store(url, options)
    try:
        return await fn(store)
    finally:
        await close_store(store)


def read_split(url: str, options: dict[str, Any] | None, split: str) -> dict[str, Any]:
    """A split read through asyncflat's format module: both arrays and max_token_id."""

    async def read(store: Any) -> dict[str, Any]:
        arrays = await open_split(guard_store(store, url, allow_missing=True), split, name=url)
        return {
            "encoded_tokens": await arrays.encoded_tokens.getitem(slice(None)),
            "seq_starts": await arrays.seq_starts.getitem(slice(None)),
            "max_token_id": arrays.max_token_id,
        }

    return asyncio.run(_with_store(url, options, read))


def remote_bytes(url: str, options: dict[str, Any] | None, keys: list[str]) -> dict[str, Any]:
    async def read(store: Any) -> dict[str, Any]:
        prototype = default_buffer_prototype()
        out = {}
        for key in keys:
            buf = await store.get(key, prototype)
            out[key] = None if buf is None else buf.to_bytes()
        return out

    return asyncio.run(_with_store(url, options, read))


def remote_keys(url: str, options: dict[str, Any] | None) -> list[str]:
    async def list_all(store: Any) -> list[str]:
        return sorted([key async for key in store.list()])

    return asyncio.run(_with_store(url, options, list_all))


def local_objects(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)).replace(os.sep, "/"): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_no_dataset(url: str, options: dict[str, Any] | None) -> None:
    with pytest.raises(DatasetFormatError, match="flat-tokens zarr group"):
        read_split(url, options, "train")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_remote_write_equals_local_write(remote: Remote, layout: str, tmp_path: Path) -> None:
    url = remote.url(layout)
    local = tmp_path / "local.zarr"
    splits = {"train": TRAIN, "validation": VALIDATION}
    write_flat_tokens(local, splits, **LAYOUTS[layout])
    write_flat_tokens(url, splits, storage_options=remote.options, **LAYOUTS[layout])

    expected = local_objects(local)
    assert remote_keys(url, remote.options) == sorted(expected)
    assert remote_bytes(url, remote.options, sorted(expected)) == expected
    for split in SPLITS:
        got, want = read_split(url, remote.options, split), read_split(str(local), None, split)
        np.testing.assert_array_equal(got["encoded_tokens"], want["encoded_tokens"])
        np.testing.assert_array_equal(got["seq_starts"], want["seq_starts"])
        assert got["max_token_id"] == want["max_token_id"]


def test_reader_sees_no_dataset_until_commit(remote: Remote) -> None:
    url = remote.url("midwrite")
    writer = FlatTokensWriter(
        url, chunk_tokens=256, shard_tokens=1024, storage_options=remote.options
    )
    with writer:
        writer.append("train", TRAIN)
        keys = remote_keys(url, remote.options)
        assert any("/c/" in k for k in keys), keys  # whole shards are already stored ...
        assert not any(k.endswith("zarr.json") for k in keys), keys  # ... but no metadata
        assert_no_dataset(url, remote.options)
        writer.append("validation", VALIDATION)
    assert int(read_split(url, remote.options, "train")["seq_starts"][-1]) == sum(map(len, TRAIN))
    writer.abort()  # after the commit: nothing to discard, the dataset stays
    writer.close()
    assert int(read_split(url, remote.options, "train")["seq_starts"][-1]) == sum(map(len, TRAIN))


def test_failed_write_leaves_nothing(remote: Remote) -> None:
    url = remote.url("failed")
    with pytest.raises(KeyError):
        with FlatTokensWriter(url, chunk_tokens=64, storage_options=remote.options) as writer:
            writer.append("train", TRAIN)
            assert remote_keys(url, remote.options)  # chunks were written ...
            raise KeyError("interrupted")
    assert remote_keys(url, remote.options) == []  # ... and removed


def test_existing_remote_dataset_needs_overwrite(remote: Remote) -> None:
    url = remote.url("overwrite")
    write_flat_tokens(url, {"train": [[1, 2, 3]]}, zarr_format=2, storage_options=remote.options)
    with pytest.raises(OutputExistsError, match="already exists"):
        FlatTokensWriter(url, storage_options=remote.options)
    assert read_split(url, remote.options, "train")["max_token_id"] == 3  # untouched

    writer = FlatTokensWriter(url, overwrite=True, storage_options=remote.options)
    # The old dataset is gone (root metadata first) before anything new is written.
    assert remote_keys(url, remote.options) == []
    assert_no_dataset(url, remote.options)
    with writer:
        writer.append("train", [[9]])
    got = read_split(url, remote.options, "train")
    assert got["max_token_id"] == 9 and got["encoded_tokens"].tolist() == [19]
    assert ".zgroup" not in remote_keys(url, remote.options)  # nothing of the v2 store survives


def test_overwrite_refuses_foreign_objects(remote: Remote) -> None:
    import fsspec

    url = remote.url("foreign")
    with fsspec.open(url + "/notes.txt", "wb", **(remote.options or {})) as f:
        f.write(b"mine")
    with pytest.raises(ConfigError, match=r"not a flat-tokens store \(it holds notes.txt\)"):
        FlatTokensWriter(url, overwrite=True, storage_options=remote.options)
    assert remote_keys(url, remote.options) == ["notes.txt"]


def test_overwrite_refuses_an_object_at_the_outputs_own_path_naming_it(remote: Remote) -> None:
    """An output URL that is an object itself was refused as holding "" (an empty name)."""
    import fsspec

    url = remote.url("an-object")
    with fsspec.open(url, "wb", **(remote.options or {})) as f:
        f.write(b"mine")
    with pytest.raises(ConfigError, match=r"it holds an object at that very path\)"):
        FlatTokensWriter(url, overwrite=True, storage_options=remote.options)
    with fsspec.open(url, "rb", **(remote.options or {})) as f:
        assert f.read() == b"mine"


def test_an_output_url_with_glob_characters_touches_nothing_else(remote: Remote) -> None:
    """fsspec's rm expands glob characters: removing ``exp[12]`` must not remove exp1, exp2."""
    import fsspec

    base = remote.url("glob").removesuffix(".zarr")
    for sibling in ("exp1", "exp2"):
        with fsspec.open(f"{base}/{sibling}/notes.txt", "wb", **(remote.options or {})) as f:
            f.write(b"mine")
    url = f"{base}/exp[12]"
    write_flat_tokens(url, {"train": [[1, 2, 3]]}, storage_options=remote.options)  # mode="w"
    write_flat_tokens(url, {"train": [[4]]}, overwrite=True, storage_options=remote.options)
    with pytest.raises(KeyError):
        with FlatTokensWriter(url, overwrite=True, storage_options=remote.options) as writer:
            writer.append("train", TRAIN)
            raise KeyError("interrupted")  # the abort removes the partial output
    assert remote_keys(url, remote.options) == []
    for sibling in ("exp1", "exp2"):
        assert remote_keys(f"{base}/{sibling}", remote.options) == ["notes.txt"]


def test_storage_options_on_a_local_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="storage_options are for fsspec URLs"):
        FlatTokensWriter(tmp_path / "d", storage_options={"token": "anon"})
    assert list(tmp_path.iterdir()) == []


def test_unknown_protocol_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot write to foo://b/x.zarr"):
        FlatTokensWriter("foo://b/x.zarr")


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_write_to_a_missing_bucket_is_a_storage_error_naming_the_object(
    kind: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("gcs_emulator" if kind == "gcs" else "s3_server")
    url = ("gs" if kind == "gcs" else "s3") + "://no-such-bucket-asyncflat/d.zarr"
    with pytest.raises(StorageError, match=rf"cannot write {url}/train/encoded_tokens/c/\d+: "):
        write_flat_tokens(
            url,
            {"train": [[1, 2, 3]] * 100},
            chunk_tokens=16,
            storage_options=server.storage_options(),
        )
