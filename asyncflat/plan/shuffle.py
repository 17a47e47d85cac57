"""The shuffle plan: pure index math from (dataset sizes, parameters, step) to buffer rows.

No I/O and no jax here, so every function can be property-tested on its own.

Vocabulary (the reference's): a *row* is one training sequence of ``len`` tokens. Rows are
grouped into *read blocks* of ``spb = sequences_per_read_block`` consecutive rows, the unit of
I/O. Each of ``streams`` independent *streams* owns a *shuffle buffer* of
``rbpsb = read_blocks_per_shuffle_buffer`` blocks; one refill of every buffer is a *minipoch*.

The map from (step, batch index) to data, derived::

    bips     = batch / streams               rows each stream contributes to a step
    stream   = b // bips                     batch rows are split into contiguous stream slices
    q        = step * bips + b % bips        the stream's q-th row overall (consumed in order)
    minipoch = q // seqs_per_buffer          seqs_per_buffer = rbpsb * spb
    position = q %  seqs_per_buffer          position within that minipoch's buffer

Blocks are dealt to buffers from one global shuffle ``block_order = permutation(seed, nblocks)``:
the j-th block of buffer (stream, m) is ``block_order[(m * rbpsb + j) * streams + stream]``, so
the streams interleave over the shuffled order (every block belongs to exactly one buffer). The
buffer is those blocks concatenated, and the row served at ``position`` is buffer row
``perm[position]`` with ``perm = permutation(seed + 1 + m * streams + stream, rows_in_buffer)``.

Worked example: batch=8, streams=2, spb=4, rbpsb=2 -> bips=4, seqs_per_buffer=8. Batch index 5
of step 3 is stream 1, q = 3*4 + 1 = 13, minipoch 1, position 5. Since q advances by ``bips``
per step, minipoch m of every stream first serves at step ``m*seqs_per_buffer // bips`` and a
step straddles two minipochs when ``seqs_per_buffer`` is not a multiple of ``bips``.

The boundary is the same step for every stream, which is what lets the engine start the fill of
m+1 the moment m starts serving and know exactly by which step each block is needed.

Epochs. One pass over the split (``step_count`` steps) is an *epoch*. Epoch 0 is seqax's order
exactly. Epoch ``e`` is the same construction with the seed replaced by::

    epoch_seed(seed, e) = seed + e * 2**64

so its block order is ``permutation(seed + e*2**64, nblocks)`` and its row permutations use
``seed + e*2**64 + 1 + m * streams + stream``. Every seed one epoch uses lies in
``[epoch_seed, epoch_seed + 2**32]`` (there are fewer than ``2**32`` blocks, hence of minipochs
times streams), so the seeds of two epochs of one run never coincide, and epoch 0's are the
reference's. Numpy hashes a seed into Philox's key (``SeedSequence``), so neighbouring seeds give
unrelated orders. A batch is a pure function of (epoch, step): resuming needs those two numbers.
Every epoch reads the same rows (the same blocks, in another order); the tail the block and
stream rounding drops is the same in every epoch (:mod:`asyncflat.plan.coverage` counts it and
warns when it is more than 1%).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np

from asyncflat.config import FlatTokensParams, TokenBatchParams
from asyncflat.errors import ConfigError, DatasetTooLargeError, StepOutOfRangeError
from asyncflat.plan.entries import permutation_entries
from asyncflat.plan.permutation import (
    NO_COMPILE_MAX,
    Stop,
    permutation,
    permutation_columns,
)

__all__ = [
    "EARLY_ENTRIES_MAX",
    "EARLY_MINIPOCHS",
    "EPOCH_SEED_STRIDE",
    "NEVER",
    "RowLocation",
    "ShufflePlan",
    "block_deadlines",
    "epoch_seed",
]

#: Deadline of a block that no step at or after the plan's starting step needs.
NEVER = np.iinfo(np.int64).max

#: Memory the plan's index arrays may take: ``PLAN_BYTES_PER_BLOCK`` per read block of the
#: streams the plan serves (the block order of those streams, uint32; nothing else is kept per
#: block), up to the larger of ``PLAN_MEMORY_FLOOR`` and the shuffle buffers of every stream
#: (``buffers_per_stream * streams * buffer_bytes``). Metadata asking for more (a hostile or
#: mistaken shape) is refused before anything is allocated.
PLAN_BYTES_PER_BLOCK = 4
PLAN_MEMORY_FLOOR = 512 << 20

#: Minipochs whose blocks a plan computes first, before the whole block order
#: (:meth:`ShufflePlan.compute_early_order`): the first one a loader serves, and the one it
#: prefetches while serving it.
EARLY_MINIPOCHS = 2
#: Entries of the block order computed that way at most (their walk costs a few microseconds
#: of Python for each of ~ln(n) moves of each); beyond, the whole order comes first.
EARLY_ENTRIES_MAX = 256

#: called first on each thread that draws early blocks (see ``permutation_entries``)
OnThread = Callable[[], object] | None

#: Distance between the seeds of consecutive epochs (see the module docstring).
EPOCH_SEED_STRIDE = 1 << 64


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed that plays the role of ``seed`` in epoch ``epoch``: ``seed + epoch * 2**64``.

    Epoch 0 is ``seed`` itself (seqax's order); every seed an epoch uses lies within ``2**32``
    above its epoch seed, so epochs of one run never share a permutation seed.
    """
    if epoch < 0:
        raise ConfigError(f"epoch must be >= 0, got {epoch}")
    return seed + epoch * EPOCH_SEED_STRIDE


@dataclasses.dataclass(frozen=True)
class RowLocation:
    """Where the rows of some batch indices of one step live (parallel int64 arrays)."""

    batch_index: np.ndarray
    stream: np.ndarray
    minipoch: np.ndarray
    position: np.ndarray


@dataclasses.dataclass(frozen=True)
class ShufflePlan:
    """The derived quantities of the module docstring and the index maps over them.

    ``epoch`` selects the pass over the split: 0 is seqax's order, ``e > 0`` the order of
    :func:`epoch_seed`. Every other quantity is the same in every epoch.

    ``served_streams`` (sorted; None: every stream) are the streams this host fills: the plan
    keeps the block order of those alone (:attr:`served_block_order`), so a host's plan costs
    memory in proportion to its own streams.
    """

    seq_len: int
    batch: int
    streams: int
    read_blocks_per_shuffle_buffer: int
    sequences_per_read_block: int
    seed: int
    sequence_packing: bool
    token_count: int
    seq_count: int
    epoch: int = 0
    served_streams: tuple[int, ...] | None = None

    @classmethod
    def create(
        cls,
        params: FlatTokensParams,
        batch_params: TokenBatchParams,
        *,
        token_count: int,
        sequence_count: int,
        epoch: int = 0,
        served_streams: tuple[int, ...] | None = None,
    ) -> ShufflePlan:
        """Build and validate the plan for a split with the given sizes (and ``epoch``), of the
        ``served_streams`` (None: all)."""
        seq_count = token_count // batch_params.len if params.sequence_packing else sequence_count
        return cls(
            seq_len=batch_params.len,
            batch=batch_params.batch,
            streams=params.streams,
            read_blocks_per_shuffle_buffer=params.read_blocks_per_shuffle_buffer,
            sequences_per_read_block=params.sequences_per_read_block,
            seed=params.seed,
            sequence_packing=params.sequence_packing,
            token_count=token_count,
            seq_count=seq_count,
            epoch=epoch,
            served_streams=served_streams,
        )

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, (int, np.integer)):
            raise ConfigError(f"epoch must be an integer, got {type(self.epoch).__name__}")
        if self.epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {self.epoch}")
        if self.batch % self.streams:
            raise ConfigError(
                f"TokenBatchParams.batch={self.batch} must be a multiple of "
                f"FlatTokensParams.streams={self.streams}: each stream serves batch/streams rows"
            )
        _check_sizes(self)

    # -- counts -------------------------------------------------------------------------------

    @property
    def read_block_count(self) -> int:
        """Blocks used, rounded down to a multiple of streams (the rest of the data is skipped)."""
        blocks = self.seq_count // self.sequences_per_read_block
        return blocks // self.streams * self.streams

    @property
    def plan_memory_budget(self) -> int:
        """Bytes the plan's per-block arrays may take (see ``PLAN_BYTES_PER_BLOCK``)."""
        return max(PLAN_MEMORY_FLOOR, self.buffers_per_stream * self.streams * self.buffer_bytes)

    @property
    def served(self) -> tuple[int, ...]:
        """The streams this plan serves (``served_streams``, or every stream)."""
        return tuple(range(self.streams)) if self.served_streams is None else self.served_streams

    @property
    def served_block_count(self) -> int:
        """Read blocks of the served streams: the entries of :attr:`served_block_order`."""
        return self.blocks_per_stream * len(self.served)

    @property
    def blocks_per_stream(self) -> int:
        return self.read_block_count // self.streams

    @property
    def step_count(self) -> int:
        return self.read_block_count * self.sequences_per_read_block // self.batch

    @property
    def rows_per_stream_step(self) -> int:
        """``bips``: rows each stream contributes to every step."""
        return self.batch // self.streams

    @property
    def seqs_per_buffer(self) -> int:
        return self.read_blocks_per_shuffle_buffer * self.sequences_per_read_block

    @property
    def epoch_seed(self) -> int:
        """The seed this epoch's permutations derive from (``seed`` in epoch 0)."""
        return epoch_seed(self.seed, self.epoch)

    @property
    def minipoch_count(self) -> int:
        per_minipoch = self.streams * self.read_blocks_per_shuffle_buffer
        return -(-self.read_block_count // per_minipoch)

    @property
    def buffers_per_stream(self) -> int:
        """Shuffle buffers the engine holds per stream: two (the minipoch served and the next
        one filling), or as many minipochs as one step reads when a buffer holds fewer rows
        than a step takes from a stream (a step reads them all at once)."""
        bips, spbuf = self.rows_per_stream_step, self.seqs_per_buffer
        offset = spbuf - math.gcd(bips, spbuf)  # the largest offset of a step in a buffer
        return max(2, (offset + bips - 1) // spbuf + 1)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one full shuffle buffer (the engine holds :attr:`buffers_per_stream` per
        served stream)."""
        return self.seqs_per_buffer * self.seq_len * 4

    def blocks_in_minipoch(self, minipoch: int) -> int:
        """Blocks per stream in ``minipoch``; only the last one can be short."""
        self._check_minipoch(minipoch)
        rbpsb = self.read_blocks_per_shuffle_buffer
        return min(rbpsb, self.blocks_per_stream - rbpsb * minipoch)

    def rows_in_buffer(self, minipoch: int) -> int:
        return self.blocks_in_minipoch(minipoch) * self.sequences_per_read_block

    # -- step <-> minipoch --------------------------------------------------------------------

    def check_step(self, step: int) -> None:
        if not 0 <= step < self.step_count:
            raise StepOutOfRangeError(
                f"step {step} is out of range: the dataset has {self.step_count} steps "
                f"at batch size {self.batch} (valid steps are 0..{self.step_count - 1})"
            )

    def minipochs_of_step(self, step: int) -> range:
        """Minipochs whose rows ``step`` serves (two when the step straddles a boundary)."""
        self.check_step(step)
        bips, spbuf = self.rows_per_stream_step, self.seqs_per_buffer
        return range(step * bips // spbuf, (step * bips + bips - 1) // spbuf + 1)

    def first_step(self, minipoch: int) -> int:
        """The first step that serves a row of ``minipoch`` (the same for every stream)."""
        self._check_minipoch(minipoch)
        return minipoch * self.seqs_per_buffer // self.rows_per_stream_step

    @property
    def last_minipoch_step(self) -> int:
        """The first step of the last minipoch a step serves (the last minipoch's rows may all
        lie in the tail no step serves): from it on, the epoch's last buffer is in use, the
        moment to make ready what comes after the epoch."""
        return self.first_step(self.minipochs_of_step(self.step_count - 1)[-1])

    def served_rows(self, minipoch: int) -> int:
        """Rows of the buffer that some step serves; the tail of the last one may be unused."""
        served_q = self.step_count * self.rows_per_stream_step
        return max(
            0, min(self.rows_in_buffer(minipoch), served_q - minipoch * self.seqs_per_buffer)
        )

    # -- (step, batch index) -> (stream, minipoch, position) ----------------------------------

    def locate(self, step: int, batch_indices: np.ndarray | None = None) -> RowLocation:
        """Vectorised index map of the module docstring for one step."""
        self.check_step(step)
        b = np.arange(self.batch) if batch_indices is None else np.asarray(batch_indices, np.int64)
        bips, spbuf = self.rows_per_stream_step, self.seqs_per_buffer
        q = step * bips + b % bips
        return RowLocation(b.astype(np.int64), b // bips, q // spbuf, q % spbuf)

    # -- buffer contents ----------------------------------------------------------------------

    @functools.cached_property
    def served_block_order(self) -> np.ndarray:
        """The served streams' part of the global shuffle of read blocks, computed once:
        ``uint32[blocks_per_stream, len(served)]``, ``[k, c]`` = ``block_order[k * streams +
        served[c]]``, the k-th block of stream ``served[c]`` (:meth:`compute_block_order`)."""
        return self.compute_block_order()

    def compute_block_order(
        self, stop: Stop | None = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """:attr:`served_block_order`, now unless computed (``stop``, ``out``: see
        :func:`~asyncflat.plan.permutation.permutation_columns`)."""
        if "served_block_order" not in self.__dict__:  # functools.cached_property's cache
            args = (self.epoch_seed, self.read_block_count, self.streams, self.served)
            order = permutation_columns(*args, yield_gil=True, stop=stop, out=out)
            self.__dict__["served_block_order"] = order
        return self.__dict__["served_block_order"]

    def early_minipochs(self, minipoch: int) -> tuple[int, ...]:
        """The minipochs :meth:`compute_early_order` computes for a load in ``minipoch`` while
        the whole order is unknown: it and the next (:data:`EARLY_MINIPOCHS`), where that needs
        the compiled kernel and they are at most :data:`EARLY_ENTRIES_MAX` entries; else ()."""
        minipochs = tuple(range(minipoch, min(minipoch + EARLY_MINIPOCHS, self.minipoch_count)))
        entries = sum(map(self.blocks_in_minipoch, minipochs)) * len(self.served)
        small = self.read_block_count <= NO_COMPILE_MAX
        return () if small or entries > EARLY_ENTRIES_MAX else minipochs

    def compute_early_order(
        self, minipochs: tuple[int, ...], stop: Stop | None = None, on_thread: OnThread = None
    ) -> None:
        """The blocks of ``minipochs`` (:meth:`early_minipochs`) alone, without the kernel; any
        thread. ``stop``, ``on_thread``: see :func:`~asyncflat.plan.entries.permutation_entries`."""
        _keep_early(self, _early_blocks(self, minipochs, stop, on_thread))

    def block_order_known(self, minipoch: int) -> bool:
        """Whether :meth:`buffer_blocks` of ``minipoch`` needs no computing."""
        early = self.__dict__.get("early_block_order", {})
        return "served_block_order" in self.__dict__ or minipoch in early

    @property
    def block_order(self) -> np.ndarray:
        """The whole global shuffle of read blocks (uint32[read_block_count]): the served order
        when every stream is served, else computed each call (for inspection and tests)."""
        if self.served_streams is None or len(self.served) == self.streams:
            return self.served_block_order.reshape(-1)
        return permutation(self.epoch_seed, self.read_block_count)

    def buffer_blocks(self, stream: int, minipoch: int) -> np.ndarray:
        """Global read-block ids of buffer (stream, minipoch), in buffer order (int64): from
        the early rows while the whole order is not computed (else it is computed now)."""
        column, first = self._column(stream), minipoch * self.read_blocks_per_shuffle_buffer
        early = self.__dict__.get("early_block_order", {}).get(minipoch)
        if early is not None and "served_block_order" not in self.__dict__:
            return early[:, column].astype(np.int64)
        return self.served_block_order[
            first : first + self.blocks_in_minipoch(minipoch), column
        ].astype(np.int64)

    def row_permutation(self, stream: int, minipoch: int, *, yield_gil: bool = False) -> np.ndarray:
        """``perm``: buffer row served at each position of buffer (stream, minipoch).

        ``yield_gil``: computed by a background thread (see :func:`~asyncflat.plan.permutation.permutation`).
        """
        self._check_stream(stream)
        seed = self.epoch_seed + 1 + minipoch * self.streams + stream
        return permutation(seed, self.rows_in_buffer(minipoch), yield_gil=yield_gil)

    # -- validation helpers -------------------------------------------------------------------

    def _check_minipoch(self, minipoch: int) -> None:
        if not 0 <= minipoch < self.minipoch_count:
            raise IndexError(f"minipoch {minipoch} outside [0, {self.minipoch_count})")

    def _check_stream(self, stream: int) -> None:
        if not 0 <= stream < self.streams:
            raise IndexError(f"stream {stream} outside [0, {self.streams})")

    def _column(self, stream: int) -> int:
        """The column of ``stream`` in :attr:`served_block_order`."""
        self._check_stream(stream)
        if self.served_streams is None:
            return stream
        column = bisect.bisect_left(self.served_streams, stream)
        if column == len(self.served_streams) or self.served_streams[column] != stream:
            raise IndexError(
                f"stream {stream} is not among the streams this plan serves {self.served_streams}"
            )
        return column


def block_deadlines(
    plan: ShufflePlan, perm: np.ndarray, minipoch: int, from_step: int = 0
) -> np.ndarray:
    """For each block slot of a buffer of ``plan``, the first step >= ``from_step`` that reads it.

    ``perm`` is the buffer's row permutation. Position p is served at step
    ``(minipoch*seqs_per_buffer + p) // bips`` and reads slot ``perm[p] // spb``; a slot's
    deadline is the minimum over its positions. Slots no step >= from_step reads get NEVER.
    A fill fetches blocks in deadline order, so the next step's rows arrive first.
    """
    bips, spb = plan.rows_per_stream_step, plan.sequences_per_read_block
    base_q = minipoch * plan.seqs_per_buffer
    first_pos = max(0, from_step * bips - base_q)
    positions = np.arange(first_pos, plan.served_rows(minipoch), dtype=np.int64)
    first_position = np.full(len(perm) // spb, NEVER, dtype=np.int64)
    np.minimum.at(first_position, perm[positions] // spb, positions)
    read = first_position != NEVER
    deadlines = first_position  # reused: steps where read, NEVER elsewhere
    deadlines[read] = (base_q + first_position[read]) // bips
    return deadlines


def _early_blocks(
    plan: ShufflePlan,
    minipochs: tuple[int, ...],
    stop: Stop | None,
    on_thread: OnThread = None,
) -> dict[int, np.ndarray]:
    """``{m: uint32[blocks_in_minipoch(m), len(served)]}``: rows of the served block order."""
    if not minipochs:  # early_minipochs' answer where the whole order comes first
        return {}
    rbpsb = plan.read_blocks_per_shuffle_buffer
    rows = [np.arange(plan.blocks_in_minipoch(m)) + m * rbpsb for m in minipochs]
    positions = (np.concatenate(rows)[:, None] * plan.streams + plan.served).ravel()
    entries = permutation_entries(
        plan.epoch_seed, plan.read_block_count, positions, stop=stop, on_thread=on_thread
    )
    found = np.split(entries.reshape(-1, len(plan.served)), np.cumsum([len(r) for r in rows]))
    return dict(zip(minipochs, found))


def _keep_early(plan: ShufflePlan, found: dict[int, np.ndarray]) -> None:
    """Add ``found`` to the plan's early blocks, in place: two threads' calls of
    ``compute_early_order`` each keep theirs, since ``setdefault`` and ``update`` (int keys)
    are each one step under the GIL. No lock: a garbage collection while one was held could
    close another loader, whose close waits for its early thread, waiting for that lock."""
    plan.__dict__.setdefault("early_block_order", {}).update(found)


def _check_sizes(plan: ShufflePlan) -> None:
    """The split's sizes against the plan's: at least a read block per stream and a batch, at
    most 2**32 blocks, the plan within its memory budget."""
    if plan.read_block_count == 0:
        # With packing the "sequences" are len-token rows of the packed tokens: name them so.
        rows = (
            f"{plan.seq_count} rows of len={plan.seq_len} tokens ({plan.token_count} tokens packed)"
            if plan.sequence_packing
            else f"{plan.seq_count} sequences"
        )
        raise ConfigError(
            f"the split has {rows}, fewer than one read block per stream "
            f"(sequences_per_read_block={plan.sequences_per_read_block} x "
            f"streams={plan.streams}); shrink streams or sequences_per_read_block"
            + (" or TokenBatchParams.len" if plan.sequence_packing else "")
        )
    if plan.read_block_count >= 1 << 32:
        raise ConfigError(
            f"{plan.read_block_count} read blocks exceed the permutation's limit of 2**32; "
            "grow sequences_per_read_block"
        )
    _check_served(plan.served_streams, plan.streams)
    need = PLAN_BYTES_PER_BLOCK * plan.served_block_count
    budget = plan.plan_memory_budget
    if need > budget:
        raise DatasetTooLargeError(
            f"the split's {plan.seq_count} rows make {plan.read_block_count} read blocks, "
            f"{plan.served_block_count} of them in the {len(plan.served)} streams served "
            f"here, whose shuffle plan needs {need} bytes, more than its budget of {budget} "
            "bytes "
            f"(the larger of {PLAN_MEMORY_FLOOR} and the shuffle buffers' buffers_per_stream "
            "* streams * buffer_bytes); grow sequences_per_read_block or "
            "read_blocks_per_shuffle_buffer, or check the dataset's shapes"
        )
    if plan.step_count == 0:
        raise ConfigError(
            f"the split yields {plan.read_block_count * plan.sequences_per_read_block} rows, "
            f"fewer than one batch of {plan.batch}"
        )


def _check_served(served: tuple[int, ...] | None, streams: int) -> None:
    if served is None:
        return
    if (
        not isinstance(served, tuple)
        or not served
        or list(served) != sorted(set(served))
        or not all(isinstance(s, int) and 0 <= s < streams for s in served)
    ):
        raise ConfigError(
            f"served_streams must be a non-empty sorted tuple of distinct streams in "
            f"[0, {streams}), got {served!r}"
        )
