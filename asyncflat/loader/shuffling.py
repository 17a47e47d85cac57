"""The synchronous facade: ``ShufflingLoader``, a drop-in for seqax's loader.

``load(step)`` is a pure function of (dataset, params, step): it asks the engine, on the
engine's own loop, for the encoded rows of this host's batch indices and hands them to a
:class:`~asyncflat.loader.batch.BatchBuilder`, which decodes them on the host and builds one sharded
``jax.Array`` per field of the batch type. Each host computes its batch indices from the sharding
and fills only the streams they belong to (docs/multihost.md).

``iter()`` also keeps the next ``EngineOptions.prefetch_to_device`` steps' batches built on a
background thread (:mod:`asyncflat.loader.background`), so the trainer's ``next()`` returns at once;
``load(step)`` of a step an iterator has prefetched returns that same batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.sharding import Sharding

from asyncflat._typecheck import checked
from asyncflat.config import (
    EngineOptions,
    FlatTokensParams,
    TokenBatchParams,
    step_argument,
)
from asyncflat.engine import Engine, EngineStats, IntervalStats
from asyncflat.engine.loop import LoopThread
from asyncflat.errors import ConfigError, LoaderClosedError
from asyncflat.format.codec import SPLITS
from asyncflat.loader.background import BackgroundBuilder, Prefetchers
from asyncflat.loader.batch import (
    BatchBuilder,
    BatchType,
    TokenBatch,
    check_batch_sharding,
    default_sharding,
    host_batch_indices,
)
from asyncflat.loader.iterator import BatchIterator, _Pin
from asyncflat.loader.load_ahead import NOT_READY, LoadAhead
from asyncflat.loader.mixture.config import MixtureParams
from asyncflat.loader.open import open_engine
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.source.protocol import StoreWrapper, TokenSource

# TokenBatch, default_sharding and check_batch_sharding live in asyncflat.loader.batch; re-exported here
# for code that imported them from this module.
__all__ = [
    "BatchIterator",
    "ShufflingLoader",
    "TokenBatch",
    "check_batch_sharding",
    "default_sharding",
]

log = logging.getLogger(__name__)

_host_batch_indices = host_batch_indices  # the old private name
DEFAULT_OPTIONS = EngineOptions()
#: build times kept for ``stats().build_median_s``
BUILD_HISTORY = 4096


class ShufflingLoader:
    """Serves batches of a flat-tokens split; the next shuffle buffer fills in the background.

    Batches are ``batch_type(targets=..., is_seq_start=...)`` with (batch, len) ``jax.Array``
    fields (uint32 and bool) sharded by ``sharding``; the default ``batch_type`` is
    :class:`~asyncflat.loader.batch.TokenBatch`, and any dataclass or pytree with those two fields works
    (e.g. seqax's own ``TokenBatch``). Use as a context manager (or call :meth:`close`) so the
    engine's thread and buffers go away. ``source`` injects a
    :class:`~asyncflat.source.protocol.TokenSource` (tests); ``store_wrapper`` wraps the zarr store (fault
    injection, instrumentation). ``epoch`` selects the pass over the split: 0 is seqax's order,
    ``e > 0`` another deterministic order (:func:`asyncflat.plan.shuffle.epoch_seed`);
    :func:`asyncflat.iter_epochs` runs several passes. Given a
    :class:`~asyncflat.loader.mixture.MixtureParams`, ``ShufflingLoader(...)`` returns a
    :class:`~asyncflat.loader.mixture.loader.MixtureLoader` instead (docs/mixtures.md).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A MixtureParams builds a MixtureLoader (not a subclass, so __init__ is not run again).
        params = args[1] if len(args) > 1 else kwargs.get("params")
        if cls is ShufflingLoader and isinstance(params, MixtureParams):
            from asyncflat.loader.mixture.loader import MixtureLoader

            return MixtureLoader(*args, **kwargs)
        return super().__new__(cls)

    @checked
    def __init__(
        self,
        split: str,
        params: FlatTokensParams | MixtureParams,
        token_batch_params: TokenBatchParams,
        sharding: Sharding | None = None,
        *,
        options: EngineOptions = DEFAULT_OPTIONS,
        store_wrapper: StoreWrapper | None = None,
        source: TokenSource | None = None,
        batch_type: BatchType = TokenBatch,
        epoch: int = 0,
    ) -> None:
        # (A MixtureParams never gets here from ShufflingLoader(...): __new__ built a
        # MixtureLoader. The annotation says it is accepted, for type checkers.)
        if not isinstance(params, FlatTokensParams):
            raise ConfigError(
                f"{type(self).__name__} takes a FlatTokensParams; a MixtureParams needs "
                "ShufflingLoader itself or MixtureLoader"
            )
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
        self.split, self.params, self.token_batch_params = split, params, token_batch_params
        self.options = options
        self.epoch = epoch
        self.sharding = default_sharding() if sharding is None else sharding
        self._builder = BatchBuilder(
            self.sharding, (token_batch_params.batch, token_batch_params.len), batch_type
        )
        self._host_rows = self._builder.host_rows
        self._prefetchers: Prefetchers[Any] = Prefetchers(
            "asyncflat-device-prefetch", lambda: LoaderClosedError("this loader is closed")
        )
        self._store_wrapper = store_wrapper
        self._injected_source = source
        self._lock = threading.Lock()
        self._closed = False
        # The last BUILD_HISTORY build times, in numpy: a fixed size from the start, so a long
        # run's memory does not creep up by one float object per load.
        self._build_s = np.zeros(BUILD_HISTORY, np.float64)
        self._builds = itertools.count()  # next() is atomic: loads from several threads
        self._built = 0
        #: batches handed to the trainer, and that count at the last interval_stats() call
        self._delivered = 0
        self._delivered_at_interval = 0
        self._runner = LoopThread(
            name="asyncflat", cpu_threads=options.decode_threads, nice=options.engine_niceness
        )
        self._pid = os.getpid()
        try:
            self._engine = self._runner.run(self._open_engine())
        except BaseException:
            self._runner.close()
            raise
        self._runner.keep(self._engine)  # its tasks never die with a dropped loader's cycle
        self.plan: ShufflePlan = self._engine.plan
        self._load_ahead = LoadAhead(
            self._prefetchers,
            self._load_now,
            self.plan.step_count,
            options.prefetch_to_device if options.load_ahead else 0,
        )

    # -- construction -------------------------------------------------------------------------

    async def _open_engine(self) -> Engine:
        return await open_engine(
            self.split,
            self.params,
            self.token_batch_params,
            self._host_rows,
            self.options,
            epoch=self.epoch,
            store_wrapper=self._store_wrapper,
            source=self._injected_source,
        )

    # -- the reference's API ------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return self.plan.step_count

    @property
    def max_token_id(self) -> int:
        return self._engine.source.max_token_id

    def load(self, step: int) -> Any:
        """The batch of ``step`` (a Python or numpy integer in [0, step_count), in any order).

        A step that a live iterator has already prefetched (or is building) is not built again:
        the iterator's arrays are returned, so both see the identical batch. Consecutive loads
        get their next batches built ahead (``EngineOptions.load_ahead``).
        """
        step = step_argument(step)
        self._check_open()
        batch = self._load_ahead.load(step, self._load_now)
        self._count_delivered()
        return batch

    def iter(self, start_step: int = 0) -> BatchIterator:
        """An iterator of ``(step, batch)`` from ``start_step`` to the end of the dataset.

        With ``EngineOptions.prefetch_to_device = k > 0`` a background thread keeps the next k
        steps' arrays built, so ``next()`` returns at once when the trainer's step is longer than
        a build. An error while building a step is raised by the ``next()`` that returns it, and
        ends the iteration (start a new ``iter(step)`` to carry on). Close the iterator (or drop
        it, or close the loader) to stop its thread.
        """
        start_step = step_argument(start_step, "start_step")
        self._check_open()
        if start_step != self.step_count:
            self.plan.check_step(start_step)
        return BatchIterator(self, start_step, self.options.prefetch_to_device)

    def __iter__(self) -> Iterator[Any]:
        iterator = self.iter()
        try:
            for _, batch in iterator:
                yield batch
        finally:
            iterator.close()

    def stats(self) -> EngineStats:
        """Engine figures (waits, fills, bytes, retries) plus the jax build times of this host.

        ``steps_loaded`` counts the batches the trainer received (each ``load()`` that returned,
        each item an iterator handed out), not the steps an iterator built ahead of it.
        """
        self._check_open()
        stats = self._runner.run(self._engine_stats())
        builds = self._build_s[: min(self._built, BUILD_HISTORY)]
        build_median_s = float(np.median(builds)) if len(builds) else None
        with self._lock:
            delivered = self._delivered
        return dataclasses.replace(
            stats,
            steps_loaded=delivered,
            build_median_s=build_median_s,
            host_batch_rows=len(self._host_rows),
        )

    async def _engine_stats(self) -> EngineStats:
        return self._engine.stats()

    def interval_stats(self) -> IntervalStats:
        """What happened since the previous call (loads, waits, fills, bytes): log every N steps.

        ``steps_loaded`` counts the batches the trainer received in the interval, as in
        :meth:`stats`.
        """
        self._check_open()
        interval = self._runner.run(self._engine_interval_stats())
        with self._lock:
            delivered, self._delivered_at_interval = (
                self._delivered - self._delivered_at_interval,
                self._delivered,
            )
        return dataclasses.replace(interval, steps_loaded=delivered)

    async def _engine_interval_stats(self) -> IntervalStats:
        return self._engine.interval_stats()

    def close(self) -> None:
        """Stop the device-prefetch threads, cancel fills, free the buffers, stop the engine's
        thread. Idempotent, from any thread: from the engine's own thread (a finalizer or
        callback running there) it schedules all that and returns at once; from any other it
        returns when it is done (within about 15 s whatever the storage does)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # no new builds start; a build in progress fails fast below
        prefetchers = self._prefetchers.close()
        engine = getattr(self, "_engine", None)
        own_thread = self._runner.in_loop_thread()
        if own_thread and engine is not None:
            engine.release()  # on the loop's thread nothing else runs on the loop: free now
        try:
            if engine is not None and self._pid == os.getpid():
                self._runner.close(engine.aclose())
            else:
                self._runner.close()
        finally:
            if not own_thread:
                for prefetcher in prefetchers:
                    prefetcher.stop()
                if engine is not None:
                    engine.release()  # the loop has stopped: nothing can hold a buffer now

    def __enter__(self) -> ShufflingLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten loader must not keep its thread nor its buffers
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                log.debug("closing a collected loader failed", exc_info=True)

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderClosedError("this ShufflingLoader is closed; create a new one")
        if self._pid != os.getpid():
            raise LoaderClosedError(
                "this ShufflingLoader was created in another process (before a fork); "
                "create a new loader in this process"
            )

    def _count_delivered(self) -> None:
        with self._lock:
            self._delivered += 1

    def _rows(self, step: int, *, ready_only: bool = False) -> np.ndarray | None:
        self._check_open()
        self.plan.check_step(step)
        rows = self._engine.try_gather(step, self._host_rows)  # steady state: no loop round trip
        if rows is not None or ready_only:
            return rows
        return self._runner.run(
            self._engine.gather(step, self._host_rows), timeout=self.options.load_timeout_s
        )

    def _load_now(self, step: int, *, ready_only: bool = False) -> Any:
        """Build the batch of ``step`` now (the ``build`` that device prefetch runs ahead);
        with ``ready_only``, only from finished buffers, else :data:`NOT_READY` (load-ahead)."""
        rows = self._rows(step, ready_only=ready_only)
        if rows is None:
            return NOT_READY
        t0 = time.perf_counter()
        batch = self._builder.build(rows)
        n = next(self._builds)
        self._build_s[n % BUILD_HISTORY] = time.perf_counter() - t0
        self._built = max(self._built, n + 1)
        return batch

    def _start_prefetch(self, start: int, depth: int) -> BackgroundBuilder[Any]:
        """A builder of steps [start, step_count) ahead of an iterator, known to :meth:`load`."""
        self._check_open()
        return self._prefetchers.start(self._load_now, start, self.step_count, depth)

    def _stop_prefetch(self, builder: BackgroundBuilder[Any], pin: _Pin) -> None:
        pin.release()
        # not from the loop's thread: the builder may be waiting on this very thread
        self._prefetchers.stop(builder, join=not self._runner.in_loop_thread())
