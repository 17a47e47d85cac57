"""The engine: per-stream double buffers, filled in the background on the engine's event loop.

For every stream this host serves there are two buffers, allocated once and reused for every
minipoch. When a stream starts serving minipoch m, the fill of m+1 starts into the other buffer,
so the boundary costs nothing when the fill finishes in time.

One job per module:

* :mod:`.fill`: a fill, its read units (one per stored chunk the fill touches, or per block
  without packing), and the buffer pair each stream's fills take turns in (allocation, and the
  hand-off that keeps a dropped fill's late writes out of the next fill's rows);
* :mod:`.table`: which fill occupies which buffer of each stream (start, find, drop, prefetch);
* :mod:`.scheduler`: one priority queue keyed by the first step that needs each unit, a fixed
  set of workers (a sliding window of reads), one admission rule for the byte budget, and the
  background limits that leave the trainer a core;
* :mod:`.units`: one unit read into its fill's buffer (the body the scheduler's workers run);
* :mod:`.waiting`: what a load does about each fill it reads (serve, wait for its blocks, or
  read its rows alone and read ahead; a failed fill's error, raised with the step);
* :mod:`.rows`: rows read on their own for a load that arrives before its blocks;
* :mod:`.stats` and :mod:`.recorder`: typed snapshots, bounded history, the trainer's step rate
  and the lateness warning;
* :mod:`.lock`: the engine's lock, which knows the thread holding it (a pin released by a
  finalizer on that thread is queued instead of waiting for itself);
* :mod:`.opening`: what starts before the first load (the block order, step 0's fills);
* :mod:`.core`: the :class:`Engine` that composes them: ``gather`` (on the loop), ``try_gather``
  (from the caller's thread, for finished buffers), ``stats``, ``interval_stats``, ``aclose``.

The engine reads through a :class:`~asyncflat.source.protocol.TokenSource` (and imports nothing
else of the reader, nor any storage layer): the reader decides how to decode (direct Blosc, raw,
or zarr) and owns its caches; the engine decides what to read, in which order, and when a buffer
may be written.

The in-buffer shuffle is never materialised: a gather reads buffer row ``perm[position]``.

Failure model: a unit that fails (after the store's retries) fails its fill; the load that needs
that fill raises the error (with the array, range and cause), the fill is dropped, and a later
load that needs the same minipoch starts it afresh. Steps served from other fills are unaffected.

May import: ``source``, ``storage``, ``plan``, ``format``, ``config`` and ``errors``.
"""

from asyncflat.engine.core import Engine
from asyncflat.engine.stats import ActiveFill, EngineStats, FillRecord, IntervalStats

__all__ = ["ActiveFill", "Engine", "EngineStats", "FillRecord", "IntervalStats"]
