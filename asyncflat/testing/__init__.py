"""Public helpers for testing a training job's data path against a misbehaving store.

* :class:`~asyncflat.testing.faults.FaultyStore`: wraps a zarr store and injects latency, errors
  and damaged bytes, with counts of what it did (pass it as a loader's ``store_wrapper``).

May import: ``storage`` and ``errors``.
"""

from asyncflat.testing.faults import FaultCounts, FaultyStore

__all__ = ["FaultCounts", "FaultyStore"]
