"""``describe_split``: sizes, storage layout, codecs, checksums and the sequence-length
distribution."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from asyncflat.errors import redact
from asyncflat.format.split import SplitArrays
from asyncflat.inspection.results import LengthStats, SplitSummary
from asyncflat.inspection.scan import open_arrays, open_source, run, seq_start_windows
from asyncflat.storage.filesystems import close_store

__all__ = ["describe_split"]

#: Sequence lengths below this are counted exactly in a dense histogram; longer ones are kept
#: in a list (there are at most token_count / this many of them).
_DENSE_LENGTHS = 1 << 22


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
    return run(
        _describe(filespec, split, scan_lengths, storage_options, progress),
        filespec,
        storage_options,
    )


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


def _has_checksums(array: Any) -> bool:
    """Whether every chunk of ``array`` carries zarr's crc32c (format 3, sharded or not; a
    format-2 ``crc32c`` compressor or filter counts too)."""
    from zarr.codecs import Crc32cCodec, ShardingCodec
    from zarr.core.metadata import ArrayV2Metadata

    meta = array.metadata
    if isinstance(meta, ArrayV2Metadata):
        codecs = [*(meta.filters or ()), meta.compressor]
        return any(getattr(codec, "codec_id", None) == "crc32c" for codec in codecs)
    chain = list(meta.codecs)
    if chain and isinstance(chain[0], ShardingCodec):
        chain = list(chain[0].codecs)
    return any(isinstance(codec, Crc32cCodec) for codec in chain)


async def _describe(
    filespec: str,
    split: str,
    scan_lengths: bool,
    storage_options: Mapping[str, Any] | None,
    progress: bool,
) -> SplitSummary:
    arrays, store = await open_arrays(filespec, split, storage_options)
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
        source = await open_source(filespec, split, storage_options)
        try:
            scan = _LengthScan()
            async for _, window in seq_start_windows(source, int(starts.chunks[0]), progress):
                scan.add(window)
            lengths = scan.result()
        finally:
            await source.aclose()
    return SplitSummary(
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
        read_filespec=filespec,  # with its credentials: kept off the shown fields
        token_checksums=_has_checksums(tokens),
        seq_starts_checksums=_has_checksums(starts),
    )


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
