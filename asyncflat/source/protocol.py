"""What the engine reads through: :class:`TokenSource`, the one interface it uses.

* ``read_into(start, stop, targets, writer)``: tokens ``[start, stop)`` (inside one stored
  chunk) into views of a shuffle buffer. The reader picks the strategy (partial Blosc decode
  straight into the views, a ranged read of an uncompressed chunk, or zarr's decoder and a copy),
  shares one fetch per chunk among the fills that need it, and hands the CPU work to ``writer``,
  the engine's side, which decides when a buffer may be written and on which threads.
* ``read_items(chunk_id, first_item, out)``: a few rows, fetching only the bytes that hold them
  (when ``partial_reads``): how a load that arrives before its blocks gets its rows.
* ``read_tokens`` / ``read_seq_starts``: plain ranges (unpacked rows, ``inspect``).
* ``demand()``: the reads made inside it are ones a waiting load needs; they go first.

Nothing here imports the storage layers: the engine sees a source, never a store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from zarr.abc.store import Store

__all__ = ["ReadCounters", "StoreWrapper", "Targets", "TokenSource", "UnitWriter"]

#: A function the caller may use to wrap the raw store (fault injection, logging).
StoreWrapper = Callable[["Store"], "Store"]

#: (chunk-relative first item, view to fill) pairs of one read.
Targets = Sequence[tuple[int, np.ndarray]]


class ReadCounters(Protocol):
    """A source's store traffic as the engine reports it (read-amplification figures)."""

    @property
    def requests(self) -> int: ...
    @property
    def bytes_read(self) -> int: ...
    @property
    def retries(self) -> int: ...
    @property
    def peak_in_flight(self) -> int: ...
    @property
    def throttled(self) -> int: ...
    @property
    def concurrency_limit(self) -> int: ...
    @property
    def bytes_decoded(self) -> int: ...


class UnitWriter(Protocol):
    """The engine's side of a read into its buffer."""

    async def write(self, fill_targets: Callable[[], None]) -> bool:
        """Run ``fill_targets`` (CPU work writing into the targets) once the buffer may be
        written, off the loop; False (and not run) when the fill was dropped meanwhile."""
        ...


class TokenSource(Protocol):
    """What the engine reads from. All coroutines run on the engine's loop."""

    name: str
    token_count: int
    sequence_count: int
    max_token_id: int
    #: Tokens per stored chunk: the engine plans one ``read_into`` per chunk a fill touches.
    token_chunk: int
    #: Behind a network: latency is hidden by keeping many reads in flight.
    remote: bool
    #: ``read_items`` fetches only the bytes holding the items (a few rows cost a few KiB).
    partial_reads: bool

    @property
    def io(self) -> ReadCounters: ...

    async def read_tokens(self, start: int, stop: int) -> np.ndarray: ...

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray: ...

    async def read_into(self, start: int, stop: int, targets: Targets, writer: UnitWriter) -> None:
        """Tokens of ``[start, stop)`` (inside one chunk) into ``targets`` through ``writer``."""
        ...

    async def read_items(self, chunk_id: int, first_item: int, out: np.ndarray) -> None:
        """Chunk-relative items ``[first_item, first_item + len(out))`` into ``out``."""
        ...

    def demand(self, needed: bool = True) -> AbstractContextManager[None]:
        """While inside: the reads this task makes (and the tasks it starts meanwhile) are
        ``needed`` by a waiting load, so they go ahead of every other request at the store."""
        ...

    async def aclose(self) -> None: ...
