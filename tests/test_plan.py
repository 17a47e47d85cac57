"""Property tests of the pure index math (asyncflat.plan.shuffle) against brute force and the oracle."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_impl import slow_permutation

from asyncflat import (
    ConfigError,
    FlatTokensParams,
    ShufflePlan,
    StepOutOfRangeError,
    TokenBatchParams,
)
from asyncflat.plan.shuffle import NEVER, block_deadlines


@st.composite
def plans(draw: st.DrawFn) -> ShufflePlan:
    streams = draw(st.sampled_from([1, 2, 3, 4, 8]))
    bips = draw(st.integers(1, 6))
    spb = draw(st.integers(1, 7))
    rbpsb = draw(st.integers(1, 5))
    blocks_per_stream = draw(st.integers(1, 12))
    leftover = draw(
        st.integers(0, spb * streams - 1)
    )  # sequences that do not fill a block per stream
    seq_len = draw(st.sampled_from([1, 4, 16]))
    seq_count = blocks_per_stream * streams * spb + leftover
    packing = draw(st.booleans())
    params = FlatTokensParams(
        "unused.zarr", streams, rbpsb, spb, draw(st.integers(0, 2**40)), packing
    )
    batch = TokenBatchParams(len=seq_len, batch=bips * streams)
    if (blocks_per_stream * spb) < bips:
        blocks_per_stream = -(-bips // spb)
        seq_count = blocks_per_stream * streams * spb
    token_count = seq_count * seq_len + draw(st.integers(0, seq_len - 1))
    return ShufflePlan.create(params, batch, token_count=token_count, sequence_count=seq_count)


@settings(max_examples=200, deadline=None)
@given(plans())
def test_every_used_block_is_in_exactly_one_buffer(plan: ShufflePlan) -> None:
    seen = collections.Counter()
    for minipoch in range(plan.minipoch_count):
        for stream in range(plan.streams):
            seen.update(plan.buffer_blocks(stream, minipoch).tolist())
    assert seen == collections.Counter(range(plan.read_block_count))


@settings(max_examples=200, deadline=None)
@given(plans())
def test_last_minipoch_is_the_only_short_one(plan: ShufflePlan) -> None:
    sizes = [plan.blocks_in_minipoch(m) for m in range(plan.minipoch_count)]
    assert sum(sizes) == plan.blocks_per_stream
    assert all(s == plan.read_blocks_per_shuffle_buffer for s in sizes[:-1])
    assert 1 <= sizes[-1] <= plan.read_blocks_per_shuffle_buffer


@settings(max_examples=150, deadline=None)
@given(plans())
def test_each_row_of_a_buffer_is_served_at_most_once_and_all_when_used(plan: ShufflePlan) -> None:
    """No buffer row is served twice, and every minipoch that ends before the last served row
    is served completely (only the tail after the last full batch is dropped)."""
    served = collections.Counter()
    first_serving: dict[int, int] = {}  # minipoch -> the first step that serves a row of it
    for step in range(plan.step_count):
        loc = plan.locate(step)
        for s, m, p in zip(loc.stream.tolist(), loc.minipoch.tolist(), loc.position.tolist()):
            row = int(plan.row_permutation(s, m)[p])
            served[(s, m, row)] += 1
            first_serving.setdefault(m, step)
    assert max(served.values()) == 1
    # The split's last minipoch may lie wholly in the unserved tail: the last one served begins
    # at last_minipoch_step, which a step reaches.
    assert plan.last_minipoch_step == first_serving[max(first_serving)]
    for m in range(plan.minipoch_count):
        rows = {(s, r) for (s, mm, r) in served if mm == m}
        assert len(rows) == plan.served_rows(m) * plan.streams
        ends_in_served_range = (
            m + 1
        ) * plan.seqs_per_buffer <= plan.step_count * plan.rows_per_stream_step
        if m < plan.minipoch_count - 1 and ends_in_served_range:
            assert plan.served_rows(m) == plan.rows_in_buffer(m)


@settings(max_examples=200, deadline=None)
@given(plans())
def test_map_is_monotone_per_stream(plan: ShufflePlan) -> None:
    last: dict[int, tuple[int, int]] = {}
    for step in range(plan.step_count):
        loc = plan.locate(step)
        for s, m, p in zip(loc.stream.tolist(), loc.minipoch.tolist(), loc.position.tolist()):
            assert (m, p) > last.get(s, (-1, -1))
            last[s] = (m, p)


@settings(max_examples=200, deadline=None)
@given(plans())
def test_minipochs_of_step_and_first_step_agree_with_locate(plan: ShufflePlan) -> None:
    first_seen: dict[int, int] = {}
    for step in range(plan.step_count):
        minipochs = set(plan.locate(step).minipoch.tolist())
        assert minipochs == set(plan.minipochs_of_step(step))
        for m in minipochs:
            first_seen.setdefault(m, step)
    for m, step in first_seen.items():
        assert plan.first_step(m) == step


@settings(max_examples=150, deadline=None)
@given(plans(), st.data())
def test_block_deadlines_are_the_first_step_reading_each_block(
    plan: ShufflePlan, data: st.DataObject
) -> None:
    minipoch = data.draw(st.integers(0, plan.minipoch_count - 1))
    stream = data.draw(st.integers(0, plan.streams - 1))
    from_step = data.draw(st.integers(0, plan.step_count))
    perm = plan.row_permutation(stream, minipoch)
    expected = np.full(plan.blocks_in_minipoch(minipoch), NEVER, np.int64)
    for step in range(from_step, plan.step_count):
        loc = plan.locate(step)
        mine = (loc.stream == stream) & (loc.minipoch == minipoch)
        for p in loc.position[mine].tolist():
            slot = perm[p] // plan.sequences_per_read_block
            expected[slot] = min(expected[slot], step)
    np.testing.assert_array_equal(block_deadlines(plan, perm, minipoch, from_step), expected)


@settings(max_examples=60, deadline=None)
@given(plans())
def test_permutations_are_the_frozen_spec(plan: ShufflePlan) -> None:
    np.testing.assert_array_equal(
        plan.block_order, slow_permutation(plan.seed, plan.read_block_count)
    )
    m = plan.minipoch_count - 1
    np.testing.assert_array_equal(
        plan.row_permutation(plan.streams - 1, m),
        slow_permutation(
            plan.seed + 1 + m * plan.streams + plan.streams - 1, plan.rows_in_buffer(m)
        ),
    )


def test_worked_example_of_the_docstring() -> None:
    params = FlatTokensParams(
        "unused.zarr",
        streams=2,
        read_blocks_per_shuffle_buffer=2,
        sequences_per_read_block=4,
        seed=0,
        sequence_packing=True,
    )
    plan = ShufflePlan.create(
        params, TokenBatchParams(len=2, batch=8), token_count=64, sequence_count=0
    )
    loc = plan.locate(3, np.array([5]))
    assert (loc.stream[0], loc.minipoch[0], loc.position[0]) == (1, 1, 5)
    assert plan.seqs_per_buffer == 8 and plan.rows_per_stream_step == 4


def _plan(**overrides: int) -> ShufflePlan:
    kw = dict(streams=2, rbpsb=2, spb=4, batch=8, seqs=64)
    kw.update(overrides)
    params = FlatTokensParams("unused.zarr", kw["streams"], kw["rbpsb"], kw["spb"], 0, False)
    return ShufflePlan.create(
        params, TokenBatchParams(len=2, batch=kw["batch"]), token_count=0, sequence_count=kw["seqs"]
    )


def test_counts_match_the_reference_formulas() -> None:
    plan = _plan(streams=2, rbpsb=3, spb=4, batch=6, seqs=75)
    assert plan.read_block_count == (75 // 4 // 2) * 2 == 18
    assert plan.step_count == 18 * 4 // 6 == 12
    assert plan.minipoch_count == -(-18 // 6) == 3
    assert [plan.blocks_in_minipoch(m) for m in range(3)] == [3, 3, 3]
    short = _plan(streams=2, rbpsb=4, spb=4, batch=6, seqs=75)
    assert [short.blocks_in_minipoch(m) for m in range(short.minipoch_count)] == [4, 4, 1]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(batch=7), r"batch=7 must be a multiple of FlatTokensParams.streams=2"),
        (dict(seqs=7), r"fewer than one read block per stream"),
        (dict(spb=4, streams=1, batch=64, seqs=16), r"fewer than one batch of 64"),
    ],
)
def test_invalid_combinations_fail_at_construction(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _plan(**overrides)


def test_a_len_longer_than_the_packed_split_names_rows_not_sequences() -> None:
    """With packing the plan's "sequences" are len-token rows: a len that leaves fewer rows than
    a read block says so (it once reported a split of 80,000 sequences as having 0)."""
    params = FlatTokensParams("unused.zarr", 1, 2, 4, 0, True)
    with pytest.raises(ConfigError, match=r"0 rows of len=2048 tokens \(1000 tokens packed\)"):
        ShufflePlan.create(
            params, TokenBatchParams(len=2048, batch=1), token_count=1000, sequence_count=80
        )


def test_out_of_range_steps_are_clear_errors() -> None:
    plan = _plan()
    for step in (-1, plan.step_count):
        with pytest.raises(StepOutOfRangeError, match=f"step {step} is out of range"):
            plan.locate(step)
