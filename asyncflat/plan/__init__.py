"""Pure index math: from (dataset sizes, parameters, step) to rows. No I/O, no jax.

* :mod:`.shuffle`: :class:`ShufflePlan`, the reference's streams, read blocks, shuffle buffers
  and minipochs, step by step.
* :mod:`.permutation`: the seeded Philox Fisher-Yates permutation, bit for bit the reference's;
  :mod:`.kernel` is its compiled kernel, :mod:`.entries` a few of its entries without it (a
  first load's blocks before the whole block order).
* :mod:`.coverage`: how much of a split a plan serves, and the one warning when it drops more
  than 1%.
* :mod:`.mixture`: which source and which row fill each slot of a weighted mixture.

May import: ``config`` and ``errors``.
"""

from asyncflat.plan.permutation import permutation
from asyncflat.plan.shuffle import ShufflePlan, epoch_seed

__all__ = ["ShufflePlan", "epoch_seed", "permutation"]
