"""Frame fuzzer: mutated chunk objects through open, sharded inner chunks and inspect.

Hypothesis mutates one object of a small valid store (a zarr-2 Blosc ``seq_starts`` chunk, a
zarr-2 Blosc token chunk, or a zarr-3 shard: its inner Blosc frames or its index) by flipping
bytes, rewriting Blosc header fields and block offsets, truncating or extending it. Each case
runs in a child process whose address space may grow by at most 1 GiB after start-up, which
opens the split, reads every token through the guarded store (zarr's codec pipeline, shard
inner chunks included), and runs ``describe_split`` and ``verify_split``. Asserted: the child
exits normally (no signal, no hang), its peak RSS stays bounded, and each read either returns
exactly the bytes zarr decodes from the same (mutated) objects or raises an AsyncflatError
(``CorruptChunkError`` for bytes that fail the gate).

``ASYNCFLAT_FUZZ_EXAMPLES`` sets the number of cases (20 by default, for CI).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import asyncflat

pytestmark = pytest.mark.timeout(3600)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("ASYNCFLAT_FUZZ_EXAMPLES", "20"))
RSS_LIMIT_KIB = 700 * 1024

CHILD = r"""
import json, resource, sys
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
import asyncio, numpy as np, zarr
import asyncflat
from asyncflat.errors import AsyncflatError
from asyncflat.format.split import open_split
from asyncflat.inspection import describe_split, verify_split
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
path = sys.argv[1]
out = {}

def outcome(fn):
    try:
        return {"ok": fn()}
    except AsyncflatError as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:400]}
    except BaseException as exc:
        return {"foreign": type(exc).__name__, "message": str(exc)[:400]}

async def guarded_read():
    from asyncflat.source.zarr_source import ZarrTokenSource

    source = await ZarrTokenSource.open(path, "train")
    try:
        tokens = await source.read_tokens(0, source.token_count)
        starts = await source.read_seq_starts(0, source.sequence_count + 1)
    finally:
        await source.aclose()
    return tokens, starts

def read():
    tokens, starts = asyncio.run(guarded_read())
    # The gate passed every object read: zarr may decode them unguarded, for comparison.
    ref_t = zarr.open_array(path + "/train/encoded_tokens", mode="r")[:]
    ref_s = zarr.open_array(path + "/train/seq_starts", mode="r")[:]
    return bool(np.array_equal(tokens, ref_t) and np.array_equal(starts, ref_s))

out["read"] = outcome(read)
out["describe"] = outcome(lambda: describe_split(path, "train").token_count)
out["verify"] = outcome(lambda: verify_split(path, "train").token_count)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the (large) pytest parent.
out["maxrss_kib"] = int(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')))
print("RESULT " + json.dumps(out), flush=True)
"""


def _sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 1000, size=int(n)) for n in rng.integers(4, 60, size=60)]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz-bases")
    seqs = _sequences()
    out = {}
    for name, kwargs in {
        "v2": dict(zarr_format=2, chunk_tokens=256),
        "sharded": dict(chunk_tokens=64, shard_tokens=256),
    }.items():
        out[name] = root / f"{name}.zarr"
        asyncflat.write_flat_tokens(out[name], {"train": seqs, "validation": seqs[:5]}, **kwargs)
    return out


def _target(base: Path, kind: str) -> Path:
    if kind == "v2-seq_starts":
        return base / "train" / "seq_starts" / "0"
    if kind == "v2-tokens":
        return base / "train" / "encoded_tokens" / "1"
    return base / "train" / "encoded_tokens" / "c" / "1"


def _inner_frames(data: bytes) -> list[tuple[int, int]]:
    entries = np.frombuffer(data[-68:-4], "<u8").reshape(-1, 2)
    return [(int(o), int(n)) for o, n in entries if int(o) != (1 << 64) - 1]


def _reindex(data: bytes) -> bytes:
    import google_crc32c

    table = data[-68:-4]
    return data[:-4] + struct.pack("<I", google_crc32c.value(table))


mutations = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(
        st.just("field"),
        st.sampled_from([2, 3, 4, 8, 12]),
        st.sampled_from([0, 1, 7, 255, 1 << 16, 1 << 20, 1 << 29, 1 << 30, (1 << 31) - 1]),
    ),
    st.tuples(st.just("bstart"), st.integers(0, 64), st.integers(-(1 << 31), (1 << 31) - 1)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 16), st.just(0)),
    st.tuples(st.just("extend"), st.integers(1, 4096), st.integers(0, 255)),
    st.tuples(st.just("index"), st.integers(0, 7), st.integers(0, (1 << 64) - 1)),
)


def _mutate(data: bytes, kind: str, mutation: tuple[str, int, int]) -> bytes:
    op, a, b = mutation
    frames = [(0, len(data))] if kind != "sharded" else _inner_frames(data)
    start, length = frames[a % len(frames)] if frames else (0, len(data))
    buf = bytearray(data)
    if op == "byte":
        buf[start + a % max(length, 1)] = b
    elif op == "field":
        width = 1 if a in (2, 3) else 4
        buf[start + a : start + a + width] = (b % (1 << (8 * width))).to_bytes(width, "little")
    elif op == "bstart":
        pos = start + 16 + 4 * (a % 8)
        if pos + 4 <= start + length:
            buf[pos : pos + 4] = struct.pack("<i", b)
    elif op == "truncate":
        return bytes(buf[: a % max(len(buf), 1)])
    elif op == "extend":
        return bytes(buf) + bytes([b]) * a
    elif op == "index" and kind == "sharded":
        pos = len(buf) - 68 + 8 * (a % 8)
        buf[pos : pos + 8] = struct.pack("<Q", b)
        return _reindex(bytes(buf))
    if kind == "sharded" and op in ("byte", "field", "bstart"):
        return bytes(buf)  # inner frames changed; the index (and its checksum) still hold
    return bytes(buf)


def _run(path: Path) -> dict[str, Any]:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {path} hung")
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-3000:]}"
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # a case costs a process: report it, no shrinking
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kind=st.sampled_from(["v2-seq_starts", "v2-tokens", "sharded"]),
    mutation=mutations,
)
def test_mutated_objects_never_crash_exhaust_or_lie(
    bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, kind: str, mutation: Any
) -> None:
    base = bases["v2" if kind.startswith("v2") else "sharded"]
    path = tmp_path_factory.mktemp("case") / "d.zarr"
    shutil.copytree(base, path)
    target = _target(path, kind)
    target.write_bytes(_mutate(target.read_bytes(), kind, mutation))
    report = _run(path)
    assert report["maxrss_kib"] <= RSS_LIMIT_KIB, report
    for action in ("read", "describe", "verify"):
        result = report[action]
        assert "foreign" not in result, (action, kind, mutation, result)
        if "ok" in result and action == "read":
            assert result["ok"] is True, (kind, mutation, "guarded bytes differ from zarr's")
    shutil.rmtree(path.parent, ignore_errors=True)
