"""Start-up behind a latency-bound wire: every load of the first minipoch, by reads in flight.

The emulated buckets of ``bench/cloud.py`` are CPU-bound on small machines (moto serves 13-25
MB/s on two cores), so the number of reads in flight hardly moves them. This benchmark reads a
:class:`asyncflat.testing.SyntheticFileSystem` instead, whose wire model is the one
``bench/cloud.py``'s proxy models (``--latency-ms`` to first byte, 64 MB/s per request, 150 MB/s
in all) and whose chunks cost no CPU to serve (``repeat_tokens``): what limits a fill is then
latency x reads in flight, as on a real bucket. The layout is bench/cloud.py's default: seqax's
(zarr format 2, one 128 KiB chunk per 16-sequence read block, 384 blocks a buffer, batches of
16 x 2048), 183 MiB of tokens.

For each ``--reads`` setting (``default``: the loader's own, sized from the chunks;
``reference``: the seqax-style loader of bench/seqax_style.py on the same wire), a fresh loader
loads every step of the first minipoch and the first boundary with a ``--step-ms`` train step
between loads, and another resumes in the middle of minipoch 1 (seconds from before its
construction to its first and its 11th batch); settings are interleaved over ``--repeats``,
after one warm-up of each kind of loader. Prints one JSON line: per setting the medians of the
first load, the worst load after step 0 and the worst ordinary one, how many loads of the first
minipoch waited longer than one step, the boundary load, the total wait from construction
through the boundary, the store's peak requests in flight, the resume's first and 11th batch,
and with the reference, ``vs_reference``: issue 36's ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from _common import emit

LEN, SPB, RBPSB, BATCH = 2048, 16, 384, 16
URL = "synthetic://wire"


def _storage(args: argparse.Namespace, counts: Any) -> dict[str, Any]:
    return {
        "tokens": int(args.tokens_mib * 2**20) // 4,
        "chunk_tokens": SPB * LEN,
        "sequence_length": LEN,
        "zarr_format": 2,
        "repeat_tokens": True,
        "latency_s": args.latency_ms / 1e3,
        "connection_bandwidth": 64e6,
        "total_bandwidth": 150e6,
        "counts": counts,
    }


def _loader(setting: str, args: argparse.Namespace, counts: Any) -> Any:
    """A fresh loader: asyncflat with ``setting`` reads in flight (``default``: its own), or the
    seqax-style reference (``reference``), on its own synthetic filesystem (its own wire)."""
    if setting == "reference":
        from seqax_style import SeqaxStyleLoader

        return SeqaxStyleLoader(
            URL,
            "train",
            seq_len=LEN,
            batch=BATCH,
            streams=1,
            read_blocks_per_shuffle_buffer=RBPSB,
            sequences_per_read_block=SPB,
            storage_options=_storage(args, counts),
        )
    from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams

    params = FlatTokensParams(
        URL,
        streams=1,
        read_blocks_per_shuffle_buffer=RBPSB,
        sequences_per_read_block=SPB,
        seed=0,
        sequence_packing=True,
        storage_options=_storage(args, counts),
    )
    reads = None if setting == "default" else int(setting)
    options = EngineOptions(max_concurrent_reads=reads)
    return ShufflingLoader("train", params, TokenBatchParams(len=LEN, batch=BATCH), options=options)


def _timed_loads(loader: Any, steps: range, step_s: float) -> tuple[list[float], list[float]]:
    """Each load's seconds, and the moment (``perf_counter``) each returned."""
    import jax

    loads, returned = [], []
    for step in steps:
        began = time.perf_counter()
        jax.block_until_ready(loader.load(step))
        returned.append(time.perf_counter())
        loads.append(returned[-1] - began)
        time.sleep(step_s)
    return loads, returned


def start_run(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """A fresh loader from construction through the first boundary."""
    from asyncflat.testing import SyntheticCounts

    counts = SyntheticCounts()
    step_s = args.step_ms / 1e3
    began = time.perf_counter()
    loader = _loader(setting, args, counts)
    construct = time.perf_counter() - began
    boundary = loader.first_step(1) if setting == "reference" else loader.plan.first_step(1)
    try:
        loads, _ = _timed_loads(loader, range(boundary + 1), step_s)
    finally:
        if setting != "reference":
            loader.close()
    ordinary = loads[1:boundary]
    return {
        "first_load_s": loads[0],
        "worst_after_step0_s": max(loads[1:]),
        "worst_ordinary_s": max(ordinary),
        "loads_over_a_step": sum(x > step_s for x in ordinary),
        "boundary_s": loads[boundary],
        "wait_to_first_boundary_s": construct + sum(loads),
        "peak_in_flight": counts.max_in_flight,
    }


def resume_run(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """A fresh loader resumed in the middle of minipoch 1: seconds from before its
    construction to its first batch and to its 11th (ten train steps between)."""
    from asyncflat.testing import SyntheticCounts

    step_s = args.step_ms / 1e3
    began = time.perf_counter()
    loader = _loader(setting, args, SyntheticCounts())
    first = loader.first_step(1) if setting == "reference" else loader.plan.first_step(1)
    step = first + RBPSB * SPB // BATCH // 2
    try:
        _, returned = _timed_loads(loader, range(step, step + 11), step_s)
    finally:
        if setting != "reference":
            loader.close()
    return {"first_batch_s": returned[0] - began, "batch11_s": returned[10] - began}


def vs_reference(mine: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Issue 36's ratios on a bucket: the waits to the first boundary (<= 0.5), the resume's
    first and 11th batch (<= 0.2, <= 0.33); and the worst load after step 0 against the
    reference's worst ordinary load (<= 2x, or one step)."""
    return {
        "wait_to_first_boundary": round(
            mine["wait_to_first_boundary_s"] / reference["wait_to_first_boundary_s"], 3
        ),
        "resume_first_batch": round(mine["first_batch_s"] / reference["first_batch_s"], 3),
        "resume_batch11": round(mine["batch11_s"] / reference["batch11_s"], 3),
        "worst_after_step0_vs_their_worst_ordinary": round(
            mine["worst_after_step0_s"] / reference["worst_ordinary_s"], 2
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--reads",
        default="16,32,64,default,reference",
        help="settings, comma-separated: reads in flight, default (the loader's own), "
        "reference (the seqax-style loader)",
    )
    parser.add_argument("--step-ms", type=float, default=10.0, help="simulated train step")
    parser.add_argument("--latency-ms", type=float, default=25.0, help="time to first byte")
    parser.add_argument("--tokens-mib", type=float, default=183.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    settings = args.reads.split(",")
    # Warm up each kind of loader once (imports, jit of the batch's decode, the loop's first
    # start): the first loader of a process pays them, and the runs are compared with each other.
    for kind in {"reference" if s == "reference" else "default" for s in settings}:
        start_run(kind, args)
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):  # interleaved: drifts of the shared machine hit every setting
        for setting in settings:
            run = {**start_run(setting, args), **resume_run(setting, args)}
            print(setting, {k: round(v, 4) for k, v in run.items()}, file=sys.stderr)
            runs.setdefault(setting, []).append(run)
    figures = {
        name: {key: round(statistics.median(r[key] for r in rs), 4) for key in rs[0]}
        for name, rs in runs.items()
    }
    reference = figures.get("reference")
    if reference:
        for name, mine in figures.items():
            if name != "reference":
                mine["vs_reference"] = vs_reference(mine, reference)
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
