"""The synchronous facade: ``ShufflingLoader``, a drop-in for seqax's loader.

``load(step)`` is a pure function of (dataset, params, step): it asks the engine, on the
engine's own loop, for the encoded rows of this host's batch indices and hands them to a
:class:`~asyncflat.batch.BatchBuilder`, which decodes them on the host and builds one sharded
``jax.Array`` per field of the batch type. Each host computes its batch indices from the sharding
and fills only the streams they belong to (docs/multihost.md).

``iter()`` also keeps the next ``EngineOptions.prefetch_to_device`` steps' batches built on a
background thread (:mod:`asyncflat._background`), so the trainer's ``next()`` returns at once;
``load(step)`` of a step an iterator has prefetched returns that same batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.sharding import Sharding

from ._background import BackgroundBuilder, BackgroundStopped
from ._loop import LoopThread
from ._typecheck import checked
from .batch import (
    BatchBuilder,
    BatchType,
    TokenBatch,
    check_batch_sharding,
    default_sharding,
    host_batch_indices,
)
from .config import (
    EngineOptions,
    FlatTokensParams,
    HuggingFaceDataParams,
    TokenBatchParams,
    redact_url,
    step_argument,
)
from .engine import Engine, EngineStats, IntervalStats
from .errors import ConfigError, LoaderClosedError
from .format import SPLITS
from .mixture.config import MixtureParams
from .permutation import warm_up as warm_up_permutation
from .plan import ShufflePlan
from .sizing import dropped_warning, format_bytes
from .source import StoreWrapper, TokenSource, ZarrTokenSource

# TokenBatch, default_sharding and check_batch_sharding live in asyncflat.batch; re-exported here
# for code that imported them from this module.
__all__ = [
    "BatchIterator",
    "ShufflingLoader",
    "TokenBatch",
    "check_batch_sharding",
    "default_sharding",
    "get_loader",
]

log = logging.getLogger(__name__)

_host_batch_indices = host_batch_indices  # the old private name
_prefetch_ids = itertools.count()
_DEFAULT_OPTIONS = EngineOptions()
#: build times kept for ``stats().build_median_s``
BUILD_HISTORY = 4096


async def open_engine(
    split: str,
    params: FlatTokensParams,
    token_batch_params: TokenBatchParams,
    host_rows: np.ndarray,
    options: EngineOptions,
    *,
    epoch: int = 0,
    store_wrapper: StoreWrapper | None = None,
    source: TokenSource | None = None,
) -> Engine:
    """Open ``params``' split (unless ``source`` is given), plan epoch ``epoch`` and build the
    engine of the streams ``host_rows`` belong to (on the running loop, which then owns it)."""
    if source is None:
        source = await ZarrTokenSource.open(
            os.fspath(params.filespec),  # a str once the config is built
            split,
            storage_options=params.storage_options,
            max_concurrent_requests=options.max_concurrent_reads,
            retry=options.retry,
            store_wrapper=store_wrapper,
        )
    plan = ShufflePlan.create(
        params,
        token_batch_params,
        token_count=source.token_count,
        sequence_count=source.sequence_count,
        epoch=epoch,
    )
    # Pay the one-time permutation compile and the global block shuffle here, at start-up,
    # not inside the first load().
    warm_up_permutation(max(plan.seqs_per_buffer, plan.read_block_count))
    _ = plan.block_order
    streams = np.unique(host_rows // plan.rows_per_stream_step).tolist()
    needed = 2 * len(streams) * plan.buffer_bytes
    if options.max_buffer_bytes is not None and needed > options.max_buffer_bytes:
        raise ConfigError(
            f"shuffle buffers need {needed:,} bytes on this host (2 x {len(streams)} streams x "
            f"{plan.buffer_bytes:,}), over EngineOptions.max_buffer_bytes="
            f"{options.max_buffer_bytes:,}; lower read_blocks_per_shuffle_buffer or "
            "sequences_per_read_block"
        )
    where = f"{redact_url(os.fspath(params.filespec))}/{split}"
    warning = dropped_warning(plan, where)
    if warning is not None:
        log.warning("%s", warning)
    log.info(
        "%s: %d steps, %d minipochs, streams %s on this host; shuffle buffers %s each, "
        "%s on this host (2 per stream), for a split of %s of tokens",
        where,
        plan.step_count,
        plan.minipoch_count,
        streams,
        format_bytes(plan.buffer_bytes),
        format_bytes(needed),
        format_bytes(plan.token_count * 4),
    )
    return Engine(plan, source, streams, options)


class ShufflingLoader:
    """Serves batches of a flat-tokens split; the next shuffle buffer fills in the background.

    Batches are ``batch_type(targets=..., is_seq_start=...)`` with (batch, len) ``jax.Array``
    fields (uint32 and bool) sharded by ``sharding``; the default ``batch_type`` is
    :class:`~asyncflat.batch.TokenBatch`, and any dataclass or pytree with those two fields works
    (e.g. seqax's own ``TokenBatch``). Use as a context manager (or call :meth:`close`) so the
    engine's thread and buffers go away. ``source`` injects a
    :class:`~asyncflat.source.TokenSource` (tests); ``store_wrapper`` wraps the zarr store (fault
    injection, instrumentation). ``epoch`` selects the pass over the split: 0 is seqax's order,
    ``e > 0`` another deterministic order (:func:`asyncflat.plan.epoch_seed`);
    :func:`asyncflat.iter_epochs` runs several passes. Given a
    :class:`~asyncflat.mixture.MixtureParams`, ``ShufflingLoader(...)`` returns a
    :class:`~asyncflat.mixture.loader.MixtureLoader` instead (docs/mixtures.md).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A MixtureParams builds a MixtureLoader (not a subclass, so __init__ is not run again).
        params = args[1] if len(args) > 1 else kwargs.get("params")
        if cls is ShufflingLoader and isinstance(params, MixtureParams):
            from .mixture.loader import MixtureLoader

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
        options: EngineOptions = _DEFAULT_OPTIONS,
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
        self._prefetchers: set[BackgroundBuilder[Any]] = set()
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
        the iterator's arrays are returned, so both see the identical batch.
        """
        step = step_argument(step)
        self._check_open()
        for prefetcher in self._live_prefetchers():
            batch = prefetcher.lookup(step)
            if batch is not None:
                self._count_delivered()
                return batch
        batch = self._load_now(step)
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
            prefetchers = list(self._prefetchers)
            self._prefetchers.clear()
        for prefetcher in prefetchers:  # no new builds start; a build in progress fails fast below
            prefetcher.signal_stop()
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

    def _rows(self, step: int) -> np.ndarray:
        self._check_open()
        self.plan.check_step(step)
        rows = self._engine.try_gather(step, self._host_rows)  # steady state: no loop round trip
        if rows is not None:
            return rows
        return self._runner.run(
            self._engine.gather(step, self._host_rows), timeout=self.options.load_timeout_s
        )

    def _load_now(self, step: int) -> Any:
        """Build the batch of ``step`` now (the ``build`` that device prefetch runs ahead)."""
        rows = self._rows(step)
        t0 = time.perf_counter()
        batch = self._builder.build(rows)
        n = next(self._builds)
        self._build_s[n % BUILD_HISTORY] = time.perf_counter() - t0
        self._built = max(self._built, n + 1)
        return batch

    def _start_prefetch(self, start: int, depth: int) -> BackgroundBuilder[Any]:
        """A builder of steps [start, step_count) ahead of an iterator, known to :meth:`load`."""
        with self._lock:
            self._check_open()
            builder: BackgroundBuilder[Any] = BackgroundBuilder(
                self._load_now,
                start,
                self.step_count,
                depth,
                name=f"asyncflat-device-prefetch-{next(_prefetch_ids)}",
            )
            self._prefetchers.add(builder)
        return builder

    def _stop_prefetch(self, builder: BackgroundBuilder[Any], pin: _Pin) -> None:
        pin.release()
        builder.signal_stop()
        with self._lock:
            self._prefetchers.discard(builder)
        if not self._runner.in_loop_thread():  # the builder may be waiting on this very thread
            builder.stop()

    def _live_prefetchers(self) -> list[BackgroundBuilder[Any]]:
        with self._lock:
            return list(self._prefetchers)


class _Pin:
    """An iterator's pin on the minipochs it is positioned in (:meth:`Engine.pin`), so other
    threads' loads and prefetches do not evict the buffers the iterator reads next.

    Held per minipoch, not per step: moving within the minipochs already pinned changes
    nothing (no engine lock, no counter churn on every ``next()``); entering the next minipoch
    pins the new keys before releasing the old ones, so the minipoch read now is never unpinned
    in between."""

    def __init__(self, engine: Engine, host_rows: np.ndarray) -> None:
        self._engine, self._rows = engine, host_rows
        self._keys: list[tuple[int, int]] | None = None
        self._lock = threading.Lock()

    def move(self, step: int) -> None:
        keys = self._engine.pin_keys(step, self._rows)
        with self._lock:  # pin and unpin under it: a release() in between cannot leak a pin
            if keys == self._keys:
                return
            old, self._keys = self._keys, keys
            self._engine.pin(keys)
            if old is not None:
                self._engine.unpin(old)

    def release(self) -> None:
        with self._lock:
            old, self._keys = self._keys, None
            if old is not None:
                self._engine.unpin(old)


class BatchIterator(Iterator[tuple[int, Any]]):
    """``(step, batch)`` pairs of a :class:`ShufflingLoader`, built ahead when prefetching.

    A ``KeyboardInterrupt`` while ``next()`` waits leaves the iterator where it was: the next
    ``next()`` returns the same step. Any other error ends the iteration.
    """

    def __init__(self, loader: ShufflingLoader, start: int, depth: int) -> None:
        self._loader = loader
        self._step = start
        self._stop_step = loader.step_count
        self._prefetch: BackgroundBuilder[Any] | None = None
        self._finalizer: weakref.finalize | None = None
        self._pin = _Pin(loader._engine, loader._host_rows)
        if start < self._stop_step:
            self._pin.move(start)
        if depth and start < self._stop_step:
            self._prefetch = loader._start_prefetch(start, depth)
            # The finalizer holds the loader and the builder, never this iterator, so a dropped
            # iterator is collected and its thread stopped.
            self._finalizer = weakref.finalize(
                self, loader._stop_prefetch, self._prefetch, self._pin
            )
        else:
            self._finalizer = weakref.finalize(self, self._pin.release)
        # Not at interpreter exit: joining a thread blocked in a load could wait a whole
        # load; the thread is a daemon and the loop's own exit hook cancels its load.
        self._finalizer.atexit = False

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._step >= self._stop_step:
            raise StopIteration
        step = self._step
        if self._prefetch is None:
            batch = self._loader.load(step)  # raising leaves the step where it is
        else:
            self._loader._check_open()
            try:
                batch = self._prefetch.take(step)
            except KeyboardInterrupt:
                raise  # the builder goes on; the next next() takes this same step
            except BackgroundStopped:
                self._step = self._stop_step
                self.close()
                self._loader._check_open()  # closed loader: LoaderClosedError
                raise LoaderClosedError("the device-prefetch thread has stopped") from None
            except BaseException:
                self._step = self._stop_step  # an error ends the iteration
                self.close()
                raise
            self._loader._count_delivered()  # (load() above counts its own)
        self._step = step + 1
        if self._step >= self._stop_step:
            self.close()
        elif not self._loader._closed:
            self._pin.move(self._step)
        return step, batch

    def close(self) -> None:
        """Stop the prefetch thread and drop the batches built ahead. Idempotent."""
        self._step = self._stop_step
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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
    :class:`~asyncflat.mixture.MixtureParams` gives a
    :class:`~asyncflat.mixture.loader.MixtureLoader` (docs/mixtures.md).
    """
    if isinstance(config, MixtureParams):
        from .mixture.loader import MixtureLoader

        return MixtureLoader(
            split, config, token_batch_params, sharding, options=options, batch_type=batch_type
        )
    if isinstance(config, FlatTokensParams):
        return ShufflingLoader(
            split,
            config,
            token_batch_params,
            sharding,
            options=_DEFAULT_OPTIONS if options is None else options,
            batch_type=batch_type,
        )
    from .hf import HuggingFaceDataLoader  # optional extra: imported only when asked for

    return HuggingFaceDataLoader(split, config, token_batch_params, sharding, batch_type=batch_type)
