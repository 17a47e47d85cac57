"""The mixture's pure slot -> (source, k) math (asyncflat.plan.mixture), as properties.

Every block of a stage holds exactly the largest-remainder counts of its weights; each source's
slots, in slot order, are numbered 0, 1, 2, ... with no gap or repeat (so the loader maps them
onto the source's own order one to one); any range of slots is computed without history; a
stage's weights apply from its first step exactly.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_config_types import from_dict

from asyncflat import ConfigError, FlatTokensParams, MixtureParams, MixtureSource, MixtureStage
from asyncflat.plan.mixture import Assignment, largest_remainder, starved_warning

weights_st = st.lists(st.floats(0, 10, allow_nan=False) | st.integers(0, 5), min_size=1, max_size=4)


@st.composite
def assignments(draw: Any) -> Assignment:
    sources = draw(st.integers(1, 4))
    weight = st.lists(
        st.floats(0, 10, allow_nan=False) | st.integers(0, 5), min_size=sources, max_size=sources
    ).filter(lambda w: sum(w) > 0)
    stage_count = draw(st.integers(0, 3))
    starts = sorted(set(draw(st.lists(st.integers(1, 12), min_size=stage_count, max_size=3))))
    schedule = [(0, draw(weight))] + [(s, draw(weight)) for s in starts]
    return Assignment(
        schedule, draw(st.integers(1, 9)), draw(st.integers(1, 17)), draw(st.integers(0, 3))
    )


@settings(max_examples=100, deadline=None)
@given(weights_st.filter(lambda w: sum(w) > 0), st.integers(0, 200))
def test_largest_remainder_is_the_floor_plus_the_largest_remainders(
    weights: list[float], n: int
) -> None:
    counts = largest_remainder(weights, n)
    assert counts.sum() == n and (counts >= 0).all()
    total = sum(Fraction(w) for w in weights)
    quotas = [Fraction(w) * n / total for w in weights]
    for c, q in zip(counts.tolist(), quotas):
        assert q - 1 < c < q + 1 and (c == 0 if q == 0 else True)
    extra = [s for s in range(len(weights)) if counts[s] > quotas[s]]
    left = [s for s in range(len(weights)) if counts[s] < quotas[s]]
    for a in extra:  # nobody rounded down has a larger remainder than someone rounded up
        for b in left:
            ra, rb = quotas[a] - int(quotas[a]), quotas[b] - int(quotas[b])
            assert ra > rb or (ra == rb and a < b)


def _stage_ends(a: Assignment, slots: int) -> list[tuple[int, int, int]]:
    bounds = [*a.stage_slots, max(slots, a.stage_slots[-1])]
    return [(g, bounds[g], bounds[g + 1]) for g in range(len(a.stage_slots))]


@settings(max_examples=50, deadline=None)
@given(assignments(), st.integers(0, 2), st.integers(1, 15))
def test_every_block_holds_exactly_its_counts(a: Assignment, stream: int, steps: int) -> None:
    slots = steps * a.rows_per_stream
    source, _ = a.slots(stream, 0, slots)
    for g, begin, end in _stage_ends(a, slots):
        start = begin
        while start < min(end, slots):
            n = a.block_length(g, (start - begin) // a.block_rows)
            if start + n > slots:
                break  # the block goes on past the slots drawn
            got = np.bincount(source[start : start + n], minlength=a.source_count)
            np.testing.assert_array_equal(got, largest_remainder(a.weights[g], n))
            start += n


@settings(max_examples=50, deadline=None)
@given(assignments(), st.integers(0, 2), st.integers(1, 15))
def test_each_source_numbers_its_slots_in_order(a: Assignment, stream: int, steps: int) -> None:
    source, k = a.slots(stream, 0, steps * a.rows_per_stream)
    for s in range(a.source_count):
        np.testing.assert_array_equal(k[source == s], np.arange((source == s).sum()))


@settings(max_examples=50, deadline=None)
@given(assignments(), st.integers(0, 2), st.integers(0, 120), st.integers(0, 60))
def test_any_range_needs_no_history(a: Assignment, stream: int, start: int, length: int) -> None:
    whole = a.slots(stream, 0, start + length)
    part = a.slots(stream, start, start + length)
    np.testing.assert_array_equal(part[0], whole[0][start:])
    np.testing.assert_array_equal(part[1], whole[1][start:])
    np.testing.assert_array_equal(
        a.count_before(stream, start), np.bincount(whole[0][:start], minlength=a.source_count)
    )


@settings(max_examples=40, deadline=None)
@given(assignments(), st.integers(1, 40))
def test_first_exhausted_step_is_the_last_that_fits(a: Assignment, cap: int) -> None:
    capacity = [cap * (s + 1) for s in range(a.source_count)]
    if not any(w > 0 for w in a.weights[-1]):
        return
    steps = a.first_exhausted_step(capacity, 2)

    def fits(t: int) -> bool:
        return all(
            (a.count_before(i, t * a.rows_per_stream) <= np.array(capacity)).all() for i in (0, 1)
        )

    assert fits(steps) and not fits(steps + 1)


def test_a_stage_applies_from_its_step_exactly() -> None:
    # Stage 1 from step 3: every slot before is source 0, every slot from step 3 on source 1.
    a = Assignment([(0, (1.0, 0.0)), (3, (0.0, 1.0))], rows_per_stream=5, block_rows=4, seed=7)
    source, k = a.slots(0, 0, 10 * 5)
    assert (source[:15] == 0).all() and (source[15:] == 1).all()
    np.testing.assert_array_equal(k[15:], np.arange(35))


def test_streams_and_seeds_place_differently_with_the_same_counts() -> None:
    a = Assignment([(0, (0.5, 0.3, 0.2))], rows_per_stream=8, block_rows=64, seed=0)
    b = Assignment([(0, (0.5, 0.3, 0.2))], rows_per_stream=8, block_rows=64, seed=1)
    s0, s1, t0 = a.slots(0, 0, 64)[0], a.slots(1, 0, 64)[0], b.slots(0, 0, 64)[0]
    assert not np.array_equal(s0, s1) and not np.array_equal(s0, t0)
    for s in (s0, s1, t0):
        np.testing.assert_array_equal(np.bincount(s, minlength=3), [32, 19, 13])


# -- the configuration ------------------------------------------------------------------------


def _params(path: str = "a.zarr", streams: int = 2, seed: int = 0) -> FlatTokensParams:
    return FlatTokensParams(path, streams, 2, 4, seed, True)


def test_mixture_params_build_from_a_plain_dict_and_round_trip() -> None:
    plain = {
        "sources": [
            {"params": dataclasses.asdict(_params("a.zarr")), "weight": 0.7},
            {"params": dataclasses.asdict(_params("b.zarr", seed=3)), "weight": "0.3"},
        ],
        "seed": "5",
        "block_rows": 64,
        "stages": [{"start_step": 100, "weights": [0.1, 0.9]}],
        "steps": None,
    }
    built = from_dict(MixtureParams, plain)
    assert built.sources[1] == MixtureSource(_params("b.zarr", seed=3), 0.3)
    assert built.stages == (MixtureStage(100, (0.1, 0.9)),) and built.seed == 5
    assert built.schedule() == ((0, (0.7, 0.3)), (100, (0.1, 0.9)))
    assert from_dict(MixtureParams, dataclasses.asdict(built)) == built
    hash(built)  # frozen and hashable, like the other configs


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(sources=()), "at least one source"),
        (dict(sources=(MixtureSource(_params(), 0.0),)), "positive sum"),
        (dict(sources=(MixtureSource(_params(), 1), MixtureSource(_params(streams=4), 1))), "same"),
        (dict(block_rows=0), "block_rows must be >= 1"),
        (dict(stages=(MixtureStage(5, (1.0,)),)), "1 weights for 2 sources"),
        (dict(stages=(MixtureStage(5, (1, 0)), MixtureStage(5, (0, 1)))), "strictly increasing"),
        (dict(steps=0), "steps must be >= 1"),
        (dict(steps=10, stages=(MixtureStage(10, (1, 0)),)), "never take effect"),
        (dict(seed=-1), "seed must be >= 0"),
    ],
)
def test_bad_mixtures_fail_at_construction(change: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = dict(
        sources=(MixtureSource(_params(), 0.5), MixtureSource(_params("b.zarr"), 0.5))
    )
    fields.update(change)
    with pytest.raises(ConfigError, match=message):
        MixtureParams(**fields)


@pytest.mark.parametrize("weight", [-0.1, float("nan"), float("inf"), True, None])
def test_bad_weights_fail_at_construction(weight: Any) -> None:
    with pytest.raises(ConfigError, match="weight"):
        MixtureSource(_params(), weight)
    with pytest.raises(ConfigError, match="weights"):
        MixtureStage(3, (1.0, weight))


def test_stage_steps_and_weights_are_checked() -> None:
    with pytest.raises(ConfigError, match="start_step must be >= 1"):
        MixtureStage(0, (1.0,))
    with pytest.raises(ConfigError, match="positive sum"):
        MixtureStage(2, (0.0, 0.0))


def test_the_starved_warning_names_each_source_and_stage_whose_share_rounds_to_zero() -> None:
    assert starved_warning(Assignment([(0, (0.75, 0.25))], 4, 4, seed=0)) is None
    assert starved_warning(Assignment([(0, (1.0, 0.0))], 4, 2, seed=0)) is None  # zero: wanted
    message = starved_warning(Assignment([(0, (0.75, 0.25)), (6, (0.1, 0.9))], 4, 2, seed=0))
    assert message is not None
    assert "source 1 (weight 0.25) in the stage from step 0" in message
    assert "source 0 (weight 0.1) in the stage from step 6" in message
    assert "block_rows >= 10" in message  # 0.1 of a block is one row from 10 rows on
    assert "source 0 (weight 0.75)" not in message and "(weight 0.9)" not in message
    # the block_rows it suggests does give every source a row, in every stage
    enough = Assignment([(0, (0.75, 0.25)), (6, (0.1, 0.9))], 4, 10, seed=0)
    assert starved_warning(enough) is None
    assert all((enough.block_counts(stage) >= 1).all() for stage in range(2))


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.floats(0.001, 1.0), min_size=2, max_size=5),
    block_rows=st.integers(1, 64),
)
def test_the_block_rows_the_warning_suggests_always_suffices(
    weights: list[float], block_rows: int
) -> None:
    message = starved_warning(Assignment([(0, tuple(weights))], 4, block_rows, seed=0))
    if message is None:
        return
    suggested = int(message.split("any block_rows >= ")[1].split()[0])
    assert starved_warning(Assignment([(0, tuple(weights))], 4, suggested, seed=0)) is None


def test_the_blocks_kept_are_bounded_in_bytes_but_hold_a_steps_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every block's placement (two int64 a row) was kept in a cache of 512 blocks: 32 GiB at
    the largest ``block_rows``, reached by a long run or random loads. The blocks kept fit in
    ``BLOCK_CACHE_BYTES``, never fewer than the two per stream that one step may read."""
    import tracemalloc

    import asyncflat.plan.mixture
    from asyncflat.loader.mixture.config import MAX_BLOCK_ROWS

    budget = 4 << 20
    monkeypatch.setattr(asyncflat.plan.mixture, "BLOCK_CACHE_BYTES", budget)
    block_rows = 2**14  # 256 KiB a block
    a = Assignment([(0, (1.0, 1.0))], 4, block_rows, 0)
    tracemalloc.start()
    try:
        for block in range(40):  # 10 MiB of placements made, at most 4 MiB kept
            a.count_before(0, block * block_rows + 1)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held <= budget + (1 << 20), held
    assert a.blocks_kept == 16
    huge = Assignment([(0, (1.0, 1.0))], 4, MAX_BLOCK_ROWS, 0, streams=8)
    assert huge.blocks_kept == 16  # a step's blocks, however large
    small = Assignment([(0, (1.0, 1.0))], 4, 16, 0)
    assert small.blocks_kept == asyncflat.plan.mixture.BLOCK_CACHE_BLOCKS


@pytest.mark.parametrize("weight", [np.int64(2), np.float32(0.5), np.uint8(3), np.float64(0.25)])
def test_numpy_weights_are_numbers(weight: Any) -> None:
    """Weights read off a numpy array are the Python numbers they equal (an ``np.int64`` or
    ``np.float32`` weight was refused: "must be a number, got int64 2")."""
    assert MixtureSource(_params(), weight).weight == float(weight)
    assert MixtureStage(3, (weight, weight)).weights == (float(weight), float(weight))
    with pytest.raises(ConfigError, match=r"MixtureSource\.weight must be a number"):
        MixtureSource(_params(), np.bool_(True))
    # the same rule as every float field of the configuration
    from asyncflat import RetryPolicy

    assert RetryPolicy(deadline_s=weight).deadline_s == float(weight)
    with pytest.raises(ConfigError, match=r"RetryPolicy\.deadline_s must be a number"):
        RetryPolicy(deadline_s=np.bool_(True))
