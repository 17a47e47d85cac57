"""Resume: a fresh loader's first batch of a step in the middle of a minipoch, against the
seqax-style reference loader's and against a whole fill, on seqax's layout and on asyncflat's.

A resumed job builds a new loader and asks for step k in the middle of a minipoch. asyncflat
reads just the rows step k needs (the Blosc blocks that hold them) and returns; the reference
(``bench/seqax_style.py``, seqax's way of working) reads, concatenates and permutes the whole
shuffle buffer first; ``whole_fill`` is asyncflat made to wait for its whole buffer
(``EngineOptions(prefetch=False)``, the reference's behaviour on asyncflat's engine). Each figure
is construction plus the first ``load`` until its arrays are ready, in one warm process (imports,
jax and the page cache are warm; ``bench/peers.py`` measures a fresh process's restart), median
of ``--repeats``, the three interleaved so drift hits all alike. Prints one JSON line.

Targets (issue 14): asyncflat <= 1/6 of the reference on seqax's layout, <= 1/8 on asyncflat's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, ensure_dataset

LEN, BATCH, SPB, RBPSB = 2048, 64, 512, 64
TARGETS = {"seqax": 6, "aligned": 8}


def asyncflat_first_batch_s(path: str, step: int, prefetch: bool) -> float:
    import jax

    import asyncflat

    t0 = time.perf_counter()
    params = asyncflat.FlatTokensParams(path, 1, RBPSB, SPB, seed=0, sequence_packing=True)
    options = asyncflat.EngineOptions(prefetch=prefetch)
    with asyncflat.ShufflingLoader(
        "train", params, asyncflat.TokenBatchParams(LEN, BATCH), options=options
    ) as loader:
        jax.block_until_ready(loader.load(step))
        return time.perf_counter() - t0


def reference_first_batch_s(path: str, step: int) -> float:
    import jax
    from seqax_style import SeqaxStyleLoader

    t0 = time.perf_counter()
    reference = SeqaxStyleLoader(
        path,
        "train",
        seq_len=LEN,
        batch=BATCH,
        streams=1,
        read_blocks_per_shuffle_buffer=RBPSB,
        sequences_per_read_block=SPB,
    )
    jax.block_until_ready(tuple(reference.load(step)))
    return time.perf_counter() - t0


def resume_step(path: str) -> int:
    """A step a third of the way into minipoch 1 (or the last minipoch, if there is one)."""
    import asyncflat

    params = asyncflat.FlatTokensParams(path, 1, RBPSB, SPB, seed=0, sequence_packing=True)
    with asyncflat.ShufflingLoader("train", params, asyncflat.TokenBatchParams(LEN, BATCH)) as ld:
        plan = ld.plan
        return plan.first_step(min(1, plan.minipoch_count - 1)) + plan.seqs_per_buffer // BATCH // 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 27)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", default="seqax,aligned")
    args = parser.parse_args()
    figures: dict[str, Any] = {"bench": "resume", "tokens": args.tokens, "unit": "s"}
    for layout in args.layouts.split(","):
        path = ensure_dataset(layout, args.tokens)
        step = resume_step(path)
        # Warm-up: imports, the page cache, and this VM's first touch of buffer-sized memory.
        asyncflat_first_batch_s(path, step, True)
        asyncflat_first_batch_s(path, step, False)
        reference_first_batch_s(path, step)
        runs: dict[str, list[float]] = {"asyncflat": [], "reference": [], "whole_fill": []}
        for _ in range(args.repeats):
            runs["asyncflat"].append(asyncflat_first_batch_s(path, step, True))
            runs["reference"].append(reference_first_batch_s(path, step))
            runs["whole_fill"].append(asyncflat_first_batch_s(path, step, False))
        med = {name: float(np.median(values)) for name, values in runs.items()}
        target = TARGETS[layout]
        figures[layout] = {
            "step": step,
            **{f"{name}_s": round(value, 4) for name, value in med.items()},
            "vs_reference": round(med["asyncflat"] / med["reference"], 3),
            "vs_whole_fill": round(med["asyncflat"] / med["whole_fill"], 3),
            "target_vs_reference": round(1 / target, 3),
            "meets_target": med["asyncflat"] <= med["reference"] / target,
            "asyncflat_all_s": [round(v, 4) for v in runs["asyncflat"]],
            "reference_all_s": [round(v, 4) for v in runs["reference"]],
        }
    emit(figures)


if __name__ == "__main__":
    main()
