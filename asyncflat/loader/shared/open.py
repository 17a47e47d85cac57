"""Opening a flat-tokens split's engine: the source, the plan of an epoch and the buffers' size
check, on the loop that then owns the engine (:func:`open_engine`, used by
:class:`~asyncflat.loader.shuffling.ShufflingLoader` and the mixture loader)."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable

import numpy as np

from asyncflat.config import EngineOptions, FlatTokensParams, TokenBatchParams, redact_url
from asyncflat.engine import Engine
from asyncflat.errors import ConfigError
from asyncflat.plan.coverage import dropped_warning, format_bytes
from asyncflat.plan.permutation import warm_up as warm_up_permutation
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.source.protocol import StoreWrapper, TokenSource
from asyncflat.source.zarr_source import ZarrTokenSource
from asyncflat.storage.local_files import is_url

__all__ = ["fills_on_open", "open_engine", "sizing_log"]

# The loader's logger: these records kept their name when this function left asyncflat.loader.shuffling.
log = logging.getLogger("asyncflat.loader.shuffling")
#: the logger of the warnings about a loader's sizes (rows never served, a mixture source
#: starved): the same for every epoch, so ``iter_epochs`` logs each once (a filter on it)
sizing_log = logging.getLogger("asyncflat.loader.sizing")


async def open_engine(
    split: str,
    params: FlatTokensParams,
    token_batch_params: TokenBatchParams,
    host_rows: np.ndarray,
    options: EngineOptions,
    *,
    epoch: int = 0,
    store_wrapper: StoreWrapper | None = None,
    source: TokenSource | None = None,
    fill_on_open: bool = True,
    warn_sizes: bool = True,
) -> Engine:
    """Open ``params``' split (unless ``source`` is given), plan epoch ``epoch`` and build the
    engine of the streams ``host_rows`` belong to (on the running loop, which then owns it).
    ``fill_on_open`` False leaves step 0's fills to the caller (``Engine.fill_on_open``),
    whatever ``options`` say; ``warn_sizes`` False skips the warning of rows never served (a
    later pass of a split whose first pass warned of the same rows). When the plan or the
    buffers' size is refused, or the engine cannot start, what was opened here is closed again
    (the engine, and the source unless the caller gave it): no store, session, thread or read
    memory is left behind, and a close that fails there is logged, never raised over the
    refusal."""
    opened_here = source is None
    where = f"{redact_url(os.fspath(params.filespec))}/{split}"  # as logs and errors name it
    if source is None and store_wrapper is None and not params.storage_options:
        source = await _open_plain_local(os.fspath(params.filespec), split, options)
    if source is None:
        source = await ZarrTokenSource.open(
            os.fspath(params.filespec),  # a str once the config is built
            split,
            storage_options=params.storage_options,
            max_concurrent_requests=options.max_concurrent_reads,
            retry=options.retry,
            store_wrapper=store_wrapper,
        )
    try:
        engine = _engine(
            where, params, token_batch_params, host_rows, options, source, epoch, warn_sizes
        )
    except BaseException:
        if opened_here:
            await _close_refused(source.aclose(), where)
        raise
    try:
        # A mixture's passes (no fills on opening) open while others serve: no page writes on
        # the pool there, where the serving passes' decodes would queue behind them.
        engine.open(fill=fill_on_open and fills_on_open(options, source), write_pages=fill_on_open)
    except BaseException:
        await _close_refused(engine.aclose(close_source=opened_here), where)
        raise
    return engine


async def _close_refused(closing: Awaitable[None], where: str) -> None:
    """Await ``closing`` (of what an open refused or failed had opened): a failure is logged,
    since the refusal is what the caller must see."""
    try:
        await closing
    except Exception:
        log.warning("could not close %s after its open was refused", where, exc_info=True)


def _engine(
    where: str,
    params: FlatTokensParams,
    token_batch_params: TokenBatchParams,
    host_rows: np.ndarray,
    options: EngineOptions,
    source: TokenSource,
    epoch: int,
    warn_sizes: bool,
) -> Engine:
    """The plan of ``epoch``, its sizes checked and logged (the split named ``where``), and the
    engine of the host's streams (not opened yet)."""
    # The plan keeps the block order of this host's streams alone (4 bytes a block of them).
    rows_per_stream = max(1, token_batch_params.batch // params.streams)
    streams = np.unique(host_rows // rows_per_stream).tolist()
    plan = ShufflePlan.create(
        params,
        token_batch_params,
        token_count=source.token_count,
        sequence_count=source.sequence_count,
        epoch=epoch,
        served_streams=tuple(streams),
    )
    # The buffers' row permutations' compile (when they need the kernel) starts now, and the
    # global block shuffle (which compiles the kernel it needs itself) once the engine exists,
    # both off this thread: construction never waits for them, the first load() waits for
    # what is left of them.
    warm_up_permutation(plan.seqs_per_buffer)
    per_stream = plan.buffers_per_stream
    needed = per_stream * len(streams) * plan.buffer_bytes
    if options.max_buffer_bytes is not None and needed > options.max_buffer_bytes:
        raise ConfigError(
            f"shuffle buffers need {needed:,} bytes on this host ({per_stream} x {len(streams)} "
            f"streams x "
            f"{plan.buffer_bytes:,}), over EngineOptions.max_buffer_bytes="
            f"{options.max_buffer_bytes:,}; lower read_blocks_per_shuffle_buffer or "
            "sequences_per_read_block"
        )
    warning = dropped_warning(plan, where) if warn_sizes else None
    if warning is not None:
        sizing_log.warning("%s", warning)
    log.info(
        "%s: %d steps, %d minipochs, streams %s on this host; shuffle buffers %s each, "
        "%s on this host (%d per stream), for a split of %s of tokens",
        where,
        plan.step_count,
        plan.minipoch_count,
        streams,
        format_bytes(plan.buffer_bytes),
        format_bytes(needed),
        per_stream,
        format_bytes(plan.token_count * 4),
    )
    return Engine(plan, source, streams, options)


def fills_on_open(options: EngineOptions, source: TokenSource) -> bool:
    """Whether an engine of ``source`` starts step 0's fills when it opens."""
    mode = options.fill_on_open
    return options.prefetch and (mode == "always" or (mode == "local" and not source.remote))


async def _open_plain_local(
    filespec: str, split: str, options: EngineOptions
) -> TokenSource | None:
    """A plain local split opened without zarr (its import alone would cost a restart 0.1-0.3 s),
    or None: a URL, or a layout the zarr-free reader does not know (zarr opens those)."""
    if is_url(filespec):
        return None
    from asyncflat.source.local_source import LocalTokenSource

    return await LocalTokenSource.open_plain(filespec, split, retry=options.retry)
