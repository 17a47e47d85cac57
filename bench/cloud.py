"""Cloud benchmark: the engine's fill throughput against the store's own concurrent-GET rate,
and load() stalls across minipoch boundaries, through gcsfs with injected network latency.

    python bench/cloud.py                          # emulator + 25 ms proxy, 64 MiB of tokens
    python bench/cloud.py --tokens-mib 8 --spb 16  # smoke run
    python bench/cloud.py gs://bucket/bench.zarr --storage-options '{"token": "google_default"}'

Without a URL it starts the GCS emulator (tests/helpers/servers.py: both emulator defects worked
around) and a TCP proxy on 127.0.0.1 that adds ``--latency-ms`` to every request's round trip
(pipelined, so concurrent transfers overlap), writes a dataset locally (chunks = one read block,
asyncflat's recommended layout) and uploads it. With a ``gs://`` or ``s3://`` URL it uses that
bucket as is (credentials: the filesystem's usual means, or ``--storage-options``), uploading
the dataset only if nothing is there yet.

Figures, in one JSON line on stdout (MB = 10^6 bytes, "wire" = compressed bytes transferred):

(a) ``store_wire_MBps``: the store alone: concurrent GETs (``--concurrency`` in flight, the
    engine's max_concurrent_reads) of exactly the chunk objects a fill of minipoch 0 reads;
(b) ``fill_wire_MBps``: the engine: a fresh loader without prefetch, whose first load() waits
    for the whole minipoch-0 buffer; wire bytes of that fill / its duration. Medians of
    ``--repeats`` interleaved runs of (a) and (b); target ``fill_vs_store >= 0.8``;
(c) ``stall``: a loop over every step with a simulated train step (``--step-ms`` of sleep),
    >= 3 minipoch boundaries, prefetch on and off: median, p99 and max load() latency, and the
    max over the boundary steps. Target with prefetch: ``max <= 2x median``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # helpers.servers: the emulator and the proxy

log = logging.getLogger("bench.cloud")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", nargs="?", help="gs:// or s3:// dataset URL (default: emulator)")
    parser.add_argument("--storage-options", default="{}", help="JSON for the fsspec filesystem")
    parser.add_argument("--latency-ms", type=float, default=25.0, help="proxy round-trip latency")
    parser.add_argument(
        "--tokens-mib", type=float, default=64.0, help="dataset size (uint32 tokens)"
    )
    parser.add_argument("--len", type=int, default=2048)
    parser.add_argument("--spb", type=int, default=128, help="sequences per read block (= chunk)")
    parser.add_argument("--rbpsb", type=int, default=16, help="read blocks per shuffle buffer")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16, help="max_concurrent_reads")
    parser.add_argument(
        "--inflight-chunks",
        type=int,
        default=None,
        help="max_inflight_bytes in decoded chunks (default: --concurrency; "
        "0: the engine's default)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=5.0, help="simulated train step")
    parser.add_argument("--skip-stall", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # internal
    return parser.parse_args()


# -- dataset --------------------------------------------------------------------------------------


def write_dataset(path: Path, tokens: int, chunk_tokens: int) -> None:
    from _common import synthetic_sequences

    import asyncflat

    with asyncflat.FlatTokensWriter(path, chunk_tokens=chunk_tokens) as writer:
        for sequences in synthetic_sequences(tokens):
            writer.append("train", sequences)
        writer.append("validation", next(synthetic_sequences(1 << 14, seed=1)))


async def _with_fs(url: str, options: dict[str, Any], fn: Any) -> Any:
    from asyncflat.source import _close_filesystem, _filesystem

    fs, path = _filesystem(url, options)
    try:
        return await fn(fs, path)
    finally:
        await _close_filesystem(fs)


def ensure_uploaded(url: str, options: dict[str, Any], tokens: int, chunk_tokens: int) -> float:
    """Upload a fresh dataset to ``url`` unless one is there; returns the seconds spent."""

    async def exists(fs: Any, path: str) -> bool:
        return bool(await fs._exists(f"{path}/zarr.json"))

    if asyncio.run(_with_fs(url, options, exists)):
        log.info("%s exists: not uploading", url)
        return 0.0
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "data.zarr"
        write_dataset(local, tokens, chunk_tokens)
        t0 = time.perf_counter()

        async def put(fs: Any, path: str) -> None:
            await fs._put(str(local), path, recursive=True)

        asyncio.run(_with_fs(url, options, put))
        return time.perf_counter() - t0


# -- (a) the store alone ----------------------------------------------------------------------------


def store_rate(
    url: str, options: dict[str, Any], keys: list[str], concurrency: int
) -> tuple[float, int]:
    """Wire bytes/s of GETting ``keys`` (object paths under the dataset) ``concurrency`` at a time."""

    async def run(fs: Any, path: str) -> tuple[float, int]:
        limit = asyncio.Semaphore(concurrency)

        async def get(key: str) -> int:
            async with limit:
                return len(await fs._cat_file(f"{path}/{key}"))

        t0 = time.perf_counter()
        sizes = await asyncio.gather(*(get(k) for k in keys))
        return sum(sizes) / (time.perf_counter() - t0), sum(sizes)

    return asyncio.run(_with_fs(url, options, run))


# -- (b) the engine's fill ----------------------------------------------------------------------------


def make_params(args: argparse.Namespace, url: str, options: dict[str, Any]) -> Any:
    import asyncflat

    return asyncflat.FlatTokensParams(
        url, 1, args.rbpsb, args.spb, seed=0, sequence_packing=True, storage_options=options
    )


def engine_options(args: argparse.Namespace, prefetch: bool) -> Any:
    """Reads in flight: on a high-latency store the window must hold ``concurrency`` chunks."""
    import asyncflat

    chunks = args.concurrency if args.inflight_chunks is None else args.inflight_chunks
    inflight = chunks * args.spb * args.len * 4 if chunks else None
    return asyncflat.EngineOptions(
        prefetch=prefetch, max_concurrent_reads=args.concurrency, max_inflight_bytes=inflight
    )


def fill_rate(args: argparse.Namespace, url: str, options: dict[str, Any]) -> dict[str, Any]:
    import asyncflat

    engine = engine_options(args, prefetch=False)
    batch = asyncflat.TokenBatchParams(len=args.len, batch=args.batch)
    with asyncflat.ShufflingLoader(
        "train", make_params(args, url, options), batch, options=engine
    ) as loader:
        before = loader.stats()["bytes_read"]
        loader.load(0)  # without prefetch: waits for the whole minipoch-0 buffer
        stats = loader.stats()
        fill = stats["fills"][0]
        wire = stats["bytes_read"] - before
        return {
            "wire_Bps": wire / fill["duration_s"],
            "wire_bytes": wire,
            "useful_Bps": fill["useful_bytes"] / fill["duration_s"],
            "seconds": fill["duration_s"],
            "blocks": loader.plan.buffer_blocks(0, 0).tolist(),
            "requests": stats["requests"],
        }


# -- (c) stalls -----------------------------------------------------------------------------------------


def stall_run(
    args: argparse.Namespace, url: str, options: dict[str, Any], prefetch: bool
) -> dict[str, Any]:
    import asyncflat

    engine = engine_options(args, prefetch)
    batch = asyncflat.TokenBatchParams(len=args.len, batch=args.batch)
    latencies = []
    with asyncflat.ShufflingLoader(
        "train", make_params(args, url, options), batch, options=engine
    ) as loader:
        plan = loader.plan
        for step in range(plan.step_count):
            t0 = time.perf_counter()
            loader.load(step)
            latencies.append(time.perf_counter() - t0)
            time.sleep(args.step_ms / 1e3)
        stats = loader.stats()
        boundaries = [plan.first_step(m) for m in range(1, plan.minipoch_count)]
    steady = np.array(latencies[1:])  # step 0 includes the first fill in both modes
    return {
        "steps": plan.step_count,
        "boundaries": len(boundaries),
        "median_ms": round(float(np.median(steady)) * 1e3, 3),
        "p99_ms": round(float(np.percentile(steady, 99)) * 1e3, 3),
        "max_ms": round(float(steady.max()) * 1e3, 3),
        "max_step": int(steady.argmax()) + 1,
        "max_boundary_ms": round(max(latencies[s] for s in boundaries) * 1e3, 3)
        if boundaries
        else None,
        "first_ms": round(latencies[0] * 1e3, 3),
        "max_over_median": round(float(steady.max() / np.median(steady)), 2),
        "retries": stats["retries"],
        "throttled": stats["throttled"],
    }


# -- the servers, in a child process (so that they do not compete with the loader for its GIL) --


def serve(latency_s: float) -> None:
    """Child: run the emulator and the proxy, print their endpoints, stop when stdin closes."""
    from helpers.servers import GcsEmulator, TcpProxy

    with (
        GcsEmulator(bucket="bench") as emulator,
        TcpProxy(emulator.endpoint, latency_s=latency_s) as proxy,
    ):
        print(json.dumps({"emulator": emulator.endpoint, "proxy": proxy.endpoint}), flush=True)
        sys.stdin.read()


@contextlib.contextmanager
def servers(latency_s: float) -> Iterator[dict[str, str]]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--latency-ms", str(latency_s * 1e3)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        if not line:
            raise RuntimeError("the emulator process did not start")
        yield json.loads(line)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# -- main ---------------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    # Before gcsfs is imported: its gRPC probe makes every emulator call take 60 s.
    if not args.url:
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    log.setLevel(logging.INFO)
    # the emulator logs an ERROR for every probe of a missing zarr metadata key
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    if args.serve:
        serve(args.latency_ms / 1e3)
        return
    options = json.loads(args.storage_options)
    tokens = int(args.tokens_mib * 2**20) // 4
    chunk_tokens = args.spb * args.len  # one chunk per read block: the recommended layout
    figures: dict[str, Any] = {
        "bench": "cloud",
        "tokens": tokens,
        "len": args.len,
        "spb": args.spb,
        "rbpsb": args.rbpsb,
        "batch": args.batch,
        "concurrency": args.concurrency,
        "inflight_chunks": args.concurrency
        if args.inflight_chunks is None
        else args.inflight_chunks,
    }

    with contextlib.ExitStack() as stack:
        if args.url:
            url = args.url.rstrip("/")
            upload_options = options
            figures["store"] = url
        else:
            endpoints = stack.enter_context(servers(args.latency_ms / 1e3))
            url = "gs://bench/data.zarr"
            gcs = {"token": "anon", "project": "bench"}
            upload_options = {**gcs, "endpoint_url": endpoints["emulator"]}
            options = {**gcs, "endpoint_url": endpoints["proxy"], **options}
            figures["store"] = f"gcs-emulator+proxy({args.latency_ms:g} ms)"
            figures["latency_ms"] = args.latency_ms
        upload_s = ensure_uploaded(url, upload_options, tokens, chunk_tokens)
        figures["upload_s"] = round(upload_s, 2)

        fills, stores = [], []
        for _ in range(args.repeats):  # interleaved, so drifts of the shared machine hit both
            fill = fill_rate(args, url, options)
            keys = [
                f"train/encoded_tokens/c/{(b * args.spb * args.len) // chunk_tokens}"
                for b in fill["blocks"]
            ]
            rate, _ = store_rate(url, options, sorted(set(keys)), args.concurrency)
            fills.append(fill)
            stores.append(rate)
        fill_wire = statistics.median(f["wire_Bps"] for f in fills)
        store_wire = statistics.median(stores)
        figures.update(
            {
                "fill_objects": len(set(keys)),
                "fill_wire_MB": round(fills[0]["wire_bytes"] / 1e6, 2),
                "store_wire_MBps": round(store_wire / 1e6, 1),
                "fill_wire_MBps": round(fill_wire / 1e6, 1),
                "fill_useful_MBps": round(
                    statistics.median(f["useful_Bps"] for f in fills) / 1e6, 1
                ),
                "fill_s": round(statistics.median(f["seconds"] for f in fills), 3),
                "fill_vs_store": round(fill_wire / store_wire, 2),
                "fill_target": 0.8,
            }
        )
        if not args.skip_stall:
            figures["stall_prefetch_on"] = stall_run(args, url, options, prefetch=True)
            figures["stall_prefetch_off"] = stall_run(args, url, options, prefetch=False)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
