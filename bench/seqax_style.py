"""A synchronous loader with the semantics (and the costs) of seqax's ``ShufflingLoader``.

The benchmarks' stand-in for seqax's loader, which cannot be imported here (it needs seqax's
``shardlib`` and an old jax): same batches, same order, same way of working. Each step maps its
batch rows to (stream, minipoch, position); when a stream's minipoch changes, the whole shuffle
buffer is read there and then (one thread per read block, through zarr's synchronous API),
concatenated, and permuted with the frozen Fisher-Yates evaluated literally, as seqax does; a batch
is gathered from the buffer, built with ``jax.make_array_from_callback`` and decoded by a jitted
function that donates its input. Nothing is prepared ahead of time, so a boundary step pays for a
whole refill: the stall asyncflat exists to remove.

Only what the benchmarks use: one host (every batch index is local), any ``streams``, sequence
packing on or off.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np


class Batch(NamedTuple):
    targets: Any
    is_seq_start: Any


def random_permutation(seed: int, n: int) -> np.ndarray:
    """The frozen shuffle, written out literally (seqax's ``_random_permutation``)."""
    randoms = np.random.Philox(seed).random_raw(n) % (np.arange(n, dtype=np.uint64) + 1)
    result = np.arange(n, dtype=np.uint32)
    for i in reversed(range(n)):
        j = randoms[i]
        result[i], result[j] = result[j], result[i]
    return result


@functools.cache
def _decoder() -> Any:
    import jax

    @functools.partial(jax.jit, donate_argnums=(0,))
    def decode(encoded: Any) -> Batch:
        return Batch(encoded >> 1, (encoded & 1) == 1)

    return decode


class SeqaxStyleLoader:
    """``load(step)`` returns ``Batch(targets uint32[batch, len], is_seq_start bool[...])``."""

    def __init__(
        self,
        path: str,
        split: str,
        *,
        seq_len: int,
        batch: int,
        streams: int,
        read_blocks_per_shuffle_buffer: int,
        sequences_per_read_block: int,
        seed: int = 0,
        sequence_packing: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        import jax
        import zarr

        # zarr's union types: untyped here
        group: Any = zarr.open_group(path, mode="r", storage_options=storage_options)[split]
        self.encoded_tokens: Any = group["encoded_tokens"]
        self.seq_starts: Any = group["seq_starts"]
        self.seq_len, self.batch, self.streams = seq_len, batch, streams
        self.rbpsb, self.spb = read_blocks_per_shuffle_buffer, sequences_per_read_block
        self.seed, self.packing = seed, sequence_packing
        tokens = self.encoded_tokens.shape[0]
        seq_count = tokens // seq_len if sequence_packing else self.seq_starts.shape[0] - 1
        self.read_block_count = seq_count // self.spb // streams * streams
        if self.read_block_count == 0:
            raise ValueError(f"{path}: fewer than {streams} read blocks of {self.spb} sequences")
        self.step_count = self.read_block_count * self.spb // batch
        self.minipoch_count = -(-self.read_block_count // (streams * self.rbpsb))
        self.seqs_per_buffer = self.rbpsb * self.spb
        if batch % streams:
            raise ValueError(f"batch {batch} is not a multiple of streams {streams}")
        self.rows_per_stream = batch // streams
        self.sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self.block_order = random_permutation(seed, self.read_block_count)
        self.buffers: dict[int, tuple[int, np.ndarray] | None] = dict.fromkeys(range(streams))

    def first_step(self, minipoch: int) -> int:
        """The first step that serves a row of ``minipoch`` (a boundary step)."""
        return minipoch * self.seqs_per_buffer // self.rows_per_stream

    def load(self, step: int) -> Batch:
        import jax

        if not 0 <= step < self.step_count:
            raise IndexError(f"step {step} not in [0, {self.step_count})")
        rows = []
        for b in range(self.batch):
            stream = b // self.rows_per_stream
            q = step * self.rows_per_stream + b % self.rows_per_stream
            buffer = self._buffer(stream, q // self.seqs_per_buffer)
            rows.append(buffer[q % self.seqs_per_buffer])
        shape = (self.batch, self.seq_len)
        encoded = jax.make_array_from_callback(
            shape, self.sharding, lambda index: np.stack(rows)[index]
        )
        return _decoder()(encoded)

    def _buffer(self, stream: int, minipoch: int) -> np.ndarray:
        held = self.buffers[stream]
        if held is not None and held[0] == minipoch:
            return held[1]
        self.buffers[stream] = None  # free the old buffer before reading the new one
        blocks = min(self.rbpsb, self.read_block_count // self.streams - self.rbpsb * minipoch)
        ids = [
            int(self.block_order[(minipoch * self.rbpsb + j) * self.streams + stream])
            for j in range(blocks)
        ]
        with ThreadPoolExecutor(max_workers=len(ids)) as pool:
            buffer = np.concatenate(list(pool.map(self._read_block, ids)), axis=0)
        seed = self.seed + 1 + minipoch * self.streams + stream
        buffer = buffer[random_permutation(seed, blocks * self.spb), :]
        self.buffers[stream] = (minipoch, buffer)
        return buffer

    def _read_block(self, block: int) -> np.ndarray:
        first, stop = block * self.spb, (block + 1) * self.spb
        if self.packing:
            flat = self.encoded_tokens[first * self.seq_len : stop * self.seq_len]
            return flat.reshape(self.spb, self.seq_len)
        starts = self.seq_starts[first : stop + 1]
        flat = self.encoded_tokens[int(starts[0]) : int(starts[-1])]
        result = np.ones((self.spb, self.seq_len), np.uint32)  # pads decode to (0, start)
        for i in range(self.spb):
            lo, hi = int(starts[i] - starts[0]), int(starts[i + 1] - starts[0])
            row = flat[lo:hi][: self.seq_len]
            result[i, : len(row)] = row
        return result
