"""Public helpers for testing a training job's data path: a misbehaving store, a generated one.

* :class:`~asyncflat.testing.faults.FaultyStore`: wraps a zarr store and injects latency, errors
  and damaged bytes, with counts of what it did (pass it as a loader's ``store_wrapper``).
* :class:`~asyncflat.testing.synthetic.SyntheticFileSystem`: an async fsspec filesystem,
  registered as ``synthetic://`` when this package is imported, serving a flat-tokens dataset of
  any size generated from a seed (the writer's bytes for the same sequences), with a latency and
  bandwidth model and :class:`~asyncflat.testing.synthetic.SyntheticCounts` of requests and
  bytes: a configuration tried at the scale of its corpus before the corpus exists.
* :mod:`.corpus`: which sequences and tokens a seed names, each range in time proportional to it.

May import: ``storage``, ``format``, ``writer`` and ``errors``.
"""

from asyncflat.testing.faults import FaultCounts, FaultyStore
from asyncflat.testing.synthetic import PROTOCOL, SyntheticCounts, SyntheticFileSystem

__all__ = ["PROTOCOL", "FaultCounts", "FaultyStore", "SyntheticCounts", "SyntheticFileSystem"]
