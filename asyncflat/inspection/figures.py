"""``loader_figures``: what a loader configuration costs on a split, from the plan."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from asyncflat.config import EngineOptions, FlatTokensParams, TokenBatchParams
from asyncflat.errors import ConfigError, DatasetTooLargeError
from asyncflat.inspection.results import LoaderFigures, SplitSummary
from asyncflat.inspection.scan import STARTS_WINDOW, open_source, run, seq_start_windows
from asyncflat.plan.coverage import coverage, dropped_warning
from asyncflat.plan.shuffle import ShufflePlan

__all__ = ["FIGURES_BLOCKS_AT_ONCE", "loader_figures"]

#: Resident memory a loader adds beyond its buffers and reads in flight, whatever their size:
#: threads' stacks and heaps, the plan's arrays, the codecs' state (measured 15-30 MiB with
#: ``bench/peers.py`` on one stream, at 32 MiB to 256 MiB buffers).
FIXED_MEMORY_BYTES = 24 << 20

#: Bytes per read block that loader_figures' arrays take at their peak (buffer ids, first and
#: last chunks, and the sort that deduplicates them), for the blocks summed at once.
_FIGURES_BYTES_PER_BLOCK = 160
#: Read blocks whose figures are summed at once at most (whole minipochs: no buffer spans two
#: runs; fewer when the plan's budget leaves less room beside the block order), so that a split
#: of any size the loader opens can be inspected: the figures then need the block order (4
#: bytes a block, as the loader's plan) and one run's arrays.
FIGURES_BLOCKS_AT_ONCE = 1 << 21


def loader_figures(
    summary: SplitSummary,
    params: FlatTokensParams,
    batch_params: TokenBatchParams,
    *,
    hosts: int = 1,
    storage_options: Mapping[str, Any] | None = None,
) -> LoaderFigures:
    """Steps, minipochs, buffer memory and read amplification of a loader over ``summary``'s split.

    ``hosts`` splits the batch rows evenly (the default sharding over all processes); a host's
    memory is 2 buffers for each stream its rows touch. Read amplification is the tokens the
    loader decodes (whole chunks) per token it keeps: with packing, each chunk decoded once per
    fill, whichever of the fill's blocks share it (the engine's small cache of recent chunks can
    only lower this); without packing, each block is one read of its sequences' token span
    (``seq_starts`` is scanned here for that).

    ``sizing_warning`` is set when rounding to whole blocks, streams and batches leaves more than
    1% of the split unserved: :func:`~asyncflat.plan.coverage.dropped_warning`, the very sentence
    the loader logs at construction over the same split and parameters.

    Raises :class:`~asyncflat.errors.ConfigError` for a configuration the loader refuses.
    """
    plan = ShufflePlan.create(
        params, batch_params, token_count=summary.token_count, sequence_count=summary.sequence_count
    )
    if hosts < 1 or batch_params.batch % hosts:
        raise ConfigError(f"hosts={hosts} must be >= 1 and divide batch={batch_params.batch}")
    rows = np.arange(batch_params.batch) // plan.rows_per_stream_step
    per_host = batch_params.batch // hosts
    streams_per_host = max(
        len(np.unique(rows[h * per_host : (h + 1) * per_host])) for h in range(hosts)
    )
    count = plan.read_block_count
    per_minipoch = plan.read_blocks_per_shuffle_buffer * plan.streams
    need = 4 * count + _FIGURES_BYTES_PER_BLOCK * min(count, per_minipoch)  # the smallest run
    if need > plan.plan_memory_budget:
        raise DatasetTooLargeError(
            f"{summary.filespec}/{summary.split}: {count} read blocks; the "
            f"figures need {need} bytes, more than the plan's budget of "
            f"{plan.plan_memory_budget}; grow sequences_per_read_block"
        )
    if params.sequence_packing:
        # as many whole minipochs at once as the budget leaves beside the order
        room = (plan.plan_memory_budget - 4 * count) // _FIGURES_BYTES_PER_BLOCK
        run_blocks = max(1, min(FIGURES_BLOCKS_AT_ONCE, room) // per_minipoch) * per_minipoch
        amplification = _packed_amplification(plan, summary.chunk_tokens, run_blocks)
    else:
        amplification = run(
            _unpacked_amplification(summary, plan, storage_options),
            summary.read_filespec or summary.filespec,
            storage_options,
        )
    rows_used = plan.step_count * plan.batch
    buffers = plan.buffers_per_stream * streams_per_host * plan.buffer_bytes
    return LoaderFigures(
        seq_count=plan.seq_count,
        read_block_count=plan.read_block_count,
        step_count=plan.step_count,
        minipoch_count=plan.minipoch_count,
        rows_used=rows_used,
        rows_skipped=plan.seq_count - rows_used,
        buffer_bytes=plan.buffer_bytes,
        hosts=hosts,
        streams_per_host=streams_per_host,
        buffer_bytes_per_host=buffers,
        buffers_per_stream=plan.buffers_per_stream,
        read_amplification=amplification,
        dropped_fraction=coverage(plan).dropped_fraction,
        split_bytes=4 * summary.token_count,
        sizing_warning=dropped_warning(plan, f"{summary.filespec}/{summary.split}"),
        memory_bytes_per_host=buffers
        + _inflight_stored_bytes(plan, summary, storage_options)
        + FIXED_MEMORY_BYTES,
    )


def _inflight_stored_bytes(
    plan: ShufflePlan, summary: SplitSummary, storage_options: Mapping[str, Any] | None
) -> int:
    """Compressed bytes of a fill's reads in flight at their most: the engine's decoded-bytes
    budget (default options) at the store's compression ratio."""
    from asyncflat.engine.units import inflight_budget_for
    from asyncflat.storage.filesystems import is_remote

    remote = is_remote(summary.read_filespec or summary.filespec)
    budget = inflight_budget_for(plan, summary.chunk_tokens, remote=remote, options=EngineOptions())
    stored = summary.tokens_nbytes_stored / max(1, summary.tokens_nbytes)
    return int(budget * min(1.0, stored))


def _packed_amplification(plan: ShufflePlan, chunk: int, run_blocks: int) -> float | None:
    """Chunk tokens decoded per block token, when each fill decodes each chunk it touches once
    (summed over runs of ``run_blocks`` blocks: whole minipochs)."""
    bt = plan.sequences_per_read_block * plan.seq_len
    order = plan.block_order
    decoded = 0
    for lo in range(0, plan.read_block_count, run_blocks):
        hi = min(lo + run_blocks, plan.read_block_count)
        decoded += _decoded_tokens(plan, chunk, bt, lo, order[lo:hi].astype(np.int64))
    useful = plan.read_block_count * bt
    return float(decoded / useful) if useful else None


def _decoded_tokens(plan: ShufflePlan, chunk: int, bt: int, lo: int, blocks: np.ndarray) -> int:
    """Chunk tokens the fills of blocks ``order[lo : lo + len(blocks)]`` decode (whole
    minipochs: every buffer they deal to is in the run)."""
    k = np.arange(lo, lo + len(blocks), dtype=np.int64)
    minipoch = (k // plan.streams) // plan.read_blocks_per_shuffle_buffer
    buffer_id = minipoch * plan.streams + k % plan.streams
    first = blocks * bt // chunk
    last = ((blocks + 1) * bt - 1) // chunk
    # Chunks strictly inside a block belong to that block alone: count them directly. The first
    # and last chunk of a block may be shared with other blocks of the same fill: deduplicate.
    interior = int(np.maximum(last - first - 1, 0).sum())
    chunks = -(-plan.token_count // chunk)
    if (int(buffer_id.max()) + 1) * chunks < 1 << 62:  # one int64 key a (buffer, chunk) pair
        keys = np.sort(np.concatenate([buffer_id * chunks + first, buffer_id * chunks + last]))
        # distinct keys by a sort (numpy's hashing np.unique took 8x as long on millions)
        edge_chunks = keys[np.flatnonzero(np.diff(keys, prepend=-1))] % chunks
    else:
        pairs = [np.stack([buffer_id, first], axis=1), np.stack([buffer_id, last], axis=1)]
        edge_chunks = np.unique(np.concatenate(pairs), axis=0)[:, 1]
    edge_tokens = int(np.minimum(chunk, plan.token_count - edge_chunks * chunk).sum())
    return interior * chunk + edge_tokens


async def _unpacked_amplification(
    summary: SplitSummary, plan: ShufflePlan, storage_options: Mapping[str, Any] | None
) -> float | None:
    """Each block is one read of its sequences' token span; every chunk it touches is decoded.

    (The engine stops at the last token it keeps, so this slightly overstates long sequences.)
    """
    spb, chunk, seq_len = plan.sequences_per_read_block, summary.chunk_tokens, plan.seq_len
    used = plan.read_block_count * spb + 1  # the seq_starts entries the blocks cover
    bounds: list[np.ndarray] = []
    kept = 0
    filespec = summary.read_filespec or summary.filespec
    source = await open_source(filespec, summary.split, storage_options)
    try:
        scan_chunk = int(spb * max(1, STARTS_WINDOW // spb))  # windows start on block bounds
        previous: int | None = None
        async for base, window in seq_start_windows(source, scan_chunk, False, stop=used):
            values = window.astype(np.int64)
            bounds.append(values[(-base) % spb :: spb])
            if previous is not None:
                values = np.concatenate([[previous], values])
            kept += int(np.minimum(np.diff(values), seq_len).sum())
            previous = int(values[-1])
    finally:
        await source.aclose()
    ends = np.concatenate(bounds)
    first, last = ends[:-1] // chunk, (ends[1:] - 1) // chunk

    def chunk_len(c: np.ndarray) -> np.ndarray:
        return np.minimum(chunk, plan.token_count - c * chunk)

    decoded = np.where(last > first, chunk_len(first) + chunk_len(last), chunk_len(first))
    decoded = decoded + np.maximum(last - first - 1, 0) * chunk
    return float(decoded.sum() / kept) if kept else None
