"""Startup: what importing asyncflat and constructing a loader cost a fresh process.

A child process (so nothing is imported yet) times ``import asyncflat``, ``import jax`` (and its
backend), then naming ``asyncflat.ShufflingLoader`` (the package is lazy: this imports the
loader's modules: ``loader_import_s``), the first construction on a local store in seqax's
layout (``first_construct_s``: imports done), then ``--repeat`` more constructions in the same
process (the warm figure: what a trainer that builds a loader per epoch or per evaluation pays).
It reports whether construction imported a cloud client or zarr (it should not, on a local
store), the threads running after construction, and the modules whose own import time is
largest on the way (``-X importtime``, after ``import jax``).

Two cases: ``bytecode`` (asyncflat's modules loaded from cached bytecode, as an installed
package's are) and ``source`` (every module compiled as it is imported: what this VM does,
where PYTHONDONTWRITEBYTECODE is set, to a checkout). Prints one JSON line.

Target (issues 14 and 36): constructing a loader, imports done, <= 50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bytecode_env, emit, ensure_dataset

CHILD = r"""
import json, statistics, sys, threading, time
t0 = time.perf_counter()
import asyncflat
import_s = time.perf_counter() - t0
import jax
sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
params = asyncflat.FlatTokensParams(sys.argv[1], 1, 128, 64, seed=0, sequence_packing=True)
batch = asyncflat.TokenBatchParams(len=2048, batch=16)
before = set(sys.modules)
t0 = time.perf_counter()
ShufflingLoader = asyncflat.ShufflingLoader
loader_import_s = time.perf_counter() - t0
CLIENTS = ("zarr", "numcodecs", "fsspec", "s3fs", "gcsfs", "obstore", "aiohttp", "botocore",
           "aiobotocore", "google", "numba", "typeguard")
times = []
for i in range(1 + int(sys.argv[2])):
    t0 = time.perf_counter()
    loader = ShufflingLoader("train", params, batch, sharding)
    times.append(time.perf_counter() - t0)
    if i == 0:
        threads = sorted(t.name for t in threading.enumerate())
        clients = sorted({m.split(".")[0] for m in set(sys.modules) - before} & set(CLIENTS))
        loader.load(0)
    loader.close()
print(json.dumps({
    "import_s": import_s,
    "loader_import_s": loader_import_s,
    "first_construct_s": times[0],
    "warm_construct_s": statistics.median(times[1:]),
    "threads_after_construct": threads,
    "clients_imported": clients,
}))
"""


def run(path: str, repeat: int, env: dict[str, str], cwd: str, *, importtime: bool) -> dict:
    """One fresh process's figures; with ``importtime``, only its import breakdown (the flag's
    own bookkeeping slows every import)."""
    flags = ["-X", "importtime"] if importtime else []
    out = subprocess.run(
        [sys.executable, *flags, "-c", CHILD, path, str(repeat)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=cwd,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    if importtime:
        return {"top_imports_after_jax_ms": top_imports(out.stderr)}
    return figures


def top_imports(log: str, count: int = 8) -> dict[str, float]:
    """The modules imported after ``jax`` (the loader's own) with the largest self time."""
    rows = [line.split("|") for line in log.splitlines() if line.startswith("import time:")]
    names = [row[2].strip() for row in rows]
    after = names.index("jax") + 1 if "jax" in names else 0
    own = [(int(row[0].split(":")[1]), row[2].strip()) for row in rows[after:]]
    return {name: round(us / 1e3, 2) for us, name in sorted(own, reverse=True)[:count]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="warm constructions")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per case")
    parser.add_argument("--tokens", type=int, default=1 << 25, help="the local store's size")
    args = parser.parse_args()
    path = ensure_dataset("seqax", args.tokens)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, base.get("PYTHONPATH")]))
    cases = {
        "bytecode": bytecode_env(base),
        "source": {**base, "PYTHONDONTWRITEBYTECODE": "1"},
    }
    cases["source"].pop("PYTHONPYCACHEPREFIX", None)
    figures: dict = {"store": "seqax layout (zarr 2, 4M-token chunks), 64 MiB buffer"}
    with tempfile.TemporaryDirectory() as cwd:
        for case, env in cases.items():
            runs = [run(path, args.repeat, env, cwd, importtime=False) for _ in range(args.runs)]
            median = {
                key: round(statistics.median(r[key] for r in runs), 4)
                for key in ("import_s", "loader_import_s", "first_construct_s", "warm_construct_s")
            }
            median["imports_done_construct_s"] = round(
                median["loader_import_s"] + median["first_construct_s"], 4
            )
            median["threads_after_construct"] = runs[0]["threads_after_construct"]
            median["clients_imported"] = runs[0]["clients_imported"]
            median.update(run(path, 1, env, cwd, importtime=True))
            figures[case] = median
    figures["target_construct_s"] = 0.05
    figures["meets_target"] = figures["bytecode"]["imports_done_construct_s"] <= 0.05
    emit(figures)


if __name__ == "__main__":
    main()
