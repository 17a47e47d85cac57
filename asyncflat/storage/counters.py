"""Counters of a source's raw store traffic (no zarr: the local reader shares them)."""

from __future__ import annotations

import dataclasses

__all__ = ["IOCounters"]


@dataclasses.dataclass
class IOCounters:
    """Raw store traffic, for read-amplification figures and the retry count."""

    requests: int = 0
    bytes_read: int = 0
    retries: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    #: Responses by which the store asked to slow down (429, 503, S3 SlowDown).
    throttled: int = 0
    #: The adaptive in-flight limit now (the configured maximum when never throttled).
    concurrency_limit: int = 0
    #: Shard-index reads answered from the cache instead of the store.
    cached_reads: int = 0
    #: Bytes decoded from stored chunks (whole chunks through zarr, items on the direct path).
    bytes_decoded: int = 0
