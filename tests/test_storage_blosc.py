"""Blosc frames alone: partial decodes match whole ones, layouts locate blocks, bad frames fail."""

from __future__ import annotations

import numpy as np
import pytest
from numcodecs import Blosc

from asyncflat.storage import blosc, gate

pytestmark = pytest.mark.skipif(not blosc.AVAILABLE, reason="this numcodecs exports no c-blosc")

DATA = (np.arange(200_000, dtype="<u4") * 2654435761 % 50_000).astype("<u4")


def frame_of(data: np.ndarray, **codec: object) -> np.ndarray:
    encoded = Blosc(**{"cname": "lz4", "shuffle": Blosc.BITSHUFFLE, "blocksize": 16384, **codec})
    return np.frombuffer(encoded.encode(data), np.uint8).copy()


@pytest.mark.parametrize(("first", "n"), [(0, 200_000), (0, 10), (4095, 3), (123_456, 50_000)])
def test_decode_into_matches_the_data(first: int, n: int) -> None:
    out = np.empty(n, np.uint32)
    blosc.decode_into(frame_of(DATA), first, out)
    np.testing.assert_array_equal(out, DATA[first : first + n])


def test_a_layout_locates_the_blocks_of_a_range() -> None:
    frame = frame_of(DATA)
    layout = blosc.FrameLayout(frame[:16].tobytes())
    lo, hi = layout.offsets_range
    layout.offsets = frame[lo:hi].view("<i4").copy()
    first, n = 70_000, 100
    start, stop = layout.items_range(first, n)
    assert stop - start < len(frame) // 10  # just the blocks holding the items
    sparse = layout.sparse_frame([(start, frame[start:stop].tobytes())])
    out = np.empty(n, np.uint32)
    blosc.decode_into(sparse, first, out)
    np.testing.assert_array_equal(out, DATA[first : first + n])
    with pytest.raises(blosc.BloscError, match="requested"):
        layout.items_range(199_990, 20)


def layout_of(frame: np.ndarray) -> blosc.FrameLayout:
    layout = blosc.FrameLayout(frame[:16].tobytes())
    lo, hi = layout.offsets_range
    layout.offsets = frame[lo:hi].view("<i4").copy()
    return layout


def blocks_reversed(frame: np.ndarray) -> np.ndarray:
    """The same frame with its compressed blocks stored last first (as c-blosc's threads may
    write them: a block's end is the next block start after it, not the next in the table)."""
    layout = layout_of(frame)
    offsets = layout.offsets
    assert offsets is not None
    ends = [*offsets[1:].tolist(), len(frame)]
    assert list(offsets) == sorted(offsets)  # written in order by one thread
    out, position, moved = [frame[: layout.offsets_range[1]]], layout.offsets_range[1], {}
    for block in reversed(range(len(offsets))):
        moved[block] = position
        out.append(frame[offsets[block] : ends[block]])
        position += ends[block] - offsets[block]
    result = np.concatenate(out)
    table = np.array([moved[b] for b in range(len(offsets))], "<i4")
    result[16 : layout.offsets_range[1]] = table.view(np.uint8)
    return result


@pytest.mark.parametrize("order", ["in-order", "reversed"])
@pytest.mark.parametrize(
    "codec",
    [
        {},
        {"cname": "zstd", "shuffle": Blosc.SHUFFLE, "typesize": 8},
        {"cname": "zlib", "shuffle": Blosc.BITSHUFFLE, "typesize": 3},
    ],
    ids=["lz4-bitshuffle", "zstd-shuffle-ts8", "zlib-ts3"],
)
def test_a_range_frame_holds_just_the_blocks_of_its_items_and_decodes_them_exactly(
    order: str, codec: dict[str, object]
) -> None:
    """A fill's read of part of a chunk is decoded from a compact frame (header, block table
    moved to the blocks read, those blocks): never an anonymous mapping the size of the chunk."""
    frame = frame_of(DATA, **codec)
    if order == "reversed":
        frame = blocks_reversed(frame)
        full = np.empty(len(DATA), np.uint32)
        blosc.decode_into(frame, 0, full)
        np.testing.assert_array_equal(full, DATA)  # still a valid frame
    layout = layout_of(frame)
    assert layout.nblocks > 4
    for first, n in [(70_000, 100), (0, 4096), (16_000, 40_000), (199_000, 1000), (0, 200_000)]:
        start, stop = layout.items_range(first, n)
        compact, at = layout.range_frame(start, stop)
        assert at == layout.offsets_range[1]
        assert len(compact) == at + stop - start  # the bytes read and the table, no more
        compact[at:] = frame[start:stop]
        assert blosc.frame_problem(compact) is None
        out = np.full(n + 2, 0xDEADBEEF, np.uint32)
        blosc.decode_into(compact, first, out[1:-1], DATA.nbytes)
        np.testing.assert_array_equal(out[1:-1], DATA[first : first + n])
        assert out[0] == out[-1] == 0xDEADBEEF
    with pytest.raises(blosc.BloscError, match="not compressed blocks"):
        layout.range_frame(0, 100)  # the header is not a block


def test_an_uncompressed_frame_gets_a_sparse_range_frame() -> None:
    """Stored uncompressed, items keep their own offsets: the frame keeps its size (a mapping
    whose untouched pages are never resident)."""
    noise = np.random.default_rng(0).integers(0, 2**32, 50_000, dtype=np.uint64).astype("<u4")
    frame = frame_of(noise, shuffle=Blosc.NOSHUFFLE, cname="lz4", clevel=0)
    layout = blosc.FrameLayout(frame[:16].tobytes())
    assert layout.memcpyed
    start, stop = layout.items_range(1000, 10)
    sparse, at = layout.range_frame(start, stop)
    assert (len(sparse), at) == (len(frame), start)
    sparse[at : at + stop - start] = frame[start:stop]
    out = np.empty(10, np.uint32)
    blosc.decode_into(sparse, 1000, out)
    np.testing.assert_array_equal(out, noise[1000:1010])


def test_damaged_frames_are_errors_not_reads_out_of_bounds() -> None:
    frame = frame_of(DATA)
    out = np.empty(10, np.uint32)
    with pytest.raises(blosc.BloscError, match="compressed bytes"):
        blosc.decode_into(frame[: len(frame) // 2].copy(), 0, out)
    with pytest.raises(blosc.BloscError):
        blosc.decode_into(frame[:8].copy(), 0, out)
    with pytest.raises(blosc.BloscError, match="decodes to"):
        blosc.decode_into(frame, 199_995, out)
    assert blosc.frame_problem(frame) is None
    assert "object has" in (blosc.frame_problem(frame[:-1].copy()) or "")
    with pytest.raises(blosc.BloscError):
        blosc.FrameLayout(b"\x02\x01\x00\x00" + bytes(12))  # typesize 0


# -- frames written with any typesize (zarr writes these for uint32 too) --------------------------


@pytest.mark.parametrize("typesize", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("shuffle", [Blosc.NOSHUFFLE, Blosc.SHUFFLE, Blosc.BITSHUFFLE])
def test_any_typesize_decodes_exactly_the_items_asked_for(typesize: int, shuffle: int) -> None:
    """typesize 8 used to make c-blosc write past ``out`` (a double free), typesize 1 to be
    reported corrupt: item counts are now in the frame's own units, buffers sized here."""
    frame = frame_of(DATA, typesize=typesize, shuffle=shuffle)
    assert frame[3] == typesize
    expected = DATA.nbytes
    for first, n in [(0, len(DATA)), (0, 10), (1, 3), (4095, 3), (123_457, 50_001), (199_999, 1)]:
        out = np.full(n + 2, 0xDEADBEEF, np.uint32)  # guard items on both sides
        blosc.decode_into(frame, first, out[1:-1], expected)
        np.testing.assert_array_equal(out[1:-1], DATA[first : first + n])
        assert out[0] == out[-1] == 0xDEADBEEF


def test_a_frame_not_understood_goes_to_zarrs_decoder() -> None:
    frame = frame_of(DATA)
    # A reserved flag bit: the fast path does not claim to know this layout.
    odd = frame.copy()
    odd[2] |= 0x08
    with pytest.raises(blosc.Unsupported):
        blosc.check_frame(odd, DATA.nbytes)
    # A frame that decodes to another size than the chunk's is not trusted to size anything.
    with pytest.raises(blosc.BloscError, match="chunk has"):
        blosc.check_frame(frame, DATA.nbytes + 4)
    # A frame for zarr's decoder passes the size checks first (c-blosc trusts them there too).
    odd[12:16] = np.frombuffer(np.uint32(len(odd) * 100).tobytes(), np.uint8)
    with pytest.raises(blosc.BloscError, match="compressed bytes"):
        blosc.decode_into(odd, 0, np.empty(10, np.uint32), DATA.nbytes)
    out = np.empty(10, np.uint32)
    with pytest.raises(blosc.BloscError, match="chunk has"):
        blosc.decode_into(frame, 0, out, DATA.nbytes + 4)


def test_block_offsets_outside_the_frame_are_errors() -> None:
    frame = frame_of(DATA)
    bad = frame.copy()
    bad[16:20] = np.frombuffer(np.int32(len(frame) + 1000).tobytes(), np.uint8)
    with pytest.raises(blosc.BloscError, match="outside the frame"):
        blosc.decode_into(bad, 0, np.empty(10, np.uint32), DATA.nbytes)
    layout = blosc.FrameLayout(frame[:16].tobytes(), DATA.nbytes)
    lo, hi = layout.offsets_range
    with pytest.raises(blosc.BloscError, match="outside the frame"):
        layout.offsets = bad[lo:hi].view("<i4").copy()


@pytest.mark.parametrize("back", [1, 2, 3])
def test_a_block_starting_in_a_frames_last_bytes_is_refused_by_ranged_reads_too(back: int) -> None:
    """A block begins with its 4-byte compressed size, so one that starts in the frame's last 3
    bytes is damage (c-blosc would read past the frame). The gate refuses it in a whole
    object; a ranged read's layout (header and table only) must refuse it too."""
    frame = frame_of(DATA)
    bad = frame.copy()
    bad[16:20] = np.frombuffer(np.int32(len(frame) - back).tobytes(), np.uint8)
    with pytest.raises(gate.ChunkRejected, match="outside the object's compressed blocks"):
        gate.check_blosc(bad, DATA.nbytes, exact=True)
    layout = blosc.FrameLayout(frame[:16].tobytes(), DATA.nbytes)
    lo, hi = layout.offsets_range
    with pytest.raises(blosc.BloscError, match="outside the frame"):
        layout.offsets = bad[lo:hi].view("<i4").copy()
    layout.offsets = frame[lo:hi].view("<i4").copy()  # the frame as written is accepted


def test_a_range_reaching_a_partial_last_item_needs_the_whole_frame() -> None:
    """With typesize 3, a 16 KiB chunk ends in a byte short of a whole item: only a decode of the
    whole frame yields it, so a range reaching it spans every block and counts as whole-frame
    work (never decoded inline on the loop as if it were one block)."""
    data = (np.arange(4096, dtype="<u4") // 16).astype("<u4")  # compressible: blocks, no memcpy
    frame = frame_of(data, typesize=3, blocksize=1000)
    layout = blosc.FrameLayout(frame[:16].tobytes())
    assert not layout.memcpyed and layout.nblocks > 1
    lo, hi = layout.offsets_range
    layout.offsets = frame[lo:hi].view("<i4").copy()
    assert layout.decoded_span(0, 10) < data.nbytes  # its own blocks
    assert layout.decoded_span(4086, 10) == data.nbytes
    start, stop = layout.items_range(4086, 10)
    assert (start, stop) == (hi, len(frame))
    sparse = layout.sparse_frame([(start, frame[start:stop].tobytes())])
    out = np.empty(10, np.uint32)
    blosc.decode_into(sparse, 4086, out)
    np.testing.assert_array_equal(out, data[4086:])


def test_a_frame_is_checked_once_for_all_the_ranges_decoded_from_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fill decodes several read blocks of one chunk: the header and block table are checked
    at the first, and every range still decodes right; a frame that fails its check is never
    taken as checked (each decode raises); one left to zarr's decoder is checked once per decode,
    not twice."""
    from asyncflat.storage.chunks import Frame

    calls = []
    real = blosc.check_frame
    monkeypatch.setattr(blosc, "check_frame", lambda *a: calls.append(1) or real(*a))
    frame = Frame(frame_of(DATA), 0, "c/0", blosc=True, nbytes=DATA.nbytes)
    for first in range(0, 200_000, 25_000):
        out = np.empty(25_000, np.uint32)
        frame.decode_into(first, out)
        np.testing.assert_array_equal(out, DATA[first : first + 25_000])
    assert len(calls) == 1

    bad = frame_of(DATA)
    bad[12:16] = np.frombuffer((len(bad) + 1).to_bytes(4, "little"), np.uint8)  # cbytes lies
    broken = Frame(bad, 0, "c/1", blosc=True, nbytes=DATA.nbytes)
    for _ in range(2):
        with pytest.raises(blosc.BloscError, match="compressed bytes"):
            broken.decode_into(0, np.empty(10, np.uint32))
    assert len(calls) == 3

    odd = frame_of(DATA)
    odd[2] |= 0x08  # a reserved flag: zarr's decoder (which refuses this one)
    unsupported = Frame(odd, 0, "c/2", blosc=True, nbytes=DATA.nbytes)
    for _ in range(2):
        with pytest.raises(blosc.BloscError, match="zarr's Blosc codec"):
            unsupported.decode_into(0, np.empty(10, np.uint32))
    assert len(calls) == 5
