"""Weighted mixtures of flat-tokens datasets (docs/mixtures.md), served by the loaders' lifecycle.

:mod:`.config` holds the configuration; the pure slot -> (source, row) math is
:mod:`asyncflat.plan.mixture`. :mod:`.loader` holds
:class:`~asyncflat.loader.mixture.loader.MixtureLoader` (it needs jax: import it from there, or as
``asyncflat.MixtureLoader``), a facade over the loaders' one lifecycle
(:mod:`asyncflat.loader.shared.lifecycle`); :mod:`.passes`, :mod:`.rows` (its
:class:`~asyncflat.loader.shared.serving.RowServer`), :mod:`.setup` and :mod:`.stats` are its parts. ``asyncflat.ShufflingLoader`` and ``get_loader`` build a ``MixtureLoader`` when given a
:class:`MixtureParams`.

May import: ``loader``, ``engine``, ``source``, ``storage``, ``plan``, ``format``, ``config``,
``errors`` and ``_typecheck``: what :mod:`asyncflat.loader` may, and the rest of it.
"""

from asyncflat.loader.mixture.config import MixtureParams, MixtureSource, MixtureStage

__all__ = ["MixtureParams", "MixtureSource", "MixtureStage"]
