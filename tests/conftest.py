"""Shared test set-up: 8 CPU devices for jax (set before jax is imported) and small datasets."""

from __future__ import annotations

import os

# Must precede the first `import jax` anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gcsfs probes the endpoint over gRPC+TLS by default, which makes every emulator call take 60 s.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest


def random_sequences(
    seed: int, count: int, *, max_len: int = 300, vocab: int = 1000
) -> list[np.ndarray]:
    """Ragged token-id sequences with lengths in [1, max_len]."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, max_len + 1)) for _ in range(count)]


def random_store(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    seed: int,
    count: int,
    *,
    validation: int,
    chunk_tokens: int,
) -> str:
    """A module's dataset: ``count`` random sequences of up to 80 tokens in ``train`` and the
    first ``validation`` of them in ``validation``, under a fresh ``name`` folder."""
    import asyncflat

    path = str(tmp_path_factory.mktemp(name) / "data.zarr")
    seqs = random_sequences(seed, count, max_len=80)
    asyncflat.write_flat_tokens(
        path, {"train": seqs, "validation": seqs[:validation]}, chunk_tokens=chunk_tokens
    )
    return path


def oracle(data: Any, params: Any, batch: Any = None, *, split: str = "train") -> Any:
    """The reference loader (tests/reference_impl.py) for the same data and parameters.

    ``data``: a dataset path (its arrays are read once per session) or ``(tokens, seq_starts)``.
    ``params``: a ``FlatTokensParams`` with ``batch`` a ``TokenBatchParams``, or a ``ShufflePlan``
    (which carries both).
    """
    if batch is None:
        seq_len, batch_size = params.seq_len, params.batch
    else:
        seq_len, batch_size = batch.len, batch.batch
    key = (
        seq_len,
        batch_size,
        params.streams,
        params.read_blocks_per_shuffle_buffer,
        params.sequences_per_read_block,
        params.seed,
        params.sequence_packing,
    )
    if isinstance(data, (str, os.PathLike)):
        return _oracle_of_path(os.fspath(data), split, key)
    return _make_oracle(data[0], data[1], key)


@functools.lru_cache(maxsize=32)
def _oracle_of_path(path: str, split: str, key: tuple[Any, ...]) -> Any:
    from reference_impl import load_split_arrays

    return _make_oracle(*load_split_arrays(path, split), key)


def _make_oracle(tokens: np.ndarray, starts: np.ndarray, key: tuple[Any, ...]) -> Any:
    from reference_impl import ReferenceLoader

    seq_len, batch, streams, rbpsb, spb, seed, packing = key
    return ReferenceLoader(
        tokens,
        starts,
        seq_len=seq_len,
        batch=batch,
        streams=streams,
        read_blocks_per_shuffle_buffer=rbpsb,
        sequences_per_read_block=spb,
        seed=seed,
        sequence_packing=packing,
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` first (the order otherwise kept): with ``-n 2`` a worker then
    takes a minutes-long soak at the start, not near the end while the other runs dry."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """:func:`wait_until` on an event loop (the loop keeps running between polls)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.002)


#: streams, blocks per buffer, sequences per block, seed, packing of ``unserved_tail``'s layout
UNSERVED_TAIL_PARAMS = (2, 16, 1, 5, True)


@pytest.fixture(scope="session")
def unserved_tail(tmp_path_factory: pytest.TempPathFactory) -> str:
    """20,000 tokens: with ``UNSERVED_TAIL_PARAMS`` and batches of 8 rows of 16 tokens, the last
    minipoch's rows all lie in the tail no step serves (its first step would be ``step_count``,
    which no step reaches), and the one before it is served from 4 steps before the end."""
    import asyncflat

    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 41, 1000)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), 20_000)]
    lengths = np.append(lengths, 20_000 - lengths.sum())
    path = str(tmp_path_factory.mktemp("unserved-tail") / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": [rng.integers(1, 1000, n) for n in lengths]})
    return path


@pytest.fixture(scope="session")
def small_sequences() -> list[np.ndarray]:
    return random_sequences(0, 3000)


# -- cloud: object-store servers on 127.0.0.1 (tests/helpers/servers.py), started on first use --


@pytest.fixture(scope="session")
def gcs_emulator():
    """gcp-storage-emulator in memory (suffix ranges and listen backlog fixed), one bucket."""
    from helpers.servers import GcsEmulator

    with GcsEmulator(bucket="asyncflat-test") as emulator:
        yield emulator


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server, one bucket; fake credentials and no EC2 metadata probing meanwhile."""
    from helpers.servers import MOTO_ENV, MotoS3

    with pytest.MonkeyPatch.context() as patch:
        for name, value in MOTO_ENV.items():
            patch.setenv(name, value)
        with MotoS3(bucket="asyncflat-test") as server:
            yield server


@pytest.fixture(autouse=True)
def _logging_as_found() -> Iterator[None]:
    """Each test leaves logging's levels and root handlers as it found them: the CLI's ``main()``
    configures logging the way a command line should, which would change what later tests see."""
    loggers = [logging.getLogger(), logging.getLogger("asyncflat")]
    levels = [lg.level for lg in loggers]
    handlers = list(logging.getLogger().handlers)
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)  # pytest's own capture handlers come and go by phase
