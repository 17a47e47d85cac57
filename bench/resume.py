"""Resume: time to the first batch of a fresh loader started mid-minipoch, vs a whole fill.

A resumed job builds a new loader and asks for step k in the middle of a minipoch. The engine
fetches the blocks holding step k's rows first and returns as soon as those are in; the
reference (prefetch off here) fills the whole buffer first. Both pay for fresh buffer memory.
Runs for streams=1 and streams=8 (the reference setup otherwise). Prints one JSON line.

Target: time to first batch <= 1/8 of a whole fill.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REFERENCE_TOKENS, emit, ensure_dataset

LEN, BATCH, SPB, RBPSB = 2048, 64, 512, 64


def first_batch_s(
    path: str, streams: int, prefetch: bool, step: int | None = None
) -> tuple[float, int, float]:
    import jax

    import asyncflat

    params = asyncflat.FlatTokensParams(path, streams, RBPSB, SPB, seed=0, sequence_packing=True)
    options = asyncflat.EngineOptions(prefetch=prefetch)
    with asyncflat.ShufflingLoader(
        "train", params, asyncflat.TokenBatchParams(LEN, BATCH), options=options
    ) as loader:
        plan = loader.plan
        if step is None:
            step = (
                plan.first_step(min(2, plan.minipoch_count - 1))
                + plan.seqs_per_buffer // plan.rows_per_stream_step // 3
            )
        t0 = time.perf_counter()
        jax.block_until_ready(loader.load(step))
        elapsed = time.perf_counter() - t0
        blocks_needed = sum(
            len(
                np.unique(
                    plan.row_permutation(s, m)[
                        plan.locate(step).position[plan.locate(step).stream == s]
                    ]
                    // SPB
                )
            )
            for s in range(streams)
            for m in set(plan.minipochs_of_step(step))
        )
        blocks_total = (
            sum(plan.blocks_in_minipoch(m) for m in set(plan.minipochs_of_step(step))) * streams
        )
    return elapsed, step, blocks_needed / blocks_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=REFERENCE_TOKENS)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    path = ensure_dataset("seqax", args.tokens)
    figures: dict = {"bench": "resume", "tokens": args.tokens}
    # Warm-up: imports, jit, numba, page cache, and this VM's first touch of the memory the
    # buffers will use (~0.7 s per 256 MiB the first time a guest page is used; see
    # docs/benchmarks.md), which would otherwise land in whichever run comes first.
    for streams in (1, 8):
        for prefetch in (True, False):
            first_batch_s(path, streams, prefetch)
    for streams in (1, 8):
        resume, fill = [], []
        for _ in range(args.repeats):
            t, step, fraction = first_batch_s(path, streams, True)
            resume.append(t)
            fill.append(first_batch_s(path, streams, False, step)[0])
        r, f = float(np.median(resume)), float(np.median(fill))
        figures[f"streams_{streams}"] = {
            "step": step,
            "first_batch_s": round(r, 4),
            "whole_fill_s": round(f, 4),
            "ratio": round(r / f, 3),
            "blocks_needed_fraction": round(fraction, 3),
            "meets_target": r <= f / 8,
        }
    emit(figures)


if __name__ == "__main__":
    main()
