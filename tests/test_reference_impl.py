"""Checks of the oracle in tests/reference_impl.py itself.

The oracle is compared with an independent transcription of the seqax reference loader's
algorithm (``ShufflingLoader.load`` / ``_get_shuffle_buffer``: the per-batch-index loop, one cached
buffer per stream, block concatenation, then ``buffer[permutation]``), written here in plain numpy
without jax, and with hand-written non-packed examples.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
from reference_impl import ReferenceLoader, load_split_arrays, slow_permutation

# --------------------------------------------------------------------------------------------
# Independent transcription of the seqax reference (no jax, no sharding: this host owns every
# batch index). Non-packed mode is transcribed with the slicing bug fixed (offsets relative to the
# first sequence of the block, sequences truncated to len).
# --------------------------------------------------------------------------------------------


def _seqax_random_permutation(seed, n):
    randoms = np.random.Philox(seed).random_raw(n) % (np.arange(n, dtype=np.uint64) + 1)
    result = np.arange(n, dtype=np.uint32)
    for i in reversed(range(n)):
        j = randoms[i]
        tmp = result[i]
        result[i] = result[j]
        result[j] = tmp
    return result


class _SeqaxTranscription:
    def __init__(
        self,
        encoded_tokens,
        seq_starts,
        *,
        seq_len,
        batch,
        streams,
        read_blocks_per_shuffle_buffer,
        sequences_per_read_block,
        seed,
        sequence_packing,
    ):
        self.encoded_tokens = encoded_tokens
        self.seq_starts = seq_starts
        self.len = seq_len
        self.batch = batch
        self.streams = streams
        self.rbpsb = read_blocks_per_shuffle_buffer
        self.spb = sequences_per_read_block
        self.seed = seed
        self.packing = sequence_packing
        if sequence_packing:
            self.seq_count = encoded_tokens.shape[0] // seq_len
        else:
            self.seq_count = seq_starts.shape[0] - 1
        read_block_count = self.seq_count // self.spb
        read_block_count = (read_block_count // streams) * streams
        assert read_block_count > 0
        self.read_block_count = read_block_count
        self.step_count = (read_block_count * self.spb) // batch
        self.minipoch_count = -(-read_block_count // (streams * self.rbpsb))
        self.seq_indices_per_shuffle_buffer = self.rbpsb * self.spb
        assert batch % streams == 0
        self.batch_indices_per_stream = batch // streams
        self.batch_indices = list(range(batch))
        self.buffers = dict.fromkeys(range(streams))  # stream -> (minipoch, buffer)
        self.read_block_ordering = _seqax_random_permutation(seed, read_block_count)

    def load(self, step):
        assert step < self.step_count
        seq_by_batch_index = {}
        for batch_index in self.batch_indices:
            stream = batch_index // self.batch_indices_per_stream
            seq_index_in_stream = step * self.batch_indices_per_stream + (
                batch_index % self.batch_indices_per_stream
            )
            minipoch = seq_index_in_stream // self.seq_indices_per_shuffle_buffer
            seq_index_in_shuffle_buffer = seq_index_in_stream % self.seq_indices_per_shuffle_buffer
            seq_by_batch_index[batch_index] = self._get_shuffle_buffer(stream, minipoch)[
                seq_index_in_shuffle_buffer
            ]
        return np.stack([seq_by_batch_index[b] for b in range(self.batch)])

    def _load_read_block(self, read_block_index):
        start_seq = read_block_index * self.spb
        end_seq = start_seq + self.spb
        shape = (self.spb, self.len)
        if self.packing:
            return self.encoded_tokens[start_seq * self.len : end_seq * self.len].reshape(shape)
        starts = self.seq_starts[start_seq : end_seq + 1].astype(np.int64)
        flat = self.encoded_tokens[starts[0] : starts[-1]]
        result = np.ones(shape, dtype=np.uint32)
        for i in range(self.spb):
            a = starts[i] - starts[0]
            e = min(starts[i + 1] - starts[0], a + self.len)
            result[i, : e - a] = flat[a:e]
        return result

    def _get_shuffle_buffer(self, stream, minipoch):
        cached = self.buffers[stream]
        if cached is None or cached[0] != minipoch:
            self.buffers[stream] = None
            blocks = self.rbpsb
            if minipoch == self.minipoch_count - 1:
                blocks = self.read_block_count // self.streams - self.rbpsb * minipoch
            indices = []
            for read_block_in_minipoch in range(blocks):
                sequential = (
                    minipoch * self.rbpsb + read_block_in_minipoch
                ) * self.streams + stream
                indices.append(self.read_block_ordering[sequential])
            buffer = np.concatenate([self._load_read_block(i) for i in indices], axis=0)
            n = blocks * self.spb
            assert buffer.shape == (n, self.len)
            permutation = _seqax_random_permutation(
                self.seed + 1 + minipoch * self.streams + stream, n
            )
            self.buffers[stream] = (minipoch, buffer[permutation, :])
        return self.buffers[stream][1]


# --------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------


def _random_dataset(rng, token_count, mean_seq_len=5):
    """Random encoded tokens with random sequence boundaries (first token of each sequence odd)."""
    ids = rng.integers(0, 1 << 31, size=token_count, dtype=np.uint64)
    lengths = []
    total = 0
    while total < token_count:
        n = int(rng.integers(1, 2 * mean_seq_len))
        n = min(n, token_count - total)
        lengths.append(n)
        total += n
    seq_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64)
    is_start = np.zeros(token_count, dtype=np.uint64)
    is_start[seq_starts[:-1].astype(np.int64)] = 1
    encoded = (2 * ids + is_start).astype(np.uint32)
    return encoded, seq_starts


def _identity_dataset(token_count):
    """encoded token at flat index i is 2*i (+1 every 7th token), so every row is recognisable."""
    i = np.arange(token_count, dtype=np.uint64)
    encoded = (2 * i + (i % 7 == 0)).astype(np.uint32)
    seq_starts = np.arange(0, token_count + 1, 7, dtype=np.uint64)
    if seq_starts[-1] != token_count:
        seq_starts = np.append(seq_starts, np.uint64(token_count))
    return encoded, seq_starts


# (seq_len, batch, streams, rbpsb, spb, seq_count_target, extra_tokens)
PACKED_CASES = [
    # streams=1, seqs_per_buffer=6 not a multiple of bips=4, short last minipoch (11 blocks, 4/buffer)
    dict(seq_len=5, batch=4, streams=1, rbpsb=4, spb=3, seqs=34, extra=3),
    # streams=2, bips=3, seqs_per_buffer=4: batches straddle minipochs; 5 blocks/stream, 2/buffer
    dict(seq_len=4, batch=6, streams=2, rbpsb=2, spb=2, seqs=21, extra=1),
    # streams=4, bips=2, seqs_per_buffer=3 (odd), 3 blocks/stream, 2/buffer -> last minipoch 1 block
    dict(seq_len=3, batch=8, streams=4, rbpsb=2, spb=1, seqs=13, extra=2),
    # streams=4, bips=1, seqs_per_buffer=15, 4 blocks/stream, 3/buffer
    dict(seq_len=8, batch=4, streams=4, rbpsb=3, spb=5, seqs=83, extra=7),
    # streams=2, bips=5, seqs_per_buffer=7 (coprime with 5), 9 blocks/stream, 1/buffer
    dict(seq_len=2, batch=10, streams=2, rbpsb=1, spb=7, seqs=130, extra=0),
    # one single minipoch, batch larger than buffer per stream
    dict(seq_len=6, batch=16, streams=2, rbpsb=8, spb=2, seqs=33, extra=5),
]


def _make(loader_cls, encoded, seq_starts, case, seed, packing):
    return loader_cls(
        encoded,
        seq_starts,
        seq_len=case["seq_len"],
        batch=case["batch"],
        streams=case["streams"],
        read_blocks_per_shuffle_buffer=case["rbpsb"],
        sequences_per_read_block=case["spb"],
        seed=seed,
        sequence_packing=packing,
    )


# --------------------------------------------------------------------------------------------
# Permutation
# --------------------------------------------------------------------------------------------

GOLDEN_PERMUTATIONS = {
    (0, 1): [0],
    (0, 2): [0, 1],
    (0, 10): [0, 4, 6, 5, 2, 1, 9, 3, 7, 8],
    (1, 10): [2, 9, 1, 4, 6, 5, 8, 0, 3, 7],
    (42, 16): [1, 13, 3, 8, 15, 0, 4, 5, 10, 2, 12, 7, 6, 14, 11, 9],
    (12345, 7): [2, 4, 6, 3, 1, 0, 5],
    (2**40 + 3, 12): [8, 5, 2, 11, 4, 7, 0, 9, 10, 6, 1, 3],
}


def test_philox_stream_is_stable():
    raw = np.random.Philox(0).random_raw(3)
    assert raw.tolist() == [259491006799949737, 4754966410622352325, 8698845897610382596]


@pytest.mark.parametrize("key", sorted(GOLDEN_PERMUTATIONS))
def test_permutation_golden(key):
    seed, n = key
    p = slow_permutation(seed, n)
    assert p.dtype == np.uint32
    assert p.tolist() == GOLDEN_PERMUTATIONS[key]


@pytest.mark.parametrize("seed", [0, 1, 7, 123456789, 2**63 - 1])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 100, 1000])
def test_permutation_matches_transcription(seed, n):
    p = slow_permutation(seed, n)
    assert p.dtype == np.uint32 and p.shape == (n,)
    np.testing.assert_array_equal(p, _seqax_random_permutation(seed, n))
    np.testing.assert_array_equal(np.sort(p), np.arange(n, dtype=np.uint32))


# --------------------------------------------------------------------------------------------
# Packed mode vs the transcription
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 5])
@pytest.mark.parametrize(
    "case", PACKED_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
)
def test_packed_matches_seqax_transcription(case, seed):
    rng = np.random.default_rng(1000 * seed + case["seqs"])
    encoded, seq_starts = _random_dataset(rng, case["seqs"] * case["seq_len"] + case["extra"])
    ref = _make(ReferenceLoader, encoded, seq_starts, case, seed, True)
    tr = _make(_SeqaxTranscription, encoded, seq_starts, case, seed, True)

    assert ref.step_count == tr.step_count > 0
    assert ref.read_block_count == tr.read_block_count
    assert ref.minipoch_count == tr.minipoch_count
    for step in range(tr.step_count):
        expected = tr.load(step)
        got = ref.encoded_batch(step)
        assert got.dtype == np.uint32 and got.shape == (case["batch"], case["seq_len"])
        np.testing.assert_array_equal(got, expected, err_msg=f"step {step}")
        targets, is_start = ref.batch(step)
        assert targets.dtype == np.uint32 and is_start.dtype == np.bool_
        np.testing.assert_array_equal(targets, expected >> 1)
        np.testing.assert_array_equal(is_start, (expected & 1) == 1)


def test_cases_exercise_boundaries():
    """The parameter sets really contain straddling batches and a short last minipoch."""
    straddle = short_last = False
    for case in PACKED_CASES:
        bips = case["batch"] // case["streams"]
        spbuf = case["rbpsb"] * case["spb"]
        blocks_per_stream = case["seqs"] // case["spb"] // case["streams"]
        straddle |= spbuf % bips != 0
        short_last |= blocks_per_stream % case["rbpsb"] != 0
    assert straddle and short_last
    assert {c["streams"] for c in PACKED_CASES} >= {1, 2, 4}


@pytest.mark.parametrize(
    "case", PACKED_CASES[:4], ids=lambda c: f"streams{c['streams']}-batch{c['batch']}"
)
def test_random_access_order_does_not_matter(case):
    rng = np.random.default_rng(7)
    encoded, seq_starts = _random_dataset(rng, case["seqs"] * case["seq_len"] + case["extra"])
    seq_ref = _make(ReferenceLoader, encoded, seq_starts, case, 3, True)
    rnd_ref = _make(ReferenceLoader, encoded, seq_starts, case, 3, True)
    steps = list(range(seq_ref.step_count))
    expected = [seq_ref.encoded_batch(s) for s in steps]
    for s in rng.permutation(steps):
        np.testing.assert_array_equal(rnd_ref.encoded_batch(int(s)), expected[s])


def test_step_out_of_range():
    case = PACKED_CASES[0]
    encoded, seq_starts = _identity_dataset(case["seqs"] * case["seq_len"])
    ref = _make(ReferenceLoader, encoded, seq_starts, case, 0, True)
    with pytest.raises(IndexError):
        ref.encoded_batch(ref.step_count)
    with pytest.raises(IndexError):
        ref.batch(-1)


# --------------------------------------------------------------------------------------------
# Every sequence of the used blocks is served exactly once per epoch
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 9])
@pytest.mark.parametrize(
    "case", PACKED_CASES, ids=lambda c: f"streams{c['streams']}-batch{c['batch']}"
)
def test_packed_each_row_served_once(case, seed):
    L = case["seq_len"]
    encoded, seq_starts = _identity_dataset(case["seqs"] * L + case["extra"])
    ref = _make(ReferenceLoader, encoded, seq_starts, case, seed, True)
    used_rows = ref.read_block_count * case["spb"]
    counts = collections.Counter()
    for step in range(ref.step_count):
        enc = ref.encoded_batch(step)
        # Recover the row id from the tokens themselves (token at flat index i encodes i).
        flat_index = (enc >> 1).astype(np.int64)
        row = flat_index[:, 0] // L
        np.testing.assert_array_equal(flat_index, row[:, None] * L + np.arange(L)[None, :])
        np.testing.assert_array_equal(row, ref.row_ids(step))
        counts.update(row.tolist())
    assert max(counts.values()) == 1
    assert all(0 <= r < used_rows for r in counts)
    served = ref.step_count * case["batch"]
    assert len(counts) == served
    if used_rows % case["batch"] == 0:
        assert sorted(counts) == list(range(used_rows))


def test_packed_each_row_served_once_full_epoch():
    """A case where batch divides the used rows: the epoch is exactly the used rows."""
    case = dict(seq_len=4, batch=6, streams=3, rbpsb=2, spb=4, seqs=77, extra=2)
    encoded, seq_starts = _identity_dataset(case["seqs"] * case["seq_len"] + case["extra"])
    ref = _make(ReferenceLoader, encoded, seq_starts, case, 11, True)
    assert ref.read_block_count == 18 and ref.step_count == 12 and ref.minipoch_count == 3
    ids = np.concatenate([ref.row_ids(s) for s in range(ref.step_count)])
    assert sorted(ids.tolist()) == list(range(72))


# --------------------------------------------------------------------------------------------
# Non-packed mode
# --------------------------------------------------------------------------------------------

# Six sequences of lengths 1, 3, 5, 2, 7, 4. Token ids: sequence k holds 10k+1, 10k+2, ...
# encoded = 2*id+1 for the first token of a sequence, 2*id otherwise.
HAND_SEQUENCES = [
    [2 * 1 + 1],
    [2 * 11 + 1, 2 * 12, 2 * 13],
    [2 * 21 + 1, 2 * 22, 2 * 23, 2 * 24, 2 * 25],
    [2 * 31 + 1, 2 * 32],
    [2 * 41 + 1, 2 * 42, 2 * 43, 2 * 44, 2 * 45, 2 * 46, 2 * 47],
    [2 * 51 + 1, 2 * 52, 2 * 53, 2 * 54],
]
# The same sequences truncated to len=4 and padded with 1, written out by hand.
HAND_ROWS = [
    [3, 1, 1, 1],
    [23, 24, 26, 1],
    [43, 44, 46, 48],
    [63, 64, 1, 1],
    [83, 84, 86, 88],
    [103, 104, 106, 108],
]


# seed 0: block_order = [0, 4, 3, 5, 2, 1], buffer permutation (seed 1) = [2, 0, 1, 4, 3, 5].
GOLDEN_HAND_ORDER_SEED0 = [3, 0, 4, 2, 5, 1]


def _hand_dataset():
    encoded = np.array(list(itertools.chain.from_iterable(HAND_SEQUENCES)), dtype=np.uint32)
    seq_starts = np.concatenate([[0], np.cumsum([len(s) for s in HAND_SEQUENCES])]).astype(
        np.uint64
    )
    assert seq_starts.tolist() == [0, 1, 4, 9, 11, 18, 22]
    return encoded, seq_starts


def test_hand_rows_are_truncated_padded_sequences():
    for seq, row in zip(HAND_SEQUENCES, HAND_ROWS):
        expected = (seq + [1] * 4)[:4]
        assert row == expected


@pytest.mark.parametrize("seed", [0, 3, 17])
@pytest.mark.parametrize("batch", [1, 2, 3, 6])
def test_non_packed_hand_example_one_minipoch(seed, batch):
    encoded, seq_starts = _hand_dataset()
    ref = ReferenceLoader(
        encoded,
        seq_starts,
        seq_len=4,
        batch=batch,
        streams=1,
        read_blocks_per_shuffle_buffer=6,
        sequences_per_read_block=1,
        seed=seed,
        sequence_packing=False,
    )
    assert ref.read_block_count == 6 and ref.minipoch_count == 1 and ref.step_count == 6 // batch
    block_order = slow_permutation(seed, 6)
    perm = slow_permutation(seed + 1, 6)
    served = []
    for step in range(ref.step_count):
        enc = ref.encoded_batch(step)
        assert enc.shape == (batch, 4) and enc.dtype == np.uint32
        for b in range(batch):
            position = step * batch + b
            expected = HAND_ROWS[block_order[perm[position]]]
            assert enc[b].tolist() == expected
            served.append(tuple(enc[b].tolist()))
        targets, is_start = ref.batch(step)
        np.testing.assert_array_equal(targets, enc >> 1)
        np.testing.assert_array_equal(is_start, (enc & 1) == 1)
    assert collections.Counter(served) == collections.Counter(tuple(r) for r in HAND_ROWS)


def test_non_packed_hand_example_golden_order():
    """Seed 0: block_order and buffer permutation give this served order (frozen)."""
    encoded, seq_starts = _hand_dataset()
    ref = ReferenceLoader(
        encoded,
        seq_starts,
        seq_len=4,
        batch=2,
        streams=1,
        read_blocks_per_shuffle_buffer=6,
        sequences_per_read_block=1,
        seed=0,
        sequence_packing=False,
    )
    block_order = slow_permutation(0, 6).tolist()
    perm = slow_permutation(1, 6).tolist()
    assert block_order == [0, 4, 3, 5, 2, 1] and perm == [2, 0, 1, 4, 3, 5]
    order = [block_order[perm[p]] for p in range(6)]
    got = np.concatenate([ref.encoded_batch(s) for s in range(3)]).tolist()
    assert got == [HAND_ROWS[k] for k in order]
    assert got == [HAND_ROWS[k] for k in GOLDEN_HAND_ORDER_SEED0]


@pytest.mark.parametrize("seed", [0, 4])
def test_non_packed_hand_example_two_minipochs(seed):
    """rbpsb=4 over 6 blocks: minipoch 0 has 4 blocks, the last one 2; batch 3 straddles them."""
    encoded, seq_starts = _hand_dataset()
    ref = ReferenceLoader(
        encoded,
        seq_starts,
        seq_len=4,
        batch=3,
        streams=1,
        read_blocks_per_shuffle_buffer=4,
        sequences_per_read_block=1,
        seed=seed,
        sequence_packing=False,
    )
    assert ref.minipoch_count == 2 and ref.step_count == 2
    block_order = slow_permutation(seed, 6)
    perms = [slow_permutation(seed + 1, 4), slow_permutation(seed + 2, 2)]
    served = np.concatenate([ref.encoded_batch(s) for s in range(2)]).tolist()
    expected = []
    for q in range(6):
        m, position = divmod(q, 4)
        buffer_blocks = [block_order[m * 4 + j] for j in range(4 if m == 0 else 2)]
        expected.append(HAND_ROWS[buffer_blocks[perms[m][position]]])
    assert served == expected
    assert sorted(served) == sorted(HAND_ROWS)


@pytest.mark.parametrize("seed", [0, 2])
def test_non_packed_hand_example_two_streams(seed):
    """streams=2, rbpsb=2, spb=1: stream s gets blocks block_order[(m*2+j)*2+s]."""
    encoded, seq_starts = _hand_dataset()
    ref = ReferenceLoader(
        encoded,
        seq_starts,
        seq_len=4,
        batch=2,
        streams=2,
        read_blocks_per_shuffle_buffer=2,
        sequences_per_read_block=1,
        seed=seed,
        sequence_packing=False,
    )
    assert ref.read_block_count == 6 and ref.minipoch_count == 2 and ref.step_count == 3
    block_order = slow_permutation(seed, 6)
    served = []
    for step in range(3):
        enc = ref.encoded_batch(step)
        for stream in range(2):
            m, position = divmod(step, 2)
            n_blocks = 2 if m == 0 else 1
            blocks = [block_order[(m * 2 + j) * 2 + stream] for j in range(n_blocks)]
            perm = slow_permutation(seed + 1 + m * 2 + stream, n_blocks)
            assert enc[stream].tolist() == HAND_ROWS[blocks[perm[position]]]
            served.append(enc[stream].tolist())
    assert sorted(served) == sorted(HAND_ROWS)


@pytest.mark.parametrize("seed", [0, 8])
@pytest.mark.parametrize(
    "case", PACKED_CASES[:4], ids=lambda c: f"streams{c['streams']}-batch{c['batch']}"
)
def test_non_packed_matches_fixed_transcription(case, seed):
    rng = np.random.default_rng(seed + 77)
    encoded, seq_starts = _random_dataset(rng, case["seqs"] * 6, mean_seq_len=case["seq_len"])
    ref = _make(ReferenceLoader, encoded, seq_starts, case, seed, False)
    tr = _make(_SeqaxTranscription, encoded, seq_starts, case, seed, False)
    assert ref.step_count == tr.step_count > 0
    for step in range(tr.step_count):
        np.testing.assert_array_equal(
            ref.encoded_batch(step), tr.load(step), err_msg=f"step {step}"
        )


def test_non_packed_multiset_over_epoch_random():
    rng = np.random.default_rng(5)
    encoded, seq_starts = _random_dataset(rng, 600, mean_seq_len=6)
    L = 5
    ref = ReferenceLoader(
        encoded,
        seq_starts,
        seq_len=L,
        batch=4,
        streams=2,
        read_blocks_per_shuffle_buffer=3,
        sequences_per_read_block=2,
        seed=1,
        sequence_packing=False,
    )
    used = ref.read_block_count * 2
    expected = []
    for r in range(used):
        seq = encoded[int(seq_starts[r]) : int(seq_starts[r + 1])][:L].tolist()
        expected.append(tuple(seq + [1] * (L - len(seq))))
    served = [tuple(row) for s in range(ref.step_count) for row in ref.encoded_batch(s).tolist()]
    assert used % 4 == 0
    assert collections.Counter(served) == collections.Counter(expected)


# --------------------------------------------------------------------------------------------
# Parameter validation and zarr loading
# --------------------------------------------------------------------------------------------


def test_validation_errors():
    encoded, seq_starts = _identity_dataset(40)
    kw = dict(
        seq_len=4,
        batch=4,
        streams=2,
        read_blocks_per_shuffle_buffer=1,
        sequences_per_read_block=2,
        seed=0,
        sequence_packing=True,
    )
    ReferenceLoader(encoded, seq_starts, **kw)
    with pytest.raises(ValueError):
        ReferenceLoader(encoded, seq_starts, **{**kw, "batch": 3})
    with pytest.raises(ValueError):
        ReferenceLoader(encoded, seq_starts, **{**kw, "sequences_per_read_block": 6})


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_load_split_arrays(tmp_path, zarr_format):
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(0)
    data = {}
    root = zarr.open_group(str(tmp_path / "ds.zarr"), mode="w", zarr_format=zarr_format)
    for split, n in [("train", 1000), ("validation", 300)]:
        encoded, seq_starts = _random_dataset(rng, n)
        g = root.create_group(split)
        a = g.create_array("encoded_tokens", shape=encoded.shape, dtype=np.uint32, chunks=(128,))
        a[:] = encoded
        s = g.create_array("seq_starts", shape=seq_starts.shape, dtype=np.uint64, chunks=(64,))
        s[:] = seq_starts
        g.attrs["max_token_id"] = int((encoded >> 1).max())
        data[split] = (encoded, seq_starts)
    for split, (encoded, seq_starts) in data.items():
        e, s = load_split_arrays(tmp_path / "ds.zarr", split)
        assert e.dtype == np.uint32 and s.dtype == np.uint64
        np.testing.assert_array_equal(e, encoded)
        np.testing.assert_array_equal(s, seq_starts)
        e2, s2 = ReferenceLoader.load_split_arrays(str(tmp_path / "ds.zarr"), split)
        np.testing.assert_array_equal(e2, encoded)
        np.testing.assert_array_equal(s2, seq_starts)
