"""asyncflat: a stall-free shuffling loader for flat-tokens datasets on JAX.

The three ideas, by analogy with a card dealer: the dataset is a deck cut into *read blocks*
(packs of consecutive cards); each *stream* shuffles a hand of packs (its *shuffle buffer*) and
deals from it; a *minipoch* is one round of hands. Everything is a pure function of the step,
so a restart resumes by step number alone. asyncflat shuffles the next hand while the current
one is dealt, so the trainer never waits at a round boundary.
"""

from .batch import TokenBatch, default_sharding
from .config import (
    EngineOptions,
    FlatTokensParams,
    HuggingFaceDataParams,
    RetryPolicy,
    TokenBatchParams,
)
from .epochs import iter_epochs
from .errors import (
    ArgumentTypeError,
    AsyncflatError,
    ConfigError,
    CorruptChunkError,
    DatasetFormatError,
    LoaderClosedError,
    LoadTimeoutError,
    LoopReentryError,
    StepOutOfRangeError,
    StorageError,
    TransientStorageError,
)
from .loader import ShufflingLoader, get_loader
from .permutation import permutation
from .plan import ShufflePlan, epoch_seed
from .writer import FlatTokensWriter, write_flat_tokens

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "AsyncflatError",
    "ConfigError",
    "CorruptChunkError",
    "DatasetFormatError",
    "EngineOptions",
    "FlatTokensParams",
    "FlatTokensWriter",
    "HuggingFaceDataParams",
    "LoadTimeoutError",
    "LoaderClosedError",
    "LoopReentryError",
    "RetryPolicy",
    "ShufflePlan",
    "ShufflingLoader",
    "StepOutOfRangeError",
    "StorageError",
    "TokenBatch",
    "TokenBatchParams",
    "TransientStorageError",
    "__version__",
    "default_sharding",
    "epoch_seed",
    "get_loader",
    "iter_epochs",
    "permutation",
    "write_flat_tokens",
]
