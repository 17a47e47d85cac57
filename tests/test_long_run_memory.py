"""A long random-access run on one loader holds flat memory once its bounded state is full.

Thousands of ``load(step)`` calls at random steps (nearly every one a new minipoch, so fills
start, finish and are recycled all the time). The loader keeps some bounded state that fills up
during the first few hundred loads (the last 256 fill records, numpy rings of step waits and
build times whose pages are touched as they fill, the allocator's arenas and jax's caches): the
growth is measured only after that warm-up window, over the following loads, and must stay well
under what a real leak would add. Retaining one batch per load (the smallest leak that matters:
a jax array is ~3.5 KiB of RSS here, a host copy of the rows 2 KiB) adds several MiB over the
measured window; the loader's own drift there is ~0.1-0.2 MiB.

Two measures: the process's resident set (``VmRSS``, so native allocations count: numpy,
jax/XLA buffers, Blosc) and the blocks of Python's small-object allocator in use (a leak of
Python records, futures or dicts per load or fill, however small each, and whether the collector
tracks them or not). ``tracemalloc`` is not used: it slows a jax process's loads ~20x.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import random_sequences
from helpers.resources import rss_kib

import asyncflat
from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc"),
]

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
BATCH = TokenBatchParams(len=64, batch=8)  # 2 KiB of tokens per batch
WARM_UP_LOADS = 400
MEASURED_LOADS = 1_600
#: RSS growth allowed over the measured loads (observed: 0.1-0.2 MiB; one batch per load: >3 MiB)
RSS_BOUND_KIB = 1_024
#: growth of Python's small blocks allowed (observed: -230..+300; one object per load: +1,600)
BLOCKS_BOUND = 800


def python_blocks() -> int:
    """Blocks of Python's small-object allocator in use: every small Python object, the ones
    the collector does not track too (a dict of ints, a tuple, a float).

    Read once the engine has settled: right after a load, the rows it started reading ahead and
    the fill streaming on hold a few hundred transient objects (+-1,000 between two reads)."""
    deadline = time.monotonic() + 5
    gc.collect()
    last = sys.getallocatedblocks()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        gc.collect()
        now = sys.getallocatedblocks()
        if abs(now - last) < 20:
            return now
        last = now
    return last


def test_thousands_of_random_loads_hold_flat_memory_after_warm_up(tmp_path: Path) -> None:
    path = str(tmp_path / "data.zarr")
    seqs = random_sequences(7, 400, max_len=320)
    asyncflat.write_flat_tokens(path, {"train": seqs}, chunk_tokens=4096)
    params = FlatTokensParams(path, 2, 2, 4, seed=0, sequence_packing=True)
    rng = np.random.default_rng(0)
    with ShufflingLoader("train", params, BATCH, SINGLE) as loader:
        steps = loader.step_count
        assert steps > 100  # random steps mostly land in another minipoch: a fill per load

        def load_random(count: int) -> None:
            for step in rng.integers(0, steps, count).tolist():
                batch = loader.load(step)
                assert batch.targets.shape == (BATCH.batch, BATCH.len)

        load_random(WARM_UP_LOADS)
        rss0 = rss_kib()
        blocks0 = python_blocks()
        fills0 = loader.stats().fills_completed
        load_random(MEASURED_LOADS)
        rss1 = rss_kib()
        blocks1 = python_blocks()
        stats = loader.stats()

    # The run recycled fills all along (the case where a per-fill leak would show). Most random
    # loads are served by row reads while the fill of their minipoch streams on, so there are
    # fewer fills than loads (about 200 in 1,600 here), but hundreds of them.
    assert stats.fills_completed - fills0 >= 100, stats.fills_completed - fills0
    assert len(stats.fills) <= 256
    growth = rss1 - rss0
    assert growth < RSS_BOUND_KIB, (
        f"RSS grew {growth} KiB over {MEASURED_LOADS} random loads after a warm-up of "
        f"{WARM_UP_LOADS} (bound {RSS_BOUND_KIB} KiB): something is kept per load"
    )
    assert blocks1 - blocks0 < BLOCKS_BOUND, (
        f"{blocks1 - blocks0} more Python blocks in use after {MEASURED_LOADS} random loads "
        f"(bound {BLOCKS_BOUND}): Python state is kept per load or per fill"
    )


def test_the_heap_is_trimmed_once_per_finished_fill(tmp_path: Path) -> None:
    """After each fill the engine hands glibc's free heap pages back (``malloc_trim``, on its
    worker pool): a fill's transient chunk reads otherwise stay resident in the heap."""
    from asyncflat.engine import heap

    if not heap.available():
        pytest.skip("no glibc malloc_trim here")
    before = heap.trim_count()
    path = str(tmp_path / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": random_sequences(3, 200, max_len=80)})
    params = FlatTokensParams(path, 1, 2, 4, seed=0, sequence_packing=True)
    with ShufflingLoader("train", params, TokenBatchParams(len=16, batch=4), SINGLE) as loader:
        for step in range(loader.step_count):
            loader.load(step)
        deadline = time.monotonic() + 10
        # A load served by row reads returns while its fill streams on: count once all are done.
        while loader.stats().active_fills and time.monotonic() < deadline:
            time.sleep(0.01)
        fills = loader.stats().fills_completed
        while heap.trim_count() - before < fills and time.monotonic() < deadline:  # on the pool
            time.sleep(0.01)
    assert fills >= 3
    assert heap.trim_count() - before == fills


def _settled(loader: ShufflingLoader) -> None:
    """Wait (bounded) until no fill is in progress: a load served by row reads returns while its
    fill streams on, and those fills' objects are live for a reason."""
    deadline = time.monotonic() + 10
    while loader.stats().active_fills and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()


def test_no_fill_outlives_its_buffer_after_random_loads(tmp_path: Path) -> None:
    """Once the fills are done, the only fills alive are those in the buffers (at most
    ``2 + EXTRA_BUFFERS`` per stream), no read unit of any other fill is alive, and no asyncio
    event beyond theirs: nothing a load or a fill made outlives it. Before, each of the scheduler's idle
    workers kept the last unit it ran, and with it that unit's dropped fill (its ready events
    and a view of its buffer): 12-16 fills alive where the buffers hold 4-8."""
    import asyncio

    from asyncflat.engine.fill import EXTRA_BUFFERS, Fill, Unit

    path = str(tmp_path / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": random_sequences(7, 400, max_len=320)})
    streams = 2
    params = FlatTokensParams(path, streams, 2, 4, seed=0, sequence_packing=True)
    rng = np.random.default_rng(1)
    with ShufflingLoader("train", params, BATCH, SINGLE) as loader:
        steps = loader.step_count
        for round_ in range(3):
            for step in rng.integers(0, steps, 150).tolist():
                loader.encoded_rows(step)
            _settled(loader)
            # The workers let go of their last unit as they finish it, on the loop's thread: on a
            # loaded machine that can come a moment after the fill is done, so poll (bounded).
            deadline = time.monotonic() + 10
            while True:
                gc.collect()
                objects = gc.get_objects()
                fills = [o for o in objects if isinstance(o, Fill)]
                units = [o for o in objects if isinstance(o, Unit)]
                events = sum(isinstance(o, asyncio.Event) for o in objects)
                # a unit still queued for a fill in a buffer is bounded with it; any other is stray
                alive, stray = len(fills), sum(not any(u.fill is f for f in fills) for u in units)
                # each fill's per-block events and its drained event, and a few of the engine's
                allowed = sum(len(f.ready) + 1 for f in fills) + 4
                del objects, fills, units
                done = alive <= streams * (2 + EXTRA_BUFFERS) and stray == 0 and events <= allowed
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert alive <= streams * (2 + EXTRA_BUFFERS), (round_, alive)
            assert stray == 0, (round_, stray)
            assert events <= allowed, (round_, events, allowed)


def test_the_traced_heap_holds_flat_over_random_and_sequential_loads(tmp_path: Path) -> None:
    """``tracemalloc``'s heap (every Python allocation, numpy's included) over random and
    sequential loads after a warm-up: at most 0.5 MiB per 1,000 loads (the issue's bound; a
    leak of two events per load is ~1 MiB). ``encoded_rows`` is the load without jax (traced,
    jax's loads are ~20x slower, and what could leak per load is the engine's)."""
    import tracemalloc

    path = str(tmp_path / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": random_sequences(7, 400, max_len=320)})
    params = FlatTokensParams(path, 2, 2, 4, seed=0, sequence_packing=True)
    rng = np.random.default_rng(2)
    measured = 600

    def walk(loader: ShufflingLoader, count: int) -> None:
        steps = loader.step_count
        for i in range(0, count, 50):  # stretches of random jumps and of sequential steps
            start = int(rng.integers(0, steps))
            sequential = (i // 50) % 2 == 1
            for k in range(50):
                loader.encoded_rows((start + k) % steps if sequential else int(rng.integers(steps)))

    with ShufflingLoader("train", params, BATCH, SINGLE) as loader:
        walk(loader, 400)  # fills the bounded state (fill records, step rings, caches)
        tracemalloc.start()
        try:
            walk(loader, 200)
            _settled(loader)
            before = tracemalloc.get_traced_memory()[0]
            walk(loader, measured)
            _settled(loader)
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    per_thousand_kib = (after - before) / 1024 * 1000 / measured
    assert per_thousand_kib <= 512, (
        f"the traced heap grew {per_thousand_kib:.0f} KiB per 1,000 loads (bound 512)"
    )
