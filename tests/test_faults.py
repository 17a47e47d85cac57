"""Faults injected under the loader (asyncflat.testing.faults.FaultyStore) against the clean oracle.

* transient errors and latency: every batch equals a clean run's, every sequence is served
  exactly once per epoch, and each injected failure shows up as one retry;
* a permanent fault: the load that needs the data raises promptly, naming the array, range and
  cause; other steps stay usable; once the fault is gone the failed minipoch is filled afresh;
* corrupt (truncated) responses: CorruptChunkError, never wrong data; a later load retries;
* load_timeout_s: a load stuck behind slow storage raises LoadTimeoutError and the loader
  stays usable.

The tokens of these datasets are their own offsets (token id = position in ``encoded_tokens``),
so every served row names the row it came from, independently of the oracle.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import zarr
from conftest import oracle as make_oracle
from reference_impl import ReferenceLoader, load_split_arrays
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import LocalStore, WrapperStore

import asyncflat
from asyncflat import (
    AsyncflatError,
    ConfigError,
    CorruptChunkError,
    EngineOptions,
    FlatTokensParams,
    LoadTimeoutError,
    RetryPolicy,
    ShufflingLoader,
    StorageError,
    TokenBatchParams,
    TransientStorageError,
)
from asyncflat.testing.faults import FaultCounts, FaultyStore

pytestmark = pytest.mark.timeout(120)

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
FAST_RETRY = RetryPolicy(
    max_attempts=8, initial_backoff_s=0.001, max_backoff_s=0.004, deadline_s=20
)
BATCH = TokenBatchParams(len=16, batch=8)
STREAMS, RBPSB, SPB, SEED = 2, 3, 4, 7
FORMATS = ("v3", "v2", "v3_sharded")
#: How a damaged chunk is reported: by the codec, or by the checks before it (a whole object
#: or range that came back short, a Blosc frame whose header disagrees with its length).
CORRUPT = r"encoded_tokens.*(do(es)? not decode|is truncated|not a whole Blosc frame)"


def positional_sequences(seed: int, count: int, max_len: int) -> list[np.ndarray]:
    """Ragged sequences whose token ids are their offsets in the concatenated tokens."""
    lengths = np.random.default_rng(seed).integers(1, max_len + 1, count)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [np.arange(offsets[i], offsets[i + 1]) for i in range(count)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    seqs = positional_sequences(0, 300, 60)
    root = tmp_path_factory.mktemp("faults")
    kwargs: dict[str, dict[str, Any]] = {
        "v3": dict(chunk_tokens=512),
        "v2": dict(zarr_format=2, chunk_tokens=512),
        "v3_sharded": dict(chunk_tokens=128, shard_tokens=1024),
    }
    paths = {}
    for name, kw in kwargs.items():
        paths[name] = str(root / f"{name}.zarr")
        asyncflat.write_flat_tokens(paths[name], {"train": seqs, "validation": seqs[:20]}, **kw)
    return paths


def oracle(path: str, packing: bool) -> Any:
    return make_oracle(path, params(path, packing), BATCH)


def params(path: str, packing: bool) -> FlatTokensParams:
    return FlatTokensParams(path, STREAMS, RBPSB, SPB, SEED, packing)


class Wrap:
    """A store_wrapper that remembers the FaultyStore it made (to read counts, or heal it)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.store: FaultyStore | None = None

    def __call__(self, store: Any) -> FaultyStore:
        self.store = FaultyStore(store, **self.settings)
        return self.store


def assert_step(batch: Any, expected: ReferenceLoader, step: int) -> None:
    targets, starts = expected.batch(step)
    np.testing.assert_array_equal(np.asarray(batch.targets), targets, err_msg=f"step {step}")
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), starts, err_msg=f"step {step}")


def served_rows(targets: np.ndarray, packing: bool, seq_starts: np.ndarray) -> np.ndarray:
    """The unshuffled row each batch row came from, read off the positional token ids."""
    first = targets[:, 0].astype(np.int64)
    if packing:
        return first // BATCH.len
    return np.searchsorted(seq_starts.astype(np.int64), first, side="right") - 1


# -- the wrapper itself ---------------------------------------------------------------------------


def _get(store: FaultyStore, key: str) -> Any:
    return asyncio.run(store.get(key, default_buffer_prototype()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(transient_rate=1.5), "transient_rate must be a number in"),
        (dict(corrupt_rate=-0.1), "corrupt_rate must be a number in"),
        (dict(latency_s=float("nan")), "latency_s must be a number >= 0"),
        (dict(latency_s="1"), "latency_s must be a number"),
        (dict(corrupt_mode="shred"), "corrupt_mode must be one of"),
        (dict(permanent_keys=[3]), "permanent_keys must hold glob strings"),
        (dict(max_transient_per_request=-1), "max_transient_per_request"),
        (dict(seed=1.5), "seed must be an int"),
    ],
)
def test_faulty_store_validates_its_settings(
    stores: dict[str, str], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        FaultyStore(LocalStore(stores["v3"], read_only=True), **kwargs)


def test_faulty_store_is_deterministic_counts_and_heals(stores: dict[str, str]) -> None:
    def outcomes(seed: int) -> list[str]:
        store = FaultyStore(LocalStore(stores["v3"], read_only=True), transient_rate=0.5, seed=seed)
        result = []
        for _ in range(12):
            try:
                _get(store, "train/encoded_tokens/c/1")
                result.append("ok")
            except TransientStorageError:
                result.append("transient")
        return result

    assert outcomes(3) == outcomes(3)
    assert {"ok", "transient"} <= set(outcomes(3))

    store = FaultyStore(
        LocalStore(stores["v3"], read_only=True),
        permanent_keys=["train/encoded_tokens/c/[23]"],
        transient_rate=1.0,
        max_transient_per_request=2,
        corrupt_rate=1.0,
        fault_keys="train/encoded_tokens/*",
    )
    copy = store.with_read_only(True)  # what zarr does: the copy shares settings and counts
    assert isinstance(copy, FaultyStore) and copy.counts is store.counts
    with pytest.raises(
        PermissionError, match=r"injected permanent fault: train/encoded_tokens/c/2"
    ):
        _get(copy, "train/encoded_tokens/c/2")
    whole = len(_get(LocalStore(stores["v3"], read_only=True), "train/encoded_tokens/c/0"))  # type: ignore[arg-type]
    for _ in range(2):  # at most two transient failures in a row per request, then it goes through
        with pytest.raises(TransientStorageError):
            _get(store, "train/encoded_tokens/c/0")
    assert len(_get(store, "train/encoded_tokens/c/0")) < whole  # ...truncated (corrupt_rate 1)
    assert _get(store, "train/zarr.json") is not None  # outside fault_keys: untouched
    assert store.counts == FaultCounts(requests=5, delayed=0, transient=2, permanent=1, corrupted=1)

    store.configure(permanent_keys=(), transient_rate=0.0, corrupt_rate=0.0)
    assert len(_get(copy, "train/encoded_tokens/c/2")) > 0
    assert len(_get(copy, "train/encoded_tokens/c/0")) == whole
    with pytest.raises(ConfigError, match="unknown setting"):
        store.configure(latency=1)


def test_metadata_is_never_corrupted(stores: dict[str, str]) -> None:
    store = FaultyStore(LocalStore(stores["v2"], read_only=True), corrupt_rate=1.0)
    raw = LocalStore(stores["v2"], read_only=True)
    for key in ("train/.zattrs", "train/encoded_tokens/.zarray", ".zgroup"):
        assert _get(store, key).to_bytes() == _get(raw, key).to_bytes()  # type: ignore[arg-type]
    assert store.counts.corrupted == 0


# -- transient faults: nothing lost ---------------------------------------------------------------


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_transient_faults_and_latency_change_nothing(
    stores: dict[str, str], fmt: str, packing: bool
) -> None:
    path = stores[fmt]
    expected = oracle(path, packing)
    _, seq_starts = load_split_arrays(path, "train")
    wrap = Wrap(
        transient_rate=0.3,
        max_transient_per_request=4,
        latency_s=0.0005,
        latency_jitter_s=0.002,
        transient_error=ConnectionResetError if fmt == "v3_sharded" else TransientStorageError,
        seed=FORMATS.index(fmt),
    )
    options = EngineOptions(load_timeout_s=30, retry=FAST_RETRY, max_concurrent_reads=4)
    order = np.random.default_rng(1).permutation(expected.step_count).tolist()
    seen = []
    with ShufflingLoader(
        "train", params(path, packing), BATCH, SINGLE, options=options, store_wrapper=wrap
    ) as loader:
        assert loader.step_count == expected.step_count
        for step in order:
            batch = loader.load(step)
            assert_step(batch, expected, step)
            rows = served_rows(np.asarray(batch.targets), packing, seq_starts)
            np.testing.assert_array_equal(rows, expected.row_ids(step))
            seen.append(rows)
        assert wrap.store is not None
        # Fills go on in the background: bracket the engine's count between two snapshots.
        before = wrap.store.counts.transient
        retries = loader.stats()["retries"]
        after = wrap.store.counts.transient
    assert before > 5 and wrap.store.counts.delayed > 0
    assert before <= retries <= after  # each injected failure was retried once, none lost
    # One epoch serves every row of the used read blocks exactly once.
    all_rows = np.sort(np.concatenate(seen))
    np.testing.assert_array_equal(all_rows, np.arange(expected.read_block_count * SPB))


def test_an_epoch_through_iter_under_faults_serves_each_sequence_once(
    stores: dict[str, str],
) -> None:
    path = stores["v3"]
    expected = oracle(path, False)
    _, seq_starts = load_split_arrays(path, "train")
    wrap = Wrap(transient_rate=0.25, max_transient_per_request=3, latency_s=0.001, seed=5)
    options = EngineOptions(load_timeout_s=30, retry=FAST_RETRY, prefetch_to_device=2)
    counts = np.zeros(expected.seq_count, np.int64)
    with ShufflingLoader(
        "train", params(path, False), BATCH, SINGLE, options=options, store_wrapper=wrap
    ) as loader:
        for step, batch in loader.iter():
            assert_step(batch, expected, step)
            np.add.at(counts, served_rows(np.asarray(batch.targets), False, seq_starts), 1)
    used = expected.read_block_count * SPB
    assert (counts[:used] == 1).all() and (counts[used:] == 0).all()
    assert wrap.store is not None and wrap.store.counts.transient > 0


# -- permanent faults -----------------------------------------------------------------------------


def _chunks_of_rows(rows: np.ndarray, chunk: int) -> set[int]:
    tokens = (np.asarray(rows)[:, None] * BATCH.len + np.array([0, BATCH.len - 1])).reshape(-1)
    return set((tokens // chunk).tolist())


@pytest.mark.parametrize("error", [PermissionError, FileNotFoundError])
def test_a_permanent_fault_fails_only_the_loads_that_need_it(
    stores: dict[str, str], error: type
) -> None:
    """The failure model of docs/reliability.md, packed, chunk c lost for good and then restored.

    A fill that needs chunk c fails; a load served by that fill raises (StorageError naming the
    array, range and cause) and drops it. Steps whose fills avoid c are unaffected. While the
    fault lasts, each load needing c raises again (a fresh fill, not a cached error); once it
    is gone the same step loads correctly.
    """
    path, chunk = stores["v3"], 512
    expected = oracle(path, True)
    bad = 5
    bad_key = f"train/encoded_tokens/c/{bad}"

    def fill_chunks(step: int) -> set[int]:
        """Chunks of every block in the fills (stream, minipoch) that serve ``step``."""
        chunks: set[int] = set()
        for b in range(BATCH.batch):
            stream, minipoch, _ = expected.locate(step, b)
            for block in expected.buffer_blocks(stream, minipoch):
                chunks |= _chunks_of_rows(np.arange(block * SPB, (block + 1) * SPB), chunk)
        return chunks

    doomed = [
        s for s in range(expected.step_count) if bad in _chunks_of_rows(expected.row_ids(s), chunk)
    ]
    safe = [s for s in range(expected.step_count) if bad not in fill_chunks(s)]
    assert len(doomed) >= 2 and len(safe) >= 10

    wrap = Wrap(permanent_keys=[bad_key], permanent_error=error)
    options = EngineOptions(load_timeout_s=30, retry=FAST_RETRY)
    with ShufflingLoader(
        "train", params(path, True), BATCH, SINGLE, options=options, store_wrapper=wrap
    ) as loader:
        for _ in range(2):  # raises every time while the fault lasts: no stale state
            t0 = time.monotonic()
            with pytest.raises(StorageError) as info:
                loader.load(doomed[0])
            assert time.monotonic() - t0 < 5
            message = str(info.value)
            assert f"step {doomed[0]}" in message and "encoded_tokens[" in message, message
            assert bad_key in message and error.__name__ in message, message
            assert not isinstance(info.value, TransientStorageError)  # not retried: permanent
        for step in safe:
            assert_step(loader.load(step), expected, step)
        with pytest.raises(StorageError, match="encoded_tokens"):
            loader.load(doomed[1])

        assert wrap.store is not None
        wrap.store.configure(permanent_keys=())  # the object is back
        for step in doomed + safe[:5]:
            assert_step(loader.load(step), expected, step)
        assert loader.stats()["retries"] == 0
        assert wrap.store.counts.permanent >= 3


def test_reads_of_a_failed_fill_never_land_in_another_fills_buffer(stores: dict[str, str]) -> None:
    """Regression: a failed fill was dropped while some of its reads were still in flight;
    they then wrote into the buffer, which a fill of another minipoch had meanwhile taken, and
    that fill served wrong rows. Jittered latency keeps reads in flight when fills fail; every
    load that does not raise must be right."""
    path, bad = stores["v3"], 5
    rng = np.random.default_rng(3)
    failures = 0
    for trial in range(8):
        packing = trial % 2 == 0
        expected = oracle(path, packing)
        wrap = Wrap(
            permanent_keys=[f"train/encoded_tokens/c/{bad}"],
            latency_jitter_s=0.02,
            seed=trial,
            fault_keys="train/encoded_tokens/c/*",
        )
        options = EngineOptions(load_timeout_s=30, retry=FAST_RETRY)
        with ShufflingLoader(
            "train", params(path, packing), BATCH, SINGLE, options=options, store_wrapper=wrap
        ) as loader:
            for step in rng.integers(0, expected.step_count, 25).tolist():
                try:
                    batch = loader.load(step)
                except StorageError:
                    failures += 1
                    continue
                assert_step(batch, expected, step)
    assert failures > 10


@pytest.mark.parametrize("error", [TransientStorageError, ConnectionResetError])
def test_retries_exhausted_raise_within_the_policy_bounds(
    stores: dict[str, str], error: type
) -> None:
    path = stores["v3"]
    expected = oracle(path, True)
    wrap = Wrap(transient_rate=1.0, transient_error=error, fault_keys="train/encoded_tokens/c/*")
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02, deadline_s=5)
    options = EngineOptions(load_timeout_s=30, retry=policy)
    with ShufflingLoader(
        "train", params(path, True), BATCH, SINGLE, options=options, store_wrapper=wrap
    ) as loader:
        t0 = time.monotonic()
        with pytest.raises(
            TransientStorageError,
            match=r"encoded_tokens\[\d+:\d+\].*still failing after 3 attempts",
        ):
            loader.load(3)
        assert time.monotonic() - t0 < 5
        assert wrap.store is not None
        wrap.store.configure(transient_rate=0.0)
        for step in (3, 0, expected.step_count - 1):
            assert_step(loader.load(step), expected, step)


# -- corrupt responses ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_responses_raise_corrupt_chunk_error_and_are_retried_later(
    stores: dict[str, str], fmt: str
) -> None:
    path = stores[fmt]
    expected = oracle(path, True)
    # A sharded read costs an index and a chunk request per object, so fewer are corrupted.
    rate = 0.08 if fmt == "v3_sharded" else 0.3
    wrap = Wrap(corrupt_rate=rate, seed=11, fault_keys="train/encoded_tokens/*")
    options = EngineOptions(load_timeout_s=30, retry=FAST_RETRY)
    failures = 0
    with ShufflingLoader(
        "train", params(path, True), BATCH, SINGLE, options=options, store_wrapper=wrap
    ) as loader:
        for step in range(0, expected.step_count, 3):
            for _ in range(30):
                try:
                    batch = loader.load(step)
                except CorruptChunkError as exc:
                    assert re.search(CORRUPT, str(exc)), str(exc)
                    failures += 1
                    continue
                assert_step(batch, expected, step)
                break
            else:
                pytest.fail(
                    f"step {step} never loaded while {rate:.0%} of responses were truncated"
                )
    assert wrap.store is not None and wrap.store.counts.corrupted > 0 and failures > 0


def test_a_corrupt_shard_index_is_read_afresh_once_the_fault_is_gone(
    stores: dict[str, str],
) -> None:
    """Regression: the store layer caches shard indexes; a damaged one used to stay cached, so
    every later read of that shard failed for the life of the loader."""
    path = stores["v3_sharded"]
    expected = oracle(path, True)
    wrap = Wrap(corrupt_rate=1.0, fault_keys="train/encoded_tokens/*")
    with ShufflingLoader(
        "train",
        params(path, True),
        BATCH,
        SINGLE,
        store_wrapper=wrap,
        options=EngineOptions(load_timeout_s=30),
    ) as loader:
        with pytest.raises(CorruptChunkError, match=CORRUPT):
            loader.load(0)
        assert wrap.store is not None
        wrap.store.configure(corrupt_rate=0.0)
        # Reads the failed fill issued while the store was still corrupt may be in flight and
        # shared with the next fill; they fail once more at most. What must not happen is the
        # old bug: a damaged index cached for good, failing every later attempt.
        for _attempt in range(5):
            try:
                batch = loader.load(0)
                break
            except CorruptChunkError:
                time.sleep(0.2)
        else:
            pytest.fail("the shard stayed unreadable after the fault was gone")
        assert_step(batch, expected, 0)
        for step in (1, 2):
            assert_step(loader.load(step), expected, step)


# -- timeouts -------------------------------------------------------------------------------------


def test_a_load_stuck_on_slow_storage_times_out_and_the_loader_recovers(
    stores: dict[str, str],
) -> None:
    path = stores["v2"]
    expected = oracle(path, False)
    wrap = Wrap(latency_s=1.0, fault_keys="train/encoded_tokens/[0-9]*")  # chunks, not .zarray
    options = EngineOptions(load_timeout_s=0.3, retry=FAST_RETRY)
    with ShufflingLoader(
        "train", params(path, False), BATCH, SINGLE, options=options, store_wrapper=wrap
    ) as loader:
        t0 = time.monotonic()
        with pytest.raises(LoadTimeoutError):
            loader.load(4)
        assert time.monotonic() - t0 < 1.0
        assert wrap.store is not None
        wrap.store.configure(latency_s=0.0)
        # The reads already sleeping finish and the fill they belong to completes: later loads
        # succeed (bounded: it must recover, not hang). Each may still time out once on a busy
        # machine (0.3 s is the loader's whole budget, a fresh fill's included), not for 10 s.
        deadline = time.monotonic() + 10
        for step in (4, 5, 0):
            while True:
                try:
                    batch = loader.load(step)
                    break
                except LoadTimeoutError:
                    if time.monotonic() > deadline:
                        pytest.fail(f"load({step}) did not succeed within 10 s of the heal")
            assert_step(batch, expected, step)


def test_every_fault_error_is_an_asyncflat_error() -> None:
    """What a trainer catches: every failure above is an AsyncflatError (and an OSError where
    it is about storage), so one except clause covers the library."""
    for cls in (StorageError, TransientStorageError, CorruptChunkError, LoadTimeoutError):
        assert issubclass(cls, AsyncflatError)
    assert issubclass(StorageError, OSError) and issubclass(LoadTimeoutError, TimeoutError)


def test_wrapper_with_a_directory_path_store(tmp_path: Path) -> None:
    """FaultyStore wraps whatever the loader opens (here a LocalStore under a plain path)."""
    seqs = positional_sequences(1, 40, 20)
    path = str(tmp_path / "d.zarr")
    asyncflat.write_flat_tokens(path, {"train": seqs}, chunk_tokens=64)
    kinds = []

    def wrap(store: Any) -> FaultyStore:
        kinds.append(type(store).__name__)
        return FaultyStore(store)

    with ShufflingLoader(
        "train",
        FlatTokensParams(path, 1, 2, 2, 0, True),
        TokenBatchParams(len=8, batch=2),
        SINGLE,
        store_wrapper=wrap,
    ) as loader:
        loader.load(0)
    assert kinds == ["LocalStore"]


def test_a_store_wrapper_that_raises_closes_the_store_it_was_given(
    stores: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's store_wrapper fails: its error reaches the caller, and the store opened
    for it is closed (a bucket's client session would otherwise stay open)."""
    import asyncflat.storage.filesystems as filesystems

    closed: list[Any] = []
    real = filesystems.close_store

    async def close_store(store: Any) -> None:
        closed.append(store)
        await real(store)

    monkeypatch.setattr(filesystems, "close_store", close_store)

    def broken(store: Any) -> Any:
        raise RuntimeError("the wrapper is broken")

    with pytest.raises(RuntimeError, match="the wrapper is broken"):
        ShufflingLoader("train", params(stores["v3"], True), BATCH, SINGLE, store_wrapper=broken)
    assert len(closed) == 1


class _IgnoresRanges(WrapperStore[Store]):
    """An HTTP server that ignores the Range header: every ranged read gets the whole object."""

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        return await self._store.get(key, prototype, None)


@pytest.mark.parametrize("layout", ["v3_sharded", "v3_uncompressed"])
def test_a_store_that_ignores_byte_ranges_is_refused_not_read(
    stores: dict[str, str], layout: str, tmp_path: Path
) -> None:
    # Sharded arrays are read by ranges (the shard index, each inner chunk), and so are the
    # rows of uncompressed chunks without checksums: whole objects in their place were taken
    # for the range (an index parsed from the shard's first bytes, rows of the wrong tokens:
    # wrong batches and no error) wherever they were not shorter than asked.
    path = stores["v3_sharded"]
    if layout == "v3_uncompressed":
        tokens, starts = load_split_arrays(stores["v3"], "train")
        path = str(tmp_path / "uncompressed.zarr")
        group = zarr.open_group(path, mode="w", zarr_format=3).create_group("train")
        group.create_array("encoded_tokens", data=tokens, chunks=(1024,), compressors=None)
        group.create_array("seq_starts", data=starts, chunks=(1024,))
        group.attrs["max_token_id"] = int(tokens.max() >> 1)
    expected = oracle(path, True)
    options = EngineOptions(retry=FAST_RETRY, load_timeout_s=30)
    with pytest.raises(StorageError, match=r"answered a range of \d+ bytes with \d+"):
        with ShufflingLoader(
            "train",
            params(path, True),
            BATCH,
            SINGLE,
            options=options,
            store_wrapper=_IgnoresRanges,
        ) as loader:
            for step in range(loader.step_count):
                assert_step(loader.load(step), expected, step)  # never a wrong batch
