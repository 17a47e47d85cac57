"""What the crc32c checksum of format-3 chunks costs a fill: the engine filling buffers from the
same tokens written with and without it (``FlatTokensWriter(checksum=...)``), warm page cache.

Fills alternate between the two stores (A B A B ...) so machine noise hits both alike; the
figure is the best whole fill of each (as ``bench/fill.py`` measures), and their ratio. Prints
one JSON line (GB/s of useful tokens, 1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BLOCK_TOKENS, bench_dir, emit, synthetic_sequences
from fill import LEN, SPB, warm_page_cache

RBPSB = 8  # 8 blocks of 1M tokens per buffer: many fills from a small store


def ensure(tokens: int, checksum: bool) -> str:
    from asyncflat import FlatTokensWriter

    path = bench_dir() / f"checksum-{int(checksum)}-{tokens}.zarr"
    if not path.exists():
        with FlatTokensWriter(path, chunk_tokens=BLOCK_TOKENS, checksum=checksum) as writer:
            for sequences in synthetic_sequences(tokens):
                writer.append("train", sequences)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 26)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import asyncflat

    best = {False: 0.0, True: 0.0}
    paths = {flag: ensure(args.tokens, flag) for flag in (False, True)}
    for path in paths.values():
        warm_page_cache(path)
    loaders = {
        flag: asyncflat.ShufflingLoader(
            "train",
            asyncflat.FlatTokensParams(path, 1, RBPSB, SPB, seed=0, sequence_packing=True),
            asyncflat.TokenBatchParams(LEN, 64),
            options=asyncflat.EngineOptions(prefetch=False),
        )
        for flag, path in paths.items()
    }
    try:
        plan = loaders[False].plan
        for _ in range(args.rounds):
            for m in range(plan.minipoch_count):
                for flag, loader in loaders.items():
                    loader.load(plan.first_step(m))
                    fill = loader.stats()["fills"][-1]
                    if fill["duration_s"] and not fill["cancelled"]:
                        rate = fill["useful_bytes"] / fill["duration_s"] / 1e9
                        best[flag] = max(best[flag], rate)
    finally:
        for loader in loaders.values():
            loader.close()
    emit(
        {
            "bench": "checksum",
            "tokens": args.tokens,
            "plain_gbps": round(best[False], 3),
            "crc32c_gbps": round(best[True], 3),
            "crc32c_over_plain": round(best[True] / best[False], 3),
        }
    )


if __name__ == "__main__":
    main()
