"""Object-store clients side by side: fsspec (s3fs/gcsfs) against obstore, over a modelled wire.

    python bench/clients.py                    # moto S3 behind the wire model, ~1 min
    python bench/clients.py --backend gcs      # the GCS emulator instead
    python bench/clients.py --tokens-mib 8 --repeats 1      # smoke run

Why: the loader's fills run on its engine thread, in the trainer's process. A client whose
per-request work is Python (s3fs/gcsfs over aiohttp: signing, headers, response parsing) holds
the GIL while the trainer's thread wants it; a Rust client (obstore) does that work off the GIL.
This measures both on what decides the choice, with the same objects, concurrency and wire:

* ``MBps``: wire rate of ranged GETs of every chunk object of a seqax-layout dataset (the fill's
  requests), ``--concurrency`` in flight, from an asyncio loop on a background thread (as the
  engine does). Median of ``--repeats`` interleaved runs.
* ``trainer``: a trainer thread's step times meanwhile. Each step is ``--step-ms`` of GIL-holding
  Python (a jitted step's dispatch and the host-side bookkeeping of a training loop), then
  ``--idle-ms`` of waiting with the GIL free (the device computing; 0: a trainer that never lets
  go of the GIL): of the GIL-held part, median,
  p99, p99.9 and max, and the same figures with no fetch running (``quiet``). ``p99_9_x_quiet``
  is the jitter a client adds to the trainer.
* ``client_cpu_s_per_GB``: CPU the client spent (process CPU minus the trainer's), per GB.
* ``import_s``: a fresh process's ``import`` of the client (a restart pays it).

The store and the wire model (tests/helpers/servers.py: moto's S3 server or the GCS emulator
behind a TCP proxy on 127.0.0.1) run in a child process, as in bench/cloud.py. obstore is an
optional dependency (``pip install obstore``, in the ``bench`` extra); without it only fsspec
runs. Prints one JSON line.
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
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

log = logging.getLogger("bench.clients")

Fetch = Callable[[str, int], Awaitable[int]]  # (key, size) -> bytes received


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["s3", "gcs"], default="s3")
    parser.add_argument("--latency-ms", type=float, default=25.0, help="time to first byte")
    parser.add_argument("--connection-MBps", type=float, default=64.0)
    parser.add_argument("--total-MBps", type=float, default=150.0)
    parser.add_argument("--tokens-mib", type=float, default=48.0, help="dataset (uint32 tokens)")
    parser.add_argument("--len", type=int, default=2048)
    parser.add_argument("--spb", type=int, default=16, help="sequences per chunk object")
    parser.add_argument(
        "--range-kib",
        type=int,
        default=0,
        help="GET this many KiB per request "
        "instead of whole objects (0: whole objects, as a fill of this layout)",
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=2.0, help="GIL-held trainer step")
    parser.add_argument(
        "--idle-ms", type=float, default=8.0, help="GIL-free wait per step (the device's compute)"
    )
    parser.add_argument("--clients", default="fsspec,obstore")
    return parser.parse_args()


# -- the trainer ----------------------------------------------------------------------------------


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i & 7
    return total


def _calibrate(step_ms: float) -> int:
    n = 10_000
    while True:
        t0 = time.perf_counter()
        _spin(n)
        took = time.perf_counter() - t0
        if took > 0.02:
            return max(1, int(n * step_ms / 1e3 / took))
        n *= 2


class Trainer:
    """Steps of GIL-held Python on the calling thread until ``stop`` is set."""

    def __init__(self, step_ms: float) -> None:
        self.n = _calibrate(step_ms)

    def run(self, stop: threading.Event, steps: list[float], idle_s: float = 0.0) -> float:
        cpu0 = time.thread_time()
        while not stop.is_set():
            t0 = time.perf_counter()
            _spin(self.n)
            steps.append(time.perf_counter() - t0)
            if idle_s:
                time.sleep(idle_s)  # the device computes; the GIL is free
        return time.thread_time() - cpu0


def _percentiles(steps: list[float]) -> dict[str, float]:
    ms = np.asarray(steps) * 1e3
    return {
        "steps": len(ms),
        "median_ms": round(float(np.median(ms)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "p99_9_ms": round(float(np.percentile(ms, 99.9)), 3),
        "max_ms": round(float(ms.max()), 3),
    }


# -- the clients ------------------------------------------------------------------------------------


class FsspecClient:
    name = "fsspec"

    def __init__(self, url: str, options: dict[str, Any], concurrency: int) -> None:
        self.url, self.options, self.concurrency = url, options, concurrency

    @contextlib.asynccontextmanager
    async def open(self) -> Any:
        from asyncflat.storage.filesystems import close_filesystem, filesystem

        fs, root = filesystem(self.url, self.options, max_connections=self.concurrency)
        try:

            async def fetch(key: str, lo: int, hi: int) -> int:
                return len(await fs._cat_file(f"{root}/{key}", start=lo, end=hi))

            yield fetch
        finally:
            await close_filesystem(fs)


class ObstoreClient:
    name = "obstore"

    def __init__(self, backend: str, endpoint: str, bucket: str, prefix: str) -> None:
        self.backend, self.endpoint, self.bucket, self.prefix = backend, endpoint, bucket, prefix

    @contextlib.asynccontextmanager
    async def open(self) -> Any:
        import obstore
        from obstore.store import GCSStore, S3Store

        store: Any
        # Explicit credentials (or none) and endpoint: the client never looks for a metadata
        # server or any address but the emulator's.
        if self.backend == "s3":
            store = S3Store(
                self.bucket,
                endpoint=self.endpoint,
                access_key_id="testing",
                secret_access_key="testing",
                region="us-east-1",
                virtual_hosted_style_request=False,
                client_options={"allow_http": True},
            )
        else:
            store = GCSStore(
                self.bucket,
                base_url=self.endpoint,
                skip_signature=True,
                client_options={"allow_http": True},
            )

        async def fetch(key: str, lo: int, hi: int) -> int:
            data = await obstore.get_range_async(store, f"{self.prefix}/{key}", start=lo, end=hi)
            return len(data)

        yield fetch


def _run_fetches(
    client: Any, objects: list[tuple[str, int]], range_bytes: int, concurrency: int
) -> tuple[threading.Thread, list[Any]]:
    """Every object's bytes in ranged GETs, on a fresh loop thread (started): the thread and
    the list that receives (bytes, seconds) or the exception."""

    async def main() -> tuple[int, float]:
        async with client.open() as fetch:
            limit = asyncio.Semaphore(concurrency)

            async def get(key: str, lo: int, hi: int) -> int:
                async with limit:
                    return int(await fetch(key, lo, hi))

            requests = [
                (key, lo, min(lo + (range_bytes or size), size))
                for key, size in objects
                for lo in range(0, size, range_bytes or size)
            ]
            t0 = time.perf_counter()
            got = await asyncio.gather(*(get(*r) for r in requests))
            return sum(got), time.perf_counter() - t0

    result: list[Any] = []

    def thread() -> None:
        try:
            result.append(asyncio.run(main()))
        except BaseException as exc:  # reported on the caller's thread
            result.append(exc)

    worker = threading.Thread(target=thread, name=f"{client.name}-loop")
    worker.start()
    return worker, result


def measure(
    client: Any,
    objects: list[tuple[str, int]],
    args: argparse.Namespace,
    trainer: Trainer,
    wire: Any,
) -> dict[str, Any]:
    requests_before = wire.ask("reset")["requests"]
    steps: list[float] = []
    stop = threading.Event()
    cpu0 = time.process_time()
    worker, result = _run_fetches(client, objects, args.range_kib * 1024, args.concurrency)
    done = threading.Thread(target=lambda: (worker.join(), stop.set()))
    done.start()
    trainer_cpu = trainer.run(stop, steps, args.idle_ms / 1e3)
    done.join()
    cpu = time.process_time() - cpu0 - trainer_cpu
    if isinstance(result[0], BaseException):
        raise result[0]
    nbytes, seconds = result[0]
    on_wire = wire.ask("stats")
    return {
        "requests": on_wire["requests"] - requests_before,
        "peak_in_flight": on_wire["peak"],
        "MBps": nbytes / seconds / 1e6,
        "seconds": seconds,
        "client_cpu_s_per_GB": cpu / (nbytes / 1e9),
        "steps": steps,
    }


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    times = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        times.append(float(out.stdout))
    return round(min(times), 3)


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    log.setLevel(logging.INFO)
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    from cloud import BUCKET, ensure_uploaded, servers
    from helpers.servers import MOTO_ENV

    names = [n for n in args.clients.split(",") if n]
    # Imported before any timing: a restart pays the import once (import_s), not per fill.
    if args.backend == "s3":
        import s3fs  # noqa: F401
    else:
        import gcsfs  # noqa: F401
    if "obstore" in names:
        try:
            import obstore.store  # noqa: F401
        except ImportError:
            log.warning("obstore is not installed (pip install obstore): fsspec only")
            names.remove("obstore")
    wire_args = argparse.Namespace(
        backend=args.backend,
        latency_ms=args.latency_ms,
        connection_MBps=args.connection_MBps,
        total_MBps=args.total_MBps,
        zarr_format=2,
        tokens_mib=args.tokens_mib,
        spb=args.spb,
        len=args.len,
    )
    figures: dict[str, Any] = {
        "bench": "clients",
        "backend": args.backend,
        "store": f"{args.backend}+wire({args.latency_ms:g} ms, {args.connection_MBps:g} MB/s "
        f"per connection, {args.total_MBps:g} MB/s in all)",
        "concurrency": args.concurrency,
        "range_kib": args.range_kib,
        "step_ms": args.step_ms,
        "idle_ms": args.idle_ms,
    }
    trainer = Trainer(args.step_ms)
    with servers(wire_args) as wire:
        url = f"{'gs' if args.backend == 'gcs' else 's3'}://{BUCKET}/data.zarr"
        if args.backend == "gcs":
            base: dict[str, Any] = {"token": "anon", "project": "bench"}
        else:
            os.environ.update(MOTO_ENV)
            base = {"key": "testing", "secret": "testing"}
        ensure_uploaded(url, {**base, "endpoint_url": wire.endpoints["store"]}, wire_args)
        options = {**base, "endpoint_url": wire.endpoints["proxy"]}

        async def listing(fs: Any, root: str) -> list[tuple[str, int]]:
            found = await fs._find(f"{root}/train/encoded_tokens", detail=True)
            prefix = f"{root}/"
            return sorted(
                (path[len(prefix) :], int(info["size"]))
                for path, info in found.items()
                if not path.rsplit("/", 1)[-1].startswith(".")
            )

        from cloud import _with_fs

        objects = asyncio.run(_with_fs(url, options, listing))
        figures["objects"] = len(objects)
        figures["MiB"] = round(sum(s for _, s in objects) / 2**20, 1)
        clients: dict[str, Any] = {"fsspec": FsspecClient(url, options, args.concurrency)}
        if "obstore" in names:
            clients["obstore"] = ObstoreClient(
                args.backend, wire.endpoints["proxy"], BUCKET, "data.zarr"
            )
        quiet: list[float] = []
        stop = threading.Event()
        threading.Timer(3.0, stop.set).start()
        trainer.run(stop, quiet, args.idle_ms / 1e3)
        figures["quiet"] = _percentiles(quiet)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for _ in range(args.repeats):  # interleaved: drift on a shared machine hits all alike
            for name in names:
                runs[name].append(measure(clients[name], objects, args, trainer, wire))
    for name in names:
        steps = [s for run in runs[name] for s in run["steps"]]
        trainer_figures = _percentiles(steps)
        figures[name] = {
            "MBps": round(statistics.median(r["MBps"] for r in runs[name]), 1),
            "MBps_all": [round(r["MBps"], 1) for r in runs[name]],
            "requests_per_object": round(
                statistics.median(r["requests"] for r in runs[name]) / len(objects), 2
            ),
            "peak_in_flight": max(r["peak_in_flight"] for r in runs[name]),
            "client_cpu_s_per_GB": round(
                statistics.median(r["client_cpu_s_per_GB"] for r in runs[name]), 2
            ),
            "trainer": trainer_figures,
            "p99_9_x_quiet": round(trainer_figures["p99_9_ms"] / figures["quiet"]["p99_9_ms"], 2),
            "median_x_quiet": round(
                trainer_figures["median_ms"] / figures["quiet"]["median_ms"], 2
            ),
            "import_s": import_seconds("s3fs" if args.backend == "s3" else "gcsfs")
            if name == "fsspec"
            else import_seconds("obstore.store"),
        }
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
