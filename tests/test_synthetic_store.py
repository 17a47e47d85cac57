"""The synthetic store (asyncflat.testing.SyntheticFileSystem): the writer's bytes for the same
sequences, the reference loader's batches through ``synthetic://``, any size, and its network
model and counts."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import pickle
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import zarr
from conftest import oracle
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import FsspecStore

import asyncflat
from asyncflat import ConfigError, FlatTokensParams, ShufflingLoader, TokenBatchParams
from asyncflat.testing import SyntheticCounts, SyntheticFileSystem
from asyncflat.testing.corpus import SyntheticSplit

ARRAYS = ("encoded_tokens", "seq_starts")
SMALL: dict[str, Any] = dict(
    tokens=300_000,
    validation_tokens=7_000,
    sequence_length=300,
    min_sequence_length=20,
    chunk_tokens=1 << 16,
    vocab_size=1000,
    seed=3,
)


def _objects(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _write_same(fs: SyntheticFileSystem, path: Path, **writer: Any) -> None:
    asyncflat.write_flat_tokens(
        path,
        {name: fs.sequences(name, 0, split.sequence_count) for name, split in fs.splits.items()},
        **writer,
    )


@pytest.mark.parametrize(
    ("layout", "lengths"),
    [
        ({}, {}),  # the writer's defaults: format 3, crc32c, 32 KiB Blosc blocks
        ({"zarr_format": 2}, {}),  # seqax's layout
        ({"checksum": False, "blosc_block_bytes": 0}, {"min_sequence_length": None}),
        ({}, {"repeat_tokens": True, "sequence_length": 256, "min_sequence_length": None}),
        # an empty split and all-zero chunks: stored as the writer stores them, not left out
        ({}, {"validation_tokens": 0, "vocab_size": 1, "min_sequence_length": None}),
    ],
    ids=["v3", "v2", "v3-bare-fixed-length", "v3-repeated-tokens", "v3-empty-split-zero-ids"],
)
def test_every_object_is_the_writers_for_the_same_sequences(
    tmp_path: Path, layout: dict[str, Any], lengths: dict[str, Any]
) -> None:
    fs = SyntheticFileSystem(**{**SMALL, **lengths, **layout})
    _write_same(fs, tmp_path / "w.zarr", chunk_tokens=SMALL["chunk_tokens"], **layout)
    written = _objects(tmp_path / "w.zarr")
    served = {path.removeprefix("corpus/"): fs.cat_file(path) for path in fs.find("corpus")}
    assert sorted(served) == sorted(written)  # the same objects, metadata and every chunk
    different = [key for key in written if served[key] != written[key]]
    assert not different, f"objects that differ from the writer's: {different}"
    assert len(written) > 10  # several chunks per array, the last one partial


def test_sequences_follow_the_seed_and_the_length_rule() -> None:
    fs = SyntheticFileSystem(**SMALL)
    train = fs.splits["train"]
    lengths = np.array([s.size for s in fs.sequences("train", 0, train.sequence_count)])
    assert lengths.sum() == SMALL["tokens"]
    assert lengths[:-1].min() >= SMALL["min_sequence_length"]  # the last one is cut at the end
    full = (SMALL["tokens"] // (64 * 300)) * 64
    assert lengths[:full].reshape(-1, 64).sum(axis=1).tolist() == [64 * 300] * (full // 64)
    assert len(set(lengths.tolist())) > 50  # random lengths, not a few values
    ids = np.concatenate(fs.sequences("train", 0, train.sequence_count))
    assert ids.max() == SMALL["vocab_size"] - 1 == train.max_token_id
    again = SyntheticFileSystem(**SMALL)
    other = SyntheticFileSystem(**{**SMALL, "seed": 4})
    key = "corpus/train/encoded_tokens/c/2"
    assert fs.cat_file(key) == again.cat_file(key) != other.cat_file(key)
    fixed = SyntheticFileSystem(**{**SMALL, "min_sequence_length": None})
    assert {s.size for s in fixed.sequences("train", 0, 900)} == {300}


def test_repeated_tokens_make_alike_chunks_one_object() -> None:
    counts = SyntheticCounts()
    options = {**SMALL, "sequence_length": 256, "min_sequence_length": None}
    fs = SyntheticFileSystem(**options, repeat_tokens=True, counts=counts)
    keys = [f"corpus/train/encoded_tokens/c/{i}" for i in range(4)]
    first, *alike = [fs.cat_file(key) for key in keys]
    assert alike[0] is alike[1] is alike[2] != first  # chunk 0 holds the largest id
    assert all(fs.cat_file(key) is alike[0] for key in keys[1:] * 3)
    assert counts.chunk_requests == 13
    tokens, period = np.concatenate(fs.sequences("train", 0, 1024)), SMALL["chunk_tokens"]
    np.testing.assert_array_equal(tokens[period + 1 : 2 * period], tokens[1:period])
    distinct = SyntheticFileSystem(**options)
    assert distinct.cat_file(keys[1]) != distinct.cat_file(keys[2])


def test_zarr_reads_the_sequences_back() -> None:
    store = FsspecStore.from_url("synthetic://corpus", storage_options=SMALL, read_only=True)
    group = zarr.open_group(store, mode="r")["validation"]
    fs = SyntheticFileSystem(**SMALL)
    seqs = fs.sequences("validation", 0, fs.splits["validation"].sequence_count)
    encoded = np.asarray(group["encoded_tokens"][:])
    starts = np.asarray(group["seq_starts"][:])
    np.testing.assert_array_equal(encoded >> 1, np.concatenate(seqs))
    np.testing.assert_array_equal(np.diff(starts), [s.size for s in seqs])
    np.testing.assert_array_equal(np.flatnonzero(encoded & 1), starts[:-1])
    assert group.attrs["max_token_id"] == SMALL["vocab_size"] - 1


def test_zarr_opens_it_by_url() -> None:
    # zarr.open_group of a URL constructs the filesystem on zarr's own event loop, where zarr's
    # synchronous API (which builds the metadata documents) refuses to run.
    group = zarr.open_group("synthetic://corpus", mode="r", storage_options=SMALL)["validation"]
    fs = SyntheticFileSystem(**SMALL)
    seqs = fs.sequences("validation", 0, fs.splits["validation"].sequence_count)
    np.testing.assert_array_equal(np.asarray(group["encoded_tokens"][:]) >> 1, np.concatenate(seqs))
    assert group.attrs["max_token_id"] == SMALL["vocab_size"] - 1


def _run_script(script: str) -> None:
    """``script`` in a fresh Python with this checkout's asyncflat; a hang fails it, not the
    suite."""
    import os
    import subprocess

    repo = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]


_READ_TRAIN_BY_URL = (
    "import numpy as np, zarr\n"
    "from asyncflat.testing import SyntheticFileSystem\n"
    "o = dict(tokens=300_000, chunk_tokens=2048, sequence_length=300, seed=3)\n"
    "def check():\n"
    "    a = zarr.open_group('synthetic://c', mode='r', storage_options=o)['train']\n"
    "    got = np.asarray(a['encoded_tokens'][:]) >> 1\n"
    "    fs = SyntheticFileSystem(**o)\n"
    "    want = np.concatenate(fs.sequences('train', 0, fs.splits['train'].sequence_count))\n"
    "    assert (got == want).all()\n"
)


def test_zarr_reads_many_chunks_at_once_through_its_own_loop() -> None:
    # Chunks generated on the calling loop's executor (zarr's own here) waited for zarr's codec
    # work queued on that same executor: with more chunks in flight than its workers, zarr hung
    # for good. Its executor made small, as on a machine of a few cores.
    _run_script(
        "import zarr\n"
        "zarr.config.set({'threading.max_workers': 2, 'async.concurrency': 16})\n"
        + _READ_TRAIN_BY_URL
        + "check()\n"
    )


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork on this platform")
def test_a_process_forked_after_reading_reads_too() -> None:
    # The stores' threads do not survive a fork; their pool must not think they did.
    _run_script(
        _READ_TRAIN_BY_URL + "import os\n"
        "check()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    check()\n"
        "    os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0\n"
    )


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
def test_the_loaders_batches_from_it_are_the_references(tmp_path: Path, packing: bool) -> None:
    fs = SyntheticFileSystem(**SMALL)
    written = tmp_path / "same.zarr"
    _write_same(fs, written, chunk_tokens=SMALL["chunk_tokens"])
    counts = SyntheticCounts()
    params = FlatTokensParams(
        "synthetic://corpus",
        streams=2,
        read_blocks_per_shuffle_buffer=3,
        sequences_per_read_block=16,
        seed=7,
        sequence_packing=packing,
        storage_options={**SMALL, "counts": counts},
    )
    batch = TokenBatchParams(len=256, batch=8)
    reference = oracle(str(written), params, batch)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ShufflingLoader("train", params, batch, sharding) as loader:
        assert loader.step_count == reference.step_count > 100
        steps = [0, 1, loader.step_count // 2, loader.step_count - 1]
        for step in steps:
            got = loader.load(step)
            targets, starts = reference.batch(step)
            np.testing.assert_array_equal(np.asarray(got.targets), targets, err_msg=f"{step}")
            np.testing.assert_array_equal(np.asarray(got.is_seq_start), starts)
    assert counts.chunk_requests > 0 and counts.requests > counts.chunk_requests
    assert counts.in_flight == 0


def test_a_corpus_of_10_to_the_14_opens_and_reads_near_its_end() -> None:
    options = dict(tokens=10**14, chunk_tokens=1 << 22, min_sequence_length=128)
    counts = SyntheticCounts()
    store = FsspecStore.from_url(
        "synthetic://big", storage_options={**options, "counts": counts}, read_only=True
    )
    group = zarr.open_group(store, mode="r")["train"]
    tokens, starts = group["encoded_tokens"], group["seq_starts"]
    assert tokens.shape == (10**14,)
    count = starts.shape[0] - 1
    assert 10**14 / 2048 * 0.99 < count < 10**14 / 2048 * 1.01
    last_starts = np.asarray(starts[count - 100 :])
    tail = np.asarray(tokens[int(last_starts[0]) :])
    assert last_starts[-1] == 10**14
    np.testing.assert_array_equal(
        np.flatnonzero(tail & 1), (last_starts[:-1] - last_starts[0]).astype(np.int64)
    )
    # Two token chunks at most (the tail may straddle one boundary), one or two of seq_starts:
    # nothing near the corpus' size was generated or sent.
    assert counts.chunk_requests <= 4 and counts.bytes < 64 << 20


def test_requests_and_bytes_are_counted() -> None:
    counts = SyntheticCounts()
    fs = SyntheticFileSystem(**SMALL, counts=counts)
    keys = [f"corpus/train/encoded_tokens/c/{i}" for i in range(3)]
    sizes = [fs.info(key)["size"] for key in keys]  # a size query is not a read
    assert counts.requests == 0
    fs.cat(keys)
    fs.cat_file("corpus/zarr.json", start=0, end=10)
    assert (counts.requests, counts.chunk_requests) == (4, 3)
    assert counts.bytes == sum(sizes) + 10
    assert counts.generate_s > 0 and counts.in_flight == 0


def test_latency_is_per_request_and_concurrent_requests_overlap() -> None:
    counts = SyntheticCounts()
    fs = SyntheticFileSystem(**SMALL, latency_s=0.25, counts=counts)
    keys = [f"corpus/{split}/{name}/zarr.json" for split in fs.splits for name in ARRAYS]
    began = time.monotonic()
    fs.cat(keys)  # four metadata reads at once (nothing to generate)
    elapsed = time.monotonic() - began
    assert counts.max_in_flight == 4
    assert counts.modelled_wait_s == pytest.approx(4 * 0.25)
    assert 0.25 <= elapsed < 4 * 0.25  # one latency, not four


def test_bandwidth_per_connection_and_shared() -> None:
    keys = [f"corpus/train/encoded_tokens/c/{i}" for i in range(4)]
    sizes = [SyntheticFileSystem(**SMALL).info(key)["size"] for key in keys]
    per_connection = SyntheticCounts()
    fs = SyntheticFileSystem(**SMALL, connection_bandwidth=4e6, counts=per_connection)
    fs.cat(keys)
    assert per_connection.modelled_wait_s == pytest.approx(sum(sizes) / 4e6)
    shared = SyntheticCounts()
    fs = SyntheticFileSystem(**SMALL, total_bandwidth=4e6, counts=shared)
    began = time.monotonic()
    fs.cat(keys)
    elapsed = time.monotonic() - began
    # The shared link is first come, first served: the last response ends when every byte has
    # crossed it, and each waits for those before it.
    assert elapsed >= sum(sizes) / 4e6 * 0.99
    assert shared.modelled_wait_s >= per_connection.modelled_wait_s * 0.99


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("tokens", -1),
        ("sequence_length", 0),
        ("min_sequence_length", 301),
        ("vocab_size", 1 << 31 + 1),
        ("zarr_format", 4),
        ("chunk_tokens", 1.5),
        ("chunk_tokens", 1 << 29),  # more than a Blosc chunk holds: refused before a read fails
        ("latency_s", -0.1),
        ("latency_s", float("nan")),  # a read would wait nan (and break the loop's timers)
        ("latency_s", float("inf")),  # every read would wait forever
        ("seed", 1 << 64),  # would name seed 0's bytes
        ("sequence_length", 1 << 58),  # OverflowError, not a named parameter
        ("total_bandwidth", 0),
        ("counts", {}),
    ],
)
def test_a_bad_parameter_is_named(option: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"SyntheticFileSystem.{option}"):
        SyntheticFileSystem(**{**SMALL, option: value})


def test_unknown_objects_are_missing_and_writes_refused() -> None:
    fs = SyntheticFileSystem(**SMALL)
    chunks = -(-SMALL["tokens"] // SMALL["chunk_tokens"])
    assert fs.exists(f"corpus/train/encoded_tokens/c/{chunks - 1}")

    for key in (
        f"corpus/train/encoded_tokens/c/{chunks}",
        "corpus/train/encoded_tokens/c/01",  # zarr names chunk 1 "c/1"
        "corpus/train/seq_starts/c/00",
        "corpus/train/other",
        "corpus/x/y",
    ):
        assert not fs.exists(key)
        with pytest.raises(FileNotFoundError, match="no such object"):
            fs.cat_file(key)
    with pytest.raises(NotImplementedError):
        fs.pipe_file("corpus/train/zarr.json", b"{}")


def test_a_listing_gives_no_wrong_sizes() -> None:
    fs = SyntheticFileSystem(**SMALL)
    listed = fs.find("corpus", detail=True)
    assert len(listed) > 10
    for path, entry in listed.items():
        # Known sizes are the objects' sizes; a chunk's is not known before it is generated.
        assert entry["size"] in (None, fs.info(path)["size"]), path
    assert all(entry["size"] for path, entry in listed.items() if "zarr.json" in path)


def test_each_filesystem_counts_into_the_counts_it_was_given() -> None:
    first, second = SyntheticCounts(), SyntheticCounts()
    for counts in (first, second):
        fs = SyntheticFileSystem(**SMALL, counts=counts)
        assert fs.counts is counts
        fs.cat_file("corpus/zarr.json")
    assert (first.requests, second.requests) == (1, 1)


def test_serving_from_threads_leaves_zarrs_config_alone() -> None:
    # The empty validation split's seq_starts chunk is all zeros: stored, as the writer stores it,
    # without changing zarr's process-wide write_empty_chunks under other threads.
    fs = SyntheticFileSystem(**{**SMALL, "validation_tokens": 0})
    before = zarr.config.get("array.write_empty_chunks")
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave often: the race shows in every run
    try:
        with ThreadPoolExecutor(8) as pool:
            served = list(
                pool.map(lambda _: fs.chunk_bytes("validation", "seq_starts", 0), range(800))
            )
    finally:
        sys.setswitchinterval(switch)
    assert zarr.config.get("array.write_empty_chunks") == before
    assert len(set(served)) == 1 and served[0]


def _synthetic_params(storage_options: dict[str, Any]) -> FlatTokensParams:
    return FlatTokensParams("synthetic://corpus", 1, 2, 8, 0, True, storage_options=storage_options)


def test_a_misspelt_option_is_refused_naming_it() -> None:
    # fsspec takes any keyword: a typo used to give the default dataset, silently
    for option in ("sequence_lenght", "shard_tokens"):
        with pytest.raises(ConfigError, match=f"unknown option.*'{option}'.*sequence_length"):
            SyntheticFileSystem(**SMALL, **{option: 1})
    SyntheticFileSystem(**SMALL, skip_instance_cache=True, use_listings_cache=False)  # fsspec's
    params = _synthetic_params({**SMALL, "tokenz": 5})
    with pytest.raises(ConfigError, match="'tokenz'"):
        ShufflingLoader("train", params, TokenBatchParams(len=300, batch=8))


def test_counts_copy_pickle_and_asdict_with_their_figures() -> None:
    counts = SyntheticCounts()
    SyntheticFileSystem(**SMALL, counts=counts).cat_file("corpus/zarr.json")
    for copied in (copy.copy(counts), copy.deepcopy(counts), pickle.loads(pickle.dumps(counts))):
        assert copied == counts and copied.requests == 1
        copied.start(chunk=False)  # with a lock of its own
        assert (copied.in_flight, counts.in_flight) == (1, 0)
    assert dataclasses.asdict(counts)["requests"] == 1
    params = _synthetic_params({"counts": counts})
    assert dataclasses.asdict(params)["storage_options"]["counts"]["requests"] == 1  # logged


def test_a_cancelled_read_gives_back_the_shared_link() -> None:
    async def main() -> float:
        fs = SyntheticFileSystem(**SMALL, total_bandwidth=5e4, asynchronous=True)
        store = FsspecStore(fs, read_only=True, path="corpus")
        keys = [f"train/encoded_tokens/c/{i}" for i in range(3)]
        sizes = [await store.getsize(key) for key in keys]
        assert sum(sizes) / 5e4 > 2  # what the three would hold the link for, unsent
        for key in keys:  # a client's timeout, say
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(store.get(key, default_buffer_prototype()), 0.05)
        began = time.monotonic()
        assert await store.get("train/zarr.json", default_buffer_prototype()) is not None
        return time.monotonic() - began

    assert asyncio.run(main()) < 0.5


def test_an_absent_object_is_a_request_that_takes_a_round_trip() -> None:
    counts = SyntheticCounts()
    fs = SyntheticFileSystem(**SMALL, latency_s=0.2, counts=counts)
    began = time.monotonic()
    with pytest.raises(FileNotFoundError, match="no such object"):
        fs.cat_file("corpus/train/.zarray")  # format 2's metadata, which a zarr open probes for
    assert time.monotonic() - began >= 0.2
    assert (counts.requests, counts.missing, counts.chunk_requests, counts.in_flight) == (
        1,
        1,
        0,
        0,
    )


def test_alike_chunks_encode_once_and_different_ones_side_by_side(monkeypatch: Any) -> None:
    generated: list[int] = []
    both_inside = threading.Barrier(2, timeout=10)
    token_ids = SyntheticSplit.token_ids

    def counted(split: SyntheticSplit, begin: int, end: int) -> np.ndarray:
        generated.append(begin)
        if random_lengths:
            both_inside.wait()  # broken (an error) if one encoding waits for the other's end
        return token_ids(split, begin, end)

    monkeypatch.setattr(SyntheticSplit, "token_ids", counted)
    # Random lengths: every chunk differs, and two are encoded at once.
    random_lengths = True
    fs = SyntheticFileSystem(**SMALL, repeat_tokens=True)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: fs.chunk_bytes("train", "encoded_tokens", i), (1, 2)))
    assert sorted(generated) == [SMALL["chunk_tokens"], 2 * SMALL["chunk_tokens"]]
    # Fixed lengths dividing the chunk: chunks 1 to 3 are alike, encoded once however many ask.
    random_lengths = False
    generated.clear()
    fixed = {**SMALL, "min_sequence_length": None, "sequence_length": 256}
    fs = SyntheticFileSystem(**fixed, repeat_tokens=True)
    with ThreadPoolExecutor(8) as pool:
        served = list(
            pool.map(lambda i: fs.chunk_bytes("train", "encoded_tokens", 1 + i % 3), range(24))
        )
    assert len(set(served)) == 1 and len(generated) == 1


def test_chunk_bytes_and_sequences_name_a_bad_argument() -> None:
    fs = SyntheticFileSystem(**SMALL)
    chunks = -(-SMALL["tokens"] // SMALL["chunk_tokens"])
    index = f"chunk_bytes index of train/encoded_tokens must be an integer >= 0 and <= {chunks - 1}"
    calls: list[tuple[Any, str]] = [
        (lambda: fs.chunk_bytes("train", "encoded_tokens", chunks), f"{index}, got {chunks}"),
        (lambda: fs.chunk_bytes("train", "encoded_tokens", -1), f"{index}, got -1"),
        (lambda: fs.chunk_bytes("train", "encoded_tokens", 1.0), f"{index}, got 1.0"),
        (lambda: fs.chunk_bytes("train", "tokens", 0), "array must be one of"),
        (lambda: fs.chunk_bytes("test", "seq_starts", 0), "split must be one of"),
        (lambda: fs.sequences("train", -2, 1), "sequences first of train .* got -2"),
        (lambda: fs.sequences("train", 5, 4), "sequences stop of train .* >= 5 .* got 4"),
        (lambda: fs.sequences("train", 0, 10**9), "sequences stop of train .* got 1000000000"),
    ]
    for call, match in calls:
        with pytest.raises(ConfigError, match=match):
            call()
    # numpy integers are indices like any other
    assert fs.chunk_bytes("train", "encoded_tokens", np.int64(1)) == fs.chunk_bytes(
        "train", "encoded_tokens", 1
    )


def test_get_downloads_an_object_and_a_tree(tmp_path: Path) -> None:
    fs = SyntheticFileSystem(**SMALL)
    fs.get("corpus/train/encoded_tokens/c/1", str(tmp_path / "chunk"))
    assert (tmp_path / "chunk").read_bytes() == fs.cat_file("corpus/train/encoded_tokens/c/1")
    fs.get("corpus/train", str(tmp_path / "tree"), recursive=True)  # directories made, not read
    files = {p.relative_to(tmp_path / "tree").as_posix() for p in (tmp_path / "tree").rglob("*")}
    assert {"zarr.json", "encoded_tokens/c/0", "seq_starts/c/0"} <= files
    assert fs.counts.missing == 0
