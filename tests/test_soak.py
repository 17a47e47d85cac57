"""Soak: several epochs under transient faults and latency, with random access and resumes.

Each epoch (a new seed, as a trainer reshuffles per epoch) is walked by a random schedule:
stretches of ``iter()`` with device prefetch, random ``load()`` jumps backwards and forwards,
and resumes (the loader closed and a new one opened mid-epoch, continuing from its step). The
store drops requests and answers late throughout. Every batch must equal the clean oracle's,
every step of the epoch must be served, and over the epoch every row of the used read blocks
must appear exactly once. Bounded in time: well under a minute on two cores.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from reference_impl import ReferenceLoader, load_split_arrays

import asyncflat
from asyncflat import (
    EngineOptions,
    FlatTokensParams,
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
        oracle = ReferenceLoader(
            tokens,
            starts,
            seq_len=BATCH.len,
            batch=BATCH.batch,
            streams=2,
            read_blocks_per_shuffle_buffer=3,
            sequences_per_read_block=4,
            seed=100 + epoch,
            sequence_packing=packing,
        )
        served: dict[int, np.ndarray] = {}
        step = 0
        while step < oracle.step_count:
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
                assert loader.step_count == oracle.step_count
                # This loader's life: a few stretches, then a resume in a fresh loader.
                for _ in range(int(rng.integers(1, 4))):
                    if step >= oracle.step_count:
                        break
                    if rng.random() < 0.3:  # random access: anywhere in the epoch, then back
                        for jump in rng.integers(0, oracle.step_count, 3).tolist():
                            check(loader.load(jump), oracle, jump, served)
                    stretch = int(rng.integers(5, 30))
                    with loader.iter(step) as iterator:
                        for got_step, batch in iterator:
                            assert got_step == step
                            check(batch, oracle, step, served)
                            step += 1
                            if step >= oracle.step_count or stretch == 0:
                                break
                            stretch -= 1
                retries += loader.stats()["retries"]
            injected += sum(s.counts.transient for s in stores)

        assert sorted(served) == list(range(oracle.step_count))
        rows = np.sort(np.concatenate(list(served.values())))
        np.testing.assert_array_equal(rows, np.arange(oracle.read_block_count * 4))  # each row once

    assert injected > 50 and retries > 50, (injected, retries)
    assert loaders > EPOCHS * 2
    assert not [t.name for t in threading.enumerate() if t.name.startswith("asyncflat")]


def check(
    batch: asyncflat.TokenBatch, oracle: ReferenceLoader, step: int, served: dict[int, np.ndarray]
) -> None:
    targets, is_start = oracle.batch(step)
    got = np.asarray(batch.targets)
    np.testing.assert_array_equal(got, targets, err_msg=f"step {step}")
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), is_start, err_msg=f"step {step}")
    first = got[:, 0].astype(np.int64)
    if oracle.sequence_packing:
        rows = first // BATCH.len
    else:  # a non-packed row starts with its sequence's first token: its offset
        rows = np.searchsorted(oracle.seq_starts.astype(np.int64), first, side="right") - 1
    np.testing.assert_array_equal(rows, oracle.row_ids(step))
    served[step] = rows
