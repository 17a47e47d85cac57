"""Step 0's fill starts when a loader opens (``EngineOptions.fill_on_open``), not at its first load.

* a trainer that sets up between construction and its first load finds step 0's buffer
  filled: the fill is recorded as ``"open"``, no load waited on it, the batches are right;
* a first load elsewhere (a resume) cancels the fill it does not read before its own reads
  are queued, and is served right;
* ``fill_on_open=False`` (or ``prefetch=False``) starts nothing before the first load;
* a loader closed before any load cancels the fill and leaves no thread behind.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
import pytest
from conftest import oracle, random_sequences, wait_until
from helpers.resources import library_threads

import asyncflat
from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
from asyncflat.testing.faults import FaultyStore

pytestmark = pytest.mark.timeout(120)

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
BATCH = TokenBatchParams(len=16, batch=8)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("fill-on-open") / "data.zarr")
    seqs = random_sequences(5, 600, max_len=80)
    asyncflat.write_flat_tokens(path, {"train": seqs, "validation": seqs[:50]}, chunk_tokens=256)
    return path


def params(path: str) -> FlatTokensParams:
    return FlatTokensParams(path, 2, 3, 4, 7, True)


def check(path: str, batch: Any, step: int) -> None:
    want = oracle(path, params(path), BATCH).batch(step)
    np.testing.assert_array_equal(np.asarray(batch.targets), np.asarray(want[0]), f"step {step}")
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), np.asarray(want[1]))


def fills(loader: Any) -> list[dict[str, Any]]:
    return [f.as_dict() for f in loader.stats().fills]


def test_the_first_fill_runs_while_the_trainer_sets_up(dataset: str) -> None:
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE) as loader:
        # the trainer's set-up: nobody has asked for a batch
        wait_until(lambda: len(fills(loader)) == 2, "step 0's fills (one per stream) to finish")
        records = fills(loader)
        assert {(f["stream"], f["minipoch"], f["reason"]) for f in records} == {
            (0, 0, "open"),
            (1, 0, "open"),
        }
        assert not any(f["waited_on"] or f["cancelled"] for f in records)
        for step in range(4):
            check(dataset, loader.load(step), step)


def test_a_first_load_elsewhere_cancels_the_fill_it_does_not_read(dataset: str) -> None:
    made: list[FaultyStore] = []

    def slow(store: Any) -> FaultyStore:
        # every chunk read takes 0.3 s: step 0's fill cannot finish before the first load
        made.append(FaultyStore(store, latency_s=0.3, fault_keys="*encoded_tokens/c*", seed=1))
        return made[-1]

    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, store_wrapper=slow) as loader:
        plan = loader.plan
        resume = plan.first_step(plan.minipoch_count - 1) + 1  # a resume in the last minipoch
        assert plan.minipoch_count >= 3
        check(dataset, loader.load(resume), resume)
        records = fills(loader)
        opened = [f for f in records if f["reason"] == "open"]
        assert len(opened) == 2 and all(
            f["cancelled"] and f["blocks_done"] < f["blocks"] for f in opened
        ), records
        served = {f["minipoch"] for f in records if not f["cancelled"]}
        assert served <= {plan.minipoch_count - 1}, records
        check(dataset, loader.load(resume + 1), resume + 1)


@pytest.mark.parametrize(
    "options", [EngineOptions(fill_on_open=False), EngineOptions(prefetch=False)]
)
def test_nothing_is_filled_before_the_first_load_when_turned_off(
    dataset: str, options: EngineOptions
) -> None:
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        time.sleep(0.3)
        stats = loader.stats().as_dict()
        assert stats["fills"] == [] and stats["active_fills"] == []
        check(dataset, loader.load(0), 0)
        assert {f["reason"] for f in fills(loader)} <= {"demand", "prefetch"}


def test_a_loader_closed_before_any_load_leaves_nothing_running(dataset: str) -> None:
    def slow(store: Any) -> FaultyStore:
        return FaultyStore(store, latency_s=0.2, fault_keys="*encoded_tokens/c*", seed=1)

    for _ in range(3):
        loader = ShufflingLoader("train", params(dataset), BATCH, SINGLE, store_wrapper=slow)
        loader.close()
    wait_until(lambda: library_threads() == [], "the loaders' threads to end")


def test_fill_on_open_must_be_a_bool() -> None:
    with pytest.raises(asyncflat.ConfigError, match="fill_on_open"):
        EngineOptions(fill_on_open=1)  # type: ignore[arg-type]
