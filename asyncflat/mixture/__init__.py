"""Weighted mixtures of flat-tokens datasets (docs/mixtures.md).

:mod:`.config` holds the configuration, :mod:`.assignment` the pure slot -> (source, row) math,
:mod:`.loader` the :class:`~asyncflat.mixture.loader.MixtureLoader` (imported on use: it needs
jax; :mod:`.passes`, :mod:`.rows`, :mod:`.setup` and :mod:`.stats` are its parts).
``asyncflat.ShufflingLoader`` and ``get_loader`` build a ``MixtureLoader`` when given a
:class:`MixtureParams`.
"""

from .assignment import Assignment, largest_remainder
from .config import MixtureParams, MixtureSource, MixtureStage

__all__ = ["Assignment", "MixtureParams", "MixtureSource", "MixtureStage", "largest_remainder"]
