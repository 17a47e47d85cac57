"""Which source rows make a mixture step: the pure row arithmetic of a
:class:`~asyncflat.loader.mixture.loader.MixtureLoader` and the per-source row counts it reports.

For each of this host's batch rows ``r`` (stream ``i = r // R``, position ``j = r % R``) the
:class:`~asyncflat.plan.mixture.Assignment` gives the source ``s`` and slot ``k``; slot
``k`` is row ``i * R + k % R`` of source step ``q = k // R`` in ``s``'s own order, pass
``q // step_count_s``, step ``q % step_count_s`` of that pass.
"""

from __future__ import annotations

import logging

import numpy as np

from asyncflat.loader.mixture.passes import RowGroup, SourceState
from asyncflat.plan.mixture import Assignment

__all__ = ["batch_sources", "count_rows", "step_groups"]

log = logging.getLogger("asyncflat.loader.mixture.loader")


def step_groups(
    assignment: Assignment,
    host_rows: np.ndarray,
    streams: tuple[int, ...],
    rows_per_stream: int,
    step_counts: np.ndarray,
    step: int,
) -> list[RowGroup]:
    """The groups of source rows (source, pass, source step, rows) that make ``host_rows`` of
    ``step``; ``streams`` are this host's streams, ``step_counts`` each source's steps per pass."""
    r = rows_per_stream
    hosts = host_rows
    sources = np.empty(len(hosts), np.int64)
    ks = np.empty(len(hosts), np.int64)
    for stream in streams:
        mine = np.flatnonzero(hosts // r == stream)
        src, k = assignment.step_slots(stream, step)
        sources[mine] = src[hosts[mine] % r]
        ks[mine] = k[hosts[mine] % r]
    passes_step = ks // r
    epochs = passes_step // step_counts[sources]
    source_steps = passes_step % step_counts[sources]
    rows = (hosts // r) * r + ks % r
    # One group per (source, pass, source step): the global source step ``passes_step``
    # holds the pass and step, so (passes_step, source) identifies a group.
    keys = passes_step * len(step_counts) + sources
    order = np.argsort(keys, kind="stable")
    starts = np.flatnonzero(np.diff(keys[order], prepend=-1))
    groups = []
    for out in np.split(order, starts[1:]):
        i = int(out[0])
        wanted, take = np.unique(rows[out], return_inverse=True)
        group = RowGroup(int(sources[i]), int(epochs[i]), int(source_steps[i]), wanted, out, take)
        groups.append(group)
    return groups


def batch_sources(
    assignment: Assignment, streams: int, batch: int, rows_per_stream: int, step: int
) -> np.ndarray:
    """The source index of every row of ``step``'s whole batch, all hosts (int64[batch])."""
    out = np.empty(batch, np.int64)
    r = rows_per_stream
    for stream in range(streams):
        out[stream * r : (stream + 1) * r] = assignment.step_slots(stream, step)[0]
    return out


def count_rows(sources: list[SourceState], groups: list[RowGroup], step: int) -> None:
    """Add ``groups``' rows to their sources' figures and note a source's new pass (call with
    the loader's lock held)."""
    for group in groups:
        source = sources[group.source]
        source.rows += len(group.out)
        if group.epoch + 1 > source.passes:
            source.passes = group.epoch + 1
            log.info(
                "mixture source %d (%s) ran out and starts pass %d at mixture step %d",
                source.index,
                source.where,
                source.passes,
                step,
            )
