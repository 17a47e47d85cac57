"""Scale: opening and serving 10^9 ... 10^14 tokens, as one host of 1 and as one host of 1,024.

Every corpus is a :class:`asyncflat.testing.SyntheticFileSystem` (``synthetic://``; nothing
stored, every chunk generated when read): zarr format 3 with the writer's default codecs and
checksums, 4M-token chunks, sequences of 2048 tokens, 512-sequence read blocks, 16 blocks per
shuffle buffer (64 MiB), batches of 1,024 rows of 2048 tokens, seed 0. The store's
``repeat_tokens`` makes alike chunks one object encoded once, so the figures are the loader's
(reading, checksumming and decoding every chunk it needs), not the generator's; ``store`` in
each result has its requests, MiB served and generation seconds.

For each size, a fresh child process (so nothing of another size stays mapped) measures, after
its imports (the baseline of the memory figure):

* ``one_host``: one stream, one host: a real ``ShufflingLoader``; ``construct_s`` (the
  constructor), ``first_batch_s`` (``load(0)``), ``end_batch_s`` (``load`` of the last step),
  ``peak_mib`` (the RSS high-water mark above the baseline: plan, buffers, everything).
* ``host_of_1024``: ``streams=1024``, the host with process index ``--process-index`` of 1,024.
  One process cannot hold 1,024 jax processes' devices, so this host's rows are what the
  default sharding gives it (a contiguous 1/1,024 of the batch) and the loader's own opening
  code (``asyncflat.loader.shared.open.open_engine``: source, plan, engine of this host's
  streams) runs with them on an event loop; the first and last batches are the engine's
  ``gather`` of those rows. Nothing is faked but the process index and count.
* ``all_1024_streams_on_one_host``: the same opening for a host serving all 1,024 streams
  (construct and memory only: its buffers would need 128 GiB): what a host of 1,024 is spared
  once each host plans only its own streams.

A size refused by the loader (a ``ConfigError``: 10^9 tokens hold too few read blocks for
1,024 streams; before issue 38's plan, ``DatasetTooLargeError`` at 10^14) is reported with its
message, not as a crash. ``vs_targets`` sets the run's figures against issue 38's targets where
the sizes they name were run (ratios within this run, of each size's medians where
``--repeats`` or ``--sizes`` runs it more than once; ``cpus``: the first batch's draws spread
over up to 4 of them); ``targets_not_run`` names those whose sizes were not run. Prints one
JSON line (kept in bench/out/scale.json); draws bench/out/scale.png (copied to docs/scale.png
with ``--docs``; ``--replot`` redraws a saved run).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, out_dir, peak_rss_bytes, reset_peak_rss, rss_bytes

SIZES = (10**9, 10**11, 10**12, 15 * 10**12, 10**14)
HOSTS = 1024
LAYOUT: dict[str, Any] = {
    "zarr_format": 3,
    "chunk_tokens": 1 << 22,
    "sequence_length": 2048,
    "sequences_per_read_block": 512,
    "read_blocks_per_shuffle_buffer": 16,
    "batch": 1024,
    "len": 2048,
}
MIB = 1 << 20
MODES = ("one_host", "host_of_1024", "all_1024_streams_on_one_host")
#: issue 38's ratios: name -> (the figure, the one it is divided by, the most the ratio may be)
RATIOS = {
    "first_batch_1.5e13_vs_1e9": (
        ("one_host", 15 * 10**12, "first_batch_s"),
        ("one_host", 10**9, "first_batch_s"),
        1.25,
    ),
    "construct_1.5e13_vs_1e9": (
        ("one_host", 15 * 10**12, "construct_s"),
        ("one_host", 10**9, "construct_s"),
        1.25,
    ),
    "host_of_1024_construct_vs_all_streams_1.5e13": (
        ("host_of_1024", 15 * 10**12, "construct_s"),
        ("all_1024_streams_on_one_host", 15 * 10**12, "construct_s"),
        0.01,
    ),
}
#: issue 38's memory targets: name -> (tokens, the most MiB above 10^11's peak)
MEMORY = {
    "memory_1.5e13_minus_1e11_mib": (15 * 10**12, 64),
    "memory_1e14_minus_1e11_mib": (10**14, 512),
}
#: the figures a size run more than once is read by, as their median (:func:`per_size`)
MEDIAN_KEYS = ("construct_s", "first_batch_s", "end_batch_s", "peak_mib")
#: The synthetic store's requests and bytes in this (child) process.
COUNTS: Any = None


def _params(tokens: int, streams: int) -> Any:
    from asyncflat import FlatTokensParams

    return FlatTokensParams(
        "synthetic://scale",
        streams=streams,
        read_blocks_per_shuffle_buffer=LAYOUT["read_blocks_per_shuffle_buffer"],
        sequences_per_read_block=LAYOUT["sequences_per_read_block"],
        seed=0,
        sequence_packing=True,
        storage_options={
            "tokens": tokens,
            "chunk_tokens": LAYOUT["chunk_tokens"],
            "sequence_length": LAYOUT["sequence_length"],
            "zarr_format": LAYOUT["zarr_format"],
            "repeat_tokens": True,  # alike chunks encoded once: the loader is measured
            "counts": COUNTS,
        },
    )


def _timed(call: Any) -> tuple[Any, float]:
    began = time.perf_counter()
    result = call()
    return result, time.perf_counter() - began


def one_host(tokens: int) -> dict[str, Any]:
    """One stream on one host: the real loader."""
    import jax

    from asyncflat import ShufflingLoader, TokenBatchParams

    batch = TokenBatchParams(len=LAYOUT["len"], batch=LAYOUT["batch"])
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    loader, construct_s = _timed(
        lambda: ShufflingLoader("train", _params(tokens, 1), batch, sharding)
    )
    with loader:
        first, first_s = _timed(lambda: jax.block_until_ready(loader.load(0)))
        last = loader.step_count - 1
        _, end_s = _timed(lambda: jax.block_until_ready(loader.load(last)))
        return {
            "construct_s": construct_s,
            "first_batch_s": first_s,
            "end_batch_s": end_s,
            "steps": loader.step_count,
            "streams_here": 1,
            "first_row_ok": bool(first.is_seq_start[0, 0]),
        }


def host_of(tokens: int, index: int, hosts: int, *, serve: bool = True) -> dict[str, Any]:
    """Host ``index`` of ``hosts`` with ``streams=hosts`` (``index=-1``: one host serving every
    stream): the loader's opening of the engine with the rows the default sharding gives that
    host, then (with ``serve``) the engine's gathers of its rows of the first and last steps."""
    import asyncio

    import numpy as np

    from asyncflat import EngineOptions, TokenBatchParams
    from asyncflat.loader.shared.open import open_engine

    batch = TokenBatchParams(len=LAYOUT["len"], batch=LAYOUT["batch"])
    per_host = batch.batch // hosts
    rows = np.arange(batch.batch, dtype=np.int64)
    if index >= 0:
        rows = rows[index * per_host : (index + 1) * per_host]

    async def run() -> dict[str, Any]:
        began = time.perf_counter()
        engine = await open_engine("train", _params(tokens, hosts), batch, rows, EngineOptions())
        figures: dict[str, Any] = {"construct_s": time.perf_counter() - began}
        try:
            figures["steps"] = engine.plan.step_count
            figures["streams_here"] = len(np.unique(rows // engine.plan.rows_per_stream_step))
            if serve:
                for name, step in (("first_batch_s", 0), ("end_batch_s", figures["steps"] - 1)):
                    began = time.perf_counter()
                    await engine.gather(step, rows)
                    figures[name] = time.perf_counter() - began
            return figures
        finally:
            await engine.aclose()

    return asyncio.run(run())


def child(tokens: int, mode: str, index: int) -> None:
    """Measure one size in this (fresh) process; print its JSON."""
    global COUNTS
    import jax

    from asyncflat.errors import ConfigError
    from asyncflat.testing import SyntheticCounts  # registers synthetic://

    jax.devices()  # the backend's start-up belongs to the baseline, as in a trainer
    # The imports leave a full collection due: run it now, not inside one mode's timing (it
    # took ~30 ms of the all-streams host's construction, allocating 1,024 streams' objects).
    gc.collect()
    COUNTS = SyntheticCounts()
    baseline = rss_bytes()
    reset_peak_rss()
    try:
        if mode == "one_host":
            figures = one_host(tokens)
        elif mode == "host_of_1024":
            figures = host_of(tokens, index, HOSTS)
        else:  # every stream on one host: the plan and engine a host of 1,024 is spared
            figures = host_of(tokens, -1, HOSTS, serve=False)
    except ConfigError as exc:  # DatasetTooLargeError is one; so is a layout that cannot fit
        figures = {"refused": f"{type(exc).__name__}: {exc}"}
    figures["peak_mib"] = (peak_rss_bytes() - baseline) / MIB
    figures["store"] = {
        "requests": COUNTS.requests,
        "chunk_requests": COUNTS.chunk_requests,
        "mib": COUNTS.bytes / MIB,
        "generate_s": COUNTS.generate_s,
    }
    figures["baseline_mib"] = baseline / MIB
    print(json.dumps(figures))


def run_child(tokens: int, mode: str, index: int, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    command = [sys.executable, os.path.abspath(__file__), "--child", str(tokens), mode]
    command += ["--process-index", str(index)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout:g} s"}
    if done.returncode != 0 or not done.stdout.strip():
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def per_size(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per size, in the order first run: where a size ran more than once, each timed
    figure and the memory are the median of its served runs (``runs``: how many), so that a
    repeated run is read as a whole rather than by its first process."""
    by_size: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_size.setdefault(row["tokens"], []).append(row)
    out = []
    for runs in by_size.values():
        served = [r for r in runs if "refused" not in r and "error" not in r]
        if not served:
            out.append(runs[0])
            continue
        row = dict(served[0], runs=len(served))
        for key in MEDIAN_KEYS:
            if key in row:
                row[key] = statistics.median(r[key] for r in served)
        out.append(row)
    return out


def vs_targets(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Issue 38's targets against this run: ``{name: {value, target, met}}`` for those whose
    sizes were run (the medians of a size run more than once); where such a size failed or was
    refused, ``value`` None, ``met`` False and the ``error``."""

    sized = {mode: per_size(rows) for mode, rows in results.items()}

    def at(mode: str, tokens: int, key: str) -> float | str | None:
        """The figure, the size's error (a str), or None where the size was not run."""
        row = next((r for r in sized[mode] if r["tokens"] == tokens), None)
        if row is None:
            return None
        failed = row.get("error") or row.get("refused")
        return str(failed) if failed else row.get(key)

    def judged(name: str, figures: tuple[Any, ...], target: float, value: Any) -> None:
        if any(f is None for f in figures):
            return  # a size it names was not run: targets_not_run says so
        errors = [f for f in figures if isinstance(f, str)]
        out[name] = (
            {"value": None, "target": target, "met": False, "error": errors[0]}
            if errors
            else {"value": value(*figures), "target": target}
        )

    out: dict[str, Any] = {}
    for name, (numerator, denominator, target) in RATIOS.items():
        figures = (at(*numerator), at(*denominator))
        judged(name, figures, target, lambda a, b: round(a / b, 3) if b else math.inf)
    for name, (tokens, allowed) in MEMORY.items():
        figures = (at("one_host", tokens, "peak_mib"), at("one_host", 10**11, "peak_mib"))
        judged(name, figures, allowed, lambda peak, base: round(peak - base, 1))
    for figures in out.values():
        if "met" not in figures:
            figures["met"] = figures["value"] <= figures["target"]
    return out


def rounded(figures: Any) -> Any:
    if isinstance(figures, dict):
        return {k: rounded(v) for k, v in figures.items()}
    return round(figures, 4) if isinstance(figures, float) else figures


def plot(results: dict[str, list[dict[str, Any]]], docs: bool) -> str | None:
    """The plot's path; None where matplotlib is not installed (the figures still print)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        print("no plot: matplotlib is not installed", file=sys.stderr)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (times, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {
        "one_host": ("one host of 1", "-"),
        "host_of_1024": ("one host of 1,024", "--"),
        "all_1024_streams_on_one_host": ("1,024 streams on one host (construct)", ":"),
    }
    for mode, all_rows in results.items():
        label, line = styles[mode]
        rows = sorted(per_size(all_rows), key=lambda r: r["tokens"])
        served = [r for r in rows if "construct_s" in r]
        xs = [r["tokens"] for r in served]
        for key, name, colour in (
            ("construct_s", "construct", "C0"),
            ("first_batch_s", "first batch", "C1"),
            ("end_batch_s", "batch near the end", "C2"),
        ):
            if not served or key not in served[0]:
                continue
            times.plot(
                xs,
                [r[key] for r in served],
                line,
                color=colour,
                marker="o",
                label=f"{name}, {label}",
            )
        opened = [r for r in rows if "refused" not in r and "peak_mib" in r]
        memory.plot(
            [r["tokens"] for r in opened],
            [r["peak_mib"] for r in opened],
            line,
            marker="o",
            label=label,
        )
        for r in rows:
            if "refused" in r:
                memory.plot([r["tokens"]], [r["peak_mib"]], "x", color="red")
                memory.annotate("refused", (r["tokens"], r["peak_mib"]), fontsize=8)
    times.set(
        xscale="log",
        xlabel="tokens in the corpus",
        ylabel="seconds",
        title="opening and serving (synthetic store)",
    )
    memory.set(
        xscale="log",
        xlabel="tokens in the corpus",
        ylabel="MiB above baseline",
        title="peak memory (RSS high-water mark)",
    )
    times.legend(fontsize=7)
    memory.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir() / "scale.png"
    fig.savefig(path, dpi=110)
    if docs:
        shutil.copy(path, os.path.join(os.path.dirname(out_dir()), "..", "docs", "scale.png"))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs=2, metavar=("TOKENS", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--process-index",
        type=int,
        default=HOSTS // 2,
        help="which host of 1,024 to be (default: %(default)s)",
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(float(x)) for x in s.split(",")],
        default=list(SIZES),
        help="corpus sizes in tokens, comma-separated",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the sizes this many times over, interleaved, each in a fresh process; "
        "the targets and the plot read each size's medians (default: %(default)s)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per child")
    parser.add_argument("--docs", action="store_true", help="copy the plot to docs/scale.png")
    parser.add_argument("--replot", metavar="JSON", help="only draw the plot of a saved run")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not 0 <= args.process_index < HOSTS:
        parser.error(f"--process-index must be in [0, {HOSTS}), got {args.process_index}")
    if args.replot:
        with open(args.replot) as f:
            saved = json.loads(f.read().strip().splitlines()[-1])
        print(plot({k: v for k, v in saved.items() if k in MODES}, args.docs))
        return
    if args.child:
        child(int(args.child[0]), args.child[1], args.process_index)
        return
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for tokens in args.sizes * args.repeats:
        for mode, rows in results.items():
            figures = rounded(
                {"tokens": tokens, **run_child(tokens, mode, args.process_index, args.timeout)}
            )
            print(f"{mode} {tokens:.3g}: {figures}", file=sys.stderr)
            rows.append(figures)
    from asyncflat.config import available_cpus

    figures = {
        "bench": "scale",
        "layout": LAYOUT,
        "process_index": args.process_index,
        "hosts": HOSTS,
        "cpus": available_cpus(),
        **results,
        "vs_targets": (met := vs_targets(results)),
        # the targets whose sizes this run left out (so an empty vs_targets reads as such)
        "targets_not_run": [name for name in (*RATIOS, *MEMORY) if name not in met],
        "plot": plot(results, args.docs),
    }
    (out_dir() / "scale.json").write_text(json.dumps(figures) + "\n")  # for --replot
    emit(figures)


if __name__ == "__main__":
    main()
