"""The reference's entry point, :func:`get_loader`: one call for every kind of dataset config.

It sits above the read and the write path because the Hugging Face streaming loader it can
return tokenizes on the fly (:mod:`asyncflat.integrations.hf`); that module and its ``datasets``
dependency are imported only when a :class:`~asyncflat.config.HuggingFaceDataParams` asks for it.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Sharding

from asyncflat._typecheck import checked
from asyncflat.config import (
    EngineOptions,
    FlatTokensParams,
    HuggingFaceDataParams,
    TokenBatchParams,
)
from asyncflat.loader.mixture.config import MixtureParams
from asyncflat.loader.mixture.loader import MixtureLoader
from asyncflat.loader.shared.batch import BatchType, TokenBatch
from asyncflat.loader.shuffling import ShufflingLoader

__all__ = ["get_loader"]


@checked
def get_loader(
    split: str,
    config: FlatTokensParams | MixtureParams | HuggingFaceDataParams,
    token_batch_params: TokenBatchParams,
    sharding: Sharding | None = None,
    *,
    batch_type: BatchType = TokenBatch,
    options: EngineOptions | None = None,
) -> Any:
    """Build the loader for ``config``, as the reference's ``get_loader`` does.

    ``batch_type`` is the class the batches are built as (see :class:`ShufflingLoader`);
    ``options`` are the flat-tokens engine's (the Hugging Face loader has none). A
    :class:`~asyncflat.loader.mixture.MixtureParams` gives a
    :class:`~asyncflat.loader.mixture.loader.MixtureLoader` (docs/mixtures.md).
    """
    if isinstance(config, MixtureParams):
        return MixtureLoader(
            split, config, token_batch_params, sharding, options=options, batch_type=batch_type
        )
    if isinstance(config, FlatTokensParams):
        return ShufflingLoader(
            split,
            config,
            token_batch_params,
            sharding,
            options=options,
            batch_type=batch_type,
        )
    from asyncflat.integrations.hf import HuggingFaceDataLoader  # the optional hf extra

    return HuggingFaceDataLoader(split, config, token_batch_params, sharding, batch_type=batch_type)
