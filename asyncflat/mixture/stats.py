"""The figures of a :class:`~asyncflat.mixture.loader.MixtureLoader` (``stats()``)."""

from __future__ import annotations

import dataclasses

from ..engine import EngineStats

__all__ = ["MixtureSourceStats", "MixtureStats"]


@dataclasses.dataclass(frozen=True)
class MixtureSourceStats:
    """One source's figures on this host: ``passes`` started (1 until it runs out once),
    ``rows`` loaded from it (a step loaded twice counts twice), the ``step_count`` of one pass,
    its ``buffer_bytes`` (one pass, 2 per stream) and its newest pass's ``engine`` figures
    (waits, fills, bytes)."""

    filespec: str
    passes: int
    rows: int
    step_count: int
    buffer_bytes: int
    engine: EngineStats


@dataclasses.dataclass(frozen=True)
class MixtureStats:
    """Per-source figures, the steps whose rows this host gathered (``steps_built``: loads and
    steps an iterator built ahead; a step built twice counts twice) and its jax build times."""

    sources: tuple[MixtureSourceStats, ...]
    steps_built: int
    build_median_s: float | None
