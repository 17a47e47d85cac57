"""A synthetic split: sequence boundaries and token ids as pure functions of a seed and an index.

Nothing is stored: any range of ``encoded_tokens`` or ``seq_starts`` is computed in time
proportional to its length, wherever it lies in the split, so a split of 10^14 tokens costs
nothing until a chunk of it is read.

The rules (frozen: a seed names the same data in every version):

* **Sequence boundaries.** Sequences come in groups of :data:`GROUP` (64). Group ``g`` covers
  the tokens ``[g*64*L, (g+1)*64*L)``, where ``L`` is the mean length. With ``min_length ==
  L`` every sequence is ``L`` tokens long. Otherwise sequence ``j`` of group ``g`` starts at
  ``g*64*L + j*min_length + c[g, j]``, where ``c[g, 0] = 0`` and ``c[g, 1:]`` are 63 sorted
  seeded uniform draws from ``[0, 64*(L - min_length)]``: lengths are ``min_length`` plus the
  spacings of uniform points (about exponential), with mean ``L`` exactly per group. The last
  sequence ends at the split's end (it may be shorter than ``min_length``).
* **Token ids.** The id at position ``p`` is a seeded 32-bit hash of ``p`` modulo
  ``vocab_size``, except position 0, which is ``vocab_size - 1``, so ``max_token_id`` is known
  without a scan. Uniform ids compress about 2x under Blosc's bitshuffle, as text-like ids do.
  With a ``period`` the hash is of ``p % period``: the ids repeat (a chunk-sized period makes
  every chunk's ids alike, so chunks with alike boundaries encode alike, once).
"""

from __future__ import annotations

import numpy as np

__all__ = ["GROUP", "SyntheticSplit"]

#: Sequences per group: each group's boundaries are drawn from its own seeded numbers.
GROUP = 64


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of a uint64 array (a new array; wraps as uint64 arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def key_of(*parts: int) -> int:
    """A 64-bit key mixed from integers (the seed, a split's number, a purpose)."""
    key = np.zeros(1, np.uint64)
    for part in parts:
        key = mix64(key ^ np.uint64(part & 0xFFFFFFFFFFFFFFFF))
    return int(key[0])


class SyntheticSplit:
    """One split's data: ``tokens`` tokens in sequences of mean ``length`` (at least
    ``min_length``), ids below ``vocab_size``, all drawn from ``key``. ``period`` (0: none):
    the ids repeat every ``period`` positions (position 0 keeps ``vocab_size - 1``)."""

    def __init__(
        self,
        *,
        tokens: int,
        length: int,
        min_length: int,
        vocab_size: int,
        key: int,
        period: int = 0,
    ) -> None:
        self.tokens, self.length, self.min_length = tokens, length, min_length
        self.period = period
        self.vocab_size = vocab_size
        self.spread = GROUP * (length - min_length)  # the cut points' range, per group
        self._cut_key = np.uint64(key_of(key, 1))
        self._id_key = key_of(key, 2)
        group_tokens = GROUP * length
        full, rest = divmod(tokens, group_tokens)
        partial = 0
        if rest:
            starts = self._group_starts(np.array([full], np.uint64))[0]
            partial = int(np.count_nonzero(starts < np.uint64(tokens)))
        self.sequence_count = full * GROUP + partial
        self.max_token_id = vocab_size - 1 if tokens else 0

    # -- boundaries ----------------------------------------------------------------------------

    def _group_starts(self, groups: np.ndarray) -> np.ndarray:
        """Starts of every sequence of ``groups`` (uint64 [len(groups), GROUP])."""
        base = groups[:, None] * np.uint64(GROUP * self.length)
        offsets = np.arange(GROUP, dtype=np.uint64) * np.uint64(self.min_length)
        starts = base + offsets
        if self.spread:
            index = groups[:, None] * np.uint64(GROUP) + np.arange(1, GROUP, dtype=np.uint64)
            cuts = mix64(np.bitwise_xor(index, self._cut_key)) % np.uint64(self.spread + 1)
            cuts.sort(axis=1)
            starts[:, 1:] += cuts
        return starts

    def seq_starts(self, first: int, stop: int) -> np.ndarray:
        """``seq_starts[first:stop]`` (uint64): the starts of those sequences, and the token
        count for entry ``sequence_count``."""
        stop = min(stop, self.sequence_count + 1)
        if stop <= first:
            return np.empty(0, np.uint64)
        last_seq = min(stop, self.sequence_count)  # sequences, not the final entry
        out = np.empty(stop - first, np.uint64)
        if last_seq > first:
            groups = np.arange(first // GROUP, (last_seq - 1) // GROUP + 1, dtype=np.uint64)
            flat = self._group_starts(groups).reshape(-1)
            skip = first - (first // GROUP) * GROUP
            out[: last_seq - first] = flat[skip : skip + last_seq - first]
        if stop == self.sequence_count + 1:
            out[-1] = self.tokens
        return out

    def starts_between(self, begin: int, end: int) -> np.ndarray:
        """Positions in ``[begin, end)`` where a sequence starts (uint64, sorted)."""
        if end <= begin:
            return np.empty(0, np.uint64)
        group_tokens = GROUP * self.length
        groups = np.arange(begin // group_tokens, (end - 1) // group_tokens + 1, dtype=np.uint64)
        starts = self._group_starts(groups).reshape(-1)
        return starts[(starts >= np.uint64(begin)) & (starts < np.uint64(min(end, self.tokens)))]

    # -- tokens --------------------------------------------------------------------------------

    def token_ids(self, begin: int, end: int) -> np.ndarray:
        """Token ids of positions ``[begin, end)`` (uint32)."""
        end = min(end, self.tokens)
        pieces = [np.empty(0, np.uint32)]
        low = begin
        while low < end:  # one piece per period (with ``period``): each is hashed from its start
            high = min(end, (low // self.period + 1) * self.period) if self.period else end
            at = low % self.period if self.period else low
            pieces.append(self._hashed(at, at + high - low))
            low = high
        out = pieces[-1] if len(pieces) == 2 else np.concatenate(pieces)
        if begin == 0 and out.size:
            out[0] = self.vocab_size - 1
        return out

    def _hashed(self, begin: int, end: int) -> np.ndarray:
        out = np.empty(max(end - begin, 0), np.uint32)
        low = begin
        while low < end:  # one segment per 2**32 positions: the hash is 32-bit
            high = min(end, (low >> 32 << 32) + (1 << 32))
            segment = out[low - begin : high - begin]
            np.add(np.arange(high - low, dtype=np.uint32), np.uint32(low & 0xFFFFFFFF), out=segment)
            segment ^= np.uint32(key_of(self._id_key, low >> 32) & 0xFFFFFFFF)
            _hash32(segment)
            np.remainder(segment, np.uint32(self.vocab_size), out=segment)
            low = high
        return out

    def encoded(self, begin: int, end: int) -> np.ndarray:
        """``encoded_tokens[begin:end]`` (uint32): ``2*id``, plus 1 at a sequence start."""
        codes = self.token_ids(begin, end)
        codes <<= np.uint32(1)
        starts = self.starts_between(begin, begin + codes.size)
        codes[(starts - np.uint64(begin)).astype(np.intp)] |= np.uint32(1)
        return codes

    def sequences(self, first: int, stop: int) -> list[np.ndarray]:
        """The token ids of sequences ``[first, stop)``, one array each (for writing the same
        data with the writer, or checking what a loader served)."""
        bounds = self.seq_starts(first, min(stop, self.sequence_count) + 1)
        if bounds.size < 2:
            return []
        ids = self.token_ids(int(bounds[0]), int(bounds[-1]))
        cuts = (bounds[1:-1] - bounds[0]).astype(np.intp)
        return np.split(ids, cuts)


def _hash32(x: np.ndarray) -> None:
    """A 32-bit integer hash (Wellons' lowbias32), in place."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
