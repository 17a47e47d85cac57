"""From pieces to output objects: per-split counts, prefix sums, and the write tasks' shares.

A document's split depends on its index in the whole corpus, which is known only once every
piece has counted its documents; the driver then prefix-sums the pieces' document counts, has
each piece's lengths classified (:func:`split_stats`, a task per batch of pieces), prefix-sums
the per-split sequence and token counts, and cuts each split's arrays into runs of whole stored
objects, each written by exactly one task (zarr loses concurrent writes inside one object).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncflat.format.codec import SPLITS
from asyncflat.writer.convert import validation_mask
from asyncflat.writer.distributed.pieces import read_lengths_many
from asyncflat.writer.distributed.storage import Location
from asyncflat.writer.flat_tokens import SEQ_STARTS_CHUNK

__all__ = ["SplitLayout", "StatsJob", "WriteJob", "plan_writes", "selected", "split_stats"]


def selected(
    lengths: np.ndarray, doc_offset: int, split: str, fraction: float, seed: int
) -> np.ndarray:
    """Which documents of a piece are sequences of ``split`` (non-empty, and hashed there)."""
    is_val = validation_mask(np.arange(doc_offset, doc_offset + lengths.size), fraction, seed)
    return (lengths > 0) & (is_val if split == "validation" else ~is_val)


@dataclasses.dataclass(frozen=True)
class StatsJob:
    work: Location
    pieces: tuple[tuple[int, int], ...]  # (piece index, index of its first document)
    fraction: float
    seed: int


def split_stats(job: StatsJob) -> list[tuple[int, int, int, int, int]]:
    """For each piece: (index, train sequences, train tokens, validation sequences, tokens)."""
    out = []
    all_lengths = read_lengths_many(job.work, [index for index, _ in job.pieces])
    for (index, doc_offset), lengths in zip(job.pieces, all_lengths):
        row = [index]
        for split in SPLITS:
            mask = selected(lengths, doc_offset, split, job.fraction, job.seed)
            row += [int(np.count_nonzero(mask)), int(lengths[mask].sum())]
        out.append((row[0], row[1], row[2], row[3], row[4]))
    return out


@dataclasses.dataclass(frozen=True)
class SplitLayout:
    """One split's pieces with their offsets in the split's sequences and tokens."""

    split: str
    piece_index: np.ndarray  # piece indices holding >= 1 sequence of the split, in order
    doc_offset: np.ndarray  # each piece's first document index in the corpus
    seq_offset: np.ndarray  # len(pieces) + 1 prefix sums of sequences
    tok_offset: np.ndarray  # len(pieces) + 1 prefix sums of tokens

    @property
    def sequences(self) -> int:
        return int(self.seq_offset[-1])

    @property
    def tokens(self) -> int:
        return int(self.tok_offset[-1])


@dataclasses.dataclass(frozen=True)
class WriteJob:
    """Write ``[start, end)`` of ``split``'s ``array`` (a run of whole objects)."""

    array: str  # "encoded_tokens" or "seq_starts"
    split: str
    start: int
    end: int
    #: (piece index, first document index, first sequence in split, first token in split)
    pieces: tuple[tuple[int, int, int, int], ...]


def plan_writes(layout: SplitLayout, object_tokens: int, run_objects: int) -> list[WriteJob]:
    """Write jobs for one split: token runs of ``run_objects`` whole objects, and whole runs of
    ``seq_starts`` chunks."""
    jobs = []

    def pieces_for(offsets: np.ndarray, lo: int, hi: int) -> tuple[tuple[int, int, int, int], ...]:
        # pieces p with offsets[p] < hi and offsets[p + 1] > lo
        first = int(np.searchsorted(offsets, lo, side="right")) - 1
        last = int(np.searchsorted(offsets, hi, side="left"))
        return tuple(
            (
                int(layout.piece_index[p]),
                int(layout.doc_offset[p]),
                int(layout.seq_offset[p]),
                int(layout.tok_offset[p]),
            )
            for p in range(max(first, 0), min(last, layout.piece_index.size))
        )

    run = object_tokens * run_objects
    for start in range(0, layout.tokens, run):
        end = min(start + run, layout.tokens)
        jobs.append(
            WriteJob(
                "encoded_tokens",
                layout.split,
                start,
                end,
                pieces_for(layout.tok_offset, start, end),
            )
        )
    entries = layout.sequences + 1
    run = SEQ_STARTS_CHUNK * max(1, run_objects * object_tokens // SEQ_STARTS_CHUNK // 64)
    for start in range(0, entries, run):
        end = min(start + run, entries)
        # seq_starts[j] is the end of sequence j - 1: sequences [start - 1, end - 1) are needed.
        jobs.append(
            WriteJob(
                "seq_starts",
                layout.split,
                start,
                end,
                pieces_for(layout.seq_offset, max(start - 1, 0), end - 1),
            )
        )
    return jobs
