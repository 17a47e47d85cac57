"""Blosc frames alone: partial decodes match whole ones, layouts locate blocks, bad frames fail."""

from __future__ import annotations

import numpy as np
import pytest
from numcodecs import Blosc

from asyncflat.storage import blosc

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
