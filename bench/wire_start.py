"""Start-up behind a latency-bound wire: every load of the first minipoch, by reads in flight.

The emulated buckets of ``bench/cloud.py`` are CPU-bound on small machines (moto serves 13-25
MB/s on two cores), so the number of reads in flight hardly moves them. This benchmark reads a
:class:`asyncflat.testing.SyntheticFileSystem` instead, whose wire model is the one
``bench/cloud.py``'s proxy models (``--latency-ms`` to first byte, 64 MB/s per request, 150 MB/s
in all) and whose chunks cost no CPU to serve (``repeat_tokens``): what limits a fill is then
latency x reads in flight, as on a real bucket. The layout is bench/cloud.py's default: seqax's
(zarr format 2, one 128 KiB chunk per 16-sequence read block, 384 blocks a buffer, batches of
16 x 2048), 183 MiB of tokens.

For each ``--reads`` setting (``default``: the loader's own, sized from the chunks), a fresh
loader loads every step of the first minipoch and the first boundary with a ``--step-ms``
train step between loads; settings are interleaved over ``--repeats``. Prints one JSON line:
per setting the medians of the first load, the worst load after step 0, how many loads of the
first minipoch waited longer than one step, the boundary load and the total wait from
construction through the boundary, and the store's peak requests in flight.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# This checkout's asyncflat, even when another one (or none) is installed.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from _common import emit

LEN, SPB, RBPSB, BATCH = 2048, 16, 384, 16


def one_run(reads: int | None, args: argparse.Namespace) -> dict[str, Any]:
    import jax

    from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
    from asyncflat.testing import SyntheticCounts

    counts = SyntheticCounts()
    params = FlatTokensParams(
        "synthetic://wire",
        streams=1,
        read_blocks_per_shuffle_buffer=RBPSB,
        sequences_per_read_block=SPB,
        seed=0,
        sequence_packing=True,
        storage_options={
            "tokens": int(args.tokens_mib * 2**20) // 4,
            "chunk_tokens": SPB * LEN,
            "sequence_length": LEN,
            "zarr_format": 2,
            "repeat_tokens": True,
            "latency_s": args.latency_ms / 1e3,
            "connection_bandwidth": 64e6,
            "total_bandwidth": 150e6,
            "counts": counts,
        },
    )
    options = EngineOptions(max_concurrent_reads=reads)
    began = time.perf_counter()
    loader = ShufflingLoader(
        "train", params, TokenBatchParams(len=LEN, batch=BATCH), options=options
    )
    construct = time.perf_counter() - began
    step_s = args.step_ms / 1e3
    with loader:
        boundary = loader.plan.first_step(1)
        loads = []
        for step in range(boundary + 1):
            began = time.perf_counter()
            jax.block_until_ready(loader.load(step))
            loads.append(time.perf_counter() - began)
            time.sleep(step_s)
        limit = loader.stats()["concurrency_limit"]
    ordinary = loads[1:boundary]
    return {
        "reads": limit,
        "first_load_s": loads[0],
        "worst_after_step0_s": max(loads[1:]),
        "loads_over_a_step": sum(x > step_s for x in ordinary),
        "boundary_s": loads[boundary],
        "wait_to_first_boundary_s": construct + sum(loads),
        "peak_in_flight": counts.max_in_flight,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reads", default="16,32,64,default", help="settings, comma-separated")
    parser.add_argument("--step-ms", type=float, default=10.0, help="simulated train step")
    parser.add_argument("--latency-ms", type=float, default=25.0, help="time to first byte")
    parser.add_argument("--tokens-mib", type=float, default=183.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    settings = [None if r == "default" else int(r) for r in args.reads.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):  # interleaved: drifts of the shared machine hit every setting
        for reads in settings:
            run = one_run(reads, args)
            name = "default" if reads is None else str(reads)
            print(name, {k: round(v, 4) for k, v in run.items()}, file=sys.stderr)
            runs.setdefault(name, []).append(run)
    figures = {
        name: {key: round(statistics.median(r[key] for r in rs), 4) for key in rs[0]}
        for name, rs in runs.items()
    }
    emit(
        {
            "bench": "wire_start",
            "step_ms": args.step_ms,
            "latency_ms": args.latency_ms,
            "tokens_mib": args.tokens_mib,
            "wire": "64 MB/s per request, 150 MB/s in all",
            "repeats": args.repeats,
            "reads": figures,
        }
    )


if __name__ == "__main__":
    main()
