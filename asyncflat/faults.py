"""Fault injection for zarr stores; see :mod:`asyncflat.storage.faults` (this path stays)."""

from .storage.faults import FaultCounts, FaultyStore

__all__ = ["FaultCounts", "FaultyStore"]
