"""The figures of a :class:`~asyncflat.loader.mixture.loader.MixtureLoader` (``stats()``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from asyncflat.engine import EngineStats
from asyncflat.engine.stats import Readable
from asyncflat.loader.mixture.passes import SourceState

__all__ = ["MixtureSourceStats", "MixtureStats", "mixture_stats"]


@dataclasses.dataclass(frozen=True)
class MixtureSourceStats(Readable):
    """One source's figures on this host: ``passes`` started (1 until it runs out once),
    ``rows`` loaded from it (a step loaded twice counts twice), the ``step_count`` of one pass,
    its ``buffer_bytes`` (one pass: ``ShufflePlan.buffers_per_stream`` per stream) and its
    newest pass's ``engine`` figures (waits, fills, bytes)."""

    filespec: str
    passes: int
    rows: int
    step_count: int
    buffer_bytes: int
    engine: EngineStats


@dataclasses.dataclass(frozen=True)
class MixtureStats(Readable):
    """Per-source figures, the steps whose rows this host gathered (``steps_built``: loads and
    steps an iterator built ahead; a step built twice counts twice) and its jax build times.
    Read by attribute or by key, as the engine's figures are (``stats["sources"][0]["rows"]``);
    :meth:`as_dict` gives it all, JSON-ready."""

    sources: tuple[MixtureSourceStats, ...]
    steps_built: int
    build_median_s: float | None


def mixture_stats(
    sources: Sequence[SourceState],
    engines: Sequence[EngineStats],
    steps_built: int,
    build_median_s: float | None,
) -> MixtureStats:
    """The figures of ``sources`` (``engines``: each one's newest pass's engine figures) and of
    the steps built (``build_median_s``: their median jax build time)."""
    per_source = tuple(
        MixtureSourceStats(
            s.where, s.passes, s.rows, s.step_count, s.buffer_bytes, engines[s.index]
        )
        for s in sources
    )
    return MixtureStats(per_source, steps_built, build_median_s)
