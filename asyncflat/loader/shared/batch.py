"""The jax glue: the batch type, decoding, sharding helpers, and building a sharded batch.

Decoding happens on the host, in numpy (a shift and a mask over this host's rows), so the way to
the first batch compiles nothing; the result is bit-identical to decoding on the device. Each
field is then one global ``jax.Array`` built with ``jax.make_array_from_callback`` from views of
the decoded rows, so every device receives exactly its shard and each host reads only the rows
its devices hold (docs/multihost.md).

Works on every jax from the declared floor to the newest: no call form newer than the floor
(the batch type registered with ``register_pytree_with_keys``, ``make_array_from_callback``
without ``dtype=``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from asyncflat.errors import ConfigError

__all__ = [
    "BatchBuilder",
    "TokenBatch",
    "check_batch_sharding",
    "check_batch_type",
    "decode",
    "default_sharding",
    "host_batch_indices",
]


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """A batch of tokens: ``targets`` (uint32) and ``is_seq_start`` (bool), both (batch, len)."""

    targets: jax.Array
    is_seq_start: jax.Array


def _flatten(batch: TokenBatch) -> tuple[tuple[tuple[Any, jax.Array], ...], None]:
    return (
        (jax.tree_util.GetAttrKey("targets"), batch.targets),
        (jax.tree_util.GetAttrKey("is_seq_start"), batch.is_seq_start),
    ), None


# Registered by hand: ``register_dataclass`` needs jax >= 0.4.27, its no-argument decorator form
# jax >= 0.4.36; this form works on every jax the package supports.
jax.tree_util.register_pytree_with_keys(
    TokenBatch, _flatten, lambda _, children: TokenBatch(*children)
)

#: What ``batch_type=`` may be: a class (or any callable) taking ``targets=`` and ``is_seq_start=``.
BatchType = Callable[..., Any]


def decode(encoded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(targets, is_seq_start)`` of flat-tokens codes: ``2*id + 1`` at a sequence start, else ``2*id``."""
    # The low bit is written straight into the bool array's bytes (0 or 1, a valid bool): no
    # uint32 temporary and no cast pass, which cost 10x more per batch.
    is_seq_start = np.empty(encoded.shape, np.bool_)
    np.bitwise_and(encoded, np.uint32(1), out=is_seq_start.view(np.uint8), casting="unsafe")
    return encoded >> np.uint32(1), is_seq_start


def check_batch_type(batch_type: Any) -> None:
    """Raise ConfigError unless ``batch_type`` can be built as ``batch_type(targets=, is_seq_start=)``."""
    if not callable(batch_type):
        raise ConfigError(f"batch_type must be a class or callable, got {batch_type!r}")
    if dataclasses.is_dataclass(batch_type) and isinstance(batch_type, type):
        names = {f.name for f in dataclasses.fields(batch_type) if f.init}
        missing = {"targets", "is_seq_start"} - names
        if missing:
            raise ConfigError(
                f"batch_type {batch_type.__qualname__} has no field(s) {sorted(missing)}; it is "
                "built as batch_type(targets=..., is_seq_start=...)"
            )


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


def _batch_range(index: Any, rows: int) -> tuple[int, int]:
    start, stop, _ = index[0].indices(rows)
    return start, stop


def host_batch_indices(sharding: Sharding, shape: tuple[int, int]) -> np.ndarray:
    """Batch rows any addressable shard of ``sharding`` holds, sorted (this host's rows)."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*_batch_range(index, shape[0])))
    return np.array(sorted(rows), dtype=np.int64)


class BatchBuilder:
    """Builds ``batch_type`` objects of sharded ``jax.Array`` s from this host's rows.

    ``rows`` handed to :meth:`build` hold this host's batch rows (``host_rows``, in order); each
    addressable shard is a view of them, normally one contiguous range (no copy before the
    transfer). :meth:`build_full` takes whole (batch, len) arrays, as a loader that holds every
    row does (the Hugging Face loader).
    """

    def __init__(
        self,
        sharding: Sharding,
        shape: tuple[int, int],
        batch_type: BatchType = TokenBatch,
    ) -> None:
        check_batch_sharding(sharding, shape)
        check_batch_type(batch_type)
        self.sharding, self.shape, self.batch_type = sharding, shape, batch_type
        self.host_rows = host_batch_indices(sharding, shape)
        row_of = np.full(shape[0], -1, np.int64)
        row_of[self.host_rows] = np.arange(len(self.host_rows))
        self._selections: dict[tuple[int, int], slice | np.ndarray] = {}
        for index in sharding.addressable_devices_indices_map(shape).values():
            start, stop = _batch_range(index, shape[0])
            local = row_of[start:stop]
            if len(local) and np.array_equal(local, np.arange(local[0], local[0] + len(local))):
                self._selections[(start, stop)] = slice(int(local[0]), int(local[0]) + len(local))
            else:
                self._selections[(start, stop)] = local

    def build(self, rows: np.ndarray) -> Any:
        """The batch of encoded ``rows`` (this host's rows, shape (len(host_rows), len))."""
        targets, is_start = decode(rows)
        return self.batch_type(
            targets=self._array(targets, local=True), is_seq_start=self._array(is_start, local=True)
        )

    def build_full(self, targets: np.ndarray, is_seq_start: np.ndarray) -> Any:
        """The batch of decoded whole-batch arrays (every row, shape ``self.shape``)."""
        return self.batch_type(
            targets=self._array(targets, local=False),
            is_seq_start=self._array(is_seq_start, local=False),
        )

    def _array(self, values: np.ndarray, *, local: bool) -> jax.Array:
        # Pieces are views of ``values``, which is built afresh for every batch, so a zero-copy
        # transfer may alias it safely.
        def shard(index: Any) -> np.ndarray:
            if not local:
                return values[index]
            return values[self._selections[_batch_range(index, self.shape[0])], index[1]]

        return jax.make_array_from_callback(self.shape, self.sharding, shard)
