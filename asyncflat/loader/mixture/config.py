"""Mixture configuration: :class:`MixtureSource`, :class:`MixtureStage`, :class:`MixtureParams`.

Frozen dataclasses validated at construction, with real field types (no ``from __future__ import
annotations``, see :mod:`asyncflat.config`), buildable from a plain dict as hydra/YAML gives it:
nested mappings (a source, a stage) and lists are converted here, in ``__post_init__``.
"""

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Optional, TypeVar

from asyncflat.config import FlatTokensParams, is_real_number
from asyncflat.errors import ConfigError

__all__ = ["MixtureParams", "MixtureSource", "MixtureStage"]

T = TypeVar("T")


def _weight(owner: str, value: object) -> float:
    if not (is_real_number(value) or isinstance(value, str)):
        raise ConfigError(f"{owner} must be a number, got {type(value).__name__} {value!r}")
    try:
        weight = float(value)
    except ValueError:
        raise ConfigError(f"{owner} must be a number, got {value!r}") from None
    if not (math.isfinite(weight) and weight >= 0):  # also rejects NaN
        raise ConfigError(f"{owner} must be a finite number >= 0, got {value!r}")
    return weight


#: A block's placement is one permutation of its rows, built whole: more rows than this would
#: take seconds and hundreds of MiB per block for no better proportions.
MAX_BLOCK_ROWS = 1 << 22
#: Steps of a mixture: far beyond any run, and small enough that row counts (steps x batch)
#: stay exact in int64.
MAX_STEPS = 1 << 40


def _int(owner: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{owner} must be an integer, got bool {value!r}")
    try:
        as_int = int(value) if isinstance(value, str) else operator.index(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(
            f"{owner} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    if as_int < minimum:
        raise ConfigError(f"{owner} must be >= {minimum}, got {as_int}")
    if maximum is not None and as_int > maximum:
        raise ConfigError(f"{owner} must be <= {maximum:,}, got {as_int:,}")
    return as_int


def _build(cls: type[T], owner: str, mapping: Mapping[object, object]) -> T:
    """``cls(**mapping)`` from a plain dict (hydra, YAML), a key it does not know or lacks named
    with where it is (``TypeError: __init__() got an unexpected keyword`` named neither)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(repr(k) for k in mapping if k not in fields)
    if unknown:
        raise ConfigError(
            f"{owner} has unknown key(s) {', '.join(unknown)}; a {cls.__name__} takes "
            f"{', '.join(fields)}"
        )
    missing = [
        name
        for name, f in fields.items()
        if name not in mapping
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{owner} lacks {', '.join(missing)}, which a {cls.__name__} needs")
    try:
        return cls(**mapping)  # type: ignore[arg-type]
    except ConfigError as error:
        if type(error) is not ConfigError:
            raise
        raise ConfigError(f"{owner}: {error}") from None  # which source or stage


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    """One dataset of a mixture: its own store, streams, read blocks, buffer and seed
    (``params``), drawn with relative ``weight`` (>= 0) until a stage changes it."""

    params: FlatTokensParams
    weight: float

    def __post_init__(self) -> None:
        params = self.params
        if isinstance(params, Mapping):
            params = _build(FlatTokensParams, "MixtureSource.params", params)
        if not isinstance(params, FlatTokensParams):
            raise ConfigError(
                "MixtureSource.params must be a FlatTokensParams (or a mapping of its fields), "
                f"got {type(params).__name__}"
            )
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "weight", _weight("MixtureSource.weight", self.weight))


@dataclasses.dataclass(frozen=True)
class MixtureStage:
    """From mixture step ``start_step`` on, the sources are drawn with ``weights`` (one per
    source, in the order of ``MixtureParams.sources``)."""

    start_step: int
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "start_step", _int("MixtureStage.start_step", self.start_step, minimum=1)
        )
        weights = self.weights
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
            raise ConfigError(
                f"MixtureStage.weights must be a sequence of numbers, got {type(weights).__name__}"
            )
        checked = tuple(_weight(f"MixtureStage.weights[{i}]", w) for i, w in enumerate(weights))
        if not sum(checked) > 0:
            raise ConfigError(
                f"MixtureStage.weights must have a positive sum, got {checked!r} "
                f"(stage at step {self.start_step})"
            )
        object.__setattr__(self, "weights", checked)


@dataclasses.dataclass(frozen=True)
class MixtureParams:
    """A weighted mixture of flat-tokens datasets, accepted wherever ``FlatTokensParams`` is.

    * ``sources``: the datasets and their weights (from step 0). All must have the same
      ``streams``: stream ``i`` of the mixture is stream ``i`` of every source (docs/mixtures.md).
    * ``seed``: seeds where, inside each block, the rows of each source are placed.
    * ``block_rows``: rows of one stream per block; every block holds exactly the counts the
      weights prescribe (largest remainder), so proportions are exact over any block.
    * ``stages``: weights that change at given steps (each ``MixtureStage.start_step``, strictly
      increasing, and before ``steps`` when that is given); a stage starts a new block, so it
      takes effect exactly at its step.
    * ``steps``: the mixture's ``step_count``. ``None``: the mixture ends before the first step
      that would need a row beyond the first pass of some source (no row repeats). An explicit
      number lets a source that runs out wrap into its next pass (its next epoch's order).
    """

    sources: tuple[MixtureSource, ...]
    seed: int = 0
    block_rows: int = 1024
    stages: tuple[MixtureStage, ...] = ()
    steps: Optional[int] = None  # noqa: UP045 (a typing construct, see asyncflat.config)

    def __post_init__(self) -> None:
        sources = self.sources
        if isinstance(sources, (str, bytes, Mapping)) or not isinstance(sources, Sequence):
            raise ConfigError(
                f"MixtureParams.sources must be a sequence of MixtureSource, got "
                f"{type(sources).__name__}"
            )
        built = tuple(
            _build(MixtureSource, f"MixtureParams.sources[{i}]", s) if isinstance(s, Mapping) else s
            for i, s in enumerate(sources)
        )
        for i, source in enumerate(built):
            if not isinstance(source, MixtureSource):
                raise ConfigError(
                    f"MixtureParams.sources[{i}] must be a MixtureSource, got "
                    f"{type(source).__name__}"
                )
        if not built:
            raise ConfigError("MixtureParams.sources must hold at least one source")
        streams = {s.params.streams for s in built}
        if len(streams) != 1:
            raise ConfigError(
                "every source of a mixture must have the same FlatTokensParams.streams (stream i "
                f"of the mixture is stream i of each source), got {[s.params.streams for s in built]}"
            )
        if not sum(s.weight for s in built) > 0:
            raise ConfigError("MixtureParams.sources: the weights must have a positive sum")
        object.__setattr__(self, "sources", built)
        # 64 bits: the row placement's key puts a tag above them (plan/mixture.py)
        seed = _int("MixtureParams.seed", self.seed, minimum=0, maximum=2**64 - 1)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(
            self,
            "block_rows",
            _int("MixtureParams.block_rows", self.block_rows, minimum=1, maximum=MAX_BLOCK_ROWS),
        )
        stages = self.stages
        if isinstance(stages, (str, bytes, Mapping)) or not isinstance(stages, Sequence):
            raise ConfigError(
                f"MixtureParams.stages must be a sequence of MixtureStage, got "
                f"{type(stages).__name__}"
            )
        built_stages = tuple(
            _build(MixtureStage, f"MixtureParams.stages[{i}]", s) if isinstance(s, Mapping) else s
            for i, s in enumerate(stages)
        )
        previous = 0
        for i, stage in enumerate(built_stages):
            if not isinstance(stage, MixtureStage):
                raise ConfigError(
                    f"MixtureParams.stages[{i}] must be a MixtureStage, got {type(stage).__name__}"
                )
            if len(stage.weights) != len(built):
                raise ConfigError(
                    f"MixtureParams.stages[{i}] has {len(stage.weights)} weights for "
                    f"{len(built)} sources"
                )
            if stage.start_step <= previous:
                raise ConfigError(
                    "MixtureParams.stages must start at strictly increasing steps > 0, got "
                    f"{[s.start_step for s in built_stages]}"
                )
            previous = stage.start_step
        object.__setattr__(self, "stages", built_stages)
        if self.steps is not None:
            object.__setattr__(
                self, "steps", _int("MixtureParams.steps", self.steps, minimum=1, maximum=MAX_STEPS)
            )
            late = [s.start_step for s in built_stages if s.start_step >= self.steps]
            if late:  # a stage that never takes effect is a mistake in the schedule
                raise ConfigError(
                    f"MixtureParams.stages start at steps {late}, at or after the mixture's last "
                    f"step (steps={self.steps}): they would never take effect"
                )

    @property
    def streams(self) -> int:
        """The streams of every source (and of the mixture)."""
        return self.sources[0].params.streams

    def schedule(self) -> tuple[tuple[int, tuple[float, ...]], ...]:
        """``(start_step, weights)`` of every stage, the sources' own weights first (step 0)."""
        first = (0, tuple(s.weight for s in self.sources))
        return (first, *((s.start_step, s.weights) for s in self.stages))
