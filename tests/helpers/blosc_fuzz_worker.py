"""Runs the direct Blosc decoder (and then zarr's) on fuzzed frames, in its own process.

Usage: ``blosc_fuzz_worker.py ours|zarr [START]``. Reads a JSON list of cases from stdin
(``frame`` hex, ``first``, ``n``, ``expected``) and, from case ``START`` on, writes one JSON line
per case, flushed at once, so that if the process dies of a signal the parent knows which case
killed it: ``{"i": 3, "ok": "<hex>"}`` or ``{"i": 3, "error": "BloscError: ..."}``. Phase
``ours`` runs the direct decoder on the requested items; ``zarr`` runs numcodecs' whole-frame
decode (the oracle).

``asyncflat/storage/blosc.py`` is loaded by its path, without the package (whose ``__init__``
imports jax: seconds per process). Its ``BloscError`` is what the reader turns into
``CorruptChunkError`` naming the object (``asyncflat.source.chunk_reader.decode``).
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

    phase = sys.argv[1]
    start = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    cases = json.load(sys.stdin)
    for i, case in enumerate(cases):
        if i < start:
            continue
        frame = np.frombuffer(bytes.fromhex(case["frame"]), np.uint8).copy()
        line: dict[str, object] = {"i": i}
        if phase == "ours":
            out = np.empty(case["n"], np.uint32)
            try:
                blosc.decode_into(frame, case["first"], out, case["expected"])
                line["ok"] = out.tobytes().hex()
            except blosc.BloscError as exc:
                line["error"] = f"BloscError: {exc}"
            except Exception as exc:  # not a BloscError: the parent fails the case
                line["error"] = f"UNEXPECTED {type(exc).__name__}: {exc}"
        else:
            try:
                line["ok"] = bytes(Blosc().decode(frame)).hex()
            except Exception as exc:
                line["error"] = repr(exc)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
