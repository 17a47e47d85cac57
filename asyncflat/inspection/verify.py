"""``verify_split``: every invariant of the format, checked in one bounded-memory scan."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from asyncflat.errors import DatasetFormatError, redact
from asyncflat.format.split import SplitArrays
from asyncflat.inspection.results import VerifyReport
from asyncflat.inspection.scan import (
    STARTS_WINDOW,
    TOKEN_WINDOW,
    open_arrays,
    open_source,
    read_checked,
    run,
    seq_start_windows,
)
from asyncflat.source.zarr_source import ZarrTokenSource
from asyncflat.storage.filesystems import close_store

__all__ = ["verify_split"]


def verify_split(
    filespec: str,
    split: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = False,
    token_window: int = TOKEN_WINDOW,
    starts_window: int = STARTS_WINDOW,
) -> VerifyReport:
    """Check every invariant of ``split``, reading it all once, chunk by chunk.

    Checked: the metadata (dtypes, 1-D, ``max_token_id``); ``seq_starts[0] == 0``,
    ``seq_starts[-1] == len(encoded_tokens)`` and ``seq_starts`` strictly increasing (every
    sequence has a token); every token id ``<= max_token_id``; the start bit
    (``encoded & 1``) is set exactly at the offsets in ``seq_starts``; every chunk of both arrays
    is present and decodes. Memory stays at a few windows: ``token_window`` tokens and
    ``starts_window`` ``seq_starts`` entries are read at a time (rounded down to whole chunks).

    Returns a :class:`VerifyReport`; raises :class:`DatasetFormatError` naming the first
    offending index, or :class:`CorruptChunkError` naming the chunk that does not decode.
    """
    scan = _verify(filespec, split, storage_options, progress, token_window, starts_window)
    return run(scan, filespec, storage_options)


async def _verify(
    filespec: str,
    split: str,
    storage_options: Mapping[str, Any] | None,
    progress: bool,
    token_window: int,
    starts_window: int,
) -> VerifyReport:
    t0 = time.perf_counter()
    arrays, store = await open_arrays(filespec, split, storage_options)  # metadata, ends
    await close_store(store)
    source = await open_source(filespec, split, storage_options)
    where = f"{redact(filespec).rstrip('/')}/{split}"
    try:
        starts_chunk = int(arrays.seq_starts.chunks[0])
        starts_reads = 0
        last = 0
        async for _, window in seq_start_windows(
            source, starts_chunk, progress, window=starts_window
        ):
            starts_reads += 1
            last = int(window[-1])
        if last != arrays.token_count:
            raise DatasetFormatError(
                f"{where}/seq_starts: last entry {last} != len(encoded_tokens) {arrays.token_count}"
            )
        starts = _StartCursor(seq_start_windows(source, starts_chunk, False, window=starts_window))
        try:
            observed, token_reads = await _check_tokens(
                source, arrays, starts, where, progress, token_window
            )
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
    source: ZarrTokenSource,
    arrays: SplitArrays,
    starts: _StartCursor,
    where: str,
    progress: bool,
    token_window: int,
) -> tuple[int | None, int]:
    """Token ids against max_token_id and start bits against seq_starts, window by window."""
    chunk = arrays.token_chunk
    window = max(chunk, token_window // chunk * chunk)
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
            encoded = await read_checked(source, "encoded_tokens", lo, hi, chunk)
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
