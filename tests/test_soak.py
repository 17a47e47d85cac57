"""Soak: several epochs under transient faults and latency, with random access and resumes.

Each epoch (a new seed, as a trainer reshuffles per epoch) is walked by a random schedule:
stretches of ``iter()`` with device prefetch, random ``load()`` jumps backwards and forwards,
and resumes (the loader closed and a new one opened mid-epoch, continuing from its step). The
store drops requests and answers late throughout. Every batch must equal the clean oracle's,
every step of the epoch must be served, and over the epoch every row of the used read blocks
must appear exactly once. Bounded in time: well under a minute on two cores.

Long life (issue 37): hundreds of loader lifecycles (closed plainly, from another thread, and
while another thread loads or iterates), then thousands of random and sequential loads on one
loader with the resident set and the traced heap bounded after a warm-up (0.5 MiB per 1,000
loads): 20,000 loads in all. No library thread is left behind. About 70-80 s on two cores.
"""

from __future__ import annotations

import collections
import gc
import os
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from conftest import oracle
from helpers.resources import library_threads, rss_kib, wait_until
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat
from asyncflat import (
    EngineOptions,
    FlatTokensParams,
    LoaderClosedError,
    RetryPolicy,
    ShufflingLoader,
    TokenBatchParams,
)
from asyncflat.testing.faults import FaultyStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
BATCH = TokenBatchParams(len=16, batch=8)
EPOCHS = 6  # alternately packed and not
BUDGET_S = 45.0


def test_epochs_with_faults_random_access_and_resumes(tmp_path: Path) -> None:
    # Token id = offset in the split, so each served row names itself (packed: row r holds
    # tokens r*len ... r*len + len-1; not packed: row r starts with seq_starts[r]).
    lengths = np.random.default_rng(0).integers(1, 80, 450)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    seqs = [np.arange(offsets[i], offsets[i + 1]) for i in range(len(lengths))]
    path = str(tmp_path / "soak.zarr")
    asyncflat.write_flat_tokens(path, {"train": seqs}, chunk_tokens=384, shard_tokens=1536)
    tokens, starts = load_split_arrays(path, "train")

    options = EngineOptions(
        load_timeout_s=30,
        prefetch_to_device=2,
        max_concurrent_reads=6,
        retry=RetryPolicy(
            max_attempts=8, initial_backoff_s=0.001, max_backoff_s=0.01, deadline_s=20
        ),
    )
    rng = np.random.default_rng(1)
    started = time.monotonic()
    injected = retries = loaders = 0

    for epoch in range(EPOCHS):
        packing = epoch % 2 == 0
        params = FlatTokensParams(path, 2, 3, 4, seed=100 + epoch, sequence_packing=packing)
        reference = oracle((tokens, starts), params, BATCH)
        served: dict[int, np.ndarray] = {}
        step = 0
        while step < reference.step_count:
            assert time.monotonic() - started < BUDGET_S, (
                f"soak over budget in epoch {epoch} at step {step}"
            )
            stores: list[FaultyStore] = []

            def wrap(
                store: object,
                seed: int = int(rng.integers(1 << 30)),
                stores: list[FaultyStore] = stores,
            ) -> FaultyStore:
                stores.append(
                    FaultyStore(
                        store,
                        transient_rate=0.15,
                        max_transient_per_request=3,  # type: ignore[arg-type]
                        latency_s=0.0005,
                        latency_jitter_s=0.003,
                        seed=seed,
                    )
                )
                return stores[-1]

            loaders += 1
            with ShufflingLoader(
                "train", params, BATCH, SINGLE, options=options, store_wrapper=wrap
            ) as loader:
                assert loader.step_count == reference.step_count
                # This loader's life: a few stretches, then a resume in a fresh loader.
                for _ in range(int(rng.integers(1, 4))):
                    if step >= reference.step_count:
                        break
                    if rng.random() < 0.3:  # random access: anywhere in the epoch, then back
                        for jump in rng.integers(0, reference.step_count, 3).tolist():
                            check(loader.load(jump), reference, jump, served)
                    stretch = int(rng.integers(5, 30))
                    with loader.iter(step) as iterator:
                        for got_step, batch in iterator:
                            assert got_step == step
                            check(batch, reference, step, served)
                            step += 1
                            if step >= reference.step_count or stretch == 0:
                                break
                            stretch -= 1
                retries += loader.stats()["retries"]
            injected += sum(s.counts.transient for s in stores)

        assert sorted(served) == list(range(reference.step_count))
        rows = np.sort(np.concatenate(list(served.values())))
        # each row once
        np.testing.assert_array_equal(rows, np.arange(reference.read_block_count * 4))

    assert injected > 50 and retries > 50, (injected, retries)
    assert loaders > EPOCHS * 2
    assert not [t.name for t in threading.enumerate() if t.name.startswith("asyncflat")]


def check(
    batch: asyncflat.TokenBatch,
    reference: ReferenceLoader,
    step: int,
    served: dict[int, np.ndarray],
    shape: TokenBatchParams = BATCH,
) -> None:
    targets, is_start = reference.batch(step)
    got = np.asarray(batch.targets)
    np.testing.assert_array_equal(got, targets, err_msg=f"step {step}")
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), is_start, err_msg=f"step {step}")
    first = got[:, 0].astype(np.int64)
    if reference.sequence_packing:
        rows = first // shape.len
    else:  # a non-packed row starts with its sequence's first token: its offset
        rows = np.searchsorted(reference.seq_starts.astype(np.int64), first, side="right") - 1
    np.testing.assert_array_equal(rows, reference.row_ids(step))
    served[step] = rows


# -- long life: lifecycles, then thousands of loads with memory and threads bounded ---------------

LIFECYCLES = 300
#: 20,000 loads (issue 37): through ``load()`` (jax batches; RSS measured) and through
#: ``encoded_rows()`` (the same engine path without jax; the traced heap measured, which would
#: slow jax's loads ~2x more), each a warm-up and then the measured loads, half random jumps and
#: half sequential stretches. The loads' batches are small (two rows of eight tokens) and their
#: buffers too, so that a random jump's fills cost little and 20,000 fit in about a minute on
#: two shared cores; the bound is per 1,000 loads, and a leak of a few small objects per load
#: already breaks it over these counts.
LOADS_RSS = 15_000
LOADS_TRACED = 3_000
WARM_UP = 1_000
LOAD_BATCH = TokenBatchParams(len=8, batch=2)
#: growth allowed per 1,000 loads after the warm-up (issue 37)
BOUND_KIB_PER_1000 = 512


def one_lifecycle(
    i: int, params: FlatTokensParams, reference: ReferenceLoader, rng: np.random.Generator
) -> str:
    """Build a loader, load a few steps, close it: plainly, from another thread, or while
    another thread loads or iterates (which then ends with LoaderClosedError or a right batch).
    Returns how it ended, for the tally."""
    steps = reference.step_count
    loader = ShufflingLoader(
        "train", params, BATCH, SINGLE, options=EngineOptions(prefetch_to_device=1)
    )
    for step in rng.integers(0, steps, 2).tolist():
        check(loader.load(step), reference, step, {})
    kind = i % 4
    if kind == 0:
        loader.close()
        return "closed"
    if kind == 1:
        closer = threading.Thread(target=loader.close, name=f"closer-{i}")
        closer.start()
        closer.join(20)
        assert not closer.is_alive()
        return "closed from another thread"
    outcome: list[str] = []
    started = threading.Event()

    def work() -> None:
        try:
            if kind == 2:  # iterating when the close comes
                with loader.iter(int(rng.integers(0, steps))) as iterator:
                    for step, batch in iterator:
                        check(batch, reference, step, {})
                        started.set()
            else:  # loading random steps when the close comes
                while True:
                    step = int(rng.integers(0, steps))
                    check(loader.load(step), reference, step, {})
                    started.set()
        except LoaderClosedError:
            outcome.append("closed while busy")
        else:
            outcome.append("finished first")
        finally:
            started.set()

    worker = threading.Thread(target=work, name=f"worker-{i}")
    worker.start()
    assert started.wait(20)
    loader.close()
    worker.join(20)
    assert not worker.is_alive() and outcome, outcome
    return outcome[0]


def walk(load: Any, steps: int, count: int, rng: np.random.Generator) -> None:
    """``count`` loads: stretches of 50 random jumps and of 50 sequential steps, alternately."""
    for i in range(0, count, 50):
        start = int(rng.integers(0, steps))
        for k in range(min(50, count - i)):
            load((start + k) % steps if (i // 50) % 2 else int(rng.integers(0, steps)))


@pytest.mark.timeout(420)  # 70-200 s on two shared cores, beside another test process
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_hundreds_of_lifecycles_and_thousands_of_loads_hold_memory_and_threads(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "long.zarr")
    lengths = np.random.default_rng(3).integers(1, 120, 900)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    seqs = [np.arange(offsets[i], offsets[i + 1]) for i in range(len(lengths))]
    asyncflat.write_flat_tokens(path, {"train": seqs}, chunk_tokens=1024)
    tokens, starts = load_split_arrays(path, "train")
    params = FlatTokensParams(path, 2, 2, 4, seed=7, sequence_packing=True)
    reference = oracle((tokens, starts), params, BATCH)
    rng = np.random.default_rng(11)
    started = time.monotonic()

    ends = collections.Counter(one_lifecycle(i, params, reference, rng) for i in range(LIFECYCLES))
    assert wait_until(lambda: not library_threads(), 10), library_threads()
    assert ends["closed while busy"] >= LIFECYCLES // 8, ends
    lifecycles_s = time.monotonic() - started

    small = oracle((tokens, starts), params, LOAD_BATCH)
    with ShufflingLoader("train", params, LOAD_BATCH, SINGLE) as loader:
        steps = loader.step_count
        assert steps == small.step_count and steps > 2000

        def load(step: int) -> None:
            batch = loader.load(step)
            if step % 97 == 0:  # a sample checked against the oracle (all of them: test_loader)
                check(batch, small, step, {}, LOAD_BATCH)

        walk(load, steps, WARM_UP, rng)
        gc.collect()
        rss0 = rss_kib()
        walk(load, steps, LOADS_RSS, rng)
        gc.collect()
        rss_growth = rss_kib() - rss0

        walk(loader.encoded_rows, steps, WARM_UP // 2, rng)
        tracemalloc.start()
        try:
            walk(loader.encoded_rows, steps, WARM_UP // 2, rng)  # traced state reaches its size
            gc.collect()
            heap0 = tracemalloc.get_traced_memory()[0]
            walk(loader.encoded_rows, steps, LOADS_TRACED, rng)
            gc.collect()
            heap_growth = (tracemalloc.get_traced_memory()[0] - heap0) // 1024
        finally:
            tracemalloc.stop()
        stats = loader.stats()
    assert wait_until(lambda: not library_threads(), 10), library_threads()

    total_loads = WARM_UP * 2 + LOADS_RSS + LOADS_TRACED
    assert total_loads == 20_000 and stats.steps_loaded >= WARM_UP + LOADS_RSS
    print(
        f"soak: {LIFECYCLES} lifecycles in {lifecycles_s:.1f} s ({dict(ends)}); "
        f"{total_loads} loads; RSS +{rss_growth} KiB over {LOADS_RSS}, traced heap "
        f"+{heap_growth} KiB over {LOADS_TRACED}; {stats.steps_loaded} step records, "
        f"{stats.fills_completed} fills; {time.monotonic() - started:.1f} s in all"
    )
    assert stats.fills_completed >= 5_000, stats.fills_completed  # the random jumps refill
    assert rss_growth <= BOUND_KIB_PER_1000 * LOADS_RSS // 1000, (
        f"RSS grew {rss_growth} KiB over {LOADS_RSS} loads after {WARM_UP} (bound "
        f"{BOUND_KIB_PER_1000} KiB per 1,000)"
    )
    assert heap_growth <= BOUND_KIB_PER_1000 * LOADS_TRACED // 1000, (
        f"the traced heap grew {heap_growth} KiB over {LOADS_TRACED} loads (bound "
        f"{BOUND_KIB_PER_1000} KiB per 1,000)"
    )
