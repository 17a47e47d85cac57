"""``MixtureLoader``: batches whose rows come from several flat-tokens datasets by weight.

Each host works at the level of its own rows: for each of its batch rows ``r`` (stream
``i = r // R``, position ``j = r % R``, ``R = batch // streams``) the pure
:class:`~asyncflat.plan.mixture.Assignment` gives the source ``s`` and the index ``k`` of
the slot among ``s``'s slots of stream ``i``. Slot ``k`` is row ``i * R + k % R`` of source step
``q = k // R`` in ``s``'s own order, pass ``q // step_count_s`` (its epoch, as
:func:`asyncflat.iter_epochs` orders passes), step ``q % step_count_s`` of that pass. One
:class:`~asyncflat.engine.Engine` per source and pass serves those rows, for this host's streams
only; each fills its next minipoch ahead from its own source step, so its boundary prefetch works
whatever the weight, and the next pass of a source is opened and filled while it serves its last
minipoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from jax.sharding import Sharding

from asyncflat._typecheck import checked
from asyncflat.config import EngineOptions, TokenBatchParams, redact_url, step_argument
from asyncflat.engine import Engine, IntervalStats
from asyncflat.errors import ConfigError
from asyncflat.format.codec import SPLITS
from asyncflat.loader.mixture.config import MAX_STEPS, MixtureParams, MixtureSource
from asyncflat.loader.mixture.passes import Passes, RowGroup, SourceState
from asyncflat.loader.mixture.rows import MixtureRows, batch_sources
from asyncflat.loader.mixture.setup import (
    check_budget,
    default_step_count,
    log_sources,
    store_wrappers,
)
from asyncflat.loader.mixture.stats import MixtureSourceStats, MixtureStats, mixture_stats
from asyncflat.loader.shared.batch import BatchBuilder, BatchType, TokenBatch, default_sharding
from asyncflat.loader.shared.iterator import BatchIterator
from asyncflat.loader.shared.lifecycle import Lifecycle
from asyncflat.loader.shared.open import open_engine, sizing_log
from asyncflat.plan.mixture import Assignment, starved_warning
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.source.protocol import StoreWrapper

__all__ = ["MixtureLoader", "MixtureSourceStats", "MixtureStats"]


class MixtureLoader:
    """Serves batches of a weighted mixture of flat-tokens splits (:class:`MixtureParams`).

    ``asyncflat.ShufflingLoader(split, MixtureParams(...), token_batch_params)`` and
    ``get_loader`` return one; it has the plain loader's ``load``/``iter``/``step_count``/
    ``stats``/``interval_stats``/``close`` (the same lifecycle,
    :mod:`asyncflat.loader.shared.lifecycle`). ``step_count`` is ``MixtureParams.steps``, or, when that
    is None, the steps served before any source would need a second pass. ``load(step)`` is a
    pure function of (config, step): a restart at any step gives the same batches.
    ``store_wrapper`` is one wrapper for every source's store, or a sequence of one per source
    (``None``: none). ``epoch`` ``e`` serves the mixture's steps ``[e * step_count,
    (e + 1) * step_count)``, numbered from 0: the mixture carried on, each source from where
    epoch ``e - 1`` left it (into its next pass when it runs out), the stages' steps counted
    from the start of epoch 0 (docs/epochs.md; :func:`asyncflat.iter_epochs` chains them).
    """

    @checked
    def __init__(
        self,
        split: str,
        params: MixtureParams,
        token_batch_params: TokenBatchParams,
        sharding: Sharding | None = None,
        *,
        options: EngineOptions | None = None,
        store_wrapper: StoreWrapper | Sequence[StoreWrapper | None] | None = None,
        batch_type: BatchType = TokenBatch,
        epoch: int = 0,
    ) -> None:
        epoch = step_argument(epoch, "epoch")
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
        if not isinstance(params, MixtureParams):
            raise ConfigError(f"params must be a MixtureParams, got {type(params).__name__}")
        self.split, self.params, self.token_batch_params = split, params, token_batch_params
        self.epoch = epoch
        self.options = EngineOptions() if options is None else options
        self._source_options = dataclasses.replace(self.options, max_buffer_bytes=None)
        streams = params.streams
        if token_batch_params.batch % streams:
            raise ConfigError(
                f"batch {token_batch_params.batch} is not a multiple of the sources' streams "
                f"{streams}"
            )
        self.rows_per_stream = token_batch_params.batch // streams
        self.sharding = default_sharding() if sharding is None else sharding
        builder = BatchBuilder(
            self.sharding, (token_batch_params.batch, token_batch_params.len), batch_type
        )
        host_rows = builder.host_rows
        self.streams = tuple(np.unique(host_rows // self.rows_per_stream).tolist())
        self._store_wrappers = store_wrappers(store_wrapper, len(params.sources))
        self._plans: list[ShufflePlan] = []
        self._sources = [
            SourceState(i, f"{redact_url(str(s.params.filespec))}/{split}")
            for i, s in enumerate(params.sources)
        ]
        self.assignment = Assignment(
            params.schedule(),
            self.rows_per_stream,
            params.block_rows,
            params.seed,
            streams=streams,
        )
        starved = starved_warning(self.assignment)
        if starved is not None:
            sizing_log.warning("%s", starved)
        self._life: Lifecycle[MixtureRows] = Lifecycle(
            "MixtureLoader",
            builder,
            self.options,
            thread_name="asyncflat-mixture",
            prefetch_name="asyncflat-mixture-prefetch",
        )
        opener = _PassOpener(
            split,
            params.sources,
            self._sources,
            token_batch_params,
            host_rows,
            self._source_options,
            self._store_wrappers,
            self._life.keep,
        )
        first_rows = np.array([i * self.rows_per_stream for i in self.streams], np.int64)
        self._passes = Passes(self._sources, opener, first_rows)
        self._rows = self._life.start(self._open())
        self.step_count = self._rows.step_count
        log_sources(self._sources, params.sources, self.step_count)

    # -- construction -------------------------------------------------------------------------

    async def _open(self) -> MixtureRows:
        """Open every source's first pass and check the budget (closing them if that fails)."""
        try:
            self._plans = await self._passes.open_first(len(self.streams))
            check_budget(self._sources, self.options.max_buffer_bytes)
            if self.epoch == 0:  # every source starts at step 0 of its first pass
                # (but a source of weight 0 in every stage, which no step reads)
                unread = frozenset(
                    i
                    for i in range(len(self._sources))
                    if all(weights[i] == 0 for _, weights in self.params.schedule())
                )
                self._passes.fill_on_open(self._source_options, unread)
            step_count = default_step_count(
                self.params, self.assignment, self._sources, self.rows_per_stream
            )
            if (self.epoch + 1) * step_count > MAX_STEPS:
                raise ConfigError(
                    f"epoch {self.epoch} of a mixture of {step_count:,} steps ends past "
                    f"{MAX_STEPS:,} steps"
                )
        except BaseException:
            await self._passes.aclose()
            raise
        return MixtureRows(
            self._passes,
            self.assignment,
            self._life.host_rows,
            self.rows_per_stream,
            self.token_batch_params.len,
            step_count,
            self._plans,
            first_step=self.epoch * step_count,
        )

    @property
    def plans(self) -> tuple[ShufflePlan, ...]:
        """Each source's shuffle plan (of its first pass; later passes have the same shape)."""
        return tuple(self._plans)

    @property
    def buffer_bytes(self) -> tuple[int, ...]:
        """Bytes of each source's shuffle buffers on this host (one pass:
        ``ShufflePlan.buffers_per_stream`` per stream)."""
        return tuple(s.buffer_bytes for s in self._sources)

    @property
    def host_rows(self) -> np.ndarray:
        """The batch rows this host holds (sorted), as the sharding places them."""
        return self._life.host_rows

    # -- the loader's API ---------------------------------------------------------------------

    def groups(self, step: int) -> list[RowGroup]:
        """Which source rows (source, pass, source step, rows) make this host's rows of ``step``."""
        step = step_argument(step)
        self._life.check_open()
        self._rows.check_step(step)
        return self._rows.groups(step)

    def sources(self, step: int) -> np.ndarray:
        """The source index (into ``params.sources``) of every row of ``step``'s batch, all
        rows of all hosts (int64[batch]); pure and cheap, e.g. for a loss per source."""
        step = step_argument(step)
        self._life.check_open()
        self._rows.check_step(step)
        batch = self.token_batch_params.batch
        return batch_sources(
            self.assignment,
            self.params.streams,
            batch,
            self.rows_per_stream,
            self._rows.first_step + step,
        )

    @property
    def max_token_id(self) -> int:
        return max(e.source.max_token_id for s in self._sources for e in list(s.engines.values()))

    def load(self, step: int) -> Any:
        """The batch of ``step`` (in [0, step_count), in any order); a pure function of it.
        Consecutive loads get their next batches built ahead (``EngineOptions.load_ahead``)."""
        return self._life.load(step)

    def encoded_rows(self, step: int) -> np.ndarray:
        """This host's rows of ``step`` as stored (flat-tokens codes, uint32[len(host_rows),
        len]): what ``load(step)`` decodes, without jax."""
        return self._life.encoded_rows(step)

    def iter(self, start_step: int = 0) -> BatchIterator:
        """``(step, batch)`` from ``start_step`` to ``step_count``, built ahead on a thread when
        ``EngineOptions.prefetch_to_device > 0``; the same iterator as
        :meth:`ShufflingLoader.iter <asyncflat.loader.shuffling.ShufflingLoader.iter>`."""
        return self._life.iter(start_step)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._life)

    def stats(self) -> MixtureStats:
        """Per-source figures (passes, rows, engine waits and fills) of this host."""
        engines = self._life.server_stats()
        with self._rows.lock:
            return mixture_stats(
                self._sources, engines, self._rows.steps_built, self._life.build_median_s()
            )

    def interval_stats(self) -> IntervalStats:
        """What happened since the previous call, summed over every source's passes (fills,
        bytes, requests; ``wait_median_s`` the largest of the sources' medians, since a step
        waits for its slowest source); ``steps_loaded`` counts the batches the trainer
        received, as the plain loader's does."""
        return self._life.interval_stats()

    def close(self) -> None:
        """Stop prefetch threads, cancel fills, free every source's buffers. Idempotent, from
        any thread (see :meth:`ShufflingLoader.close
        <asyncflat.loader.shuffling.ShufflingLoader.close>`)."""
        self._life.close()

    def __enter__(self) -> MixtureLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class _PassOpener:
    """Opens pass ``epoch`` of source ``index`` with the loader's settings.

    The passes hold this, not a method of the loader: a dropped mixture loader is then in no
    reference cycle and is closed at once, as a plain loader is, not whenever the collector
    runs (on whatever thread allocates). It holds the loader's settings, never the loader: an
    iterator that outlives its loader still opens every pass it needs.
    """

    split: str
    sources: Sequence[MixtureSource]
    states: list[SourceState]
    token_batch_params: TokenBatchParams
    host_rows: np.ndarray
    options: EngineOptions
    store_wrappers: list[StoreWrapper | None]
    keep: Callable[[Any], None]  # the loop's, which holds no lifecycle

    async def __call__(self, index: int, epoch: int) -> Engine:
        state = self.states[index]
        warn_sizes, state.sizes_warned = not state.sizes_warned, True
        engine = await open_engine(
            self.split,
            self.sources[index].params,
            self.token_batch_params,
            self.host_rows,
            self.options,
            epoch=epoch,
            store_wrapper=self.store_wrappers[index],
            fill_on_open=False,  # the first passes' once the budget is checked (see _open)
            warn_sizes=warn_sizes,
        )
        self.keep(engine)  # its tasks never die with a dropped loader's cycle
        return engine
