"""Runs the direct Blosc decoder (and then zarr's) on fuzzed frames, in its own process.

Reads a JSON list of cases from stdin (``frame`` hex, ``first``, ``n``, ``expected``) and writes
one JSON line per case and phase, flushed at once, so that if the process dies of a signal the
parent knows which case killed it: ``{"phase": "ours", "i": 3, "ok": "<hex>"}`` or
``{"phase": "ours", "i": 3, "error": "CorruptChunkError: ..."}``, then the same for
``"zarr"`` (numcodecs' whole-frame decode, the oracle).

``asyncflat/storage/blosc.py`` is loaded by its path, without the package (whose ``__init__``
imports jax: seconds per process). Its ``BloscError`` is what the reader turns into
``CorruptChunkError`` naming the object (``ZarrTokenSource._decode``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    from numcodecs import Blosc

    path = Path(__file__).parent.parent.parent / "asyncflat" / "storage" / "blosc.py"
    spec = importlib.util.spec_from_file_location("_fuzzed_blosc", path)
    assert spec is not None and spec.loader is not None
    blosc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(blosc)

    cases = json.load(sys.stdin)
    for i, case in enumerate(cases):
        frame = np.frombuffer(bytes.fromhex(case["frame"]), np.uint8).copy()
        out = np.empty(case["n"], np.uint32)
        try:
            blosc.decode_into(frame, case["first"], out, case["expected"])
            line = {"phase": "ours", "i": i, "ok": out.tobytes().hex()}
        except blosc.BloscError as exc:
            line = {"phase": "ours", "i": i, "error": f"BloscError: {exc}"}
        except Exception as exc:  # not an AsyncflatError: the parent fails the case
            line = {"phase": "ours", "i": i, "error": f"UNEXPECTED {type(exc).__name__}: {exc}"}
        print(json.dumps(line), flush=True)
    for i, case in enumerate(cases):
        frame = np.frombuffer(bytes.fromhex(case["frame"]), np.uint8).copy()
        try:
            data = bytes(Blosc().decode(frame))
            print(json.dumps({"phase": "zarr", "i": i, "ok": data.hex()}), flush=True)
        except Exception as exc:
            print(json.dumps({"phase": "zarr", "i": i, "error": repr(exc)}), flush=True)


if __name__ == "__main__":
    main()
