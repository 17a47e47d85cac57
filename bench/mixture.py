"""Mixture benchmark: no stall at any source's minipoch or pass boundary.

Three sources of different sizes (1, 1/4 and 1/16 of ``--tokens``) mixed 0.5/0.3/0.2, the
smallest served by the emulated cloud store (the GCS emulator behind a TCP proxy adding
``--latency-ms`` per round trip, as bench/cloud.py runs it; ``--no-emulator``: a local store
with ``FaultyStore`` latency per request instead), for enough steps that the smallest runs out
and wraps. A simulated
trainer step (``--step-ms`` of sleep) follows every batch; ``next()`` waits are recorded. For
each source, the mixture steps where its own step enters a new minipoch or pass are its
boundaries; the figure is its worst wait there against the median wait of all steps. Prints one
JSON line.

Target: every source's worst boundary wait within the machine's jitter of the median (a few ms),
no late fill.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_dir, emit, synthetic_sequences

SIZES = (1.0, 0.25, 0.0625)
WEIGHTS = (0.5, 0.3, 0.2)


def ensure(tokens: int, index: int) -> str:
    from asyncflat import FlatTokensWriter

    path = bench_dir() / f"mixture-{index}-{tokens}.zarr"
    if not path.exists():
        with FlatTokensWriter(path, chunk_tokens=1 << 15) as writer:
            for sequences in synthetic_sequences(tokens, seed=index):
                writer.append("train", sequences)
    return str(path)


def upload(local: str, endpoint: str) -> str:
    """Copy the local store ``local`` to the emulator's bucket; returns its gs:// URL."""
    import asyncio

    from cloud import _with_fs

    url = f"gs://bench/{Path(local).name}"

    async def put(fs: object, path: str) -> None:
        await fs._put(local, path, recursive=True)  # type: ignore[attr-defined]

    asyncio.run(_with_fs(url, {**GCS, "endpoint_url": endpoint}, put))
    return url


GCS = {"token": "anon", "project": "bench"}


def boundaries(loader: object, step_count: int) -> list[set[int]]:
    """Per source, the mixture steps whose rows enter one of its minipochs or passes first."""
    plans = loader.plans  # type: ignore[attr-defined]
    firsts = [{p.first_step(m) for m in range(1, p.minipoch_count)} | {0} for p in plans]
    seen: list[set[tuple[int, int]]] = [set() for _ in plans]
    result: list[set[int]] = [set() for _ in plans]
    for step in range(step_count):
        for group in loader.groups(step):  # type: ignore[attr-defined]
            key = (group.epoch, group.step)
            if group.step in firsts[group.source] and key not in seen[group.source]:
                if group.epoch or group.step:  # not the very first step of the run
                    result[group.source].add(step)
                seen[group.source].add(key)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1 << 23)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--no-emulator", action="store_true", help="FaultyStore latency instead")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Before gcsfs is imported: its gRPC probe makes every emulator call take 60 s.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    if args.no_emulator:
        run(args, None)
        return
    import logging

    from cloud import servers

    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    with servers(args.latency_ms / 1e3) as endpoints:
        run(args, endpoints)


def run(args: argparse.Namespace, endpoints: dict[str, str] | None) -> None:

    import asyncflat
    from asyncflat import EngineOptions, FlatTokensParams, MixtureParams, MixtureSource
    from asyncflat.testing.faults import FaultyStore

    paths = [ensure(int(args.tokens * size), i) for i, size in enumerate(SIZES)]
    options: list[dict[str, str] | None] = [None, None, None]
    if endpoints is not None:
        paths[2] = upload(paths[2], endpoints["emulator"])
        options[2] = {**GCS, "endpoint_url": endpoints["proxy"]}
    sources = tuple(
        MixtureSource(FlatTokensParams(path, 2, 4, 64, i, True, storage_options=opts), weight)
        for i, (path, weight, opts) in enumerate(zip(paths, WEIGHTS, options))
    )
    mixture = MixtureParams(sources, seed=0, block_rows=256, steps=args.steps)
    batch = asyncflat.TokenBatchParams(len=512, batch=16)
    latency = args.latency_ms / 1000

    def slow(store: object) -> object:
        return FaultyStore(store, latency_s=latency, seed=0)  # type: ignore[arg-type]

    t0 = time.perf_counter()
    with asyncflat.ShufflingLoader(
        "train",
        mixture,
        batch,
        options=EngineOptions(prefetch_to_device=1),
        store_wrapper=(None, None, slow if endpoints is None else None),
    ) as loader:
        waits = np.zeros(loader.step_count)
        iterator = loader.iter()
        for step in range(loader.step_count):
            t = time.perf_counter()
            next(iterator)
            waits[step] = time.perf_counter() - t
            time.sleep(args.step_ms / 1000)
        iterator.close()
        stats = loader.stats()
        edges = boundaries(loader, loader.step_count)
    median = float(np.median(waits[1:]))
    worst = int(np.argmax(waits[2:])) + 2  # steps 0 and 1 wait for the first fills
    emit(
        {
            "bench": "mixture",
            "steps": len(waits),
            "step_ms": args.step_ms,
            "median_wait_ms": round(median * 1e3, 3),
            "max_wait_from_step_2_ms": round(float(waits[worst]) * 1e3, 3),
            "max_wait_step": worst,
            "boundary_steps": [sorted(e) for e in edges],
            "sources": [
                {
                    "weight": weight,
                    "tokens": int(args.tokens * size),
                    "latency_ms": args.latency_ms if i == 2 else 0.0,
                    "store": "local" if i < 2 or endpoints is None else "gcs-emulator",
                    "passes": s.passes,
                    "boundaries": len(edges[i]),
                    "worst_boundary_wait_ms": round(
                        max((float(waits[e]) for e in edges[i]), default=0.0) * 1e3, 3
                    ),
                    "fills_late": s.engine.fills_late,
                    "engine_wait_max_ms": None
                    if s.engine.wait_max_s is None
                    else round(s.engine.wait_max_s * 1e3, 3),
                }
                for i, (weight, size, s) in enumerate(zip(WEIGHTS, SIZES, stats.sources))
            ],
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    )


if __name__ == "__main__":
    main()
