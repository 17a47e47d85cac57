"""Checks and logs of a :class:`~asyncflat.loader.mixture.loader.MixtureLoader`'s sources at
construction: one store wrapper per source, the shuffle-buffer budget, the default step count."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from asyncflat.errors import ConfigError
from asyncflat.loader.mixture.config import MixtureParams, MixtureSource
from asyncflat.loader.mixture.passes import SourceState
from asyncflat.plan.coverage import format_bytes
from asyncflat.plan.mixture import Assignment
from asyncflat.source.protocol import StoreWrapper

__all__ = ["check_budget", "default_step_count", "log_sources", "store_wrappers"]

log = logging.getLogger("asyncflat.loader.mixture.loader")


def store_wrappers(
    store_wrapper: StoreWrapper | Sequence[StoreWrapper | None] | None, sources: int
) -> list[StoreWrapper | None]:
    """One wrapper for every source, or a sequence of one per source."""
    if store_wrapper is None or callable(store_wrapper):
        return [store_wrapper] * sources
    wrappers = list(store_wrapper)
    if len(wrappers) != sources:
        raise ConfigError(f"store_wrapper: {len(wrappers)} wrappers for {sources} sources")
    return wrappers


def check_budget(sources: list[SourceState], budget: int | None) -> None:
    """Raise if the sources' shuffle buffers on this host need more than ``budget`` bytes."""
    needed = sum(s.buffer_bytes for s in sources)
    if budget is not None and needed > budget:
        each = ", ".join(f"{s.where}: {s.buffer_bytes:,}" for s in sources)
        raise ConfigError(
            f"the mixture's shuffle buffers need {needed:,} bytes on this host ({each}), over "
            f"EngineOptions.max_buffer_bytes={budget:,}"
        )


def default_step_count(
    params: MixtureParams,
    assignment: Assignment,
    sources: list[SourceState],
    rows_per_stream: int,
) -> int:
    """``params.steps``, or, when that is None, the steps before any source needs a second pass."""
    if params.steps is not None:
        return params.steps
    capacity = [s.step_count * rows_per_stream for s in sources]
    steps = assignment.first_exhausted_step(capacity, params.streams)
    if steps == 0:
        raise ConfigError("the mixture exhausts a source at step 0; set MixtureParams.steps")
    return steps


def log_sources(
    sources: list[SourceState], specs: Sequence[MixtureSource], step_count: int
) -> None:
    for source, spec in zip(sources, specs):
        log.info(
            "mixture source %d %s: weight %g, %d steps per pass, shuffle buffers %s on this "
            "host (one pass; up to twice that while a next pass starts)",
            source.index,
            source.where,
            spec.weight,
            source.step_count,
            format_bytes(source.buffer_bytes),
        )
    log.info(
        "mixture of %d sources: %d steps, shuffle buffers %s on this host in all",
        len(sources),
        step_count,
        format_bytes(sum(s.buffer_bytes for s in sources)),
    )
