"""Describe and verify flat-tokens datasets: what ``asyncflat inspect`` prints, as library calls.

* :func:`describe_split`: sizes, storage layout (zarr format, chunking, codecs, compression
  ratio) and, from one scan of ``seq_starts``, the sequence-length distribution.
* :func:`loader_figures`: what a given loader configuration costs on that split: steps,
  minipochs, shuffle-buffer memory per host and read amplification (chunk tokens decoded per
  token used), computed from the plan without reading any tokens.
* :func:`verify_split`: a full scan, chunk by chunk in bounded memory, of every invariant of the
  format (see ``docs/format.md``). It raises :class:`~asyncflat.errors.DatasetFormatError` (or
  :class:`~asyncflat.errors.CorruptChunkError` for bytes that do not decode, or a chunk that is
  missing) at the first violation, naming the array and the index.

Everything reads through the same guarded source as the loader, so local paths and fsspec URLs
(``gs://``, ``s3://``, ``memory://``) both work and a missing chunk is an error, not zeros.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ._loop import LoopThread
from .config import FlatTokensParams, TokenBatchParams
from .errors import (
    AsyncflatError,
    ConfigError,
    CorruptChunkError,
    DatasetFormatError,
    DatasetTooLargeError,
    carries_secret,
    install_log_redaction,
    option_secrets,
    redact,
    scrubbed,
)
from .format import SplitArrays, open_split
from .plan import ShufflePlan
from .source import ZarrTokenSource, _make_store
from .storage.filesystems import close_store, construction_error

__all__ = [
    "LengthStats",
    "LoaderFigures",
    "SplitSummary",
    "VerifyReport",
    "describe_split",
    "loader_figures",
    "verify_split",
]

log = logging.getLogger(__name__)

#: Tokens / seq_starts entries read per request while scanning (rounded to whole chunks):
#: 16 MiB of tokens and 8 MiB of offsets, so a scan's memory stays bounded.
_TOKEN_WINDOW = 1 << 22
_STARTS_WINDOW = 1 << 20
#: Sequence lengths below this are counted exactly in a dense histogram; longer ones are kept
#: in a list (there are at most token_count / this many of them).
_DENSE_LENGTHS = 1 << 22
#: Bytes per read block that loader_figures' arrays take at their peak (block order, buffer
#: ids, first and last chunks, and the sort that deduplicates them).
_FIGURES_BYTES_PER_BLOCK = 160


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LengthStats:
    """Sequence lengths of a split (exact; percentiles are the smallest length L such that at
    least that fraction of sequences is <= L). ``log2_histogram[k]`` counts lengths in
    ``[2**k, 2**(k+1))``."""

    count: int
    min: int
    median: int
    p90: int
    max: int
    mean: float
    log2_histogram: list[int]


@dataclasses.dataclass(frozen=True)
class SplitSummary:
    """What :func:`describe_split` found; ``lengths`` is None when not scanned or empty."""

    filespec: str
    split: str
    zarr_format: int
    token_count: int
    sequence_count: int
    max_token_id: int
    chunk_tokens: int
    shard_tokens: int | None
    seq_starts_chunk: int
    token_codecs: list[str]
    seq_starts_codecs: list[str]
    tokens_nbytes: int
    tokens_nbytes_stored: int
    seq_starts_nbytes: int
    seq_starts_nbytes_stored: int
    lengths: LengthStats | None

    @property
    def compression_ratio(self) -> float | None:
        """Uncompressed over stored bytes of both arrays (None for an empty split)."""
        stored = self.tokens_nbytes_stored + self.seq_starts_nbytes_stored
        raw = self.tokens_nbytes + self.seq_starts_nbytes
        return raw / stored if stored and raw else None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["compression_ratio"] = self.compression_ratio
        return out


@dataclasses.dataclass(frozen=True)
class LoaderFigures:
    """What a loader configuration costs on a split (see :func:`loader_figures`)."""

    seq_count: int
    read_block_count: int
    step_count: int
    minipoch_count: int
    rows_used: int
    rows_skipped: int
    buffer_bytes: int
    hosts: int
    streams_per_host: int
    buffer_bytes_per_host: int
    read_amplification: float | None
    #: Share of the split (tokens with packing, sequences without) an epoch never serves.
    dropped_fraction: float = 0.0
    #: The split's tokens as the loader holds them (uint32), to set the buffers against.
    split_bytes: int = 0
    #: Why and how to fix it, when the rounding drops more than 1% of the split.
    sizing_warning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """A split that passed :func:`verify_split`, with what was checked."""

    filespec: str
    split: str
    token_count: int
    sequence_count: int
    max_token_id: int
    observed_max_token_id: int | None
    token_reads: int
    seq_starts_reads: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def describe_split(
    filespec: str,
    split: str,
    *,
    scan_lengths: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> SplitSummary:
    """Describe ``split`` of the dataset at ``filespec`` (a path or fsspec URL).

    With ``scan_lengths`` the whole of ``seq_starts`` is read (8 bytes per sequence, in bounded
    windows) for the length statistics; without it only metadata is read. A ``seq_starts`` that
    is not strictly increasing raises :class:`DatasetFormatError`.
    """
    return _run(
        _describe(filespec, split, scan_lengths, storage_options, progress),
        filespec,
        storage_options,
    )


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

    ``sizing_warning`` is set (the loader logs the same) when rounding to whole blocks, streams
    and batches leaves more than 1% of the split unserved.

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
    need = _FIGURES_BYTES_PER_BLOCK * plan.read_block_count
    if need > plan.plan_memory_budget:
        raise DatasetTooLargeError(
            f"{summary.filespec}/{summary.split}: {plan.read_block_count} read blocks; the "
            f"figures need {need} bytes, more than the plan's budget of "
            f"{plan.plan_memory_budget}; grow sequences_per_read_block"
        )
    if params.sequence_packing:
        amplification = _packed_amplification(plan, summary.chunk_tokens)
    else:
        amplification = _run(
            _unpacked_amplification(summary, plan, storage_options),
            getattr(summary, "_filespec", summary.filespec),
            storage_options,
        )
    rows_used = plan.step_count * plan.batch
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
        buffer_bytes_per_host=2 * streams_per_host * plan.buffer_bytes,
        read_amplification=amplification,
        dropped_fraction=plan.dropped_fraction,
        split_bytes=4 * summary.token_count,
        sizing_warning=plan.sizing_warning(),
    )


def verify_split(
    filespec: str,
    split: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> VerifyReport:
    """Check every invariant of ``split``, reading it all once, chunk by chunk.

    Checked: the metadata (dtypes, 1-D, ``max_token_id``); ``seq_starts[0] == 0``,
    ``seq_starts[-1] == len(encoded_tokens)`` and ``seq_starts`` strictly increasing (every
    sequence has a token); every token id ``<= max_token_id``; the start bit
    (``encoded & 1``) is set exactly at the offsets in ``seq_starts``; every chunk of both arrays
    is present and decodes. Memory stays at a few windows of ``_TOKEN_WINDOW`` tokens.

    Returns a :class:`VerifyReport`; raises :class:`DatasetFormatError` naming the first
    offending index, or :class:`CorruptChunkError` naming the chunk that does not decode.
    """
    return _run(_verify(filespec, split, storage_options, progress), filespec, storage_options)


# --------------------------------------------------------------------------------------------
# Implementation
# --------------------------------------------------------------------------------------------


def _run(coro: Any, filespec: str, storage_options: Mapping[str, Any] | None) -> Any:
    """Run ``coro`` on a loop of its own; errors leave with any URL secret and any value of
    ``storage_options`` removed."""
    secrets = option_secrets(storage_options)
    install_log_redaction(secrets)
    runner = LoopThread(name="asyncflat-inspect", cpu_threads=2)
    try:
        return runner.run(coro)
    except AsyncflatError as exc:
        if not carries_secret(exc, secrets):
            raise
        raise scrubbed(exc, filespec, secrets) from None
    finally:
        runner.close()


async def _open_arrays(
    filespec: str, split: str, storage_options: Mapping[str, Any] | None
) -> tuple[SplitArrays, Any]:
    """The split's arrays (through a guarded store) and the raw store, to close after."""
    try:
        store = _make_store(filespec, storage_options)
    except Exception as exc:  # noqa: BLE001 - a filesystem constructor, credential exchange
        secrets = option_secrets(storage_options)
        raise construction_error(exc, filespec, secrets) from (
            None if carries_secret(exc, secrets) else exc
        )
    try:
        return await open_split(store, split, name=filespec), store
    except BaseException:
        await close_store(store)
        raise


async def _open_source(
    filespec: str, split: str, storage_options: Mapping[str, Any] | None
) -> ZarrTokenSource:
    try:
        return await ZarrTokenSource.open(filespec, split, storage_options=storage_options)
    except AsyncflatError:
        raise
    except Exception as exc:  # noqa: BLE001 - a filesystem constructor, credential exchange
        raise scrubbed(exc, filespec) from (None if carries_secret(exc) else exc)


def _codec_names(array: Any) -> list[str]:
    names = []
    for codec in (*array.filters, *array.compressors):
        cname = getattr(codec, "cname", None)
        if cname is not None:  # Blosc (zarr 3 codec or numcodecs)
            shuffle: Any = getattr(codec, "shuffle", None)
            shuffle = getattr(shuffle, "value", shuffle)
            shuffle = {0: "noshuffle", 1: "shuffle", 2: "bitshuffle"}.get(shuffle, shuffle)
            names.append(
                f"blosc({getattr(cname, 'value', cname)}, clevel={codec.clevel}, {shuffle})"
            )
        else:
            config = getattr(codec, "codec_id", None) or type(codec).__name__
            names.append(str(config).lower().removesuffix("codec"))
    return names


async def _describe(
    filespec: str,
    split: str,
    scan_lengths: bool,
    storage_options: Mapping[str, Any] | None,
    progress: bool,
) -> SplitSummary:
    arrays, store = await _open_arrays(filespec, split, storage_options)
    try:
        return await _summarise(arrays, filespec, split, scan_lengths, storage_options, progress)
    finally:
        await close_store(store)


async def _summarise(
    arrays: SplitArrays,
    filespec: str,
    split: str,
    scan_lengths: bool,
    storage_options: Mapping[str, Any] | None,
    progress: bool,
) -> SplitSummary:
    tokens, starts = arrays.encoded_tokens, arrays.seq_starts
    lengths = None
    if scan_lengths and arrays.sequence_count:
        source = await _open_source(filespec, split, storage_options)
        try:
            scan = _LengthScan()
            async for _, window in _seq_start_windows(source, int(starts.chunks[0]), progress):
                scan.add(window)
            lengths = scan.result()
        finally:
            await source.aclose()
    summary = SplitSummary(
        filespec=redact(filespec),
        split=split,
        zarr_format=arrays.zarr_format,
        token_count=arrays.token_count,
        sequence_count=arrays.sequence_count,
        max_token_id=arrays.max_token_id,
        chunk_tokens=arrays.token_chunk,
        shard_tokens=int(tokens.shards[0]) if tokens.shards else None,
        seq_starts_chunk=int(starts.chunks[0]),
        token_codecs=_codec_names(tokens),
        seq_starts_codecs=_codec_names(starts),
        tokens_nbytes=int(tokens.nbytes),
        tokens_nbytes_stored=int(await tokens.nbytes_stored()),
        seq_starts_nbytes=int(starts.nbytes),
        seq_starts_nbytes_stored=int(await starts.nbytes_stored()),
        lengths=lengths,
    )
    # The URL as given (with its credentials) stays off the shown fields, for later reads.
    object.__setattr__(summary, "_filespec", filespec)
    return summary


class _LengthScan:
    """Exact length statistics accumulated window by window."""

    def __init__(self) -> None:
        self.dense = np.zeros(0, np.int64)
        self.long: list[np.ndarray] = []
        self.count = 0
        self.total = 0
        self.previous: int | None = None

    def add(self, window: np.ndarray) -> None:
        """Add the lengths ending in ``window``, the next consecutive entries of seq_starts."""
        values = window.astype(np.int64)
        if self.previous is not None:
            values = np.concatenate([[self.previous], values])
        if values.size:
            self.previous = int(values[-1])
        lengths = np.diff(values)
        if not lengths.size:
            return
        self.count += lengths.size
        self.total += int(lengths.sum())
        small = lengths[lengths < _DENSE_LENGTHS]
        if small.size:
            counts = np.bincount(small)
            if counts.size > self.dense.size:
                counts[: self.dense.size] += self.dense
                self.dense = counts
            else:
                self.dense[: counts.size] += counts
        big = lengths[lengths >= _DENSE_LENGTHS]
        if big.size:
            self.long.append(big)

    def result(self) -> LengthStats | None:
        if not self.count:
            return None
        long = np.sort(np.concatenate(self.long)) if self.long else np.zeros(0, np.int64)
        dense_cum = np.cumsum(self.dense)

        def quantile(q: float) -> int:
            rank = max(1, math.ceil(q * self.count))  # the rank-th smallest length
            if rank <= (dense_cum[-1] if dense_cum.size else 0):
                return int(np.searchsorted(dense_cum, rank))
            return int(long[rank - (int(dense_cum[-1]) if dense_cum.size else 0) - 1])

        nonzero = np.flatnonzero(self.dense)
        lo = int(nonzero[0]) if nonzero.size else int(long[0])
        hi = int(long[-1]) if long.size else int(nonzero[-1])
        hist = np.zeros(hi.bit_length(), np.int64)
        if nonzero.size:
            np.add.at(hist, np.log2(nonzero).astype(np.int64), self.dense[nonzero])
        if long.size:
            np.add.at(hist, np.log2(long).astype(np.int64), 1)
        return LengthStats(
            count=self.count,
            min=lo,
            median=quantile(0.5),
            p90=quantile(0.9),
            max=hi,
            mean=self.total / self.count,
            log2_histogram=hist.tolist(),
        )


async def _read_checked(
    source: ZarrTokenSource, array: str, start: int, stop: int, chunk: int
) -> np.ndarray:
    """Read ``array[start:stop]``; if it fails to decode, find and name the exact chunk."""
    read = source.read_tokens if array == "encoded_tokens" else source.read_seq_starts
    try:
        return await read(start, stop)
    except CorruptChunkError as exc:
        first_error: Exception = exc
    for lo in range(start, stop, chunk):  # narrow the failure down to one chunk
        try:
            await read(lo, min(lo + chunk, stop))
        except CorruptChunkError as exc:
            raise CorruptChunkError(
                f"{source.name}/{array}: chunk {lo // chunk} (elements {lo}:{min(lo + chunk, stop)}) "
                f"does not decode: {exc}"
            ) from exc
    raise first_error


async def _seq_start_windows(
    source: ZarrTokenSource, chunk: int, progress: bool, stop: int | None = None
) -> AsyncGenerator[tuple[int, np.ndarray], None]:
    """Yield consecutive windows ``(base, seq_starts[base : base + len(window)])`` (uint64) of the
    first ``stop`` entries (all by default), checking that the entries strictly increase, within
    and across windows, and naming the first index where they do not."""
    entries = source.sequence_count + 1 if stop is None else stop
    window = max(chunk, _STARTS_WINDOW // chunk * chunk)
    previous: int | None = None
    with tqdm(
        total=entries, unit=" offsets", desc="seq_starts", disable=not progress, leave=False
    ) as bar:
        for base in range(0, entries, window):
            data = await _read_checked(
                source, "seq_starts", base, min(base + window, entries), chunk
            )
            data = data.astype(np.uint64, copy=False)
            ok = data[1:] > data[:-1]
            bad = None if ok.all() else base + 1 + int(np.argmin(ok))
            if previous is not None and int(data[0]) <= previous:
                bad = base
            if bad is not None:
                before = previous if bad == base else int(data[bad - base - 1])
                raise DatasetFormatError(
                    f"{source.name}/seq_starts: not strictly increasing at index {bad}: "
                    f"seq_starts[{bad}] = {int(data[bad - base])} <= seq_starts[{bad - 1}] = "
                    f"{before} (every sequence needs at least one token)"
                )
            bar.update(len(data))
            yield base, data
            previous = int(data[-1])


async def _verify(
    filespec: str, split: str, storage_options: Mapping[str, Any] | None, progress: bool
) -> VerifyReport:
    t0 = time.perf_counter()
    arrays, store = await _open_arrays(filespec, split, storage_options)  # metadata, ends
    await close_store(store)
    source = await _open_source(filespec, split, storage_options)
    where = f"{redact(filespec).rstrip('/')}/{split}"
    try:
        starts_chunk = int(arrays.seq_starts.chunks[0])
        starts_reads = 0
        last = 0
        async for _, window in _seq_start_windows(source, starts_chunk, progress):
            starts_reads += 1
            last = int(window[-1])
        if last != arrays.token_count:
            raise DatasetFormatError(
                f"{where}/seq_starts: last entry {last} != len(encoded_tokens) {arrays.token_count}"
            )
        starts = _StartCursor(_seq_start_windows(source, starts_chunk, False))
        try:
            observed, token_reads = await _check_tokens(source, arrays, starts, where, progress)
        finally:
            await starts.windows.aclose()
    finally:
        await source.aclose()
    return VerifyReport(
        filespec=redact(filespec),
        split=split,
        token_count=arrays.token_count,
        sequence_count=arrays.sequence_count,
        max_token_id=arrays.max_token_id,
        observed_max_token_id=observed,
        token_reads=token_reads,
        seq_starts_reads=starts_reads,
        seconds=time.perf_counter() - t0,
    )


class _StartCursor:
    """Hands out the seq_starts entries in successive token ranges, reading windows as needed."""

    def __init__(self, windows: AsyncGenerator[tuple[int, np.ndarray], None]) -> None:
        self.windows = windows
        self.pending = np.zeros(0, np.uint64)  # entries read but not yet handed out
        self.index = 0  # the index in seq_starts of pending[0]
        self.exhausted = False

    async def take_below(self, hi: int) -> tuple[int, np.ndarray]:
        """``(index of the first, entries)`` of the next entries below ``hi``."""
        while not self.exhausted and (self.pending.size == 0 or int(self.pending[-1]) < hi):
            try:
                _, more = await self.windows.__anext__()
            except StopAsyncIteration:
                self.exhausted = True
                break
            self.pending = np.concatenate([self.pending, more])
        n = int(np.searchsorted(self.pending, hi))
        first, taken = self.index, self.pending[:n]
        self.pending, self.index = self.pending[n:], self.index + n
        return first, taken


async def _check_tokens(
    source: ZarrTokenSource, arrays: SplitArrays, starts: _StartCursor, where: str, progress: bool
) -> tuple[int | None, int]:
    """Token ids against max_token_id and start bits against seq_starts, window by window."""
    chunk = arrays.token_chunk
    window = max(chunk, _TOKEN_WINDOW // chunk * chunk)
    observed: int | None = None
    reads = 0
    with tqdm(
        total=arrays.token_count,
        unit=" tok",
        unit_scale=True,
        desc=f"verify {arrays.split}",
        disable=not progress,
        leave=False,
    ) as bar:
        for lo in range(0, arrays.token_count, window):
            hi = min(lo + window, arrays.token_count)
            encoded = await _read_checked(source, "encoded_tokens", lo, hi, chunk)
            reads += 1
            ids = encoded >> 1
            top = int(ids.max())
            observed = top if observed is None else max(observed, top)
            if top > arrays.max_token_id:
                k = int(np.argmax(ids > arrays.max_token_id))
                raise DatasetFormatError(
                    f"{where}/encoded_tokens[{lo + k}]: token id {int(ids[k])} > max_token_id "
                    f"{arrays.max_token_id}"
                )
            first_seq, here = await starts.take_below(hi)  # every entry is >= lo by now
            expected = np.zeros(hi - lo, bool)
            expected[(here - np.uint64(lo)).astype(np.intp)] = True
            actual = (encoded & 1).astype(bool)
            if not np.array_equal(expected, actual):
                k = int(np.argmax(expected != actual))
                if actual[k]:
                    raise DatasetFormatError(
                        f"{where}/encoded_tokens[{lo + k}]: start bit set but no sequence starts "
                        f"there (no seq_starts entry is {lo + k})"
                    )
                seq = first_seq + int(np.searchsorted(here, lo + k))
                raise DatasetFormatError(
                    f"{where}/encoded_tokens[{lo + k}]: sequence {seq} starts there "
                    f"(seq_starts[{seq}]) but its start bit is 0"
                )
            bar.update(hi - lo)
    return observed, reads


def _packed_amplification(plan: ShufflePlan, chunk: int) -> float | None:
    """Chunk tokens decoded per block token, when each fill decodes each chunk it touches once."""
    bt = plan.sequences_per_read_block * plan.seq_len
    k = np.arange(plan.read_block_count, dtype=np.int64)
    blocks = plan.block_order.astype(np.int64)
    minipoch = (k // plan.streams) // plan.read_blocks_per_shuffle_buffer
    buffer_id = minipoch * plan.streams + k % plan.streams
    first = blocks * bt // chunk
    last = ((blocks + 1) * bt - 1) // chunk
    # Chunks strictly inside a block belong to that block alone: count them directly. The first
    # and last chunk of a block may be shared with other blocks of the same fill: deduplicate.
    interior = np.maximum(last - first - 1, 0).sum()
    edges = np.unique(
        np.concatenate([np.stack([buffer_id, first], axis=1), np.stack([buffer_id, last], axis=1)]),
        axis=0,
    )
    edge_chunks = edges[:, 1]
    edge_tokens = np.minimum(chunk, plan.token_count - edge_chunks * chunk).sum()
    useful = plan.read_block_count * bt
    return float((interior * chunk + edge_tokens) / useful) if useful else None


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
    filespec = getattr(summary, "_filespec", summary.filespec)
    source = await _open_source(filespec, summary.split, storage_options)
    try:
        scan_chunk = int(spb * max(1, _STARTS_WINDOW // spb))  # windows start on block bounds
        previous: int | None = None
        async for base, window in _seq_start_windows(source, scan_chunk, False, stop=used):
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
