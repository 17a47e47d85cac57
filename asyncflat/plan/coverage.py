"""How much of a split a shuffle plan serves, and the one warning when the rounding drops more.

The reference's plan rounds a split down three times: to whole read blocks, to a multiple of
``streams`` blocks, and to whole batches. On a small split with large blocks that silently drops
a large share of the data. :func:`dropped_warning` is the one rule for saying so: the loader logs
it at construction and ``asyncflat inspect`` (``LoaderFigures.sizing_warning``) shows the same
sentence, when more than :data:`WARN_FRACTION` is dropped. It names the figure, the main cause,
and the ``sequences_per_read_block`` that would bring the loss under the threshold (or says that
none does). Pure arithmetic over a :class:`~asyncflat.plan.shuffle.ShufflePlan`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncflat.plan.shuffle import ShufflePlan

__all__ = ["WARN_FRACTION", "Coverage", "coverage", "dropped_warning", "format_bytes"]

#: Dropping more than this fraction of a split is warned about (a WARNING at construction).
WARN_FRACTION = 0.01


@dataclasses.dataclass(frozen=True)
class Coverage:
    """What one epoch of a plan serves of its split (every epoch serves the same rows).

    Counted in tokens with sequence packing (rows are ``len`` tokens of the stream) and in
    sequences without it (each row is one sequence, truncated or padded).
    """

    unit: str
    total: int
    served: int
    lost: dict[str, int]

    @property
    def dropped(self) -> int:
        return self.total - self.served

    @property
    def dropped_fraction(self) -> float:
        """The share of the split an epoch never serves (0 for an empty split)."""
        return self.dropped / self.total if self.total else 0.0


def coverage(plan: ShufflePlan) -> Coverage:
    """The :class:`Coverage` of ``plan``, with the loss split by cause."""
    spb = plan.sequences_per_read_block
    rows = plan.seq_count
    whole_blocks = rows // spb
    row_losses = {
        "the last partial read block": rows - whole_blocks * spb,
        "read blocks beyond a multiple of streams": (whole_blocks - plan.read_block_count) * spb,
        "rows after the last whole batch": plan.read_block_count * spb
        - plan.step_count * plan.batch,
    }
    served_rows = plan.step_count * plan.batch
    if not plan.sequence_packing:
        return Coverage("sequences", rows, served_rows, row_losses)
    per_row = plan.seq_len
    lost = {"tokens after the last whole sequence": plan.token_count - rows * per_row}
    lost.update({cause: count * per_row for cause, count in row_losses.items()})
    return Coverage("tokens", plan.token_count, served_rows * per_row, lost)


def dropped_warning(plan: ShufflePlan, where: str) -> str | None:
    """The warning when ``plan`` drops more than :data:`WARN_FRACTION` of the split ``where``
    (``PATH/SPLIT``, shown as given), else None: the figure, its main cause, and the fix."""
    cov = coverage(plan)
    if cov.dropped_fraction <= WARN_FRACTION:
        return None
    cause, count = max(cov.lost.items(), key=lambda item: item[1])
    return (
        f"{where}: {cov.dropped:,} of {cov.total:,} {cov.unit} ({cov.dropped_fraction:.1%}) are "
        f"never served: each epoch rounds the split down to whole read blocks "
        f"(sequences_per_read_block={plan.sequences_per_read_block}), a multiple of streams "
        f"(streams={plan.streams}) and whole batches (batch={plan.batch}), and most of the loss "
        f"({count:,} {cov.unit}) is {cause}; {_advice(plan)}"
    )


def _advice(plan: ShufflePlan) -> str:
    """The ``sequences_per_read_block`` that fixes the loss, or why none does."""
    spb, best = _best_block_size(plan)
    if best <= WARN_FRACTION:
        return f"sequences_per_read_block={spb} would drop at most {WARN_FRACTION:.0%}"
    advice = (
        f"the split holds too few batches of {plan.batch} x {plan.seq_len} for "
        f"{WARN_FRACTION:.0%}, so lower batch or streams, or use a larger split"
    )
    if spb == plan.sequences_per_read_block:
        return f"no smaller sequences_per_read_block drops less: {advice}"
    return (
        f"the least any sequences_per_read_block drops here is {best:.1%} "
        f"(sequences_per_read_block={spb}); {advice}"
    )


def _best_block_size(plan: ShufflePlan) -> tuple[int, float]:
    """The largest sequences_per_read_block <= the plan's that drops at most
    :data:`WARN_FRACTION`; failing that, the one that drops least (and its dropped share).
    The same rounding as :func:`coverage`, vectorised over every candidate: a few milliseconds
    even for a million."""
    total = plan.token_count if plan.sequence_packing else plan.seq_count
    unit = plan.seq_len if plan.sequence_packing else 1
    spb = np.arange(1, plan.sequences_per_read_block + 1, dtype=np.int64)
    blocks = plan.seq_count // spb // plan.streams * plan.streams
    served = blocks * spb // plan.batch * plan.batch * unit
    dropped = (total - served) / max(total, 1)
    fixes = np.flatnonzero(dropped <= WARN_FRACTION)
    if len(fixes):
        best = int(fixes[-1])
    else:  # the least dropped, preferring the largest block among equals
        best = len(dropped) - 1 - int(np.argmin(dropped[::-1]))
    return int(spb[best]), float(dropped[best])


def format_bytes(count: float) -> str:
    """``count`` bytes in binary units, e.g. ``'10.7 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")
