"""The read path's face: loaders a trainer calls, their one lifecycle, and the jax glue.

* :mod:`.shuffling`: :class:`ShufflingLoader`, the drop-in for seqax's loader (one split).
* :mod:`.mixture`: :class:`~asyncflat.loader.mixture.loader.MixtureLoader`, weighted mixtures of
  splits, one engine per source and pass.
* :mod:`.lifecycle`: what every loader shares: the engine's loop thread, ``load``/``iter``,
  load-ahead, device prefetch, statistics, ``close`` and its errors. A loader supplies only
  *which rows* make a step (a :class:`~asyncflat.loader.serving.RowServer`).
* :mod:`.serving`: that protocol, and the :class:`~asyncflat.loader.serving.Pin` an iterator
  holds on the buffers it reads next.
* :mod:`.iterator`: the one iterator of ``(step, batch)``, every loader's.
* :mod:`.load_ahead` and :mod:`.background`: batches built ahead of the trainer on a thread.
* :mod:`.batch`: the batch type, host-side decoding, sharding and ``jax.Array`` building.
* :mod:`.open`: a split's source, plan and engine, opened on the loop that then owns them.
* :mod:`.epochs`: several passes over a split or a mixture (:func:`iter_epochs`).

May import: ``engine``, ``source``, ``storage``, ``plan``, ``format``, ``config``, ``errors``
and ``_typecheck``; never the write path (:mod:`asyncflat.writer`, :mod:`asyncflat.text`). Names resolve on first use: they need jax,
and importing a loader's configuration must not import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncflat.loader.batch import TokenBatch, default_sharding
    from asyncflat.loader.epochs import iter_epochs
    from asyncflat.loader.iterator import BatchIterator
    from asyncflat.loader.mixture.loader import MixtureLoader
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
    "BatchIterator": "asyncflat.loader.iterator",
    "MixtureLoader": "asyncflat.loader.mixture.loader",
    "ShufflingLoader": "asyncflat.loader.shuffling",
    "TokenBatch": "asyncflat.loader.batch",
    "default_sharding": "asyncflat.loader.batch",
    "iter_epochs": "asyncflat.loader.epochs",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
