"""``MixtureLoader``: batches whose rows come from several flat-tokens datasets by weight.

Each host works at the level of its own rows: for each of its batch rows ``r`` (stream
``i = r // R``, position ``j = r % R``, ``R = batch // streams``) the pure
:class:`~asyncflat.mixture.assignment.Assignment` gives the source ``s`` and the index ``k`` of
the slot among ``s``'s slots of stream ``i``. Slot ``k`` is row ``i * R + k % R`` of source step
``q = k // R`` in ``s``'s own order, pass ``q // step_count_s`` (its epoch, as
:func:`asyncflat.iter_epochs` orders passes), step ``q % step_count_s`` of that pass. One
:class:`~asyncflat.engine.Engine` per source and pass serves those rows, for this host's streams
only; each fills its next minipoch ahead from its own source step, so its boundary prefetch works
whatever the weight, and the next pass of a source is opened and filled while it serves its last
minipoch.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from jax.sharding import Sharding

from .._background import BackgroundBuilder
from .._loop import LoopThread
from .._typecheck import checked
from ..batch import BatchBuilder, BatchType, TokenBatch, default_sharding
from ..config import EngineOptions, TokenBatchParams, redact_url, step_argument
from ..engine import Engine, EngineStats
from ..errors import ConfigError, LoaderClosedError, StepOutOfRangeError
from ..format import SPLITS
from ..loader import open_engine
from ..plan import ShufflePlan
from ..sizing import format_bytes
from ..source import StoreWrapper
from .assignment import Assignment
from .config import MixtureParams
from .iterator import MixtureIterator
from .passes import Passes, RowGroup, SourceState
from .stats import MixtureSourceStats, MixtureStats

__all__ = ["MixtureLoader", "MixtureSourceStats", "MixtureStats"]

log = logging.getLogger(__name__)

_ids = itertools.count()


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
        if store_wrapper is None or callable(store_wrapper):
            self._store_wrappers = [store_wrapper] * len(params.sources)
        else:
            self._store_wrappers = list(store_wrapper)
            if len(self._store_wrappers) != len(params.sources):
                raise ConfigError(
                    f"store_wrapper: {len(self._store_wrappers)} wrappers for "
                    f"{len(params.sources)} sources"
                )
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        self._steps_built = 0
        self._build_s: collections.deque[float] = collections.deque(maxlen=1 << 16)
        self._prefetchers: set[BackgroundBuilder[Any]] = set()
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
            self._runner.run(self._open_first_passes())
            self._check_budget()
            self.step_count = self._step_count()
        except BaseException:
            self.close()
            raise
        self._log_sources()

    # -- construction -------------------------------------------------------------------------

    async def _open_first_passes(self) -> None:
        engines = await asyncio.gather(
            *(self._passes.engine(s.index, 0) for s in self._sources), return_exceptions=True
        )
        for engine in engines:
            if isinstance(engine, BaseException):
                raise engine
        for source, engine in zip(self._sources, engines):
            assert isinstance(engine, Engine)
            plan = engine.plan
            self._plans.append(plan)
            source.step_count = plan.step_count
            source.last_minipoch_step = plan.first_step(plan.minipoch_count - 1)
            source.buffer_bytes = 2 * len(self.streams) * plan.buffer_bytes

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

    def _check_budget(self) -> None:
        needed = sum(s.buffer_bytes for s in self._sources)
        budget = self.options.max_buffer_bytes
        if budget is not None and needed > budget:
            each = ", ".join(f"{s.where}: {s.buffer_bytes:,}" for s in self._sources)
            raise ConfigError(
                f"the mixture's shuffle buffers need {needed:,} bytes on this host ({each}), over "
                f"EngineOptions.max_buffer_bytes={budget:,}"
            )

    def _step_count(self) -> int:
        if self.params.steps is not None:
            return self.params.steps
        capacity = [s.step_count * self.rows_per_stream for s in self._sources]
        steps = self.assignment.first_exhausted_step(capacity, self.params.streams)
        if steps == 0:
            raise ConfigError("the mixture exhausts a source at step 0; set MixtureParams.steps")
        return steps

    def _log_sources(self) -> None:
        for source, spec in zip(self._sources, self.params.sources):
            log.info(
                "mixture source %d %s: weight %g, %d steps per pass, shuffle buffers %s on this "
                "host (2 per stream; up to twice that while a next pass starts)",
                source.index,
                source.where,
                spec.weight,
                source.step_count,
                format_bytes(source.buffer_bytes),
            )
        log.info(
            "mixture of %d sources: %d steps, shuffle buffers %s on this host in all",
            len(self._sources),
            self.step_count,
            format_bytes(sum(s.buffer_bytes for s in self._sources)),
        )

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
        r = self.rows_per_stream
        hosts = self._host_rows
        sources = np.empty(len(hosts), np.int64)
        ks = np.empty(len(hosts), np.int64)
        for stream in self.streams:
            mine = np.flatnonzero(hosts // r == stream)
            src, k = self.assignment.step_slots(stream, step)
            sources[mine] = src[hosts[mine] % r]
            ks[mine] = k[hosts[mine] % r]
        counts = np.array([s.step_count for s in self._sources], np.int64)
        passes_step = ks // r
        epochs = passes_step // counts[sources]
        source_steps = passes_step % counts[sources]
        rows = (hosts // r) * r + ks % r
        # One group per (source, pass, source step): the global source step ``passes_step``
        # holds the pass and step, so (passes_step, source) identifies a group.
        keys = passes_step * len(self._sources) + sources
        order = np.argsort(keys, kind="stable")
        starts = np.flatnonzero(np.diff(keys[order], prepend=-1))
        groups = []
        for out in np.split(order, starts[1:]):
            i = int(out[0])
            wanted, take = np.unique(rows[out], return_inverse=True)
            group = RowGroup(
                int(sources[i]), int(epochs[i]), int(source_steps[i]), wanted, out, take
            )
            groups.append(group)
        return groups

    def _fast(self, groups: list[RowGroup]) -> list[np.ndarray] | None:
        results = []
        for group in groups:
            engine = self._passes.engine_now(group.source, group.epoch)
            if engine is None or self._passes.next_pass_due(group):
                return None
            try:
                rows = engine.try_gather(group.step, group.rows)
            except LoaderClosedError:  # this pass was just evicted: the loop path reopens it
                return None
            if rows is None:
                return None
            results.append(rows)
        return results

    def _rows(self, step: int) -> np.ndarray:
        self._check_open()
        if not 0 <= step < self.step_count:
            raise StepOutOfRangeError(
                f"step {step} is out of range: the mixture has {self.step_count} steps "
                f"(valid steps are 0..{self.step_count - 1})"
            )
        groups = self.groups(step)
        results = self._fast(groups)
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
            for group in groups:
                source = self._sources[group.source]
                source.rows += len(group.out)
                if group.epoch + 1 > source.passes:
                    source.passes = group.epoch + 1
                    log.info(
                        "mixture source %d (%s) ran out and starts pass %d at mixture step %d",
                        source.index,
                        source.where,
                        source.passes,
                        step,
                    )

    # -- the loader's API ---------------------------------------------------------------------

    def sources(self, step: int) -> np.ndarray:
        """The source index (into ``params.sources``) of every row of ``step``'s batch, all
        rows of all hosts (int64[batch]); pure and cheap, e.g. for a loss per source."""
        step = step_argument(step)
        out = np.empty(self.token_batch_params.batch, np.int64)
        r = self.rows_per_stream
        for stream in range(self.params.streams):
            out[stream * r : (stream + 1) * r] = self.assignment.step_slots(stream, step)[0]
        return out

    @property
    def max_token_id(self) -> int:
        return max(e.source.max_token_id for s in self._sources for e in list(s.engines.values()))

    def load(self, step: int) -> Any:
        """The batch of ``step`` (in [0, step_count), in any order); a pure function of it."""
        step = step_argument(step)
        self._check_open()
        for prefetcher in self._live_prefetchers():
            batch = prefetcher.lookup(step)
            if batch is not None:
                return batch
        return self._load_now(step)

    def _load_now(self, step: int) -> Any:
        rows = self._rows(step)
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
        builds = np.array(self._build_s)
        with self._lock:
            sources = tuple(
                MixtureSourceStats(
                    s.where, s.passes, s.rows, s.step_count, s.buffer_bytes, engines[s.index]
                )
                for s in self._sources
            )
            steps = self._steps_built
        return MixtureStats(sources, steps, float(np.median(builds)) if len(builds) else None)

    async def _newest_engine_stats(self) -> list[EngineStats]:
        return [s.engines[max(s.engines)].stats() for s in self._sources]

    def close(self) -> None:
        """Stop prefetch threads, cancel fills, free every source's buffers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            prefetchers = list(self._prefetchers)
            self._prefetchers.clear()
        for prefetcher in prefetchers:
            prefetcher.signal_stop()
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
        with self._lock:
            self._check_open()
            builder: BackgroundBuilder[Any] = BackgroundBuilder(
                self._load_now,
                start,
                self.step_count,
                depth,
                name=f"asyncflat-mixture-prefetch-{next(_ids)}",
            )
            self._prefetchers.add(builder)
        return builder

    def _stop_prefetch(self, builder: BackgroundBuilder[Any]) -> None:
        builder.signal_stop()
        with self._lock:
            self._prefetchers.discard(builder)
        if not self._runner.in_loop_thread():
            builder.stop()

    def _live_prefetchers(self) -> list[BackgroundBuilder[Any]]:
        with self._lock:
            return list(self._prefetchers)
