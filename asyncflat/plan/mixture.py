"""Which source fills each row slot of a mixture: pure index math, no I/O, no history.

The *slots* of mixture stream ``i`` are its rows in order: slot ``n = step * R + j`` is row ``j``
of the stream at ``step`` (``R`` rows per stream and step; batch row ``i * R + j``). A *stage*
``g`` (weights ``w_g`` from step ``T_g`` on) covers slots ``[T_g * R, T_{g+1} * R)``, cut into
blocks of ``L = block_rows`` slots (the stage's last block may be shorter). A block of ``n`` slots
holds exactly ``c = largest_remainder(w_g, n)`` slots of each source, placed by the seeded
permutation :func:`asyncflat.plan.permutation` keyed by ``(seed, stage, stream, block)``: the block's
labels ``[0]*c_0 + [1]*c_1 + ...`` are read in permuted order. Because every block before the
current one in its stage is full, the number of slots of source ``s`` before any slot is
``base_g[s] + b * c_L[s] + (its rank among the block's slots of s, in slot order)``, with ``base_g`` the exact counts of all
earlier stages: O(1) per slot plus one permutation of ``L`` items per block.

``k``, the index of a slot among its source's slots in this stream, is what the loader maps to the
source's own order (docs/mixtures.md).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from asyncflat.errors import ConfigError
from asyncflat.plan.permutation import permutation

__all__ = ["Assignment", "largest_remainder", "starved_warning"]

# Keeps the block seeds apart from any FlatTokensParams seed (those are below 2**130).
_TAG = 0x6D6978 << 192
#: The most blocks' placements kept, and the bytes they may take in all (each holds two int64
#: per row): 512 blocks of the largest ``block_rows`` (2**22) held 32 GiB.
BLOCK_CACHE_BLOCKS = 512
BLOCK_CACHE_BYTES = 256 << 20


def largest_remainder(weights: Sequence[float], n: int) -> np.ndarray:
    """Counts (int64, summing to ``n``) proportional to ``weights``, by largest remainder.

    Quotas ``n * w / sum(w)`` are computed exactly (as fractions of the float weights); every
    source gets the floor of its quota, and the slots left go to the largest remainders, ties to
    the lower index. A zero weight gets zero.
    """
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    if not total > 0:
        raise ConfigError(f"weights must have a positive sum, got {list(weights)!r}")
    quotas = [q * n / total for q in exact]
    counts = [int(q) for q in quotas]  # floor: quotas are >= 0
    left = n - sum(counts)
    order = sorted(range(len(quotas)), key=lambda s: (-(quotas[s] - counts[s]), s))
    for s in order[:left]:
        counts[s] += 1
    return np.array(counts, np.int64)


def starved_warning(assignment: Assignment) -> str | None:
    """The one warning when a source of positive weight gets no row of a full block in some
    stage (its quota of ``block_rows`` rows rounds to zero: weights (0.75, 0.25) with
    ``block_rows=2`` give counts (2, 0)), so that it is served only in a stage's shorter last
    block, if at all; else None. The loader logs it at construction and ``asyncflat inspect
    --mixture`` prints it."""
    starved = []
    for stage, (start, weights) in enumerate(zip(assignment.stage_steps, assignment.weights)):
        counts = assignment.block_counts(stage)
        for source, weight in enumerate(weights):
            if weight > 0 and counts[source] == 0:
                starved.append(
                    f"source {source} (weight {weight:g}) in the stage from step {start}"
                )
    if not starved:
        return None
    smallest = min(
        Fraction(w) / sum(Fraction(x) for x in weights)
        for weights in assignment.weights
        for w in weights
        if w > 0
    )
    return (
        f"mixture: {'; '.join(starved)} gets no row of a block of block_rows="
        f"{assignment.block_rows} (largest remainder rounds its share to zero), so it is "
        "served only in a stage's shorter last block, if at all; choose block_rows so that "
        "every weight's share of a block is whole (any block_rows >= "
        f"{math.ceil(1 / smallest)} gives every source at least one row)"
    )


class Assignment:
    """The slot -> (source, k) map of a mixture for every stream.

    ``schedule``: ``(start_step, weights)`` per stage, the first at step 0, strictly increasing.
    ``streams``: the streams whose slots are asked for; the blocks kept (at most
    :data:`BLOCK_CACHE_BYTES` of them, but always two per stream, those one step reads) are
    sized by it. Thread-safe (its caches are ``functools.lru_cache``).
    """

    def __init__(
        self,
        schedule: Sequence[tuple[int, Sequence[float]]],
        rows_per_stream: int,
        block_rows: int,
        seed: int,
        *,
        streams: int = 1,
    ) -> None:
        if not schedule or schedule[0][0] != 0:
            raise ConfigError("a mixture schedule starts at step 0")
        self.rows_per_stream, self.block_rows, self.seed = rows_per_stream, block_rows, seed
        self.source_count = len(schedule[0][1])
        self.weights = [tuple(float(w) for w in weights) for _, weights in schedule]
        self.stage_steps = [int(start) for start, _ in schedule]
        self.stage_slots = [start * rows_per_stream for start in self.stage_steps]
        self._counts = functools.lru_cache(maxsize=1024)(self._make_counts)
        fitting = BLOCK_CACHE_BYTES // (16 * block_rows)  # labels and ranks, int64 each
        #: how many blocks' placements are kept (the most recently used)
        self.blocks_kept = max(2 * streams, min(BLOCK_CACHE_BLOCKS, fitting))
        self._block = functools.lru_cache(maxsize=self.blocks_kept)(self._make_block)
        self._full = [self._counts(g, block_rows) for g in range(len(schedule))]
        base = np.zeros(self.source_count, np.int64)
        self._base = []
        for g in range(len(schedule)):
            self._base.append(base.copy())
            if g + 1 < len(schedule):
                length = self.stage_slots[g + 1] - self.stage_slots[g]
                full, rest = divmod(length, block_rows)
                base = base + full * self._full[g] + self._counts(g, rest)

    # -- blocks ---------------------------------------------------------------------------------

    def block_counts(self, stage: int) -> np.ndarray:
        """Each source's rows in a full block of ``stage`` (a copy)."""
        return self._full[stage].copy()

    def _make_counts(self, stage: int, n: int) -> np.ndarray:
        return largest_remainder(self.weights[stage], n)

    def block_seed(self, stream: int, stage: int, block: int) -> int:
        """The :func:`asyncflat.plan.permutation` seed that places the rows of one block."""
        return _TAG | (((self.seed << 32 | stage) << 32 | stream) << 64) | block

    def block_length(self, stage: int, block: int) -> int:
        """Slots in ``block`` of ``stage`` (``block_rows``, or less for a stage's last block)."""
        if stage + 1 < len(self.stage_slots):
            end = self.stage_slots[stage + 1] - self.stage_slots[stage]
            return min(self.block_rows, end - block * self.block_rows)
        return self.block_rows

    def _make_block(self, stream: int, stage: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """``(labels, rank)`` of the block's slots: the source of each, and its rank among that
        source's slots of the block."""
        n = self.block_length(stage, block)
        counts = self._counts(stage, n)
        sorted_labels = np.repeat(np.arange(self.source_count, dtype=np.int64), counts)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        perm = permutation(self.block_seed(stream, stage, block), n).astype(np.int64)
        labels = sorted_labels[perm]
        # The i-th slot of a source in slot order gets rank i (not its label's permuted position).
        order = np.argsort(labels, kind="stable")
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n, dtype=np.int64) - starts[labels[order]]
        return labels, rank

    def block_labels(self, stream: int, stage: int, block: int) -> np.ndarray:
        """The source of each slot of one block (for tests and docs)."""
        return self._block(stream, stage, block)[0]

    # -- slots ----------------------------------------------------------------------------------

    def stage_of_step(self, step: int) -> int:
        return bisect.bisect_right(self.stage_steps, step) - 1

    def _locate(self, slot: int) -> tuple[int, int, int]:
        stage = bisect.bisect_right(self.stage_slots, slot) - 1
        block, offset = divmod(slot - self.stage_slots[stage], self.block_rows)
        return stage, block, offset

    def count_before(self, stream: int, slot: int) -> np.ndarray:
        """Slots of each source among slots ``[0, slot)`` of ``stream`` (int64[sources])."""
        stage, block, offset = self._locate(slot)
        counts = self._base[stage] + block * self._full[stage]
        if offset:
            labels = self._block(stream, stage, block)[0][:offset]
            counts = counts + np.bincount(labels, minlength=self.source_count)
        return counts

    def slots(self, stream: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` of slots ``[start, stop)`` of ``stream``: which source fills each and
        the index of the slot among that source's slots of this stream."""
        sources, ks = [], []
        slot = start
        while slot < stop:
            stage, block, offset = self._locate(slot)
            n = min(stop - slot, self.block_length(stage, block) - offset)
            labels, rank = self._block(stream, stage, block)
            src = labels[offset : offset + n]
            before = self._base[stage] + block * self._full[stage]
            sources.append(src)
            ks.append(before[src] + rank[offset : offset + n])
            slot += n
        if not sources:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(sources), np.concatenate(ks)

    def step_slots(self, stream: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`slots` of the ``rows_per_stream`` rows of ``stream`` at ``step``."""
        r = self.rows_per_stream
        return self.slots(stream, step * r, (step + 1) * r)

    def first_exhausted_step(self, capacity: Sequence[int], streams: int) -> int:
        """The number of steps before the first one that needs slot ``capacity[s]`` (or later)
        of some source ``s`` in some stream: the mixture's length when no source may wrap."""

        def fits(steps: int) -> bool:
            cap = np.asarray(capacity, np.int64)
            slot = steps * self.rows_per_stream
            return all(bool((self.count_before(i, slot) <= cap).all()) for i in range(streams))

        hi = 1
        while fits(hi):
            if hi > 1 << 62:
                raise ConfigError("this mixture never exhausts a source; set MixtureParams.steps")
            hi *= 2
        lo = hi // 2 if hi > 1 else 0  # fits(lo) holds (or lo == 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo
