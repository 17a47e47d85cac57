"""The synchronous facade: ``ShufflingLoader``, a drop-in for seqax's loader, and the jax glue.

``load(step)`` is a pure function of (dataset, params, step): it asks the engine, on the
engine's own loop, for the encoded rows of this host's batch indices, builds one sharded
``jax.Array`` with ``jax.make_array_from_callback`` and decodes it with a jitted function.
Each host computes its batch indices from the sharding and fills only the streams they belong to
(docs/multihost.md).

``iter()`` also keeps the next ``EngineOptions.prefetch_to_device`` steps' arrays built on a
background thread, so the trainer's ``next()`` returns at once; ``load(step)`` of a step an
iterator has prefetched returns those same arrays.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from ._loop import LoopThread
from ._typecheck import checked
from .config import EngineOptions, FlatTokensParams, HuggingFaceDataParams, TokenBatchParams
from .engine import Engine, EngineStats, IntervalStats
from .errors import ConfigError, LoaderClosedError
from .format import SPLITS
from .permutation import warm_up as warm_up_permutation
from .plan import ShufflePlan
from .source import StoreWrapper, TokenSource, ZarrTokenSource

__all__ = ["BatchIterator", "ShufflingLoader", "TokenBatch", "default_sharding", "get_loader"]

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """A batch of tokens: ``targets`` (uint32) and ``is_seq_start`` (bool), both (batch, len)."""

    targets: jax.Array
    is_seq_start: jax.Array


def _decode_impl(encoded: jax.Array) -> TokenBatch:
    # encoded = 2*id + 1 on the first token of a sequence, 2*id elsewhere.
    return TokenBatch(targets=encoded >> 1, is_seq_start=(encoded & 1) == 1)


@functools.cache
def _decoder(donate: bool) -> Any:
    # Donation lets XLA reuse the encoded buffer for targets; the CPU backend cannot use donated
    # buffers (and warns), so only donate on accelerators.
    return jax.jit(_decode_impl, donate_argnums=(0,) if donate else ())


def default_sharding() -> Sharding:
    """The batch axis over every device of every process; the sequence axis replicated.

    Devices are ordered by process, so each process holds one contiguous range of batch rows
    and therefore as few streams as possible (docs/multihost.md).
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("batch",))
    return NamedSharding(mesh, PartitionSpec("batch", None))


def check_batch_sharding(sharding: Sharding, shape: tuple[int, int]) -> None:
    """Raise ConfigError unless ``sharding`` can shard a (batch, len) array on this process."""
    try:
        sharding.shard_shape(shape)
    except Exception as exc:
        raise ConfigError(
            f"sharding {sharding} cannot shard a batch of shape {shape}: {exc}"
        ) from exc
    if not sharding.addressable_devices_indices_map(shape):
        raise ConfigError(f"sharding {sharding} has no device in this process")


def _host_batch_indices(sharding: Sharding, shape: tuple[int, int]) -> np.ndarray:
    """Batch rows any addressable shard of ``sharding`` holds, sorted (this host's rows)."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])))
    return np.array(sorted(rows), dtype=np.int64)


class ShufflingLoader:
    """Serves ``TokenBatch`` es of a flat-tokens split; the next shuffle buffer fills in the background.

    Use as a context manager (or call :meth:`close`) so the engine's thread and buffers go away.
    ``source`` injects a :class:`~asyncflat.source.TokenSource` (tests); ``store_wrapper`` wraps
    the zarr store (fault injection, instrumentation).
    """

    @checked
    def __init__(
        self,
        split: str,
        params: FlatTokensParams,
        token_batch_params: TokenBatchParams,
        sharding: Sharding | None = None,
        *,
        options: EngineOptions = EngineOptions(),
        store_wrapper: StoreWrapper | None = None,
        source: TokenSource | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
        self.split, self.params, self.token_batch_params = split, params, token_batch_params
        self.options = options
        self.sharding = default_sharding() if sharding is None else sharding
        self._shape = (token_batch_params.batch, token_batch_params.len)
        check_batch_sharding(self.sharding, self._shape)
        self._host_rows = _host_batch_indices(self.sharding, self._shape)
        self._row_of_batch_index = np.full(token_batch_params.batch, -1, np.int64)
        self._row_of_batch_index[self._host_rows] = np.arange(len(self._host_rows))
        self._shard_rows = self._local_row_selections()
        self._decode = _decoder(donate=jax.default_backend() != "cpu")
        self._prefetchers: set[_DevicePrefetch] = set()
        self._store_wrapper = store_wrapper
        self._injected_source = source
        self._lock = threading.Lock()
        self._closed = False
        self._build_s: collections.deque[float] = collections.deque(maxlen=1 << 16)  # recent builds
        self._runner = LoopThread(
            name="asyncflat", cpu_threads=options.decode_threads, nice=options.engine_niceness
        )
        self._pid = os.getpid()
        try:
            self._engine = self._runner.run(self._open_engine())
        except BaseException:
            self._runner.close()
            raise
        self.plan: ShufflePlan = self._engine.plan

    # -- construction -------------------------------------------------------------------------

    async def _open_engine(self) -> Engine:
        params = self.params
        source = self._injected_source
        if source is None:
            source = await ZarrTokenSource.open(
                params.filespec,
                self.split,
                storage_options=params.storage_options,
                max_concurrent_requests=self.options.max_concurrent_reads,
                retry=self.options.retry,
                store_wrapper=self._store_wrapper,
            )
        plan = ShufflePlan.create(
            params,
            self.token_batch_params,
            token_count=source.token_count,
            sequence_count=source.sequence_count,
        )
        # Pay the one-time permutation compile and the global block shuffle here, at start-up,
        # not inside the first load().
        warm_up_permutation(max(plan.seqs_per_buffer, plan.read_block_count))
        plan.block_order
        streams = np.unique(self._host_rows // plan.rows_per_stream_step).tolist()
        needed = 2 * len(streams) * plan.buffer_bytes
        if self.options.max_buffer_bytes is not None and needed > self.options.max_buffer_bytes:
            raise ConfigError(
                f"shuffle buffers need {needed:,} bytes on this host (2 x {len(streams)} streams x "
                f"{plan.buffer_bytes:,}), over EngineOptions.max_buffer_bytes="
                f"{self.options.max_buffer_bytes:,}; lower read_blocks_per_shuffle_buffer or "
                "sequences_per_read_block"
            )
        log.info(
            "%s/%s: %d steps, %d minipochs, streams %s on this host, %.1f MiB per buffer",
            params.filespec,
            self.split,
            plan.step_count,
            plan.minipoch_count,
            streams,
            plan.buffer_bytes / 2**20,
        )
        return Engine(plan, source, streams, self.options)

    # -- the reference's API ------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return self.plan.step_count

    @property
    def max_token_id(self) -> int:
        return self._engine.source.max_token_id

    def load(self, step: int) -> TokenBatch:
        """The batch of ``step`` (any step in [0, step_count), in any order).

        A step that a live iterator has already prefetched (or is building) is not built again:
        the iterator's arrays are returned, so both see the identical batch.
        """
        self._check_open()
        for prefetcher in self._live_prefetchers():
            batch = prefetcher.lookup(step)
            if batch is not None:
                return batch
        return self._load_now(step)

    def iter(self, start_step: int = 0) -> BatchIterator:
        """An iterator of ``(step, batch)`` from ``start_step`` to the end of the dataset.

        With ``EngineOptions.prefetch_to_device = k > 0`` a background thread keeps the next k
        steps' arrays built, so ``next()`` returns at once when the trainer's step is longer than
        a build. An error while building a step is raised by the ``next()`` that returns it, and
        ends the iteration (start a new ``iter(step)`` to carry on). Close the iterator (or drop
        it, or close the loader) to stop its thread.
        """
        self._check_open()
        if start_step != self.step_count:
            self.plan.check_step(start_step)
        return BatchIterator(self, start_step, self.options.prefetch_to_device)

    def __iter__(self) -> Iterator[TokenBatch]:
        iterator = self.iter()
        try:
            for _, batch in iterator:
                yield batch
        finally:
            iterator.close()

    def stats(self) -> EngineStats:
        """Engine figures (waits, fills, bytes, retries) plus the jax build times of this host."""
        self._check_open()
        stats = self._runner.run(self._engine_stats())
        builds = np.array(self._build_s)
        build_median_s = float(np.median(builds)) if len(builds) else None
        return dataclasses.replace(
            stats, build_median_s=build_median_s, host_batch_rows=len(self._host_rows)
        )

    async def _engine_stats(self) -> EngineStats:
        return self._engine.stats()

    def interval_stats(self) -> IntervalStats:
        """What happened since the previous call (loads, waits, fills, bytes): log every N steps."""
        self._check_open()
        return self._runner.run(self._engine_interval_stats())

    async def _engine_interval_stats(self) -> IntervalStats:
        return self._engine.interval_stats()

    def close(self) -> None:
        """Stop the device-prefetch threads, cancel fills, stop the engine's thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            prefetchers = list(self._prefetchers)
        for prefetcher in prefetchers:  # no new builds start; a build in progress fails fast below
            prefetcher.signal_stop()
        try:
            if self._pid == os.getpid():
                self._runner.run(self._engine.aclose(), timeout=30)
        finally:
            for prefetcher in prefetchers:
                prefetcher.stop()
            self._runner.close()

    def __enter__(self) -> ShufflingLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten loader must not keep its thread
        if not getattr(self, "_closed", True):
            try:
                self._runner.close()
            except Exception:
                pass

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderClosedError("this ShufflingLoader is closed; create a new one")

    def _rows(self, step: int) -> np.ndarray:
        self._check_open()
        if self._pid != os.getpid():
            raise LoaderClosedError(
                "this ShufflingLoader was created in another process (before a fork); "
                "create a new loader in this process"
            )
        self.plan.check_step(step)
        rows = self._engine.try_gather(step, self._host_rows)  # steady state: no loop round trip
        if rows is not None:
            return rows
        return self._runner.run(
            self._engine.gather(step, self._host_rows), timeout=self.options.load_timeout_s
        )

    def _load_now(self, step: int) -> TokenBatch:
        rows = self._rows(step)
        t0 = time.perf_counter()
        batch = self._build(rows)
        self._build_s.append(time.perf_counter() - t0)
        return batch

    def _local_row_selections(self) -> dict[tuple[int, int], slice | np.ndarray]:
        """For each batch range an addressable shard holds: its rows in the gathered array.

        Host rows are sorted, so a shard's rows are normally one contiguous range of the
        gathered array and the shard is a view of it (no copy before the transfer).
        """
        selections: dict[tuple[int, int], slice | np.ndarray] = {}
        for index in self.sharding.addressable_devices_indices_map(self._shape).values():
            start, stop, _ = index[0].indices(self._shape[0])
            local = self._row_of_batch_index[start:stop]
            if len(local) and np.array_equal(local, np.arange(local[0], local[0] + len(local))):
                selections[(start, stop)] = slice(int(local[0]), int(local[0]) + len(local))
            else:
                selections[(start, stop)] = local
        return selections

    def _build(self, rows: np.ndarray) -> TokenBatch:
        # make_array_from_callback hands all pieces to one batched device_put (jax >= 0.4.36);
        # bench/handoff.py measured it faster than device_put(pieces, devices) +
        # make_array_from_single_device_arrays. Pieces are views of ``rows``, which the engine
        # allocates afresh for every step, so a zero-copy transfer may alias it safely.
        def shard(index: tuple[slice, ...]) -> np.ndarray:
            start, stop, _ = index[0].indices(self._shape[0])
            return rows[self._shard_rows[(start, stop)], index[1]]

        encoded = jax.make_array_from_callback(self._shape, self.sharding, shard, dtype=np.uint32)
        return self._decode(encoded)

    def _register(self, prefetcher: _DevicePrefetch) -> None:
        with self._lock:
            self._check_open()
            self._prefetchers.add(prefetcher)

    def _unregister(self, prefetcher: _DevicePrefetch) -> None:
        with self._lock:
            self._prefetchers.discard(prefetcher)

    def _live_prefetchers(self) -> list[_DevicePrefetch]:
        with self._lock:
            return list(self._prefetchers)


_JOIN_TIMEOUT_S = 30.0
_WAIT_SLICE_S = 0.2  # consumers wait in slices so Ctrl-C reaches the main thread
_prefetch_ids = itertools.count()


class _DevicePrefetch:
    """A thread that builds the batches of steps [start, stop) ahead of a consumer.

    At most ``depth`` steps are built (or being built) and not yet taken. Holds the loader but
    never the iterator, so a dropped iterator is collected and its finalizer stops the thread.
    """

    def __init__(self, loader: ShufflingLoader, start: int, stop: int, depth: int) -> None:
        self._loader = loader
        self._stop_step = stop
        self._depth = depth
        self._cond = threading.Condition()
        self._built: dict[int, concurrent.futures.Future[TokenBatch]] = {}
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run,
            args=(start,),
            daemon=True,
            name=f"asyncflat-device-prefetch-{next(_prefetch_ids)}",
        )
        loader._register(self)
        self._thread.start()

    def _run(self, step: int) -> None:
        while step < self._stop_step:
            with self._cond:
                while not self._stopping and len(self._built) >= self._depth:
                    self._cond.wait()
                if self._stopping:
                    return
                future: concurrent.futures.Future[TokenBatch] = concurrent.futures.Future()
                self._built[step] = future
                self._cond.notify_all()
            try:
                future.set_result(self._loader._load_now(step))
            except BaseException as exc:  # raised by the next() (or load()) that takes this step
                future.set_exception(exc)
                return
            step += 1

    def take(self, step: int) -> concurrent.futures.Future[TokenBatch]:
        """The future of ``step`` (the consumer's next step), once the thread has started it."""
        with self._cond:
            while step not in self._built:
                if self._stopping or not self._thread.is_alive():
                    raise LoaderClosedError("the device-prefetch thread has stopped")
                self._cond.wait(_WAIT_SLICE_S)
            return self._built[step]

    def taken(self, step: int) -> None:
        with self._cond:
            self._built.pop(step, None)
            self._cond.notify_all()

    def lookup(self, step: int) -> TokenBatch | None:
        """The prefetched batch of ``step`` (waiting if it is being built), else None."""
        with self._cond:
            future = self._built.get(step)
        if future is None:
            return None
        try:
            return _result(future)
        except Exception:
            return None  # the caller loads it itself; the iterator still reports the error

    def signal_stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop and join the thread (a build in progress finishes first). Idempotent."""
        self.signal_stop()
        self._loader._unregister(self)
        if threading.current_thread() is self._thread:
            return  # collected on our own thread: it exits at its next check
        self._thread.join(_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("%s did not stop within %ss", self._thread.name, _JOIN_TIMEOUT_S)
        with self._cond:
            self._built.clear()


def _result(future: concurrent.futures.Future[TokenBatch]) -> TokenBatch:
    while True:
        try:
            return future.result(_WAIT_SLICE_S)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise


class BatchIterator(Iterator[tuple[int, TokenBatch]]):
    """``(step, batch)`` pairs of a :class:`ShufflingLoader`, built ahead when prefetching."""

    def __init__(self, loader: ShufflingLoader, start: int, depth: int) -> None:
        self._loader = loader
        self._step = start
        self._stop_step = loader.step_count
        self._prefetch: _DevicePrefetch | None = None
        self._finalizer: weakref.finalize | None = None
        if depth and start < self._stop_step:
            self._prefetch = _DevicePrefetch(loader, start, self._stop_step, depth)
            self._finalizer = weakref.finalize(self, self._prefetch.stop)
            # Not at interpreter exit: joining a thread blocked in a load could wait a whole
            # load; the thread is a daemon and the loop's own exit hook cancels its load.
            self._finalizer.atexit = False

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[int, TokenBatch]:
        if self._step >= self._stop_step:
            raise StopIteration
        step = self._step
        if self._prefetch is None:
            batch = self._loader.load(step)
        else:
            self._loader._check_open()
            future = self._prefetch.take(step)
            try:
                batch = _result(future)
            except BaseException:
                self._step = self._stop_step  # an error ends the iteration
                self.close()
                raise
            finally:
                self._prefetch.taken(step)
        self._step = step + 1
        if self._step >= self._stop_step:
            self.close()
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
    config: FlatTokensParams | HuggingFaceDataParams,
    token_batch_params: TokenBatchParams,
    sharding: Sharding | None = None,
) -> Any:
    """Build the loader for ``config``, as the reference's ``get_loader`` does."""
    if isinstance(config, FlatTokensParams):
        return ShufflingLoader(split, config, token_batch_params, sharding)
    from .hf import HuggingFaceDataLoader  # optional extra: imported only when asked for

    return HuggingFaceDataLoader(split, config, token_batch_params, sharding)
