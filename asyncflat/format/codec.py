"""The token codec: ``2*id + 1`` at a sequence start, ``2*id`` elsewhere (pure numpy).

A flat-tokens dataset is a zarr group holding the groups ``train`` and ``validation``. Each split
stores every sequence back to back in one 1-D array, so a read of any token range is one slice:

* ``encoded_tokens`` (uint32, 1-D): ``2*id + 1`` for the first token of a sequence, ``2*id``
  for the others. Sequence boundaries travel with the tokens, so a packed row needs no side table.
* ``seq_starts`` (uint64, 1-D): ``sequence_count + 1`` increasing offsets into
  ``encoded_tokens``; the first is 0 and the last is the token count. Sequence ``i`` is
  ``encoded_tokens[seq_starts[i]:seq_starts[i+1]]``.
* the split group's attribute ``max_token_id``: the largest token id (inclusive), so a model can
  size its vocabulary without scanning the data.

Token ids are below 2**31, so ``2*id + 1`` fits in uint32.

Worked example: sequences ``[5, 6]`` and ``[7]`` encode to ``encoded_tokens = [11, 12, 15]`` and
``seq_starts = [0, 2, 3]``; decoding gives ``targets = [5, 6, 7]`` and
``is_seq_start = [True, False, True]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from asyncflat.errors import ConfigError

__all__ = [
    "CHUNK_TOKENS_MAX",
    "MANY_CHUNKS",
    "METADATA_FILES",
    "MIN_CHUNK_ELEMENTS",
    "SPLITS",
    "TOKEN_ID_LIMIT",
    "decode",
    "encode_sequences",
]

SPLITS: tuple[str, str] = ("train", "validation")

#: Token ids must be strictly below this, so that ``2*id + 1`` fits in a uint32.
TOKEN_ID_LIMIT: int = 1 << 31

#: The most tokens a chunk that is written may hold: Blosc encodes at most ``2**31 - 1`` bytes
#: less its 16-byte header (numcodecs refuses a larger buffer, after the chunk was gathered).
CHUNK_TOKENS_MAX: int = (2**31 - 1 - 16) // 4

#: An array of more chunks than this must have chunks of at least ``MIN_CHUNK_ELEMENTS``: a read
#: costs zarr (and the engine) one Python object per chunk, so a huge array of tiny chunks would
#: make memory grow with the array, not with what is read.
MANY_CHUNKS: int = 1 << 16
MIN_CHUNK_ELEMENTS: int = 1 << 12

#: The zarr metadata documents a store may hold (format 3, then format 2's), by file name.
METADATA_FILES: frozenset[str] = frozenset(
    {"zarr.json", ".zgroup", ".zarray", ".zattrs", ".zmetadata"}
)

# --------------------------------------------------------------------------------------------
# Encoding and decoding (pure numpy)
# --------------------------------------------------------------------------------------------


def encode_sequences(seqs: Iterable[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Encode ragged token-id sequences into ``(encoded_tokens, lengths)``.

    ``seqs`` is an iterable of 1-D integer array-likes (lists, numpy arrays), or a 2-D integer
    numpy array whose rows are the sequences (the fully vectorised path, for packed data).
    Returns ``encoded`` (uint32, the sequences concatenated and encoded) and ``lengths``
    (uint64, one per sequence; a cumulative sum of them extends ``seq_starts``).

    Every sequence must be non-empty: a zero-length sequence would make ``seq_starts`` repeat an
    offset, and a reader padding it would serve a row of nothing but padding. Ids must be
    integers in ``[0, 2**31)``. Violations raise :class:`ConfigError` naming the sequence.
    """
    if isinstance(seqs, np.ndarray) and seqs.ndim == 2:
        if seqs.shape[1] == 0 and seqs.shape[0] > 0:
            raise ConfigError("sequence 0 is empty: flat-tokens sequences must have >= 1 token")
        _check_integer_dtype(seqs.dtype, "sequences")
        _check_id_range(seqs.reshape(-1), "sequences")
        ids = seqs.reshape(-1).astype(np.uint32)  # a fresh copy, encoded in place below
        lengths = np.full(seqs.shape[0], seqs.shape[1], dtype=np.uint64)
        return _encode_concatenated(ids, lengths), lengths

    arrays: list[np.ndarray] = []
    for i, seq in enumerate(seqs):
        arr = np.asarray(seq)
        if arr.ndim != 1:
            hint = " (to append one sequence, pass a list holding it)" if arr.ndim == 0 else ""
            raise ConfigError(f"sequence {i} must be 1-D, got shape {arr.shape}{hint}")
        if arr.size == 0:
            raise ConfigError(f"sequence {i} is empty: flat-tokens sequences must have >= 1 token")
        _check_integer_dtype(arr.dtype, f"sequence {i}")
        arrays.append(arr)
    if not arrays:
        return np.empty(0, np.uint32), np.empty(0, np.uint64)

    # Range-check once per integer kind on a concatenation, not once per sequence: a Python-level
    # min/max per short sequence would dominate. Signed and unsigned are kept apart because
    # numpy promotes int64 with uint64 to float64, which would lose ids.
    for kind, wide in (("i", np.int64), ("u", np.uint64)):
        same_kind = [a for a in arrays if a.dtype.kind == kind]
        if same_kind:
            _check_id_range(np.concatenate(same_kind, dtype=wide), "sequences", arrays=arrays)
    # Every id is now known to fit, so the unsafe cast cannot change a value.
    ids = np.concatenate(arrays, dtype=np.uint32, casting="unsafe")
    lengths = np.fromiter((a.size for a in arrays), dtype=np.uint64, count=len(arrays))
    return _encode_concatenated(ids, lengths), lengths


def decode(encoded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split encoded tokens into ``(targets, is_seq_start)``, both the shape of ``encoded``."""
    encoded = np.asarray(encoded, np.uint32)
    # The low bit is written straight into the bool array's bytes (0 or 1, a valid bool): no
    # uint32 temporary and no cast pass, which cost 10x more per batch.
    is_seq_start = np.empty(encoded.shape, np.bool_)
    np.bitwise_and(encoded, np.uint32(1), out=is_seq_start.view(np.uint8), casting="unsafe")
    return encoded >> np.uint32(1), is_seq_start


def _encode_concatenated(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Encode ``ids`` in place (a fresh, range-checked uint32 array) and return it."""
    encoded = ids
    encoded <<= 1
    if lengths.size:
        starts = np.cumsum(lengths, dtype=np.uint64) - lengths
        encoded[starts.astype(np.intp)] |= 1
    return encoded


def _check_integer_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.kind not in "iu":
        raise ConfigError(f"{what}: token ids must be integers, got dtype {dtype}")


def _check_id_range(values: np.ndarray, what: str, arrays: list[np.ndarray] | None = None) -> None:
    """Raise ConfigError unless every value is in [0, TOKEN_ID_LIMIT); name the offender."""
    if values.size == 0:
        return
    lo, hi = values.min(), values.max()
    if lo >= 0 and hi < TOKEN_ID_LIMIT:
        return
    bad = int(lo) if lo < 0 else int(hi)
    where = what
    if arrays is not None:  # slow path, only on error: find which sequence holds it
        where = next(
            (f"sequence {i}" for i, a in enumerate(arrays) if a.size and np.any(a == bad)), what
        )
    raise ConfigError(f"{where}: token id {bad} is outside [0, 2**31)")
