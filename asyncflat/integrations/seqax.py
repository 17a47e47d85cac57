"""seqax integration: batches of seqax's own ``TokenBatch``, sharded as seqax shards them.

``examples/seqax/input_loader.py`` is the file a seqax user copies over seqax's
``input_loader.py``; it defines seqax's ``TokenBatch`` and calls :func:`get_loader` here. This
module imports seqax's ``shardlib``, so it is importable only where seqax is (a seqax checkout on
``sys.path``); nothing else in asyncflat imports it.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Sharding

try:
    from shardlib import shardtypes
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "asyncflat.integrations.seqax needs seqax's shardlib (run from a seqax checkout, where "
        "`import shardlib.shardtypes` works)"
    ) from exc

from asyncflat.config import (
    EngineOptions,
    FlatTokensParams,
    HuggingFaceDataParams,
    TokenBatchParams,
)
from asyncflat.errors import ConfigError
from asyncflat.integrations.reference import get_loader as _get_loader
from asyncflat.loader.mixture.config import MixtureParams
from asyncflat.loader.shared.batch import BatchType

__all__ = ["batch_sharding", "get_loader"]


def batch_sharding(batch_type: BatchType) -> Sharding:
    """seqax's sharding of ``batch_type.targets`` on the current mesh (``with Mesh(...)``).

    This is ``shardtypes.make_shardings(batch_type).targets``, the sharding seqax's own loader
    uses, so on several hosts each host reads exactly the rows its devices hold.
    """
    hint = (
        "call get_loader inside `with Mesh(...)`, as seqax's train.py does, so the batch is "
        "sharded over the training mesh"
    )
    try:
        sharding = shardtypes.make_shardings(batch_type).targets
    except Exception as exc:
        raise ConfigError(
            f"shardtypes.make_shardings({getattr(batch_type, '__name__', batch_type)}) failed "
            f"({type(exc).__name__}: {exc}); {hint}"
        ) from exc
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        raise ConfigError(f"no device mesh is active: {hint}")
    return sharding


def get_loader(
    split: str,
    config: FlatTokensParams | MixtureParams | HuggingFaceDataParams,
    token_batch_params: TokenBatchParams,
    batch_type: BatchType,
    *,
    options: EngineOptions | None = None,
) -> Any:
    """seqax's ``get_loader``: batches are ``batch_type`` objects with seqax's batch sharding.

    ``FlatTokensParams`` gives asyncflat's :class:`~asyncflat.ShufflingLoader` (bit-identical to
    seqax's ``ShufflingLoader``), ``MixtureParams`` a mixture of them (docs/mixtures.md),
    ``HuggingFaceDataParams`` asyncflat's Hugging Face loader
    (imported only then, so the flat-tokens path needs no ``datasets``/``transformers``/``torch``).
    """
    return _get_loader(
        split,
        config,
        token_batch_params,
        batch_sharding(batch_type),
        batch_type=batch_type,
        options=options,
    )
