"""The one fake source the engine tests use: in memory, behind the real TokenSource interface."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Iterator

import numpy as np

from asyncflat.source.protocol import Targets, TokenSource, UnitWriter
from asyncflat.storage.counters import IOCounters

SEQ_LEN = 8

#: Inside FakeSource.demand() (tasks started there copy it, as the real store's flag).
_IN_DEMAND: contextvars.ContextVar[bool] = contextvars.ContextVar("fake_demand", default=False)


class FakeSource:
    """In-memory tokens behind the real :class:`TokenSource` interface, with per-read latency,
    failure injection and a log of every read.

    ``partial_reads``: row reads (``read_items``) are offered and fast, like a Blosc or
    uncompressed zarr store; chunk reads still take ``latency_s``.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        starts: np.ndarray,
        *,
        chunk: int,
        latency_s: float = 0.0,
        fail: Callable[[int, int], BaseException | None] | None = None,
        partial_reads: bool = False,
        latency_for: Callable[[int, int], float] | None = None,
        item_latency_s: float = 0.0,
    ) -> None:
        self.tokens, self.starts = tokens, starts
        self.name = "fake://tokens"
        self.token_count, self.sequence_count = len(tokens), len(starts) - 1
        self.max_token_id = int((tokens >> 1).max())
        self.token_chunk = chunk
        self.remote = False
        self.partial_reads = partial_reads
        self.io = IOCounters()
        self.latency_s, self.fail, self.latency_for = latency_s, fail, latency_for
        self.item_latency_s = item_latency_s
        self.in_flight = self.peak_in_flight = 0
        self.reads: list[tuple[int, int]] = []  # completed token reads, in completion order
        self.item_reads = 0
        self.item_demands: list[bool] = []  # per read_items: made inside demand()?
        self.cancelled_reads = 0
        self.closed = False

    async def _read(self, array: np.ndarray, start: int, stop: int, log: bool) -> np.ndarray:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await asyncio.sleep(
                self.latency_for(start, stop) if self.latency_for else self.latency_s
            )
            error = self.fail(start, stop) if self.fail and log else None
            if error is not None:
                raise error
            if log:
                self.reads.append((start, stop))
            return array[start:stop].copy()
        except asyncio.CancelledError:
            self.cancelled_reads += 1
            raise
        finally:
            self.in_flight -= 1

    async def read_tokens(self, start: int, stop: int) -> np.ndarray:
        data = await self._read(self.tokens, start, stop, log=True)
        self.io.bytes_decoded += data.nbytes
        return data

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray:
        return await self._read(self.starts, start, stop, log=False)

    async def read_into(self, start: int, stop: int, targets: Targets, writer: UnitWriter) -> None:
        data = await self.read_tokens(start, stop)
        chunk_start = start // self.token_chunk * self.token_chunk

        def fill_targets() -> None:
            for first_item, out in targets:
                offset = chunk_start + first_item - start
                out[:] = data[offset : offset + len(out)]

        await writer.write(fill_targets)

    async def read_items(self, chunk_id: int, first_item: int, out: np.ndarray) -> None:
        assert self.partial_reads, "the engine asked for rows of a source that has no row reads"
        self.item_reads += 1
        self.item_demands.append(_IN_DEMAND.get())
        if self.item_latency_s:
            await asyncio.sleep(self.item_latency_s)
        start = chunk_id * self.token_chunk + first_item
        out[:] = self.tokens[start : start + len(out)]

    @contextlib.contextmanager
    def demand(self, needed: bool = True) -> Iterator[None]:
        token = _IN_DEMAND.set(needed)
        try:
            yield
        finally:
            _IN_DEMAND.reset(token)

    async def aclose(self) -> None:
        self.closed = True


def _implements_the_interface(source: FakeSource) -> TokenSource:
    return source  # mypy checks the fake against the real Protocol here


def make_data(seed: int = 0, rows: int = 640) -> tuple[np.ndarray, np.ndarray]:
    """Packed tokens whose value encodes their own position (so any misplacement shows)."""
    tokens = (np.arange(rows * SEQ_LEN, dtype=np.uint32) * 2) % (1 << 31)
    starts = np.arange(0, rows * SEQ_LEN + 1, SEQ_LEN, dtype=np.uint64)
    tokens[starts[:-1].astype(np.int64)] |= 1
    return tokens, starts
