"""The storage layers under the reader, one job per module.

* :mod:`.filesystems`: fsspec filesystems and zarr stores, made and closed on the engine's loop,
  with a single retry loop (ours); ``pread`` for small local reads.
* :mod:`.obstore_client`: obstore (Rust) as the reading client of ``s3://`` and ``gs://`` URLs,
  when ``storage_options`` asks for it; fsspec-style options translated or refused by name.
* :mod:`.guarded`: the one gate every object request passes (limits, retries, counters, strict
  checks against missing, truncated or malformed chunk objects).
* :mod:`.retry`: which failures are transient, and jittered exponential backoff to a deadline.
* :mod:`.limiter`: the adaptive (AIMD) bound on requests in flight.
* :mod:`.blosc`: Blosc frames: header checks, block layouts, partial decoding into buffers.
* :mod:`.chunks`: chunk objects the reader decodes itself (codec detection, ``Frame``, crc32c).
* :mod:`.faults`: a store wrapper that injects latency, errors and damaged bytes (tests, benches).

The reader (:mod:`asyncflat.source`) sits on top of these; the engine never sees them.
"""

from .guarded import GuardedStore, IOCounters, PerKeyWrapperStore, describe_range
from .limiter import AdaptiveLimiter

__all__ = [
    "AdaptiveLimiter",
    "GuardedStore",
    "IOCounters",
    "PerKeyWrapperStore",
    "describe_range",
]
