"""Each host plans only its own streams: the block order of the served streams alone, bit for bit
the global order's, in memory in proportion to them; the engine of a simulated host of many."""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_impl import ReferenceLoader, load_split_arrays, slow_permutation

import asyncflat
from asyncflat import ConfigError, FlatTokensParams, ShufflePlan, TokenBatchParams
from asyncflat.config import EngineOptions
from asyncflat.engine.loop import LoopThread
from asyncflat.errors import DatasetTooLargeError
from asyncflat.loader.shared.open import open_engine
from asyncflat.plan.permutation import ensure_kernel, permutation, permutation_columns


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([1, 2, 3, 7, 16, 64]),
    st.integers(0, 2**40),
    st.data(),
)
def test_columns_are_the_global_orders_columns(
    rows: int, streams: int, seed: int, data: st.DataObject
) -> None:
    served = tuple(sorted(data.draw(st.sets(st.integers(0, streams - 1), min_size=1))))
    n = rows * streams
    expected = slow_permutation(seed, n).reshape(rows, streams)[:, list(served)]
    for method in ("python", "kernel"):
        got = permutation_columns(seed, n, streams, served, method=method)
        assert got.dtype == np.uint32 and got.shape == (rows, len(served))
        np.testing.assert_array_equal(got, expected, err_msg=method)


@pytest.mark.parametrize(
    ("n", "streams", "served"),
    [(1 << 20, 1024, (5,)), (3 << 18, 64, (0, 1, 63)), (70_000, 100, tuple(range(0, 100, 3)))],
)
def test_the_columns_kernel_matches_the_whole_permutation_at_scale(
    n: int, streams: int, served: tuple[int, ...]
) -> None:
    """Sizes above 2**16 (the float quotient path of the swap targets), few and many columns."""
    ensure_kernel()
    full = permutation(11, n, method="kernel").reshape(-1, streams)[:, list(served)]
    for method in ("kernel", "auto"):
        got = permutation_columns(11, n, streams, served, method=method)  # type: ignore[arg-type]
        np.testing.assert_array_equal(got, full, err_msg=method)


def test_few_columns_take_memory_in_proportion_to_them() -> None:
    """One column of 1,024 of 2**22 entries: the kernel's table and result, a small fraction
    of the 16 MiB of the whole permutation (measured by tracemalloc, which sees numpy's)."""
    ensure_kernel()
    n, streams = 1 << 22, 1024
    tracemalloc.start()
    try:
        one = permutation_columns(3, n, streams, (700,))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert one.nbytes == 4 * n // streams
    assert peak < 4 * n / 100, peak


@pytest.mark.parametrize(
    "served", [(1,), (0, 2), (3,), (0, 1, 2, 3)], ids=lambda s: "-".join(map(str, s))
)
def test_a_plan_of_some_streams_deals_the_full_plans_blocks(served: tuple[int, ...]) -> None:
    params = FlatTokensParams("unused.zarr", 4, 3, 2, 9, False)
    batch = TokenBatchParams(len=4, batch=8)
    full = ShufflePlan.create(params, batch, token_count=0, sequence_count=1000)
    part = ShufflePlan.create(
        params, batch, token_count=0, sequence_count=1000, served_streams=served
    )
    assert part.served == served and part.served_block_count == full.blocks_per_stream * len(served)
    assert part.served_block_order.nbytes == 4 * part.served_block_count
    np.testing.assert_array_equal(part.block_order, full.block_order)
    for stream in range(4):
        for minipoch in range(full.minipoch_count):
            if stream in served:
                np.testing.assert_array_equal(
                    part.buffer_blocks(stream, minipoch), full.buffer_blocks(stream, minipoch)
                )
            else:
                with pytest.raises(IndexError, match="not among the streams this plan serves"):
                    part.buffer_blocks(stream, minipoch)


@pytest.mark.parametrize("served", [(), (2, 1), (1, 1), (4,), (-1,)])
def test_bad_served_streams_are_refused(served: tuple[int, ...]) -> None:
    params = FlatTokensParams("unused.zarr", 4, 3, 2, 9, False)
    with pytest.raises(ConfigError, match="served_streams must be a non-empty sorted tuple"):
        ShufflePlan.create(
            params,
            TokenBatchParams(len=4, batch=8),
            token_count=0,
            sequence_count=1000,
            served_streams=served,
        )


def test_a_100t_token_split_fits_the_default_plan_budget() -> None:
    """10**14 tokens in seqax's layout (95,367,431 read blocks) plan within the default budget:
    4 bytes a served block. The order itself is not computed here (a bench does that)."""
    params = FlatTokensParams("unused.zarr", 1, 16, 512, 0, True)
    plan = ShufflePlan.create(
        params, TokenBatchParams(len=2048, batch=64), token_count=10**14, sequence_count=1
    )
    assert plan.read_block_count == 95_367_431
    assert 4 * plan.read_block_count <= plan.plan_memory_budget
    many = FlatTokensParams("unused.zarr", 1024, 16, 8, 0, True)
    batch = TokenBatchParams(len=16, batch=1024)
    with pytest.raises(DatasetTooLargeError, match="1024 streams served here"):
        ShufflePlan.create(many, batch, token_count=2**35, sequence_count=1)
    one = ShufflePlan.create(many, batch, token_count=2**35, sequence_count=1, served_streams=(7,))
    assert one.served_block_count == one.read_block_count // 1024


SEQ_LEN, SPB, RBPSB, SEED = 8, 4, 2, 3


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(5)
    seqs = [rng.integers(1, 1000, rng.integers(1, 30)) for _ in range(3000)]
    path = str(tmp_path_factory.mktemp("hosts") / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": seqs}, chunk_tokens=SPB * SEQ_LEN)
    return path


def test_a_host_of_many_plans_and_serves_its_own_streams(dataset: str) -> None:
    """Host h of 64 (64 streams, one each) through the loader's own open path: the batch rows
    the default sharding gives process h, and nothing else simulated. Its plan keeps the block
    order of its stream alone, and its rows are the reference loader's."""
    streams = 64  # and hosts
    batch = TokenBatchParams(len=SEQ_LEN, batch=2 * streams)
    params = FlatTokensParams(dataset, streams, RBPSB, SPB, SEED, True)
    tokens, starts = load_split_arrays(dataset, "train")
    oracle = ReferenceLoader(
        tokens,
        starts,
        seq_len=SEQ_LEN,
        batch=batch.batch,
        streams=streams,
        read_blocks_per_shuffle_buffer=RBPSB,
        sequences_per_read_block=SPB,
        seed=SEED,
        sequence_packing=True,
    )
    loop = LoopThread(name="asyncflat-test-hosts")
    try:
        for host in (0, 37, 63):
            rows = np.arange(2 * host, 2 * host + 2, dtype=np.int64)
            engine = loop.run(open_engine("train", params, batch, rows, EngineOptions()))
            try:
                plan = engine.plan
                assert plan.served == (host,) and engine.streams == (host,)
                for step in (0, plan.step_count // 2, plan.step_count - 1):
                    got = loop.run(engine.gather(step, rows))
                    np.testing.assert_array_equal(got, oracle.encoded_batch(step)[rows])
                assert plan.served_block_order.nbytes == 4 * plan.blocks_per_stream
                assert plan.served_block_order.shape == (plan.read_block_count // streams, 1)
            finally:
                loop.run(engine.aclose())
    finally:
        loop.close()


@pytest.mark.parametrize("raised", [ValueError("no order"), SystemExit(3)])
def test_a_block_order_that_fails_reaches_the_load_and_close_is_clean(
    dataset: str, monkeypatch: pytest.MonkeyPatch, raised: BaseException
) -> None:
    """A failure computing the block order on its thread is the load's error (never a hang, nor
    a SystemExit raised on the engine's loop), and closing waits for that thread."""

    def fail(self: ShufflePlan, stop: object = None, out: object = None) -> np.ndarray:
        raise raised

    monkeypatch.setattr(ShufflePlan, "compute_block_order", fail)
    params = FlatTokensParams(dataset, 1, RBPSB, SPB, SEED, True)
    batch = TokenBatchParams(len=SEQ_LEN, batch=8)
    options = EngineOptions(load_timeout_s=30)
    with asyncflat.ShufflingLoader("train", params, batch, options=options) as loader:
        expected = ValueError if isinstance(raised, Exception) else asyncflat.AsyncflatError
        for _ in range(2):  # and again: the loader is not wedged
            with pytest.raises(expected):
                loader.encoded_rows(0)
    assert not [t for t in threading.enumerate() if t.name == "asyncflat-plan"]
