"""The synchronous facade: ``ShufflingLoader``, a drop-in for seqax's loader, and the jax glue.

``load(step)`` is a pure function of (dataset, params, step): it asks the engine, on the
engine's own loop, for the encoded rows of this host's batch indices, builds one sharded
``jax.Array`` with ``jax.make_array_from_callback`` and decodes it with a jitted function.
Each host computes its batch indices from the sharding and fills only the streams they belong to.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
from typeguard import typechecked

from ._loop import LoopThread
from .config import EngineOptions, FlatTokensParams, HuggingFaceDataParams, TokenBatchParams
from .engine import Engine
from .errors import ConfigError, LoaderClosedError
from .format import SPLITS
from .plan import ShufflePlan
from .source import StoreWrapper, TokenSource, ZarrTokenSource

__all__ = ["ShufflingLoader", "TokenBatch", "get_loader", "default_sharding"]

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


@functools.lru_cache(maxsize=None)
def _decoder(donate: bool) -> Any:
    # Donation lets XLA reuse the encoded buffer for targets; the CPU backend cannot use donated
    # buffers (and warns), so only donate on accelerators.
    return jax.jit(_decode_impl, donate_argnums=(0,) if donate else ())


def default_sharding() -> Sharding:
    """The batch axis over every device of every process; the sequence axis replicated."""
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    return NamedSharding(mesh, PartitionSpec("batch", None))


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

    @typechecked
    def __init__(
        self,
        split: str,
        params: FlatTokensParams,
        token_batch_params: TokenBatchParams,
        sharding: Optional[Sharding] = None,
        *,
        options: EngineOptions = EngineOptions(),
        store_wrapper: Optional[StoreWrapper] = None,
        source: Optional[TokenSource] = None,
    ) -> None:
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
        self.split, self.params, self.token_batch_params = split, params, token_batch_params
        self.options = options
        self.sharding = default_sharding() if sharding is None else sharding
        self._shape = (token_batch_params.batch, token_batch_params.len)
        self._check_sharding()
        self._host_rows = _host_batch_indices(self.sharding, self._shape)
        self._row_of_batch_index = np.full(token_batch_params.batch, -1, np.int64)
        self._row_of_batch_index[self._host_rows] = np.arange(len(self._host_rows))
        self._decode = _decoder(donate=jax.default_backend() != "cpu")
        self._store_wrapper = store_wrapper
        self._injected_source = source
        self._lock = threading.Lock()
        self._closed = False
        self._build_s: list[float] = []
        self._runner = LoopThread(name="asyncflat", cpu_threads=options.decode_threads)
        self._pid = os.getpid()
        try:
            self._engine = self._runner.run(self._open_engine())
        except BaseException:
            self._runner.close()
            raise
        self.plan: ShufflePlan = self._engine.plan

    # -- construction -------------------------------------------------------------------------

    def _check_sharding(self) -> None:
        try:
            self.sharding.shard_shape(self._shape)
        except Exception as exc:
            raise ConfigError(
                f"sharding {self.sharding} cannot shard a batch of shape {self._shape}: {exc}"
            ) from exc
        if len(self.sharding.device_set) and not self.sharding.is_fully_addressable:
            return  # multi-process: rows are split by the addressable shards
        if not self.sharding.addressable_devices_indices_map(self._shape):
            raise ConfigError(f"sharding {self.sharding} has no device in this process")

    async def _open_engine(self) -> Engine:
        params = self.params
        source = self._injected_source
        if source is None:
            source = await ZarrTokenSource.open(
                params.filespec, self.split, storage_options=params.storage_options,
                max_concurrent_requests=self.options.max_concurrent_reads,
                retry=self.options.retry, store_wrapper=self._store_wrapper,
            )
        plan = ShufflePlan.create(
            params, self.token_batch_params,
            token_count=source.token_count, sequence_count=source.sequence_count,
        )
        streams = np.unique(self._host_rows // plan.rows_per_stream_step).tolist()
        needed = 2 * len(streams) * plan.buffer_bytes
        if self.options.max_buffer_bytes is not None and needed > self.options.max_buffer_bytes:
            raise ConfigError(
                f"shuffle buffers need {needed:,} bytes on this host (2 x {len(streams)} streams x "
                f"{plan.buffer_bytes:,}), over EngineOptions.max_buffer_bytes="
                f"{self.options.max_buffer_bytes:,}; lower read_blocks_per_shuffle_buffer or "
                "sequences_per_read_block"
            )
        log.info("%s/%s: %d steps, %d minipochs, streams %s on this host, %.1f MiB per buffer",
                 params.filespec, self.split, plan.step_count, plan.minipoch_count, streams,
                 plan.buffer_bytes / 2**20)
        return Engine(plan, source, streams, self.options)

    # -- the reference's API ------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return self.plan.step_count

    @property
    def max_token_id(self) -> int:
        return self._engine.source.max_token_id

    def load(self, step: int) -> TokenBatch:
        """The batch of ``step`` (any step in [0, step_count), in any order)."""
        rows = self._rows(step)
        t0 = time.perf_counter()
        batch = self._build(rows)
        self._build_s.append(time.perf_counter() - t0)
        return batch

    def iter(self, start_step: int = 0) -> Iterator[tuple[int, TokenBatch]]:
        """Yield ``(step, batch)`` from ``start_step`` to the end of the dataset."""
        if start_step != self.step_count:
            self.plan.check_step(start_step)
        for step in range(start_step, self.step_count):
            yield step, self.load(step)

    def __iter__(self) -> Iterator[TokenBatch]:
        for _, batch in self.iter():
            yield batch

    def stats(self) -> dict[str, Any]:
        """Engine figures (waits, fills, bytes, retries) plus the jax build times of this host."""
        self._check_open()
        stats = self._runner.run(self._engine_stats())
        builds = np.array(self._build_s)
        stats["build_median_s"] = float(np.median(builds)) if len(builds) else None
        stats["host_batch_rows"] = len(self._host_rows)
        return stats

    async def _engine_stats(self) -> dict[str, Any]:
        return self._engine.stats()

    def close(self) -> None:
        """Cancel fills, stop the engine's thread, free the buffers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._pid == os.getpid():
                self._runner.run(self._engine.aclose(), timeout=30)
        finally:
            self._runner.close()

    def __enter__(self) -> "ShufflingLoader":
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
        return self._runner.run(
            self._engine.gather(step, self._host_rows), timeout=self.options.load_timeout_s
        )

    def _build(self, rows: np.ndarray) -> TokenBatch:
        def shard(index: tuple[slice, ...]) -> np.ndarray:
            batch_rows = self._row_of_batch_index[index[0]]
            return rows[batch_rows, index[1]]

        encoded = jax.make_array_from_callback(self._shape, self.sharding, shard)
        return self._decode(encoded)


@typechecked
def get_loader(
    split: str,
    config: Union[FlatTokensParams, HuggingFaceDataParams],
    token_batch_params: TokenBatchParams,
    sharding: Optional[Sharding] = None,
) -> Any:
    """Build the loader for ``config``, as the reference's ``get_loader`` does."""
    if isinstance(config, FlatTokensParams):
        return ShufflingLoader(split, config, token_batch_params, sharding)
    from .hf import HuggingFaceDataLoader  # optional extra: imported only when asked for

    return HuggingFaceDataLoader(split, config, token_batch_params, sharding)
