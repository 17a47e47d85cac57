"""Sizing made visible: the share of a split an epoch drops, and the advice that fixes it."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflat import FlatTokensParams, ShufflePlan, TokenBatchParams
from asyncflat.errors import ConfigError
from asyncflat.plan.coverage import coverage, dropped_warning


def _dropped(plan: ShufflePlan) -> float:
    return coverage(plan).dropped_fraction


def _plan(tokens: int, spb: int, streams: int, batch: int, length: int) -> ShufflePlan | None:
    try:
        return ShufflePlan.create(
            FlatTokensParams("unused.zarr", streams, 4, spb, 0, True),
            TokenBatchParams(len=length, batch=batch),
            token_count=tokens,
            sequence_count=0,
        )
    except ConfigError:
        return None


def test_the_issue_example_warns_with_the_figure() -> None:
    # The README's parameters on a 2.82M-token corpus: 16 steps, 26% of the tokens dropped.
    plan = _plan(2_820_000, 512, 1, 64, 2048)
    assert plan is not None and plan.step_count == 16
    assert abs(_dropped(plan) - (1 - 16 * 64 * 2048 / 2_820_000)) < 1e-12
    warning = dropped_warning(plan, "corpus.zarr/train")
    assert warning is not None
    assert "(25.6%) are never served" in warning and "sequences_per_read_block=512" in warning
    assert "lower batch" in warning  # a partial batch alone is over 1% here


@settings(max_examples=150, deadline=None)
@given(
    st.integers(10_000, 3_000_000),
    st.integers(1, 600),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([4, 8, 16]),
    st.sampled_from([16, 128]),
)
def test_the_advice_is_the_largest_block_that_fixes_it(
    tokens: int, spb: int, streams: int, bips: int, length: int
) -> None:
    plan = _plan(tokens, spb, streams, bips * streams, length)
    if plan is None:
        return
    warning = dropped_warning(plan, "x")
    assert (warning is None) == (_dropped(plan) <= 0.01)
    if warning is None:
        return
    named = [int(v) for v in re.findall(r"sequences_per_read_block=(\d+)", warning)]
    assert named[0] == spb
    if "no smaller sequences_per_read_block drops less" in warning:
        for other_spb in range(1, spb):
            other = _plan(tokens, other_spb, streams, bips * streams, length)
            assert other is None or _dropped(other) >= _dropped(plan) - 1e-12
        return
    suggested = named[-1]
    fixed = _plan(tokens, suggested, streams, bips * streams, length)
    assert fixed is not None and suggested < spb
    if "would drop at most 1%" in warning:
        assert _dropped(fixed) <= 0.01
        for larger in range(suggested + 1, spb):  # and it is the largest that does
            other = _plan(tokens, larger, streams, bips * streams, length)
            assert other is None or _dropped(other) > 0.01
    else:  # nothing fixes it: the suggestion is the least bad
        for other_spb in range(1, spb):
            other = _plan(tokens, other_spb, streams, bips * streams, length)
            assert other is None or _dropped(other) >= _dropped(fixed) - 1e-12


def test_without_packing_the_share_is_of_sequences() -> None:
    plan = ShufflePlan.create(
        FlatTokensParams("unused.zarr", 1, 4, 100, 0, False),
        TokenBatchParams(len=16, batch=8),
        token_count=0,
        sequence_count=1050,
    )
    assert _dropped(plan) == 50 / 1050
    assert "x: 50 of 1,050 sequences (4.8%) are never served" in (dropped_warning(plan, "x") or "")
