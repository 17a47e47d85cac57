"""The read path's face: the loaders a trainer calls.

* :mod:`.shuffling`: :class:`ShufflingLoader`, the drop-in for seqax's loader (one split).
* :mod:`.mixture`: :class:`~asyncflat.loader.mixture.loader.MixtureLoader`, weighted mixtures of
  splits, one engine per source and pass.
* :mod:`.epochs`: several passes over a split or a mixture (:func:`iter_epochs`).
* :mod:`.shared`: what both loaders are built from: the one lifecycle (loop thread,
  ``load``/``iter``, load-ahead, device prefetch, statistics, ``close`` and its errors), its
  iterator, and the jax glue. A loader supplies only *which rows* make a step.

May import: ``engine``, ``source``, ``storage``, ``plan``, ``format``, ``config``, ``errors``
and ``_typecheck``; never the write path (:mod:`asyncflat.writer`, :mod:`asyncflat.text`).
Names resolve on first use: they need jax, and importing a loader's configuration must not
import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncflat.loader.epochs import iter_epochs
    from asyncflat.loader.mixture.loader import MixtureLoader
    from asyncflat.loader.shared.batch import TokenBatch, default_sharding
    from asyncflat.loader.shared.iterator import BatchIterator
    from asyncflat.loader.shuffling import ShufflingLoader

__all__ = [
    "BatchIterator",
    "MixtureLoader",
    "ShufflingLoader",
    "TokenBatch",
    "default_sharding",
    "iter_epochs",
]

_HOMES = {
    "BatchIterator": "asyncflat.loader.shared.iterator",
    "MixtureLoader": "asyncflat.loader.mixture.loader",
    "ShufflingLoader": "asyncflat.loader.shuffling",
    "TokenBatch": "asyncflat.loader.shared.batch",
    "default_sharding": "asyncflat.loader.shared.batch",
    "iter_epochs": "asyncflat.loader.epochs",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
