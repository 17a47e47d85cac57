"""Fuzzing the direct Blosc decoder: mutated frames never crash it, never fool it.

Valid frames (typesizes 1/2/4/8/16, every shuffle mode, several compressors and block sizes)
are mutated (header bytes, block-offset table, payload bytes, lengths, with or without the
header's length fixed up to match) and decoded by the fast path in a subprocess, one per batch
of cases. Every case must end with the bytes zarr's own decoder returns for that range, or a
``BloscError`` (which the reader raises as ``CorruptChunkError`` naming the object); a signal (a crash in c-blosc) fails the test naming the case.

CI runs a few hundred cases; ``ASYNCFLAT_FUZZ_EXAMPLES=20000`` runs more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numcodecs import Blosc

from asyncflat.storage import blosc

pytestmark = pytest.mark.skipif(not blosc.AVAILABLE, reason="this numcodecs exports no c-blosc")

ITEMS = 4096
DATA = (np.arange(ITEMS, dtype="<u4") * 2654435761 % 3000).astype("<u4")
EXPECTED = DATA.nbytes
CASES_PER_BATCH = 100
TOTAL = int(os.environ.get("ASYNCFLAT_FUZZ_EXAMPLES", "300"))
WORKER = Path(__file__).parent / "helpers" / "blosc_fuzz_worker.py"


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    typesize = draw(st.sampled_from([1, 2, 4, 8, 16]))
    shuffle = draw(st.sampled_from([Blosc.NOSHUFFLE, Blosc.SHUFFLE, Blosc.BITSHUFFLE]))
    cname = draw(st.sampled_from(["lz4", "zstd", "blosclz", "zlib"]))
    blocksize = draw(st.sampled_from([0, 256, 1024, 4096]))
    frame = bytearray(
        Blosc(
            cname=cname, clevel=5, shuffle=shuffle, blocksize=blocksize, typesize=typesize
        ).encode(DATA)
    )
    nblocks = 0 if frame[2] & 0x2 else -(-EXPECTED // int.from_bytes(frame[8:12], "little"))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["header", "table", "payload", "int32"]))
        if kind == "header":
            frame[draw(st.integers(0, 15))] = draw(st.integers(0, 255))
        elif kind == "table" and nblocks:
            at = 16 + 4 * draw(st.integers(0, nblocks - 1))
            value = draw(
                st.one_of(
                    st.integers(-(2**31), 2**31 - 1),
                    st.integers(0, len(frame) + 64),
                )
            )
            frame[at : at + 4] = value.to_bytes(4, "little", signed=True)
        elif kind == "int32" and len(frame) > 20:
            at = draw(st.integers(0, len(frame) - 4))
            frame[at : at + 4] = draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little")
        elif len(frame) > 0:
            at = draw(st.integers(0, len(frame) - 1))
            frame[at] ^= draw(st.integers(1, 255))
    length = draw(st.sampled_from(["keep", "truncate", "extend"]))
    if length == "truncate":
        del frame[draw(st.integers(0, max(len(frame) - 1, 0))) :]
    elif length == "extend":
        frame += bytes(draw(st.integers(1, 64)))
    if len(frame) >= 16 and draw(st.booleans()):  # make the header's length agree
        frame[12:16] = len(frame).to_bytes(4, "little")
    first = draw(st.integers(0, ITEMS))
    n = draw(st.integers(1, ITEMS))
    return {"frame": bytes(frame).hex(), "first": first, "n": n, "expected": EXPECTED}


def _phase(phase: str, batch: list[dict[str, Any]], start: int = 0) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, str(WORKER), phase, str(start)],
        input=json.dumps(batch),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "start` out of bounds" in proc.stderr or "stop` out of bounds" in proc.stderr:
        pytest.fail(f"c-blosc was called out of bounds: {proc.stderr[-500:]}")
    lines = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        lines[record["i"]] = record
    return proc.returncode, lines


def _oracle(batch: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """zarr's decode of each case; a case that kills numcodecs counts as rejected by it."""
    results: dict[int, dict[str, Any]] = {}
    start = 0
    while start < len(batch):
        code, lines = _phase("zarr", batch, start)
        results.update(lines)
        missing = [i for i in range(start, len(batch)) if i not in results]
        if not missing:
            break
        results[missing[0]] = {"i": missing[0], "error": f"zarr's decoder died (exit {code})"}
        start = missing[0] + 1
    return results


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # big examples
@settings(
    max_examples=max(1, -(-TOTAL // CASES_PER_BATCH)),
    deadline=None,
    derandomize=TOTAL <= 1000,  # CI: the same cases every run
    suppress_health_check=list(HealthCheck),
)
@given(st.lists(cases(), min_size=CASES_PER_BATCH, max_size=CASES_PER_BATCH))
def test_mutated_frames_decode_to_zarrs_bytes_or_fail_clearly(batch: list[dict[str, Any]]) -> None:
    code, ours = _phase("ours", batch)
    missing = [i for i in range(len(batch)) if i not in ours]
    if missing:
        pytest.fail(f"the decoder died (exit {code}) on {batch[missing[0]]}")
    theirs = _oracle(batch)
    for i, case in enumerate(batch):
        mine = ours[i]
        if "error" in mine:
            # BloscError: what the reader raises as CorruptChunkError naming the object.
            assert mine["error"].startswith("BloscError: "), (mine, case)
            continue
        lo, hi = case["first"] * 4, (case["first"] + case["n"]) * 4
        if "ok" in theirs[i]:
            assert mine["ok"] == theirs[i]["ok"][2 * lo : 2 * hi], case
        else:
            # zarr's decoder rejects the frame; a partial decode touches only the blocks it
            # needs and may still succeed, a whole one must not.
            assert not (lo == 0 and hi == EXPECTED), (case, theirs[i])
