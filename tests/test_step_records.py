"""Every gather records its step's wait once in the engine's figures (``EngineStats``).

A mixture step reads several sources' engines. Its fast path asked each engine in turn for rows
already in finished buffers; when a later source's rows were not ready, the step went to the
loop, where every engine gathered (and recorded) again: the sources asked first recorded the
step twice, with a near-zero wait beside the real one (their median wait, their step counts and
their lateness figures were off).
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
from conftest import random_sequences

import asyncflat
from asyncflat import EngineOptions, FlatTokensParams, MixtureParams, MixtureSource

pytestmark = pytest.mark.timeout(120)

BATCH = asyncflat.TokenBatchParams(len=16, batch=8)
OPTIONS = EngineOptions(prefetch_to_device=0)  # no build ahead: each step is gathered once


def test_a_mixture_step_records_each_source_engines_step_once(tmp_path: Path) -> None:
    small, large = str(tmp_path / "small.zarr"), str(tmp_path / "large.zarr")
    asyncflat.write_flat_tokens(small, {"train": random_sequences(1, 300, max_len=40)})
    asyncflat.write_flat_tokens(large, {"train": random_sequences(2, 1200, max_len=40)})
    # Source 0 has two minipochs (the steps below read only the first: ready once filled);
    # source 1 has many, so a random step often finds source 0 ready and source 1 not:
    # the case where the fast path gave up after source 0 had recorded the step.
    mixture = MixtureParams(
        (
            MixtureSource(FlatTokensParams(small, 2, 25, 4, 0, True), 1.0),
            MixtureSource(FlatTokensParams(large, 2, 2, 4, 0, True), 1.0),
        ),
        seed=5,
    )
    rng = np.random.default_rng(0)
    expected: collections.Counter[int] = collections.Counter()
    with asyncflat.MixtureLoader("train", mixture, BATCH, options=OPTIONS) as loader:
        # Steps before each source's last minipoch: reaching it opens the source's next pass,
        # whose engine the figures would then describe.
        last = [plan.last_minipoch_step for plan in loader.plans]
        assert loader.plans[0].minipoch_count == 2, loader.plans[0].minipoch_count
        loaded = 0
        for step in rng.permutation(loader.step_count).tolist():
            groups = loader.groups(step)
            if any(g.epoch != 0 or g.step >= last[g.source] for g in groups):
                continue
            loader.load(step)
            for group in groups:
                expected[group.source] += 1
            loaded += 1
            if loaded == 60:
                break
        stats = loader.stats()
    assert expected[0] >= 20 and expected[1] >= 20, expected
    for index, source in enumerate(stats.sources):
        assert source.passes == 1
        records = source.engine.steps_loaded
        assert records == expected[index], (
            f"source {index}: {records} step records for {expected[index]} gathers "
            f"(waits {source.engine.step_waits_s[:8]}...)"
        )
