"""Side by side: asyncflat, a seqax-style synchronous loader and Grain on the same tokens.

    python bench/peers.py                  # small: 2^25 tokens, 1-2 minutes on 2 cores
    python bench/peers.py --size large     # 2^27 tokens, batch 64 x 2048, 256 MiB buffer

Every loader runs in fresh processes of its own, through its public API, on the same generated
tokens (a flat-tokens store written once by asyncflat's writer; for Grain an uncompressed memmap of
the same encoded tokens). Each one delivers what a JAX trainer consumes: ``targets`` (uint32) and
``is_seq_start`` (bool) as jax arrays of ``[batch, len]``. Loaders:

* ``asyncflat``: ``ShufflingLoader.load(step)``, default options;
* ``asyncflat-iter``: ``ShufflingLoader.iter(start)``, which also builds the next batch's arrays
  on a thread (``EngineOptions.prefetch_to_device``);
* ``seqax``: ``bench/seqax_style.py``, seqax's ``ShufflingLoader`` semantics, synchronous;
* ``grain``: ``grain.MapDataset`` over a memmap of rows, globally shuffled, batched, read by
  ``--grain-threads`` threads ``--grain-prefetch`` batches ahead, decoded and put on the device
  in a thread stage (the fastest configuration found on a 2-core machine; needs the ``peers``
  extra).

Figures per loader:

* ``tokens_per_s``: one epoch, every step loaded back to back (no trainer work), from the
  loader's construction to the last batch;
* ``first_ms``: the first step of an epoch from a fresh loader (seqax reads its whole first
  buffer there; asyncflat only the rows that step needs); ``median_ms`` / ``p999_ms`` /
  ``max_ms`` (``max_step``: where): ``load`` latency (until the arrays are ready) of every later
  step, over an epoch in which each step is followed by ``--step-ms`` of simulated trainer work
  (a sleep: a trainer waiting on its accelerator), with ``gc.freeze()`` as JAX trainers do;
  ``ordinary_p999_ms`` / ``ordinary_max_ms``: the same over ordinary steps only (neither a
  boundary nor one of the first 16 steps, a fresh loader's start-up); ``boundary_ms``: the worst first step of a minipoch (a shuffle-buffer refill; for Grain the
  same step numbers, where nothing special happens);
* ``restart_s``: process start to the first batch of a step in the middle of the second
  minipoch, as a preempted job's restart sees it, median of ``--restarts`` fresh processes
  (interpreter start and every import included: ``jax`` dominates for every loader);
  ``restart_own_s``: the loader's own share of it (its imports, construction and first batch:
  the restart minus process start, ``import jax`` and the start of JAX's backend, which every
  loader pays alike, a trainer before it builds its loader, and which are its noisiest part),
  median over the same processes;
* issue 36's cold-start figures (seconds), from the same epoch: ``construct_s``, every load of
  the first minipoch (``first_minipoch_loads``), the worst load after step 0, ordinary (steps
  1.. that start no minipoch) and at a boundary (``worst_after_step0``, ``worst_ordinary``,
  ``worst_boundary``), and construction plus every load through the first boundary
  (``wait_to_first_boundary``);
* ``resume``: from the restart processes, the clock started after the imports every loader
  shares (interpreter, ``import jax`` and its backend), as a user would time the reference:
  ``first_batch`` and ``batch11`` (medians), and ``waits``, every load from the restart step to
  the end of its minipoch (a ``--step-ms`` step between loads) of the median process;
  ``bench/out/peers-<size>.png`` plots the epoch's loads and these;
* ``rss_mib``: peak RSS growth over that epoch from just before the loader is built (imports and
  jax already initialised), and ``rss_x_buffer``, the same over the bytes of one shuffle buffer;
  ``rss_file_mib``: the part of it that is file-backed (Grain's memmap pages).

Prints the table on stderr and one JSON line on stdout; writes the table to
``bench/out/peers.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import bench_dir, emit, ensure_dataset, out_dir, plot_cold_start  # noqa: E402

SIZES: dict[str, dict[str, int]] = {
    # 1024 steps; 32 MiB buffer; 4 minipochs (3 boundaries)
    "small": dict(tokens=1 << 25, seq_len=2048, batch=16, spb=64, rbpsb=64),
    # the peer setup: 1024 steps; 256 MiB buffer; 2 minipochs (1 boundary)
    "large": dict(tokens=1 << 27, seq_len=2048, batch=64, spb=512, rbpsb=64),
}
LOADERS = ("asyncflat", "asyncflat-iter", "seqax", "grain")
#: Steps after a loader's construction that do not count as ordinary (its start-up)
STARTUP_STEPS = 16


# -- the loaders, each as "an iterator of (targets, is_seq_start) jax arrays from a step" -------


def open_loader(args: argparse.Namespace, start: int) -> tuple[Any, Any]:
    """(iterator over batches from ``start``, close function) for ``args.child``."""
    kind = args.child
    if kind in ("asyncflat", "asyncflat-iter"):
        import asyncflat

        params = asyncflat.FlatTokensParams(
            args.path, 1, args.rbpsb, args.spb, seed=0, sequence_packing=True
        )
        batch_params = asyncflat.TokenBatchParams(len=args.seq_len, batch=args.batch)
        loader = asyncflat.ShufflingLoader("train", params, batch_params)
        if kind == "asyncflat-iter":
            iterator = loader.iter(start)
            batches = ((b.targets, b.is_seq_start) for _, b in iterator)

            def close() -> None:
                iterator.close()
                loader.close()

            return batches, close
        batches = ((b.targets, b.is_seq_start) for b in map(loader.load, range(start, args.steps)))
        return batches, loader.close
    if kind == "seqax":
        from seqax_style import SeqaxStyleLoader

        reference = SeqaxStyleLoader(
            args.path,
            "train",
            seq_len=args.seq_len,
            batch=args.batch,
            streams=1,
            read_blocks_per_shuffle_buffer=args.rbpsb,
            sequences_per_read_block=args.spb,
        )
        return (tuple(reference.load(s)) for s in range(start, args.steps)), lambda: None
    if kind == "grain":
        return grain_batches(args, start), lambda: None
    raise ValueError(f"unknown loader {kind!r}")


class MemmapRows:
    """Grain's random-access source: row ``i`` is tokens ``[i * len, (i + 1) * len)``."""

    def __init__(self, path: str, seq_len: int) -> None:
        self.tokens = np.memmap(path, np.uint32, mode="r")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[i * self.seq_len : (i + 1) * self.seq_len]


def grain_batches(args: argparse.Namespace, start: int) -> Any:
    import grain
    import jax

    device = jax.devices()[0]

    def to_device(encoded: np.ndarray) -> tuple[Any, Any]:
        targets = jax.device_put(encoded >> 1, device)
        starts = jax.device_put((encoded & 1).astype(bool), device)
        return jax.block_until_ready((targets, starts))

    rows = MemmapRows(args.memmap, args.seq_len)
    dataset = grain.MapDataset.source(rows).shuffle(seed=0).batch(args.batch, drop_remainder=True)
    dataset = dataset[start : args.steps]
    options = grain.ReadOptions(
        num_threads=args.grain_threads, prefetch_buffer_size=args.grain_prefetch
    )
    pipeline = dataset.to_iter_dataset(options).map(to_device)
    pipeline = grain.experimental.ThreadPrefetchIterDataset(pipeline, prefetch_buffer_size=2)
    return iter(pipeline)


# -- one child process ----------------------------------------------------------------------


def memory() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process. Where the kernel does not split
    RSS (gVisor's ``/proc`` has only ``VmRSS``), all of it counts as anonymous."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:", "VmRSS:")):
                name, value = line.split(":")
                fields[name] = int(value.split()[0]) * 1024
    if "RssAnon" not in fields:
        return fields["VmRSS"], 0
    return fields["RssAnon"] + fields.get("RssShmem", 0), fields["RssFile"]


def import_loader_modules(kind: str) -> None:
    """The imports a trainer writes for each loader (asyncflat's package is lazy: naming the
    loader imports its modules)."""
    if kind.startswith("asyncflat"):
        from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams  # noqa: F401
    elif kind == "seqax":
        import seqax_style  # noqa: F401
        import zarr  # noqa: F401
    else:
        import grain  # noqa: F401


def child(args: argparse.Namespace) -> None:
    import jax

    figures: dict[str, Any] = {"loader": args.child, "phase": args.phase}
    if args.phase == "restart":
        # A trainer starts JAX's backend (its mesh, its model) before it builds a loader; started
        # here for every loader alike, it is not charged to whichever loader touches it first
        # (asyncflat's default sharding, Grain's and seqax's first device_put): 40-80 ms.
        jax.devices()
        # wall-clock stamps; the parent subtracts the time it spawned this process
        figures["jax_imported_at"] = time.time()
        import_loader_modules(args.child)
        figures["imported_at"] = time.time()
        batches, close = open_loader(args, args.restart_step)
        figures["constructed_at"] = time.time()
        # every load to the end of the resumed minipoch, a train step between loads
        end = min([b for b in args.boundaries if b > args.restart_step] + [args.steps])
        waits = []
        for i in range(end - args.restart_step):
            if i:
                time.sleep(args.step_ms / 1e3)
            t0 = time.perf_counter()
            jax.block_until_ready(next(batches))
            waits.append(time.perf_counter() - t0)
            if i == 0:
                figures["ready_at"] = time.time()
            if i == 10:
                figures["eleventh_at"] = time.time()
        close()
        figures["waits"] = waits
        print(json.dumps(figures), flush=True)
        return

    import_loader_modules(args.child)  # imports are not the loader's memory
    # jax's client and its first transfer before the baseline, for every loader alike
    jax.block_until_ready(jax.device_put(np.zeros((args.batch, args.seq_len), np.uint32)))
    gc.collect()
    anon0, file0 = memory()
    peak_anon, peak_file = anon0, file0
    started = time.perf_counter()
    batches, close = open_loader(args, 0)
    construct_s = time.perf_counter() - started
    latencies = []
    step_s = args.step_ms / 1e3
    if args.phase == "steps":
        gc.freeze()
    try:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(next(batches))
            latencies.append(time.perf_counter() - t0)
            if args.phase == "steps":
                anon, file = memory()
                peak_anon, peak_file = max(peak_anon, anon), max(peak_file, file)
                time.sleep(step_s)
    finally:
        elapsed = time.perf_counter() - started
        close()
    if args.phase == "epoch":
        figures["tokens_per_s"] = args.steps * args.batch * args.seq_len / elapsed
    else:
        ms = np.array(latencies[1:]) * 1e3
        figures["first_ms"] = latencies[0] * 1e3
        figures["max_step"] = int(np.argmax(ms)) + 1
        figures["median_ms"] = float(np.median(ms))
        figures["p999_ms"] = float(np.quantile(ms, 0.999))
        figures["max_ms"] = float(ms.max())
        figures["boundary_ms"] = max(latencies[s] * 1e3 for s in args.boundaries)
        # ordinary steps: neither a boundary nor one of the first STARTUP_STEPS (whose rows a
        # fresh loader may still be reading while its first fill streams)
        ordinary = np.array(
            [
                latencies[s]
                for s in range(STARTUP_STEPS, len(latencies))
                if s not in set(args.boundaries)
            ]
        )
        figures["ordinary_p999_ms"] = float(np.quantile(ordinary, 0.999)) * 1e3
        figures["ordinary_max_ms"] = float(ordinary.max()) * 1e3
        figures.update(cold_start(latencies, args.boundaries, construct_s))
        figures["rss_mib"] = (peak_anon - anon0 + peak_file - file0) / 2**20
        figures["rss_file_mib"] = (peak_file - file0) / 2**20
    print(json.dumps(figures), flush=True)


def cold_start(waits: list[float], boundaries: list[int], construct_s: float) -> dict[str, Any]:
    """Issue 36's figures of one run from step 0 (seconds): every load of the first minipoch,
    the worst after step 0, ordinary (steps 1.. that start no minipoch) and at a boundary, and
    the wait from construction through the first boundary's load."""
    first = boundaries[0]
    ordinary = [w for s, w in enumerate(waits) if s and s not in set(boundaries)]
    return {
        "construct_s": construct_s,
        "first_minipoch_loads": [round(w, 5) for w in waits[:first]],
        "worst_after_step0": max(waits[1:]),
        "worst_ordinary": max(ordinary),
        "worst_boundary": max(waits[b] for b in boundaries if b < len(waits)),
        "wait_to_first_boundary": construct_s + sum(waits[: first + 1]),
        "_waits": waits,  # for the plot (not printed)
    }


# -- the parent -----------------------------------------------------------------------------


def write_memmap(store: str) -> str:
    """The store's encoded training tokens, uncompressed, for Grain (written once)."""
    import zarr

    path = Path(store).with_suffix(".u32")
    if not path.exists():
        group: Any = zarr.open_group(store, mode="r")
        tokens = group["train"]["encoded_tokens"]
        partial = path.with_suffix(".u32.partial")
        with open(partial, "wb") as f:
            for lo in range(0, tokens.shape[0], 1 << 24):
                np.asarray(tokens[lo : lo + (1 << 24)], np.uint32).tofile(f)
        partial.rename(path)
    return str(path)


def run_child(args: argparse.Namespace, loader: str, phase: str, **extra: Any) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    # bytecode cached as an installed package's would be (this VM disables it by default)
    env["PYTHONPYCACHEPREFIX"] = str(bench_dir() / "pycache")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(Path(__file__).resolve()), "--child", loader, "--phase", phase]
    for name in ("path", "memmap", "seq_len", "batch", "spb", "rbpsb", "steps", "step_ms"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--grain-threads", str(args.grain_threads)]
    command += ["--grain-prefetch", str(args.grain_prefetch)]
    command += ["--boundaries", ",".join(map(str, args.boundaries))]
    command += ["--restart-step", str(args.restart_step)]
    spawned_at = time.time()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{loader} {phase} failed:\n{proc.stderr[-4000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    if phase == "restart":
        stamps = {k: figures.pop(k) - spawned_at for k in list(figures) if k.endswith("_at")}
        figures["restart_s"] = stamps["ready_at"]
        # the clock a user would start: after the imports every loader shares (the interpreter,
        # `import jax` and its backend)
        figures["first_batch"] = stamps["ready_at"] - stamps["jax_imported_at"]
        figures["batch11"] = stamps["eleventh_at"] - stamps["jax_imported_at"]
        # where the restart went: start + jax import and backend, the loader's imports,
        # construction, first batch
        figures["parts_s"] = [
            stamps["jax_imported_at"],
            stamps["imported_at"] - stamps["jax_imported_at"],
            stamps["constructed_at"] - stamps["imported_at"],
            stamps["ready_at"] - stamps["constructed_at"],
        ]
    return figures


def check_same_batches(args: argparse.Namespace) -> None:
    """The seqax-style loader and asyncflat must serve identical batches (else no comparison)."""
    from seqax_style import SeqaxStyleLoader

    import asyncflat

    reference = SeqaxStyleLoader(
        args.path,
        "train",
        seq_len=args.seq_len,
        batch=args.batch,
        streams=1,
        read_blocks_per_shuffle_buffer=args.rbpsb,
        sequences_per_read_block=args.spb,
    )
    params = asyncflat.FlatTokensParams(
        args.path, 1, args.rbpsb, args.spb, seed=0, sequence_packing=True
    )
    batch_params = asyncflat.TokenBatchParams(len=args.seq_len, batch=args.batch)
    steps = sorted(
        {0, args.boundaries[0] - 1, args.boundaries[0], args.restart_step, args.steps - 1}
    )
    with asyncflat.ShufflingLoader("train", params, batch_params) as loader:
        for step in steps:
            ours, theirs = loader.load(step), reference.load(step)
            for name in ("targets", "is_seq_start"):
                if not np.array_equal(
                    np.asarray(getattr(ours, name)), np.asarray(getattr(theirs, name))
                ):
                    raise SystemExit(
                        f"asyncflat and the seqax-style loader differ: step {step} {name}"
                    )
    print(f"  asyncflat and the seqax-style loader agree at steps {steps}", file=sys.stderr)


def machine() -> dict[str, Any]:
    import jax

    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "numpy": np.__version__,
    }
    try:
        import grain

        versions["grain"] = grain.__version__
    except ImportError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load_avg": os.getloadavg(), **versions}


def _rss(r: dict[str, Any], buffer_mib: float) -> str:
    text = f"{r['rss_mib']:.0f} ({r['rss_mib'] / buffer_mib:.2f}x"
    return text + (f"; {r['rss_file_mib']:.0f} file-backed)" if r["rss_file_mib"] >= 1 else ")")


#: the table's columns after the loader's name: the figures each needs, and how it is written
#: (a phase not run leaves its columns as "-")
COLUMNS: list[tuple[tuple[str, ...], Callable[[dict[str, Any], float], str]]] = [
    (("tokens_per_s",), lambda r, _: f"{r['tokens_per_s'] / 1e6:.0f}M"),
    (("first_ms",), lambda r, _: f"{r['first_ms']:.0f}"),
    (
        ("median_ms", "p999_ms", "max_ms", "max_step"),
        lambda r, _: (
            f"{r['median_ms']:.2f} / {r['p999_ms']:.2f} / {r['max_ms']:.1f} ({r['max_step']})"
        ),
    ),
    (
        ("ordinary_p999_ms", "ordinary_max_ms"),
        lambda r, _: f"{r['ordinary_p999_ms']:.2f} / {r['ordinary_max_ms']:.1f}",
    ),
    (("boundary_ms",), lambda r, _: f"{r['boundary_ms']:.1f}"),
    (
        ("restart_s", "restart_parts_s"),
        lambda r, _: (
            f"{r['restart_s']:.2f} = " + " + ".join(f"{p:.2f}" for p in r["restart_parts_s"])
        ),
    ),
    # the loader's own share of a restart (what start + `import jax`, the same for every loader
    # and its noisiest part, leaves): median over the restarts, each run on its own
    (("restart_own_s",), lambda r, _: f"{r['restart_own_s']:.3f}"),
    (("rss_mib", "rss_file_mib"), _rss),
]


def table(size: str, results: dict[str, dict[str, Any]], buffer_mib: float) -> str:
    head = (
        "| loader | tokens/s (epoch) | first step (ms) | later steps: median / p99.9 / max "
        "(ms, at step) | ordinary steps: p99.9 / max (ms) | worst boundary (ms) "
        "| restart (s): total = start+jax, imports, construct, first batch "
        "| restart beyond start+jax (s) "
        "| RSS growth (MiB, x buffer) |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for name, r in results.items():
        cells = [name]
        for keys, render in COLUMNS:
            cells.append(render(r, buffer_mib) if all(k in r for k in keys) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> None:
    size = SIZES[args.size]
    for key, value in size.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    loaders = [name.strip() for name in args.loaders.split(",") if name.strip()]
    unknown = set(loaders) - set(LOADERS)
    if unknown:
        raise SystemExit(f"unknown loaders {sorted(unknown)}; choose from {LOADERS}")
    if "grain" in loaders:
        try:
            import grain  # noqa: F401
        except ImportError:
            raise SystemExit("grain is not installed: pip install 'asyncflat[peers]'") from None
    args.path = ensure_dataset(args.layout, args.tokens)
    args.memmap = write_memmap(args.path)
    # the page cache holds both copies, as it would on a warm host
    for path in [args.memmap, *Path(args.path).rglob("*")]:
        if Path(path).is_file():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass
    import zarr

    group: Any = zarr.open_group(args.path, mode="r")
    tokens = group["train"]["encoded_tokens"].shape[0]
    rows = tokens // args.seq_len // args.spb * args.spb
    args.steps = rows // args.batch
    seqs_per_buffer = args.rbpsb * args.spb
    minipochs = -(-rows // seqs_per_buffer)
    args.boundaries = [m * seqs_per_buffer // args.batch for m in range(1, minipochs)]
    if minipochs < 2:
        raise SystemExit("the dataset fills less than two shuffle buffers: no restart step")
    args.restart_step = (seqs_per_buffer + seqs_per_buffer // 2) // args.batch
    buffer_mib = seqs_per_buffer * args.seq_len * 4 / 2**20
    print(
        f"{args.size}: {args.tokens} tokens, batch {args.batch} x {args.seq_len}, {args.steps} "
        f"steps, {buffer_mib:.0f} MiB buffer, {minipochs} minipochs, restart at step "
        f"{args.restart_step}, step {args.step_ms} ms; loaders {loaders}",
        file=sys.stderr,
    )
    if args.check:
        check_same_batches(args)
    results: dict[str, dict[str, Any]] = {name: {} for name in loaders}
    for phase in [p for p in ("epoch", "steps") if p in args.phases]:
        for name in loaders:
            figures = run_child(args, name, phase)
            results[name].update({k: v for k, v in figures.items() if k not in ("loader", "phase")})
            print(f"  {name} {phase}: {figures}", file=sys.stderr)
    restarts: dict[str, list[dict[str, Any]]] = {name: [] for name in loaders}
    for _ in range(
        args.restarts if "restart" in args.phases else 0
    ):  # interleaved, so drift on a shared machine hits all alike
        for name in loaders:
            restarts[name].append(run_child(args, name, "restart"))
    for name in [n for n in loaders if restarts[n]]:
        runs = sorted(restarts[name], key=lambda r: r["restart_s"])
        median = runs[(len(runs) - 1) // 2]
        results[name]["restart_s"] = median["restart_s"]
        results[name]["restart_all_s"] = [round(r["restart_s"], 3) for r in restarts[name]]
        # of the median run: process start to jax imported, loader imports, construct, batch
        results[name]["restart_parts_s"] = [round(p, 3) for p in median["parts_s"]]
        own = sorted(r["restart_s"] - r["parts_s"][0] for r in restarts[name])
        results[name]["restart_own_s"] = round(own[(len(own) - 1) // 2], 4)
        by_11th = sorted(restarts[name], key=lambda r: r["batch11"])
        results[name]["resume"] = {
            "first_batch": round(sorted(r["first_batch"] for r in runs)[(len(runs) - 1) // 2], 4),
            "batch11": round(by_11th[(len(runs) - 1) // 2]["batch11"], 4),
            # every load from the resumed step to its minipoch's end, of the median process
            "waits": [round(w, 5) for w in by_11th[(len(runs) - 1) // 2]["waits"]],
        }
        print(f"  {name} restarts: {restarts[name]}", file=sys.stderr)
    waits = {n: r.pop("_waits") for n, r in results.items() if "_waits" in r}
    resumed = {n: results[n]["resume"]["waits"] for n in waits if "resume" in results[n]}
    if waits and len(resumed) == len(waits):
        plot = out_dir() / f"peers-{args.size}.png"
        plot_cold_start(
            str(plot),
            waits,
            args.boundaries,
            resumed,
            title=f"load() per step, local disk ({args.size})",
            caption=(
                f"{args.tokens} tokens, {buffer_mib:.0f} MiB buffer, batch {args.batch} x "
                f"{args.seq_len}, {args.step_ms:g} ms train step, {args.layout} layout"
            ),
        )
        print(f"  wrote {plot}", file=sys.stderr)
    text = table(args.size, results, buffer_mib)
    command = "python bench/peers.py " + " ".join(sys.argv[1:])
    (out_dir() / "peers.md").write_text(f"`{command}`\n\n{text}\n")
    print(text, file=sys.stderr)
    emit(
        {
            "bench": "peers",
            "size": args.size,
            "setup": {
                "tokens": args.tokens,
                "seq_len": args.seq_len,
                "batch": args.batch,
                "steps": args.steps,
                "buffer_mib": buffer_mib,
                "step_ms": args.step_ms,
                "layout": args.layout,
                "grain_threads": args.grain_threads,
                "grain_prefetch": args.grain_prefetch,
            },
            "machine": machine(),
            "loaders": {
                name: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                for name, r in results.items()
            },
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--layout", choices=("aligned", "seqax"), default="aligned")
    parser.add_argument("--step-ms", type=float, default=5.0)
    # process start + `import jax` (~1 s) varies by 0.07-0.14 s (sd) from one process to the
    # next on a 2-core VM, more than the loaders' own shares differ: 9 restarts each, so that
    # the medians' error (~0.04 s) stays below that difference
    parser.add_argument("--restarts", type=int, default=9)
    parser.add_argument(
        "--phases",
        type=lambda s: s.split(","),
        default=["epoch", "steps", "restart"],
        help="the phases to run, comma-separated (epoch, steps, restart)",
    )
    parser.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip checking that asyncflat and the seqax-style loader serve identical batches",
    )
    parser.add_argument("--grain-threads", type=int, default=1)
    parser.add_argument("--grain-prefetch", type=int, default=16)
    for name in ("tokens", "seq_len", "batch", "spb", "rbpsb"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    # the child's arguments
    parser.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("epoch", "steps", "restart"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--memmap", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--boundaries", help=argparse.SUPPRESS)
    parser.add_argument("--restart-step", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.boundaries = [int(s) for s in args.boundaries.split(",") if s]
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
