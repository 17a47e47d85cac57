"""Slow, obvious oracle for the flat-tokens shuffling semantics (the index map of asyncflat.plan.shuffle's docstring).

This module is the test suite's source of truth: the fast library must reproduce its batches
bit for bit. It is written to be easy to check by eye, not to be fast:

* the permutation is a plain Python Fisher-Yates loop;
* a shuffle buffer is built whole with ``np.concatenate`` and cached per (stream, minipoch);
* every batch row is looked up one at a time.

It deliberately imports nothing from ``asyncflat``.

Non-packed mode implements the *intended* semantics (row r = sequence r truncated to ``seq_len``
and right-padded with the value 1), not the seqax reference's slicing bug (which indexes a sliced
token array with absolute offsets and never truncates).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ReferenceLoader", "load_split_arrays", "slow_permutation"]


def slow_permutation(seed: int, n: int) -> np.ndarray:
    """The frozen flat-tokens permutation, as a Python loop.

    ``r = Philox(seed).random_raw(n) % (arange(n) + 1)``; start from ``arange(n)`` and, for i from
    n-1 down to 0, swap items i and r[i].
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n >= 1 << 32:
        raise ValueError(f"n must be < 2**32, got {n}")
    result = np.arange(n, dtype=np.uint32)
    if n == 0:
        return result
    raw = np.random.Philox(int(seed)).random_raw(n)
    randoms = raw % (np.arange(n, dtype=np.uint64) + np.uint64(1))
    for i in range(n - 1, -1, -1):
        j = int(randoms[i])
        tmp = result[i]
        result[i] = result[j]
        result[j] = tmp
    return result


def load_split_arrays(path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Read ``<path>/<split>/{encoded_tokens, seq_starts}`` fully with zarr's sync API."""
    import zarr  # local import: only the tests that touch real stores need it

    root = zarr.open_group(str(path), mode="r")
    group = root[split]
    encoded_tokens = np.asarray(group["encoded_tokens"][:])
    seq_starts = np.asarray(group["seq_starts"][:])
    if encoded_tokens.dtype != np.uint32 or encoded_tokens.ndim != 1:
        raise ValueError(
            f"encoded_tokens must be 1-D uint32, got {encoded_tokens.dtype} {encoded_tokens.shape}"
        )
    if seq_starts.dtype != np.uint64 or seq_starts.ndim != 1:
        raise ValueError(
            f"seq_starts must be 1-D uint64, got {seq_starts.dtype} {seq_starts.shape}"
        )
    return encoded_tokens, seq_starts


class ReferenceLoader:
    """Whole-array, in-memory implementation of the shuffling loader's batch function."""

    load_split_arrays = staticmethod(load_split_arrays)

    def __init__(
        self,
        encoded_tokens: np.ndarray,
        seq_starts: np.ndarray,
        *,
        seq_len: int,
        batch: int,
        streams: int,
        read_blocks_per_shuffle_buffer: int,
        sequences_per_read_block: int,
        seed: int,
        sequence_packing: bool,
    ):
        self.encoded_tokens = np.asarray(encoded_tokens, dtype=np.uint32)
        self.seq_starts = np.asarray(seq_starts, dtype=np.uint64)
        self.seq_len = int(seq_len)
        self.batch_size = int(batch)
        self.streams = int(streams)
        self.rbpsb = int(read_blocks_per_shuffle_buffer)
        self.spb = int(sequences_per_read_block)
        self.seed = int(seed)
        self.sequence_packing = bool(sequence_packing)

        for name, value in [
            ("seq_len", self.seq_len),
            ("batch", self.batch_size),
            ("streams", self.streams),
            ("read_blocks_per_shuffle_buffer", self.rbpsb),
            ("sequences_per_read_block", self.spb),
        ]:
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

        token_count = self.encoded_tokens.shape[0]
        if self.sequence_packing:
            self.seq_count = token_count // self.seq_len
        else:
            self.seq_count = self.seq_starts.shape[0] - 1

        self.read_block_count = (self.seq_count // self.spb // self.streams) * self.streams
        if self.read_block_count <= 0:
            raise ValueError("need at least one read block per stream")
        self.step_count = self.read_block_count * self.spb // self.batch_size
        self.seqs_per_buffer = self.rbpsb * self.spb
        blocks_per_minipoch = self.streams * self.rbpsb
        self.minipoch_count = (
            self.read_block_count + blocks_per_minipoch - 1
        ) // blocks_per_minipoch
        if self.batch_size % self.streams != 0:
            raise ValueError(f"batch {self.batch_size} is not a multiple of streams {self.streams}")
        self.bips = self.batch_size // self.streams

        self.block_order = slow_permutation(self.seed, self.read_block_count)
        self._buffers: dict[tuple[int, int], np.ndarray] = {}
        self._buffer_row_ids: dict[tuple[int, int], np.ndarray] = {}
        self._permutations: dict[tuple[int, int], np.ndarray] = {}

    # --- rows -------------------------------------------------------------------------------

    def row(self, r: int) -> np.ndarray:
        """Row r of the unshuffled (seq_count, seq_len) array."""
        L = self.seq_len
        if self.sequence_packing:
            return self.encoded_tokens[r * L : (r + 1) * L].copy()
        start = int(self.seq_starts[r])
        end = int(self.seq_starts[r + 1])
        seq = self.encoded_tokens[start:end][:L]
        out = np.ones(L, dtype=np.uint32)
        out[: len(seq)] = seq
        return out

    def block_rows(self, block: int) -> np.ndarray:
        rows = [self.row(r) for r in range(block * self.spb, (block + 1) * self.spb)]
        return np.stack(rows)

    # --- buffers ----------------------------------------------------------------------------

    def blocks_in_minipoch(self, minipoch: int) -> int:
        if minipoch == self.minipoch_count - 1:
            return self.read_block_count // self.streams - self.rbpsb * minipoch
        return self.rbpsb

    def buffer_blocks(self, stream: int, minipoch: int) -> list[int]:
        """The read blocks of buffer (stream, minipoch), in concatenation order."""
        return [
            int(self.block_order[(minipoch * self.rbpsb + j) * self.streams + stream])
            for j in range(self.blocks_in_minipoch(minipoch))
        ]

    def buffer_permutation(self, stream: int, minipoch: int) -> np.ndarray:
        key = (stream, minipoch)
        if key not in self._permutations:
            rows_in_buffer = self.blocks_in_minipoch(minipoch) * self.spb
            seed = self.seed + 1 + minipoch * self.streams + stream
            self._permutations[key] = slow_permutation(seed, rows_in_buffer)
        return self._permutations[key]

    def _buffer(self, stream: int, minipoch: int) -> tuple[np.ndarray, np.ndarray]:
        key = (stream, minipoch)
        if key not in self._buffers:
            blocks = self.buffer_blocks(stream, minipoch)
            buf = np.concatenate([self.block_rows(b) for b in blocks], axis=0)
            ids = np.concatenate(
                [np.arange(b * self.spb, (b + 1) * self.spb, dtype=np.int64) for b in blocks]
            )
            assert buf.shape == (len(blocks) * self.spb, self.seq_len)
            self._buffers[key] = buf
            self._buffer_row_ids[key] = ids
        return self._buffers[key], self._buffer_row_ids[key]

    # --- batches ----------------------------------------------------------------------------

    def locate(self, step: int, b: int) -> tuple[int, int, int]:
        """(stream, minipoch, position) of batch index b of step."""
        stream = b // self.bips
        q = step * self.bips + b % self.bips
        return stream, q // self.seqs_per_buffer, q % self.seqs_per_buffer

    def _check_step(self, step: int) -> int:
        step = int(step)
        if not 0 <= step < self.step_count:
            raise IndexError(f"step {step} out of range [0, {self.step_count})")
        return step

    def _served(self, step: int, b: int) -> tuple[np.ndarray, int]:
        stream, minipoch, position = self.locate(step, b)
        buf, ids = self._buffer(stream, minipoch)
        perm = self.buffer_permutation(stream, minipoch)
        k = int(perm[position])
        return buf[k], int(ids[k])

    def encoded_batch(self, step: int) -> np.ndarray:
        step = self._check_step(step)
        rows = [self._served(step, b)[0] for b in range(self.batch_size)]
        return np.stack(rows).astype(np.uint32)

    def row_ids(self, step: int) -> np.ndarray:
        """Unshuffled row index served at each batch index of step."""
        step = self._check_step(step)
        return np.array([self._served(step, b)[1] for b in range(self.batch_size)], dtype=np.int64)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        encoded = self.encoded_batch(step)
        targets = (encoded >> np.uint32(1)).astype(np.uint32)
        is_seq_start = (encoded & np.uint32(1)) == 1
        return targets, is_seq_start
