"""The lateness warning through the loader, with a real jitted train step under async dispatch.

The trainer loop is the ordinary one: ``load(step)``, a jitted step that consumes the batch and
returns at once (async dispatch), and a sync only when the loss is logged every few steps. Loads
therefore come in bursts with ~0 s gaps, which a predictor reading the gaps between loads took
for the step time (a false "expect a stall" warning). A CPU run has no accelerator to take the
step's time, so after each logged loss the loop waits out the device time of those steps (a
floor of ``STEP_S`` per step): the trainer's pace is then the same on any machine, also under
load (the wait shortens by the time the steps took), while the fill shares the CPU with it: the
on-time case leaves the fill about five times the time it needs on an idle machine.

Minipoch 1's chunks are slowed by a store wrapper (one delay per chunk, reads one at a time), so
its prefetch takes a known time while the trainer works through minipoch 0.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_sequences
from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

import asyncflat
from asyncflat import EngineOptions, FlatTokensParams, ShufflePlan, TokenBatchParams

SEQ_LEN, BATCH, SPB, RBPSB = 32, 8, 16, 32  # 64 steps per minipoch, 32 blocks of 512 tokens
STEP_S = 0.1  # the simulated device time of one step: minipoch 0 lasts >= 6.4 s
LOG_EVERY = 8  # steps between two logged losses (the loop's only sync)


class _SlowChunks(WrapperStore[Any]):
    """Delays the first read of each chunk of ``encoded_tokens`` listed in ``slow``."""

    def __init__(self, store: Any, slow: set[int], delay_s: float) -> None:
        super().__init__(store)
        self._slow, self._delay_s = slow, delay_s
        self._seen: set[str] = set()

    def _with_store(self, store: Any) -> _SlowChunks:
        return type(self)(store, self._slow, self._delay_s)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        match = re.search(r"encoded_tokens/c/(\d+)$", key)
        if match and int(match.group(1)) in self._slow and key not in self._seen:
            self._seen.add(key)
            await asyncio.sleep(self._delay_s)
        return await self._store.get(key, prototype, byte_range)


@jax.jit
def _train_step(w: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = targets.astype(jnp.float32) / 1000.0
    h = jnp.tanh(x @ w)
    loss = jnp.mean(h * h)
    return w - 0.01 * loss, loss


def _train(loader: asyncflat.ShufflingLoader, stop: Any) -> int:
    """Train through minipoch 0 until ``stop()`` says so (checked at each logged loss); returns
    the step reached."""
    w = jnp.eye(SEQ_LEN, dtype=jnp.float32)
    # Compile for the loader's batches first, as a trainer's first step would, outside the pace.
    like = jax.device_put(np.zeros((BATCH, SEQ_LEN), np.uint32), loader.sharding)
    float(_train_step(w, like)[1])
    last = loader.plan.first_step(1) - 1
    burst = time.perf_counter()
    for step in range(last + 1):
        batch = loader.load(step)
        w, loss = _train_step(w, batch.targets)  # async dispatch: returns at once
        if step % LOG_EVERY == LOG_EVERY - 1:
            float(loss)  # log the loss: waits for the steps dispatched so far
            device_time = burst + LOG_EVERY * STEP_S - time.perf_counter()
            time.sleep(max(0.0, device_time))  # the device's time for them (see the docstring)
            burst = time.perf_counter()
            if stop():
                return step
    return last


def _loader(tmp_path: Path, delay_s: float) -> asyncflat.ShufflingLoader:
    path = str(tmp_path / "data.zarr")
    seqs = random_sequences(3, 1200, max_len=100)
    block_tokens = SPB * SEQ_LEN
    with asyncflat.FlatTokensWriter(path, zarr_format=3, chunk_tokens=block_tokens) as writer:
        writer.append("train", seqs)  # with packing, block b is chunk b
    params = FlatTokensParams(path, 1, RBPSB, SPB, seed=0, sequence_packing=True)
    batch = TokenBatchParams(len=SEQ_LEN, batch=BATCH)
    plan = ShufflePlan.create(
        params, batch, token_count=sum(len(s) for s in seqs), sequence_count=len(seqs)
    )
    assert plan.minipoch_count >= 2 and plan.first_step(1) == 64
    slow = set(plan.buffer_blocks(0, 1).tolist())
    return asyncflat.ShufflingLoader(
        "train",
        params,
        batch,
        options=EngineOptions(max_concurrent_reads=1),
        store_wrapper=lambda store: _SlowChunks(store, slow, delay_s),
    )


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "predicted to finish" in r.getMessage() and "minipoch 1 " in r.getMessage()
    ]


def _prefetch_of_minipoch_1(loader: asyncflat.ShufflingLoader) -> list[Any]:
    return [f for f in loader.stats().fills if f.minipoch == 1 and not f.cancelled]


def test_an_on_time_prefetch_is_not_warned_about_under_async_dispatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 32 chunks at 40 ms: ~1.3 s of fill (more on a busy machine), needed after >= 6.4 s.
    with caplog.at_level(logging.WARNING, logger="asyncflat.engine"):
        with _loader(tmp_path, delay_s=0.04) as loader:
            _train(loader, stop=lambda: bool(_prefetch_of_minipoch_1(loader)))
            stats = loader.stats()
    records = [f for f in stats.fills if f.minipoch == 1 and not f.cancelled]
    assert len(records) == 1, f"minipoch 1's prefetch did not finish in minipoch 0: {records}"
    (record,) = records
    assert record.reason == "prefetch" and not record.late and not record.waited_on
    assert record.finished_at_step is not None
    assert record.finished_at_step < record.must_finish_by_step
    # The fill outlived the first second, after which the step rate is known and every
    # finished read is checked: the absence of a warning is a verdict, not a silence.
    assert record.duration_s > 1.2, record
    assert stats.step_rate_per_s is not None
    assert not _warnings(caplog)
    assert stats.fills_predicted_late == 0


def test_a_prefetch_behind_a_slow_store_is_warned_about_before_the_stall(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 32 chunks at 0.5 s: ~16 s of fill, needed after ~6.4 s. The loop ends at the warning.
    with caplog.at_level(logging.WARNING, logger="asyncflat.engine"):
        with _loader(tmp_path, delay_s=0.5) as loader:
            reached = _train(loader, stop=lambda: bool(_warnings(caplog)))
            stats = loader.stats()
    (message,) = _warnings(caplog)
    assert reached < loader.plan.first_step(1) - 1  # warned ahead of the step that needs it
    assert "after step 64" in message and "max_concurrent_reads" in message
    assert stats.fills_predicted_late == 1
    assert not [f for f in stats.fills if f.late]  # no stall happened: the loop stopped first
    assert np.isfinite(stats.step_rate_per_s or np.nan)
