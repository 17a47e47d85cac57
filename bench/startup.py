"""Startup: what importing asyncflat and constructing a loader cost a fresh process.

A child process (so nothing is imported yet) times ``import asyncflat``, the first
``ShufflingLoader`` construction on a local store (jax already initialised, as in a trainer),
then ``--repeat`` more constructions in the same process (the warm figure: what a trainer that
builds a loader per epoch or per evaluation pays), and whether typeguard was imported on the
way. Prints one JSON line.

Target (issue 14): constructing a loader <= 50 ms on a warm process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_dir, emit

CHILD = r"""
import json, statistics, sys, time
t0 = time.perf_counter(); c0 = time.process_time()
import asyncflat
import_s, import_cpu_s = time.perf_counter() - t0, time.process_time() - c0
import jax
sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
params = asyncflat.FlatTokensParams(sys.argv[1], 2, 4, 64, seed=0, sequence_packing=True)
batch = asyncflat.TokenBatchParams(len=128, batch=16)
times = []
for _ in range(1 + int(sys.argv[2])):
    t0 = time.perf_counter()
    loader = asyncflat.ShufflingLoader("train", params, batch, sharding)
    times.append(time.perf_counter() - t0)
    loader.close()
print(json.dumps({
    "import_s": round(import_s, 4),
    "import_cpu_s": round(import_cpu_s, 4),
    "first_construct_s": round(times[0], 4),
    "warm_construct_median_s": round(statistics.median(times[1:]), 4),
    "warm_construct_min_s": round(min(times[1:]), 4),
    "typeguard_imported": "typeguard" in sys.modules,
    "unittest_mock_imported": "unittest.mock" in sys.modules,
}))
"""


def ensure_store() -> str:
    import numpy as np

    import asyncflat

    path = bench_dir() / "startup-small.zarr"
    if not path.exists():
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, 50_000, int(n)) for n in rng.integers(1, 600, 4000)]
        asyncflat.write_flat_tokens(str(path), {"train": seqs}, chunk_tokens=1 << 16)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5, help="warm constructions")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes")
    args = parser.parse_args()
    path = ensure_store()
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    runs = []
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.runs):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, path, str(args.repeat)],
                capture_output=True,
                text=True,
                check=True,
                env=env,
                cwd=cwd,
            )
            runs.append(__import__("json").loads(out.stdout.strip().splitlines()[-1]))
    figures = {key: [r[key] for r in runs] for key in runs[0]}
    figures["target_construct_s"] = 0.05
    figures["meets_target"] = max(figures["warm_construct_median_s"]) <= 0.05
    emit(figures)


if __name__ == "__main__":
    main()
