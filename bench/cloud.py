"""Cloud benchmark: asyncflat against a bare client and the reference loader, over a modelled wire.

    python bench/cloud.py                          # moto S3 behind the wire model, ~2 min
    python bench/cloud.py --backend gcs            # the GCS emulator instead
    python bench/cloud.py --tokens-mib 8 --skip-reference   # smoke run
    python bench/cloud.py s3://bucket/bench.zarr --storage-options '{"anon": false}'
    python bench/cloud.py --storage-options '{"client": "obstore"}'   # the loader on obstore

Without a URL it starts the store (moto's S3 server or the GCS emulator, tests/helpers/servers.py)
and, in front of it, a TCP proxy on 127.0.0.1 that models a cloud VM reading a same-region
bucket: ``--latency-ms`` to first byte per request, ``--connection-MBps`` per connection and
``--total-MBps`` for all of them together. Both run in a child process (they do not compete
with the loaders for this process's GIL); the proxy counts the requests in flight as the wire
sees them. The dataset is written in seqax's layout (zarr format 2, one chunk per read block) and
uploaded. With a ``gs://`` or ``s3://`` URL that bucket is used as is (no wire figures).

Figures, in one JSON line on stdout (MB = 10^6 bytes, wire = stored bytes transferred):

* ``fill``: a fresh loader without prefetch, whose first load() waits for the whole minipoch-0
  buffer: its wire rate vs a bare client's ranged GETs of the same chunk objects at the same
  concurrency (``fill_vs_bare``, target >= 0.9); requests in flight on the wire during each
  (peak, time-weighted mean). Medians of ``--repeats`` interleaved runs.
* ``loaders``, per loader (asyncflat and ``reference``, the seqax-style loader of
  bench/seqax_style.py reading the same bucket through the AWS/GCS environment variables), in
  seconds: construction (``construct_s``), then every step of two minipochs with a ``--step-ms``
  train step between loads: every load of the first minipoch (``first_minipoch_loads``), the
  worst after step 0 (``worst_after_step0``), the worst ordinary load (steps 1.. that start no
  minipoch: ``worst_ordinary``) and boundary load (``worst_boundary``), and the total wait from
  construction through the first boundary's load (``wait_to_first_boundary``);
* ``loaders.<name>.resume``: a resume mid-minipoch 1 in a fresh process, the clock started after
  the imports both loaders share (interpreter, ``import jax`` and its backend, zarr and the
  cloud client's modules), as a user would time the reference: ``construct``, ``first_batch``,
  ``batch11`` (seconds from the clock's start; medians of ``--repeats`` processes) and
  ``waits``, every load from the resumed step to the end of its minipoch;
* ``vs_reference``: asyncflat / reference for the figures issue 36 sets targets on.

The per-step picture (``--plot``): both loaders' loads from construction, and after the resume.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # helpers.servers: the stores and the proxy
from _common import synthetic_sequences  # noqa: E402  (it puts this checkout first, too)

log = logging.getLogger("bench.cloud")
BUCKET = "bench"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", nargs="?", help="gs:// or s3:// dataset URL (default: emulated)")
    parser.add_argument("--backend", choices=["s3", "gcs"], default="s3")
    parser.add_argument("--storage-options", default="{}", help="JSON for the fsspec filesystem")
    parser.add_argument("--latency-ms", type=float, default=25.0, help="time to first byte")
    parser.add_argument("--connection-MBps", type=float, default=64.0)
    parser.add_argument("--total-MBps", type=float, default=150.0)
    # The defaults are issue 21's setup: 183 MiB of tokens, a 48 MiB buffer of 128 KiB chunks.
    parser.add_argument("--tokens-mib", type=float, default=183.0, help="dataset (uint32 tokens)")
    parser.add_argument("--zarr-format", type=int, choices=[2, 3], default=2)
    parser.add_argument("--len", type=int, default=2048)
    parser.add_argument("--spb", type=int, default=16, help="sequences per read block (= chunk)")
    parser.add_argument("--rbpsb", type=int, default=384, help="read blocks per shuffle buffer")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="max_concurrent_reads (default: the loader's own, sized from the chunks: 32 for "
        "this layout's 128 KiB)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=10.0, help="simulated train step")
    parser.add_argument("--steps", type=int, default=0, help="steps to run (0: 2 minipochs)")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument(
        "--plot",
        default=str(Path(__file__).resolve().parent / "out" / "cloud.png"),
        help="PNG of per-step load() time, asyncflat vs the reference ('' for none)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # internal
    # internal: one fresh-process resume (see fresh_resume_figures)
    parser.add_argument(
        "--resume-child", choices=["asyncflat", "reference"], help=argparse.SUPPRESS
    )
    parser.add_argument("--child-url", help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", help=argparse.SUPPRESS)
    return parser.parse_args()


# -- the servers, in a child process ----------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """Child: run the store and the proxy, print their endpoints, answer ``reset``/``stats``
    lines on stdin with the proxy's figures; stop when stdin closes."""
    from helpers.servers import MOTO_ENV, GcsEmulator, MotoS3, TcpProxy

    os.environ.update(MOTO_ENV)
    store = GcsEmulator(bucket=BUCKET) if args.backend == "gcs" else MotoS3(bucket=BUCKET)
    with (
        store,
        TcpProxy(
            store.endpoint,
            latency_s=args.latency_ms / 1e3,
            connection_Bps=args.connection_MBps * 1e6,
            total_Bps=args.total_MBps * 1e6,
            dialect=args.backend,
        ) as proxy,
    ):
        print(json.dumps({"store": store.endpoint, "proxy": proxy.endpoint}), flush=True)
        for line in sys.stdin:
            if line.strip() == "reset":
                proxy.reset_counts()
            print(
                json.dumps(
                    {
                        "peak": proxy.peak_in_flight,
                        "mean": round(proxy.mean_in_flight(), 2),
                        "requests": len(proxy.requests),
                    }
                ),
                flush=True,
            )


class Servers:
    def __init__(self, args: argparse.Namespace) -> None:
        argv = [sys.executable, __file__, "--serve", "--backend", args.backend]
        for name in ("latency_ms", "connection_MBps", "total_MBps"):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        self.child = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.child.stdout is not None
        line = self.child.stdout.readline()
        if not line:
            raise RuntimeError("the store process did not start")
        self.endpoints = json.loads(line)

    def ask(self, what: str) -> dict[str, Any]:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(what + "\n")
        self.child.stdin.flush()
        return dict(json.loads(self.child.stdout.readline()))

    def close(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()
        try:
            self.child.wait(10)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[Servers]:
    running = Servers(args)
    try:
        yield running
    finally:
        running.close()


# -- the dataset ------------------------------------------------------------------------------------


async def _with_fs(url: str, options: dict[str, Any], fn: Any, connections: int = 16) -> Any:
    from asyncflat.storage.filesystems import close_filesystem, filesystem

    fs, path = filesystem(url, options, max_connections=connections)
    try:
        return await fn(fs, path)
    finally:
        await close_filesystem(fs)


def ensure_uploaded(url: str, options: dict[str, Any], args: argparse.Namespace) -> float:
    """Upload a fresh dataset to ``url`` unless one is there; returns the seconds spent."""
    import asyncflat

    marker = "zarr.json" if args.zarr_format == 3 else ".zgroup"

    async def exists(fs: Any, path: str) -> bool:
        return bool(await fs._exists(f"{path}/{marker}"))

    if asyncio.run(_with_fs(url, options, exists)):
        log.info("%s exists: not uploading", url)
        return 0.0
    tokens = int(args.tokens_mib * 2**20) // 4
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "data.zarr"
        with asyncflat.FlatTokensWriter(
            local, chunk_tokens=args.spb * args.len, zarr_format=args.zarr_format
        ) as writer:
            for sequences in synthetic_sequences(tokens):
                writer.append("train", sequences)
            writer.append("validation", next(synthetic_sequences(1 << 14, seed=1)))
        t0 = time.perf_counter()

        async def put(fs: Any, path: str) -> None:
            await fs._put(str(local), path, recursive=True)

        asyncio.run(_with_fs(url, options, put))
        return time.perf_counter() - t0


# -- fill vs a bare client ------------------------------------------------------------------------


def bare_rate(url: str, options: dict[str, Any], keys: list[str], concurrency: int) -> float:
    """Wire bytes/s of ranged GETs of the whole objects ``keys``, ``concurrency`` in flight,
    through the client the loader uses (``storage_options["client"]``)."""
    if options.get("client") == "obstore":
        return _bare_obstore_rate(url, options, keys, concurrency)

    async def run(fs: Any, path: str) -> float:
        limit = asyncio.Semaphore(concurrency)

        async def size(key: str) -> int:
            async with limit:
                return int(await fs._size(f"{path}/{key}"))

        sizes = await asyncio.gather(*(size(k) for k in keys))

        async def get(key: str, size: int) -> int:
            async with limit:
                return len(await fs._cat_file(f"{path}/{key}", start=0, end=size))

        t0 = time.perf_counter()
        got = await asyncio.gather(*(get(k, s) for k, s in zip(keys, sizes)))
        return sum(got) / (time.perf_counter() - t0)

    return float(asyncio.run(_with_fs(url, options, run, connections=concurrency)))


def _bare_obstore_rate(
    url: str, options: dict[str, Any], keys: list[str], concurrency: int
) -> float:
    from zarr.core.buffer import default_buffer_prototype

    from asyncflat.storage.filesystems import make_store

    async def run() -> float:
        store = make_store(url, options, max_connections=concurrency)
        limit = asyncio.Semaphore(concurrency)

        async def get(key: str) -> int:
            async with limit:
                buffer = await store.get(key, default_buffer_prototype())
                assert buffer is not None, key
                return len(buffer)

        t0 = time.perf_counter()
        got = await asyncio.gather(*(get(k) for k in keys))
        return sum(got) / (time.perf_counter() - t0)

    return float(asyncio.run(run()))


def params(args: argparse.Namespace, url: str, options: dict[str, Any]) -> Any:
    import asyncflat

    return asyncflat.FlatTokensParams(
        url, 1, args.rbpsb, args.spb, seed=0, sequence_packing=True, storage_options=options
    )


def batch_params(args: argparse.Namespace) -> Any:
    import asyncflat

    return asyncflat.TokenBatchParams(len=args.len, batch=args.batch)


def reads_in_flight(args: argparse.Namespace) -> int:
    """The reads the loader keeps in flight here (``--concurrency``, or its default)."""
    import asyncflat

    engine = asyncflat.EngineOptions(max_concurrent_reads=args.concurrency)
    return engine.reads_in_flight(token_chunk=args.spb * args.len, remote=True)


def fill_run(args: argparse.Namespace, url: str, options: dict[str, Any]) -> dict[str, Any]:
    import asyncflat

    engine = asyncflat.EngineOptions(prefetch=False, max_concurrent_reads=args.concurrency)
    with asyncflat.ShufflingLoader(
        "train", params(args, url, options), batch_params(args), options=engine
    ) as loader:
        before = loader.stats()["bytes_read"]
        loader.load(0)  # without prefetch: waits for the whole minipoch-0 buffer
        stats = loader.stats()
        fill = stats["fills"][0]
        blocks = loader.plan.buffer_blocks(0, 0).tolist()
    keys = sorted({f"train/encoded_tokens/{_chunk_key(args, b)}" for b in blocks})
    return {"Bps": (stats["bytes_read"] - before) / fill["duration_s"], "keys": keys}


def _chunk_key(args: argparse.Namespace, block: int) -> str:
    return f"c/{block}" if args.zarr_format == 3 else str(block)


def fill_figures(
    args: argparse.Namespace, url: str, options: dict[str, Any], wire: Servers | None
) -> dict[str, Any]:
    fills, bares, fill_wire, bare_wire = [], [], [], []
    for _ in range(args.repeats):  # interleaved: drifts of the shared machine hit both
        if wire:
            wire.ask("reset")
        fill = fill_run(args, url, options)
        if wire:
            fill_wire.append(wire.ask("stats"))
            wire.ask("reset")
        bares.append(bare_rate(url, options, fill["keys"], reads_in_flight(args)))
        if wire:
            bare_wire.append(wire.ask("stats"))
        fills.append(fill["Bps"])
    out: dict[str, Any] = {
        "objects": len(fill["keys"]),
        "fill_MBps": round(statistics.median(fills) / 1e6, 1),
        "bare_MBps": round(statistics.median(bares) / 1e6, 1),
        "fill_vs_bare": round(statistics.median(fills) / statistics.median(bares), 2),
    }
    if wire:
        out["fill_in_flight_peak"] = max(w["peak"] for w in fill_wire)
        out["fill_in_flight_mean"] = statistics.median(w["mean"] for w in fill_wire)
        out["bare_in_flight_peak"] = max(w["peak"] for w in bare_wire)
        out["bare_in_flight_mean"] = statistics.median(w["mean"] for w in bare_wire)
    return out


# -- steps and resumes, asyncflat and the reference ------------------------------------------------


def _asyncflat_loader(args: argparse.Namespace, url: str, options: dict[str, Any]) -> Any:
    import asyncflat

    engine = asyncflat.EngineOptions(max_concurrent_reads=args.concurrency)
    return asyncflat.ShufflingLoader(
        "train", params(args, url, options), batch_params(args), options=engine
    )


def _reference_loader(args: argparse.Namespace, url: str) -> Any:
    from seqax_style import SeqaxStyleLoader

    return SeqaxStyleLoader(
        url,
        "train",
        seq_len=args.len,
        batch=args.batch,
        streams=1,
        read_blocks_per_shuffle_buffer=args.rbpsb,
        sequences_per_read_block=args.spb,
    )


def _first_step(loader: Any, minipoch: int) -> int:
    """The first step of ``minipoch`` (the step count past the last one)."""
    plan = getattr(loader, "plan", loader)
    if minipoch >= plan.minipoch_count:
        return _step_count(loader)
    return int(plan.first_step(minipoch))


def _step_count(loader: Any) -> int:
    plan = getattr(loader, "plan", None)
    return int(plan.step_count) if plan is not None else int(loader.step_count)


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if close is not None:
        close()


def steps_figures(args: argparse.Namespace, make: Callable[[], Any]) -> dict[str, Any]:
    """Construction, then every ``load()`` of two minipochs with a train step between loads."""
    t0 = time.perf_counter()
    loader = make()
    construct = time.perf_counter() - t0
    try:
        boundaries = [_first_step(loader, m) for m in (1, 2)]
        last = args.steps or min(_step_count(loader), boundaries[1] + 1)
        waits = []
        for step in range(last):
            t1 = time.perf_counter()
            loader.load(step)
            waits.append(time.perf_counter() - t1)
            time.sleep(args.step_ms / 1e3)
    finally:
        _close(loader)
    return {"construct_s": round(construct, 4), **load_figures(waits, boundaries, construct)}


def load_figures(waits: list[float], boundaries: list[int], construct: float) -> dict[str, Any]:
    """The cold-start figures of one run of loads from step 0 (seconds): every load of the first
    minipoch, the worst after step 0, ordinary (steps 1.. that start no minipoch) and at a
    boundary, and the wait from construction through the first boundary's load."""
    at = [s for s in boundaries if s < len(waits)]
    ordinary = [w for s, w in enumerate(waits) if s and s not in at]
    return {
        "_waits": waits,  # per-step load() seconds, for the plot (not printed)
        "_boundaries": at,
        "first_load_s": round(waits[0], 4),
        "first_minipoch_loads": [round(w, 5) for w in waits[: boundaries[0]]],
        "worst_after_step0": round(max(waits[1:]), 5),
        "worst_ordinary": round(max(ordinary), 5),
        "worst_boundary": round(max(waits[s] for s in at), 5) if at else None,
        "median_ordinary": round(statistics.median(ordinary), 5),
        "wait_to_first_boundary": round(construct + sum(waits[: boundaries[0] + 1]), 4),
        "steps": len(waits),
    }


def shared_imports(url: str) -> None:
    """What a trainer on this bucket has imported whichever loader it builds: jax (and its
    backend started) and the cloud client's own modules (zarr, s3fs or gcsfs)."""
    import jax
    import zarr  # noqa: F401

    jax.devices()
    if url.startswith("s3://"):
        import s3fs  # noqa: F401
    elif url.startswith(("gs://", "gcs://")):
        import gcsfs  # noqa: F401


def resume_child(args: argparse.Namespace) -> None:
    """In a fresh process, the clock started after :func:`shared_imports`: import the loader,
    construct it, resume mid-minipoch 1 and load every step to the end of that minipoch (a train
    step between loads); print the seconds of each part and every load's wait."""
    import jax

    spawned = float(args.spawned_at)
    shared_imports(args.child_url)
    clock = time.perf_counter()
    imported_at = time.time()
    if args.resume_child == "asyncflat":
        from asyncflat import ShufflingLoader  # noqa: F401  (the lazy package's imports)

        options = json.loads(args.storage_options)
        make: Callable[[], Any] = lambda: _asyncflat_loader(args, args.child_url, options)  # noqa: E731
    else:
        import seqax_style  # noqa: F401

        make = lambda: _reference_loader(args, args.child_url)  # noqa: E731
    loader = make()
    constructed = time.perf_counter() - clock
    waits: list[float] = []
    try:
        start = _first_step(loader, 1)
        end = _first_step(loader, 2)
        step = start + (end - start) // 2
        for s in range(step, end):
            if s > step:
                time.sleep(args.step_ms / 1e3)
            t1 = time.perf_counter()
            jax.block_until_ready(loader.load(s))
            waits.append(time.perf_counter() - t1)
            if s == step:
                first = time.perf_counter() - clock
            if s == step + 10:
                eleventh = time.perf_counter() - clock
    finally:
        _close(loader)
    out = {
        "step": step,
        "shared_imports_s": imported_at - spawned,
        "construct": constructed,
        "first_batch": first,
        "batch11": eleventh,
        "waits": waits,
    }
    print(json.dumps(out), flush=True)


def fresh_resume_figures(
    args: argparse.Namespace, loader: str, url: str, options: dict[str, Any]
) -> dict[str, Any]:
    """A resume as a restarted job sees it, timed as a user would time the reference: a fresh
    process, the clock started once the interpreter, ``import jax`` and the cloud client's
    modules (imports both loaders share) are done; seconds to construction, to the first and to
    the 11th batch, medians of ``--repeats`` processes; ``waits``: every load() from the
    resumed step to the end of its minipoch, of the median process (by the 11th batch)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--resume-child", loader]
    command += ["--child-url", url, "--storage-options", json.dumps(options)]
    for name in ("len", "spb", "rbpsb", "batch", "concurrency", "step_ms"):
        if getattr(args, name) is not None:  # --concurrency's default: the loader's own
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    from _common import bytecode_env

    env = bytecode_env()
    runs = []
    for _ in range(max(1, args.repeats)):
        argv = [*command, "--spawned-at", repr(time.time())]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{loader} resume child failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    runs.sort(key=lambda run: run["batch11"])
    median = runs[(len(runs) - 1) // 2]
    out: dict[str, Any] = {
        key: round(statistics.median(run[key] for run in runs), 4)
        for key in ("shared_imports_s", "construct", "first_batch", "batch11")
    }
    waits = median["waits"]
    out["step"] = median["step"]
    out["waits"] = [round(w, 5) for w in waits]
    out["worst_after_first"] = round(max(waits[1:]), 5)
    out["next_10_waits_s"] = round(sum(waits[1:11]), 4)
    return out


def reference_env(args: argparse.Namespace, endpoint: str) -> None:
    """The reference loader gets the proxy through the environment, as seqax would."""
    if args.backend == "s3":
        os.environ.update(
            {
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
            }
        )
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint


# -- main ---------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    # Before gcsfs is imported: its gRPC probe makes every emulator call take 60 s.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    log.setLevel(logging.INFO)
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # 404 probes
    if args.serve:
        serve(args)
        return
    if args.resume_child:
        resume_child(args)
        return
    options = json.loads(args.storage_options)
    figures: dict[str, Any] = {
        "bench": "cloud",
        "tokens_mib": args.tokens_mib,
        "zarr_format": args.zarr_format,
        "len": args.len,
        "spb": args.spb,
        "rbpsb": args.rbpsb,
        "buffer_mib": round(args.rbpsb * args.spb * args.len * 4 / 2**20, 1),
        "batch": args.batch,
        "concurrency": reads_in_flight(args),
        "step_ms": args.step_ms,
    }
    with contextlib.ExitStack() as stack:
        wire: Servers | None = None
        if args.url:
            url = args.url.rstrip("/")
            upload_options = options
            figures["store"] = url
        else:
            wire = stack.enter_context(servers(args))
            url = f"{'gs' if args.backend == 'gcs' else 's3'}://{BUCKET}/data.zarr"
            if args.backend == "gcs":
                base = {"token": "anon", "project": "bench"}
            else:
                from helpers.servers import MOTO_ENV

                os.environ.update(MOTO_ENV)
                base = {"key": "testing", "secret": "testing"}
            upload_options = {**base, "endpoint_url": wire.endpoints["store"]}
            options = {**base, "endpoint_url": wire.endpoints["proxy"], **options}
            figures["store"] = (
                f"{args.backend}+wire({args.latency_ms:g} ms, {args.connection_MBps:g} MB/s "
                f"per connection, {args.total_MBps:g} MB/s in all)"
            )
            reference_env(args, wire.endpoints["proxy"])
        figures["upload_s"] = round(ensure_uploaded(url, upload_options, args), 2)
        figures["fill"] = fill_figures(args, url, options, wire)
        names = ["asyncflat"] if args.skip_reference else ["asyncflat", "reference"]
        makers = {
            "asyncflat": lambda: _asyncflat_loader(args, url, options),
            "reference": lambda: _reference_loader(args, url),
        }
        loaders: dict[str, dict[str, Any]] = {}
        for name in names:
            loaders[name] = steps_figures(args, makers[name])
            loaders[name]["resume"] = fresh_resume_figures(args, name, url, options)
        figures["loaders"] = loaders
    if "reference" in loaders:
        figures["vs_reference"] = ratios(loaders["asyncflat"], loaders["reference"])
    waits = {name: run.pop("_waits") for name, run in loaders.items()}
    marks = [run.pop("_boundaries") for run in loaders.values()]
    boundaries = marks[0]  # the same for all
    if args.plot:
        resumed = {name: run["resume"]["waits"] for name, run in loaders.items()}
        from _common import plot_cold_start

        plot_cold_start(
            args.plot,
            waits,
            boundaries,
            resumed,
            title="load() per step over an emulated bucket",
            caption=f"{figures['store']}; {_setup(figures)}",
        )
        log.info("wrote %s", args.plot)
        figures["plot"] = args.plot
    print(json.dumps(figures), flush=True)


def _setup(figures: dict[str, Any]) -> str:
    return (
        f"{figures['tokens_mib']:g} MiB of tokens, {figures['buffer_mib']:g} MiB buffer, batch "
        f"{figures['batch']} x {figures['len']}, {figures['step_ms']:g} ms train step"
    )


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """asyncflat / reference for the figures issue 36 sets targets on."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {
        "wait_to_first_boundary": ratio(
            ours["wait_to_first_boundary"], theirs["wait_to_first_boundary"]
        ),
        "resume_first_batch": ratio(ours["resume"]["first_batch"], theirs["resume"]["first_batch"]),
        "resume_batch11": ratio(ours["resume"]["batch11"], theirs["resume"]["batch11"]),
        "worst_after_step0_vs_their_worst_ordinary": ratio(
            ours["worst_after_step0"], theirs["worst_ordinary"]
        ),
    }


if __name__ == "__main__":
    main()
