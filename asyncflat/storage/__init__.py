"""The storage layers under the reader, one job per module.

* :mod:`.filesystems`: fsspec filesystems and zarr stores, made and closed on the engine's loop,
  with a single retry loop (ours).
* :mod:`.local_files`: a local store's files, opened and read safely without zarr.
* :mod:`.local_split`: a plain local split's metadata, parsed without zarr (fast start-up).
* :mod:`.counters`: counters of a source's store traffic.
* :mod:`.obstore_client`: obstore (Rust) as the reading client of ``s3://`` and ``gs://`` URLs,
  when ``storage_options`` asks for it; fsspec-style options translated or refused by name.
* :mod:`.guarded`: the one gate every object request passes (limits, retries, counters, strict
  checks against missing, truncated or malformed chunk objects).
* :mod:`.pins`: every object read from a bucket pinned to the version its first read saw;
  later reads conditional on it (:class:`~asyncflat.storage.filesystems.PinnedStore` issues
  them), a replaced object refused until the loader is reopened.
* :mod:`.retry`: which failures are transient, and jittered exponential backoff to a deadline.
* :mod:`.limiter`: the adaptive (AIMD) bound on requests in flight, and the lane of the
  requests a waiting load needs (:func:`~asyncflat.storage.limiter.demand`).
* :mod:`.gate`: what a chunk object may be, checked before any decoder runs.
* :mod:`.blosc`: Blosc frames: header checks, block layouts, partial decoding into buffers.
* :mod:`.chunks`: chunk objects the reader decodes itself (codec detection, ``Frame``, crc32c).
* :mod:`.single_flight`: one fetch per key shared by its callers, and a few results kept.
* :mod:`.recycled`: memory for a local store's object reads, used again once nothing refers to
  it (fresh memory's page faults were most of a first fill's reads under a sandboxed kernel).

The readers (:mod:`asyncflat.source`) sit on top of these; of them the engine sees only
:mod:`.recycled`, whose kept slabs it frees with the heap after each fill.

May import: ``format``, ``config`` and ``errors``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncflat.storage.counters import IOCounters
    from asyncflat.storage.guarded import GuardedStore, PerKeyWrapperStore, describe_range
    from asyncflat.storage.limiter import AdaptiveLimiter

__all__ = [
    "AdaptiveLimiter",
    "GuardedStore",
    "IOCounters",
    "PerKeyWrapperStore",
    "describe_range",
]

# Names resolved on first use: importing a storage module must not import zarr (0.3 s) unless
# the code that runs needs it (a plain local dataset never does).
_HOMES = {
    "AdaptiveLimiter": ".limiter",
    "GuardedStore": ".guarded",
    "IOCounters": ".counters",
    "PerKeyWrapperStore": ".guarded",
    "describe_range": ".guarded",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)
