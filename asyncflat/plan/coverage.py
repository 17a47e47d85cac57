"""How much of a split a shuffle plan serves, and what the rounding that drops the rest costs.

The reference's plan rounds a split down three times: to whole read blocks, to a multiple of
``streams`` blocks, and to whole batches. On a small split with large blocks that silently drops
a large share of the data, so the loader warns when more than :data:`WARN_FRACTION` is dropped and
names the parameter that would fix it. Pure arithmetic over a :class:`~asyncflat.plan.shuffle.ShufflePlan`.
"""

from __future__ import annotations

import dataclasses

from asyncflat.plan.shuffle import ShufflePlan

__all__ = ["WARN_FRACTION", "Coverage", "coverage", "dropped_warning", "format_bytes"]

#: Dropping more than this fraction of a split at construction is logged as a WARNING.
WARN_FRACTION = 0.01

#: For each cause of loss, the parameter whose change recovers the data.
_FIX = {
    "tokens after the last whole sequence": "TokenBatchParams.len",
    "the last partial read block": "a smaller FlatTokensParams.sequences_per_read_block",
    "read blocks beyond a multiple of streams": (
        "fewer FlatTokensParams.streams or a smaller sequences_per_read_block"
    ),
    "rows after the last whole batch": "a smaller TokenBatchParams.batch",
}


@dataclasses.dataclass(frozen=True)
class Coverage:
    """What one epoch of a plan serves of its split.

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
    """The WARNING text when ``plan`` drops more than :data:`WARN_FRACTION` of ``where``, else None."""
    cov = coverage(plan)
    if cov.dropped_fraction <= WARN_FRACTION:
        return None
    cause, count = max(cov.lost.items(), key=lambda item: item[1])
    return (
        f"{where}: {cov.dropped:,} of {cov.total:,} {cov.unit} ({cov.dropped_fraction:.1%}) are "
        f"never served: the shuffle plan rounds the split down to whole read blocks, a multiple "
        f"of streams and whole batches. Most of the loss ({count:,} {cov.unit}) is {cause}; "
        f"{_FIX[cause]} would keep it"
    )


def format_bytes(count: float) -> str:
    """``count`` bytes in binary units, e.g. ``'10.7 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")
