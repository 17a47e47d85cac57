"""asyncflat: a stall-free shuffling loader for flat-tokens datasets on JAX.

The three ideas, by analogy with a card dealer: the dataset is a deck cut into *read blocks*
(packs of consecutive cards); each *stream* shuffles a hand of packs (its *shuffle buffer*) and
deals from it; a *minipoch* is one round of hands. Everything is a pure function of the step,
so a restart resumes by step number alone. asyncflat shuffles the next hand while the current
one is dealt, so the trainer never waits at a round boundary.
"""

from typing import TYPE_CHECKING, Any

from asyncflat.config import (
    EngineOptions,
    FlatTokensParams,
    HuggingFaceDataParams,
    RetryPolicy,
    TokenBatchParams,
)
from asyncflat.errors import (
    ArgumentTypeError,
    AsyncflatError,
    ConfigError,
    CorruptChunkError,
    DatasetFormatError,
    DatasetTooLargeError,
    LoaderClosedError,
    LoadTimeoutError,
    LoopReentryError,
    ObjectReplacedError,
    StepOutOfRangeError,
    StorageError,
    TransientStorageError,
)
from asyncflat.loader.mixture.config import MixtureParams, MixtureSource, MixtureStage
from asyncflat.plan import ShufflePlan, epoch_seed, permutation

__version__ = "0.1.0"

# The loader's names need jax, the writer's zarr's writing side; each is imported on first use, so
# that importing the package for writing or converting does not load jax, and a trainer's restart
# does not import the writer.
_LAZY_NAMES = {
    "FlatTokensWriter": "writer.flat_tokens",
    "write_flat_tokens": "writer.flat_tokens",
    "ShufflingLoader": "loader.shuffling",
    "get_loader": "integrations.reference",
    "TokenBatch": "loader.shared.batch",
    "default_sharding": "loader.shared.batch",
    "iter_epochs": "loader.epochs",
    "MixtureLoader": "loader.mixture.loader",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


if TYPE_CHECKING:
    from asyncflat.integrations.reference import get_loader
    from asyncflat.loader.epochs import iter_epochs
    from asyncflat.loader.mixture.loader import MixtureLoader
    from asyncflat.loader.shared.batch import TokenBatch, default_sharding
    from asyncflat.loader.shuffling import ShufflingLoader
    from asyncflat.writer.flat_tokens import FlatTokensWriter, write_flat_tokens

__all__ = [  # noqa: RUF022 - grouped by use, each group sorted (the errors by hierarchy)
    # reading: loaders and the plan they serve
    "MixtureLoader",
    "ShufflePlan",
    "ShufflingLoader",
    "TokenBatch",
    "default_sharding",
    "epoch_seed",
    "get_loader",
    "iter_epochs",
    "permutation",
    # writing
    "FlatTokensWriter",
    "write_flat_tokens",
    # configuration
    "EngineOptions",
    "FlatTokensParams",
    "HuggingFaceDataParams",
    "MixtureParams",
    "MixtureSource",
    "MixtureStage",
    "RetryPolicy",
    "TokenBatchParams",
    "__version__",
    # errors, in the order of their hierarchy (asyncflat.errors)
    "AsyncflatError",
    "ConfigError",
    "ArgumentTypeError",
    "DatasetFormatError",
    "CorruptChunkError",
    "DatasetTooLargeError",
    "StepOutOfRangeError",
    "StorageError",
    "TransientStorageError",
    "ObjectReplacedError",
    "LoadTimeoutError",
    "LoaderClosedError",
    "LoopReentryError",
]
