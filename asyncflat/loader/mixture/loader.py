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

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jax.sharding import Sharding

from asyncflat._typecheck import checked
from asyncflat.config import EngineOptions, TokenBatchParams, redact_url, step_argument
from asyncflat.engine import Engine, EngineStats
from asyncflat.engine.loop import LoopThread
from asyncflat.errors import ConfigError, LoaderClosedError, StepOutOfRangeError
from asyncflat.format.codec import SPLITS
from asyncflat.loader.background import BackgroundBuilder, Prefetchers
from asyncflat.loader.batch import BatchBuilder, BatchType, TokenBatch, default_sharding
from asyncflat.loader.load_ahead import NOT_READY, LoadAhead
from asyncflat.loader.mixture.config import MixtureParams
from asyncflat.loader.mixture.iterator import MixtureIterator
from asyncflat.loader.mixture.passes import Passes, RowGroup, SourceState
from asyncflat.loader.mixture.rows import batch_sources, count_rows, step_groups
from asyncflat.loader.mixture.setup import (
    check_budget,
    default_step_count,
    log_sources,
    store_wrappers,
)
from asyncflat.loader.mixture.stats import MixtureSourceStats, MixtureStats, mixture_stats
from asyncflat.loader.open import open_engine
from asyncflat.plan.mixture import Assignment
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.source.protocol import StoreWrapper

__all__ = ["MixtureLoader", "MixtureSourceStats", "MixtureStats"]

log = logging.getLogger(__name__)


class MixtureLoader:
    """Serves batches of a weighted mixture of flat-tokens splits (:class:`MixtureParams`).

    ``asyncflat.ShufflingLoader(split, MixtureParams(...), token_batch_params)`` and
    ``get_loader`` return one; it has the plain loader's ``load``/``iter``/``step_count``/
    ``stats``/``close``. ``step_count`` is ``MixtureParams.steps``, or, when that is None, the
    steps served before any source would need a second pass. ``load(step)`` is a pure function
    of (config, step): a restart at any step gives the same batches. ``store_wrapper`` is one
    wrapper for every source's store, or a sequence of one per source (``None``: none).
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
    ) -> None:
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
        if not isinstance(params, MixtureParams):
            raise ConfigError(f"params must be a MixtureParams, got {type(params).__name__}")
        self.split, self.params, self.token_batch_params = split, params, token_batch_params
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
        self._builder = BatchBuilder(
            self.sharding, (token_batch_params.batch, token_batch_params.len), batch_type
        )
        self._host_rows = self._builder.host_rows
        self.streams = tuple(np.unique(self._host_rows // self.rows_per_stream).tolist())
        self._store_wrappers = store_wrappers(store_wrapper, len(params.sources))
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        self._steps_built = 0
        self._build_s: collections.deque[float] = collections.deque(maxlen=1 << 16)
        self._prefetchers: Prefetchers[Any] = Prefetchers(
            "asyncflat-mixture-prefetch",
            lambda: LoaderClosedError("this MixtureLoader is closed; create a new one"),
        )
        self._plans: list[ShufflePlan] = []
        self._sources = [
            SourceState(i, f"{redact_url(str(s.params.filespec))}/{split}")
            for i, s in enumerate(params.sources)
        ]
        first_rows = np.array([i * self.rows_per_stream for i in self.streams], np.int64)
        self._passes = Passes(self._sources, self._open_pass, first_rows)
        self.assignment = Assignment(
            params.schedule(), self.rows_per_stream, params.block_rows, params.seed
        )
        self._runner = LoopThread(
            name="asyncflat-mixture",
            cpu_threads=self.options.decode_threads,
            nice=self.options.engine_niceness,
        )
        try:
            self._plans = self._runner.run(self._passes.open_first(len(self.streams)))
            check_budget(self._sources, self.options.max_buffer_bytes)
            self.step_count = default_step_count(
                params, self.assignment, self._sources, self.rows_per_stream
            )
        except BaseException:
            self.close()
            raise
        log_sources(self._sources, params.sources, self.step_count)
        options = self.options
        self._load_ahead = LoadAhead(
            self._prefetchers,
            self._load_now,
            self.step_count,
            options.prefetch_to_device if options.load_ahead else 0,
        )

    # -- construction -------------------------------------------------------------------------

    async def _open_pass(self, index: int, epoch: int) -> Engine:
        engine = await open_engine(
            self.split,
            self.params.sources[index].params,
            self.token_batch_params,
            self._host_rows,
            self._source_options,
            epoch=epoch,
            store_wrapper=self._store_wrappers[index],
        )
        self._runner.keep(engine)  # its tasks never die with a dropped loader's cycle
        return engine

    @property
    def plans(self) -> tuple[ShufflePlan, ...]:
        """Each source's shuffle plan (of its first pass; later passes have the same shape)."""
        return tuple(self._plans)

    @property
    def buffer_bytes(self) -> tuple[int, ...]:
        """Bytes of each source's shuffle buffers on this host (one pass, 2 per stream)."""
        return tuple(s.buffer_bytes for s in self._sources)

    # -- rows of a step -----------------------------------------------------------------------

    def groups(self, step: int) -> list[RowGroup]:
        """Which source rows (source, pass, source step, rows) make this host's rows of ``step``."""
        counts = np.array([s.step_count for s in self._sources], np.int64)
        return step_groups(
            self.assignment, self._host_rows, self.streams, self.rows_per_stream, counts, step
        )

    def _check_step(self, step: int) -> None:
        self._check_open()
        if not 0 <= step < self.step_count:
            raise StepOutOfRangeError(
                f"step {step} is out of range: the mixture has {self.step_count} steps "
                f"(valid steps are 0..{self.step_count - 1})"
            )

    def _rows(self, step: int, *, ready_only: bool = False) -> np.ndarray | None:
        self._check_step(step)
        groups = self.groups(step)
        results = self._passes.try_gather(groups)
        if results is None and ready_only:
            return None
        if results is None:
            results = self._runner.run(
                self._passes.gather(groups), timeout=self.options.load_timeout_s
            )
        out = np.empty((len(self._host_rows), self.token_batch_params.len), np.uint32)
        for group, rows in zip(groups, results):
            out[group.out] = rows[group.take]
        self._count(step, groups)
        return out

    def _count(self, step: int, groups: list[RowGroup]) -> None:
        with self._lock:
            self._steps_built += 1
            count_rows(self._sources, groups, step)

    # -- the loader's API ---------------------------------------------------------------------

    def sources(self, step: int) -> np.ndarray:
        """The source index (into ``params.sources``) of every row of ``step``'s batch, all
        rows of all hosts (int64[batch]); pure and cheap, e.g. for a loss per source."""
        step = step_argument(step)
        self._check_step(step)
        batch = self.token_batch_params.batch
        return batch_sources(
            self.assignment, self.params.streams, batch, self.rows_per_stream, step
        )

    @property
    def max_token_id(self) -> int:
        return max(e.source.max_token_id for s in self._sources for e in list(s.engines.values()))

    def load(self, step: int) -> Any:
        """The batch of ``step`` (in [0, step_count), in any order); a pure function of it.
        Consecutive loads get their next batches built ahead (``EngineOptions.load_ahead``)."""
        step = step_argument(step)
        self._check_open()
        batch = self._load_ahead.load(step, self._load_now)
        return batch

    def _load_now(self, step: int, *, ready_only: bool = False) -> Any:
        rows = self._rows(step, ready_only=ready_only)
        if rows is None:
            return NOT_READY  # (load-ahead: not every row is in a finished buffer yet)
        t0 = time.perf_counter()
        batch = self._builder.build(rows)
        self._build_s.append(time.perf_counter() - t0)
        return batch

    def iter(self, start_step: int = 0) -> MixtureIterator:
        """``(step, batch)`` from ``start_step`` to ``step_count``, built ahead on a thread when
        ``EngineOptions.prefetch_to_device > 0``."""
        start_step = step_argument(start_step, "start_step")
        self._check_open()
        if not 0 <= start_step <= self.step_count:
            raise StepOutOfRangeError(
                f"start_step {start_step} is out of range [0, {self.step_count}]"
            )
        return MixtureIterator(self, start_step, self.options.prefetch_to_device)

    def __iter__(self) -> Iterator[Any]:
        with self.iter() as iterator:
            for _, batch in iterator:
                yield batch

    def stats(self) -> MixtureStats:
        """Per-source figures (passes, rows, engine waits and fills) of this host."""
        self._check_open()
        engines = self._runner.run(self._newest_engine_stats())
        builds = list(self._build_s)
        with self._lock:
            return mixture_stats(self._sources, engines, self._steps_built, builds)

    async def _newest_engine_stats(self) -> list[EngineStats]:
        return [s.engines[max(s.engines)].stats() for s in self._sources]

    def close(self) -> None:
        """Stop prefetch threads, cancel fills, free every source's buffers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        prefetchers = self._prefetchers.close()
        own_thread = self._runner.in_loop_thread()
        try:
            if self._pid == os.getpid():
                self._runner.close(self._passes.aclose())
            else:
                self._runner.close()
        finally:
            if not own_thread:
                for prefetcher in prefetchers:
                    prefetcher.stop()
            self._passes.release()

    def __enter__(self) -> MixtureLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                log.debug("closing a collected mixture loader failed", exc_info=True)

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderClosedError("this MixtureLoader is closed; create a new one")
        if self._pid != os.getpid():
            raise LoaderClosedError("this MixtureLoader was created in another process")

    def _start_prefetch(self, start: int, depth: int) -> BackgroundBuilder[Any]:
        self._check_open()
        return self._prefetchers.start(self._load_now, start, self.step_count, depth)

    def _stop_prefetch(self, builder: BackgroundBuilder[Any]) -> None:
        self._prefetchers.stop(builder, join=not self._runner.in_loop_thread())
