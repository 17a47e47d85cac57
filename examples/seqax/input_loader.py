"""seqax's ``input_loader.py``, served by asyncflat: copy this file over seqax's ``input_loader.py``.

It exports what seqax's ``train.py`` imports. ``TokenBatch`` is seqax's own shardlib type, so
``train.py``'s ``shard_map`` specs and type checks see what they expect; batches are sharded as
seqax shards them (``make_shardings(TokenBatch).targets``: the batch axis over mesh axis ``d``).
The configs are asyncflat's, with seqax's fields, order and meaning (plus optional extras), and
build from seqax's hydra configs unchanged. See asyncflat's docs/migrating.md.
"""

from shardlib.shardtypes import bool_, pytree_dataclass, u32

from asyncflat import (
    FlatTokensParams,
    HuggingFaceDataParams,
    MixtureParams,
    MixtureSource,
    MixtureStage,
    TokenBatchParams,
)
from asyncflat.integrations import seqax

__all__ = [
    "FlatTokensParams",
    "HuggingFaceDataParams",
    "MixtureParams",
    "MixtureSource",
    "MixtureStage",
    "TokenBatch",
    "TokenBatchParams",
    "get_loader",
]


@pytree_dataclass
class TokenBatch:
    """A batch of tokens, which are typically the input to training."""

    targets: u32[b"batch/d len"]
    is_seq_start: bool_[b"batch/d len"]


def get_loader(split, config, token_batch_params):
    """asyncflat's loader of ``split`` (flat-tokens, a mixture of them, or Hugging Face),
    batches of ``TokenBatch``."""
    return seqax.get_loader(split, config, token_batch_params, TokenBatch)
