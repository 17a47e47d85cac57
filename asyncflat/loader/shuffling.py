"""The synchronous facade: ``ShufflingLoader``, a drop-in for seqax's loader.

``load(step)`` is a pure function of (dataset, params, step): it asks the engine, on the
engine's own loop, for the encoded rows of this host's batch indices and hands them to a
:class:`~asyncflat.loader.shared.batch.BatchBuilder`, which decodes them on the host and builds one sharded
``jax.Array`` per field of the batch type. Each host computes its batch indices from the sharding
and fills only the streams they belong to (docs/multihost.md).

``iter()`` also keeps the next ``EngineOptions.prefetch_to_device`` steps' batches built on a
background thread (:mod:`asyncflat.loader.shared.background`), so the trainer's ``next()`` returns at once;
``load(step)`` of a step an iterator has prefetched returns that same batch.

All of that is the lifecycle every loader shares (:mod:`asyncflat.loader.shared.lifecycle`); this module
supplies only its rows, one engine's (:class:`EngineRows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.sharding import Sharding

from asyncflat._typecheck import checked
from asyncflat.config import EngineOptions, FlatTokensParams, TokenBatchParams
from asyncflat.engine import Engine, EngineStats, IntervalStats
from asyncflat.errors import ConfigError
from asyncflat.format.codec import SPLITS
from asyncflat.loader.mixture.config import MixtureParams
from asyncflat.loader.shared.batch import BatchBuilder, BatchType, TokenBatch, default_sharding
from asyncflat.loader.shared.iterator import BatchIterator
from asyncflat.loader.shared.lifecycle import Lifecycle
from asyncflat.loader.shared.open import open_engine
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.source.protocol import StoreWrapper, TokenSource

__all__ = ["EngineRows", "ShufflingLoader"]


class EngineRows:
    """The :class:`~asyncflat.loader.shared.serving.RowServer` of one engine: this host's rows of a
    step of one split's pass."""

    def __init__(self, engine: Engine, host_rows: np.ndarray) -> None:
        self.engine, self._host_rows = engine, host_rows

    @property
    def step_count(self) -> int:
        return self.engine.plan.step_count

    def check_step(self, step: int) -> None:
        self.engine.plan.check_step(step)

    def ready_rows(self, step: int) -> np.ndarray | None:
        return self.engine.try_gather(step, self._host_rows)

    async def rows(self, step: int) -> np.ndarray:
        return await self.engine.gather(step, self._host_rows)

    def delivered(self, step: int) -> None:
        pass  # the engine's figures count its gathers

    def pin_keys(self, step: int) -> tuple[tuple[int, int], ...]:
        return tuple(self.engine.pin_keys(step, self._host_rows))

    def pin(self, keys: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        self.engine.pin(list(keys))
        return keys

    def unpin(self, pinned: tuple[tuple[int, int], ...]) -> None:
        self.engine.unpin(list(pinned))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def interval_stats(self) -> IntervalStats:
        return self.engine.interval_stats()

    async def aclose(self) -> None:
        await self.engine.aclose()

    def release(self) -> None:
        self.engine.release()


class ShufflingLoader:
    """Serves batches of a flat-tokens split; the next shuffle buffer fills in the background.

    Batches are ``batch_type(targets=..., is_seq_start=...)`` with (batch, len) ``jax.Array``
    fields (uint32 and bool) sharded by ``sharding``; the default ``batch_type`` is
    :class:`~asyncflat.loader.shared.batch.TokenBatch`, and any dataclass or pytree with those two fields works
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
        options: EngineOptions | None = None,
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
        # made here, not at import: its defaults read the CPUs this process may use now
        self.options = options = EngineOptions() if options is None else options
        self.epoch = epoch
        self.sharding = default_sharding() if sharding is None else sharding
        builder = BatchBuilder(
            self.sharding, (token_batch_params.batch, token_batch_params.len), batch_type
        )
        self._life: Lifecycle[EngineRows] = Lifecycle(
            "ShufflingLoader",
            builder,
            options,
            thread_name="asyncflat",
            prefetch_name="asyncflat-device-prefetch",
        )
        self._server = self._life.start(self._open(store_wrapper, source))
        self.plan: ShufflePlan = self._server.engine.plan

    async def _open(
        self, store_wrapper: StoreWrapper | None, source: TokenSource | None
    ) -> EngineRows:
        engine = await open_engine(
            self.split,
            self.params,
            self.token_batch_params,
            self._life.host_rows,
            self.options,
            epoch=self.epoch,
            store_wrapper=store_wrapper,
            source=source,
        )
        self._life.keep(engine)  # its tasks never die with a dropped loader's cycle
        return EngineRows(engine, self._life.host_rows)

    # -- the reference's API ------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        return self.plan.step_count

    @property
    def max_token_id(self) -> int:
        return self._server.engine.source.max_token_id

    @property
    def source(self) -> TokenSource:
        """The reader of the split (a zarr-free one for a plain local split)."""
        return self._server.engine.source

    @property
    def host_rows(self) -> np.ndarray:
        """The batch rows this host holds (sorted), as the sharding places them."""
        return self._life.host_rows

    def load(self, step: int) -> Any:
        """The batch of ``step`` (a Python or numpy integer in [0, step_count), in any order).

        A step that a live iterator has already prefetched (or is building) is not built again:
        the iterator's arrays are returned, so both see the identical batch. Consecutive loads
        get their next batches built ahead (``EngineOptions.load_ahead``).
        """
        return self._life.load(step)

    def encoded_rows(self, step: int) -> np.ndarray:
        """This host's rows of ``step`` as stored (flat-tokens codes, uint32[len(host_rows),
        len]): what ``load(step)`` decodes, without jax."""
        return self._life.encoded_rows(step)

    def iter(self, start_step: int = 0) -> BatchIterator:
        """An iterator of ``(step, batch)`` from ``start_step`` to the end of the dataset.

        With ``EngineOptions.prefetch_to_device = k > 0`` a background thread keeps the next k
        steps' arrays built, so ``next()`` returns at once when the trainer's step is longer than
        a build. An error while building a step is raised by the ``next()`` that returns it, and
        ends the iteration (start a new ``iter(step)`` to carry on). Close the iterator (or drop
        it, or close the loader) to stop its thread.
        """
        return self._life.iter(start_step)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._life)

    def stats(self) -> EngineStats:
        """Engine figures (waits, fills, bytes, retries) plus the jax build times of this host.

        ``steps_loaded`` counts the batches the trainer received (each ``load()`` that returned,
        each item an iterator handed out), not the steps an iterator built ahead of it.
        """
        stats = self._life.server_stats()
        return dataclasses.replace(
            stats,
            steps_loaded=self._life.delivered,
            build_median_s=self._life.build_median_s(),
            host_batch_rows=len(self._life.host_rows),
        )

    def interval_stats(self) -> IntervalStats:
        """What happened since the previous call (loads, waits, fills, bytes): log every N steps.

        ``steps_loaded`` counts the batches the trainer received in the interval, as in
        :meth:`stats`.
        """
        return self._life.interval_stats()

    def close(self) -> None:
        """Stop the device-prefetch threads, cancel fills, free the buffers, stop the engine's
        thread. Idempotent, from any thread: from the engine's own thread (a finalizer or
        callback running there) it schedules all that and returns at once; from any other it
        returns when it is done (within about 15 s whatever the storage does)."""
        self._life.close()

    def __enter__(self) -> ShufflingLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
