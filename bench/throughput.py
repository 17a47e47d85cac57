"""Loader-only throughput over a whole epoch (no train step), jax arrays included.

Iterates every step of the reference setup (2^28 tokens, len 2048, batch 64, 256 MiB buffers)
through ``loader.iter()`` with prefetch on and off, and reports tokens/s with the batches built
as sharded jax arrays on 8 CPU devices. Prints one JSON line.

Target: >= 150M tokens/s (the reference: 35M; boundaries dominate it).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REFERENCE_TOKENS, emit, ensure_dataset


def epoch(path: str, layout_streams: int, prefetch: bool) -> dict:
    import jax

    import asyncflat

    params = asyncflat.FlatTokensParams(
        path, layout_streams, 64, 512, seed=0, sequence_packing=True
    )
    options = asyncflat.EngineOptions(prefetch=prefetch)
    with asyncflat.ShufflingLoader(
        "train", params, asyncflat.TokenBatchParams(2048, 64), options=options
    ) as loader:
        gc.collect()
        gc.freeze()
        t0 = time.perf_counter()
        last = None
        for _, batch in loader.iter():
            last = batch
        jax.block_until_ready(last)
        elapsed = time.perf_counter() - t0
        steps = loader.step_count
    gc.unfreeze()
    return {
        "tokens_per_s": round(steps * 64 * 2048 / elapsed / 1e6, 1),
        "seconds": round(elapsed, 2),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=REFERENCE_TOKENS)
    parser.add_argument("--layout", default="seqax", choices=["seqax", "aligned"])
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    path = ensure_dataset(args.layout, args.tokens)
    epoch(path, 1, True)  # warm-up: page cache, jit, numba
    on, off = epoch(path, 1, True), epoch(path, 1, False)
    emit(
        {
            "bench": "throughput",
            "tokens": args.tokens,
            "layout": args.layout,
            "unit": "M tokens/s",
            "prefetch_on": on,
            "prefetch_off": off,
            "target_m_tokens_per_s": 150,
            "meets_target": on["tokens_per_s"] >= 150,
        }
    )


if __name__ == "__main__":
    main()
