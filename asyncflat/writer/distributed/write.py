"""The output's arrays, the write tasks, and the commit, through :mod:`asyncflat.writer.output`.

The driver opens the output as the single-machine writer does (:func:`open_output`: the same
checks before anything is replaced, the same staging and commit); only the root group's metadata
is held back on an object store, since the tasks open the arrays' metadata themselves. The tasks
write their objects at the output's :attr:`~asyncflat.writer.output.Output.location` (the
staging directory, or the URL), reached through an :class:`OutputTarget`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
import zarr

from asyncflat.format.codec import SPLITS
from asyncflat.writer.distributed.layout import WriteJob, selected
from asyncflat.writer.distributed.pieces import read_lengths_many, read_token_ranges_many
from asyncflat.writer.distributed.storage import Location
from asyncflat.writer.flat_tokens import create_split_arrays
from asyncflat.writer.output import Output

__all__ = ["OutputTarget", "WriteTask", "commit_output", "create_arrays", "run_write_job"]


@dataclasses.dataclass(frozen=True)
class OutputTarget:
    """Where the write tasks write: the output's location (picklable, for other machines)."""

    location: Location
    zarr_format: Literal[2, 3]

    def store(self) -> Any:
        if self.location.local:
            return zarr.storage.LocalStore(self.location.root)
        return zarr.storage.FsspecStore.from_url(
            self.location.root, storage_options=self.location.storage_options or None
        )


def create_arrays(
    output: Output,
    shapes: dict[str, tuple[int, int]],
    *,
    zarr_format: Literal[2, 3],
    chunk_tokens: int,
    shard_tokens: int | None,
) -> None:
    """Create the groups and arrays at their final shapes (the root's metadata held back)."""
    root = zarr.open_group(output.store, mode="w", zarr_format=zarr_format)
    for split in SPLITS:
        create_split_arrays(
            root.create_group(split),
            shapes[split],
            zarr_format=zarr_format,
            chunk_tokens=chunk_tokens,
            shard_tokens=shard_tokens,
        )


def commit_output(
    output: Output, max_token_ids: dict[str, int], zarr_format: Literal[2, 3]
) -> None:
    """Record each split's ``max_token_id``, then commit the output (root metadata last)."""
    for split in SPLITS:
        group = zarr.open_group(output.store, path=split, mode="r+", zarr_format=zarr_format)
        group.attrs["max_token_id"] = max_token_ids[split]
    output.commit()


# --------------------------------------------------------------------------------------------
# Write tasks
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WriteTask:
    """One write job and what it needs: where to write, the pieces, the split rule."""

    job: WriteJob
    target: OutputTarget
    work: Location
    fraction: float
    seed: int


def run_write_job(task: WriteTask) -> tuple[str, str, int]:
    """Write one run of whole objects; returns (split, array, largest token id written)."""
    job = task.job
    if job.array == "encoded_tokens":
        data, max_id = _encoded_tokens(task)
    else:
        data, max_id = _seq_starts(task), 0
    # Chunks equal to the fill value are written too, as the single-machine writer does (an
    # empty split's seq_starts is one 0; a reader fetching objects directly must find them).
    # zarr keeps this setting only at run time, read from its config when an array is opened.
    with zarr.config.set({"array.write_empty_chunks": True}):
        array = zarr.open_array(
            task.target.store(),
            path=f"{job.split}/{job.array}",
            mode="r+",
            zarr_format=task.target.zarr_format,
        )
    array[job.start : job.end] = data
    return job.split, job.array, max_id


def _split_docs(
    task: WriteTask, lengths: np.ndarray, doc_offset: int
) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, start in the piece's token file) of the piece's sequences of the split."""
    starts = np.zeros(lengths.size, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    mask = selected(lengths, doc_offset, task.job.split, task.fraction, task.seed)
    return lengths[mask], starts[mask]


def _encoded_tokens(task: WriteTask) -> tuple[np.ndarray, int]:
    job = task.job
    out = np.empty(job.end - job.start, np.uint32)
    max_id = 0
    # Every piece's lengths, then every token range, each fetched in one concurrent batch.
    all_lengths = read_lengths_many(task.work, [p[0] for p in job.pieces])
    placed = []  # (split_starts, lo) of each piece's documents in this run
    wanted = []  # (piece index, token ranges) to read
    for (index, doc_offset, _seq_off, tok_off), piece_lengths in zip(job.pieces, all_lengths):
        lengths, piece_starts = _split_docs(task, piece_lengths, doc_offset)
        split_starts = tok_off + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        keep = (split_starts < job.end) & (split_starts + lengths > job.start)
        lengths, piece_starts, split_starts = lengths[keep], piece_starts[keep], split_starts[keep]
        lo = np.maximum(job.start - split_starts, 0)
        hi = np.minimum(job.end - split_starts, lengths)
        a, b = piece_starts + lo, piece_starts + hi
        # Coalesce runs of adjacent documents into one read each.
        breaks = np.flatnonzero(a[1:] != b[:-1]) + 1
        firsts = np.concatenate(([0], breaks))
        lasts = np.concatenate((breaks, [a.size])) - 1
        placed.append((split_starts, lo))
        wanted.append((index, [(int(a[f]), int(b[la])) for f, la in zip(firsts, lasts)]))
    for (split_starts, lo), ids in zip(placed, read_token_ranges_many(task.work, wanted)):
        if not ids.size:
            continue
        max_id = max(max_id, int(ids.max()))
        pos = int(split_starts[0] + lo[0]) - job.start
        encoded = ids.astype(np.uint32) << np.uint32(1)
        flags = (split_starts[lo == 0] - split_starts[0] - lo[0]).astype(np.int64)
        encoded[flags] |= np.uint32(1)
        out[pos : pos + encoded.size] = encoded
    return out, max_id


def _seq_starts(task: WriteTask) -> np.ndarray:
    job = task.job
    first_seq = max(job.start - 1, 0)  # seq_starts[j] = end of sequence j - 1
    parts = [np.zeros(1, np.uint64)] if job.start == 0 else []
    all_lengths = read_lengths_many(task.work, [p[0] for p in job.pieces])
    for (_index, doc_offset, seq_off, tok_off), piece_lengths in zip(job.pieces, all_lengths):
        lengths, _ = _split_docs(task, piece_lengths, doc_offset)
        ends = np.uint64(tok_off) + np.cumsum(lengths, dtype=np.uint64)
        lo = max(first_seq - seq_off, 0)
        hi = min(job.end - 1 - seq_off, lengths.size)
        parts.append(ends[lo:hi])
    out = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
    if out.size != job.end - job.start:
        raise AssertionError(f"seq_starts run {job}: {out.size} entries")
    return out
