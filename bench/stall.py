"""Stall benchmark: load() latency per step across minipoch boundaries, prefetch on vs off.

Runs a training loop with a simulated step (``--step-ms`` of sleep, i.e. a trainer that waits
on the accelerator) over a whole epoch of the reference setup (2^28 tokens in seqax's layout,
len 2048, batch 64, 512 sequences per block, 64 blocks per buffer: 4 minipochs, 3 boundaries),
once with prefetch and once with the reference's synchronous fills, each in a fresh process so
peak RSS is per mode. In the same process it times the bare cost of a batch (numpy gather +
``make_array_from_callback`` + decode) as the floor. Prints one JSON line, writes the per-step
latencies to ``bench/out/stall.json`` and draws ``bench/out/stall.png`` (the figure of
``docs/stall.png``: the worst load() after each boundary, both modes, log scale, with the
configuration and machine in its caption). ``--replot FILE.json`` redraws a saved run.

Targets: max load() after the first <= 2x the steady median; steady median <= 1.3x the bare
floor; peak RSS <= 2.2x the shuffle buffer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    REFERENCE_TOKENS,
    emit,
    ensure_dataset,
    out_dir,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)


def child(args: argparse.Namespace) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax

    import asyncflat
    from asyncflat.loader.shared.batch import BatchBuilder, decode, default_sharding

    params = asyncflat.FlatTokensParams(
        args.path, args.streams, args.rbpsb, args.spb, seed=0, sequence_packing=True
    )
    batch_params = asyncflat.TokenBatchParams(len=args.len, batch=args.batch)
    # jax and the batch building warm up before the baseline RSS is taken
    shape = (args.batch, args.len)
    jax.block_until_ready(
        BatchBuilder(default_sharding(), shape).build_full(*decode(np.zeros(shape, np.uint32)))
    )
    # The permutation kernel's one-time JIT (~130 MiB of LLVM, whatever the buffer size) is
    # measured apart, so that the ratio below is the memory that scales with the buffer.
    rss_jit = rss_bytes()
    asyncflat.plan.permutation(0, 1 << 16)
    rss0 = rss_bytes()
    reset_peak_rss()  # the peak below: over the epoch, not the start-up's transients
    options = asyncflat.EngineOptions(prefetch=args.mode == "on")
    latencies = []
    with asyncflat.ShufflingLoader("train", params, batch_params, options=options) as loader:
        if args.gc_freeze:
            # What long-running JAX trainers do: move the start-up heap out of the collector's
            # sight, so a full collection does not walk jax's ~10^5 objects (~100 ms here).
            gc.collect()
            gc.freeze()
        steps = loader.step_count if args.steps is None else min(args.steps, loader.step_count)
        for step in range(steps):
            t0 = time.perf_counter()
            batch = loader.load(step)
            latencies.append(time.perf_counter() - t0)
            time.sleep(args.step_ms / 1000)
            del batch
        stats = loader.stats()
        plan = loader.plan
        peak = peak_rss_bytes()
        # The floor: the same rows gathered from a resident numpy array, decoded and wrapped.
        rows = np.random.default_rng(0).integers(
            0, 1 << 30, (plan.seqs_per_buffer, args.len), dtype=np.uint32
        )
        perm = plan.row_permutation(0, 0)
        builder = BatchBuilder(loader.sharding, shape)
        floor = []
        for step in range(min(400, steps)):
            t0 = time.perf_counter()
            host = rows[perm[(step * args.batch + np.arange(args.batch)) % len(perm)]]
            out = builder.build_full(*decode(host))
            floor.append(time.perf_counter() - t0)
            time.sleep(args.step_ms / 1000)
            del out
    print(
        json.dumps(
            {
                "jit_rss": rss0 - rss_jit,
                "latencies": latencies,
                "floor": floor,
                "step_s": args.step_ms / 1000,
                "rss0": rss0,
                "peak_rss": peak,
                "buffer_bytes": plan.buffer_bytes,
                "streams": plan.streams,
                "minipoch_first_steps": [plan.first_step(m) for m in range(plan.minipoch_count)],
                "fills": stats.as_dict()["fills"],
                "read_amplification": stats["read_amplification"],
            }
        )
    )


def summarize(run: dict) -> dict:
    lat = np.array(run["latencies"])
    after_first = lat[1:]
    median = float(np.median(after_first))
    fills = [f for f in run["fills"] if not f["cancelled"]]
    # Loads just after each boundary (where the reference stalls for a whole fill), and the
    # steady state: after the first fill has completed (the first steps of a fresh loader wait
    # for the blocks that step 0 did not need: that is start-up, measured by bench/resume.py).
    boundary = np.concatenate([lat[b : b + 64] for b in run["minipoch_first_steps"][1:]])
    wall = np.cumsum(lat + run["step_s"])
    warm = int(np.searchsorted(wall, max(f["duration_s"] for f in fills[:1]))) + 1 if fills else 1
    # From the second minipoch on, both buffers have been touched once: on these VMs the first
    # touch of guest memory stalls the whole VM (~0.7 s per 256 MiB), a one-time start-up cost.
    second = lat[run["minipoch_first_steps"][1] :]
    return {
        "max_from_second_minipoch_ms": round(float(second.max()) * 1e3, 3),
        "max_from_second_minipoch_over_median": round(float(second.max()) / median, 2),
        "max_at_boundaries_ms": round(float(boundary.max()) * 1e3, 3),
        "max_after_first_fill_ms": round(float(lat[warm:].max()) * 1e3, 3),
        "max_after_first_fill_over_median": round(float(lat[warm:].max()) / median, 2),
        "first_load_ms": round(lat[0] * 1e3, 3),
        "median_ms": round(median * 1e3, 3),
        "p99_ms": round(float(np.percentile(after_first, 99)) * 1e3, 3),
        "max_after_first_ms": round(float(after_first.max()) * 1e3, 3),
        "max_over_median": round(float(after_first.max()) / median, 2),
        "floor_median_ms": round(float(np.median(run["floor"])) * 1e3, 3),
        "median_over_floor": round(median / float(np.median(run["floor"])), 2),
        "fill_s": [round(f["duration_s"], 3) for f in fills],
        "permutation_jit_mib": round(run["jit_rss"] / 2**20),
        "peak_rss_over_buffer": round(
            (run["peak_rss"] - run["rss0"]) / (run["buffer_bytes"] * run["streams"]), 2
        ),
    }


def plot(runs: dict, path: str, config: dict) -> None:
    from asyncflat.cli.stall_figure import machine_description, plot_boundary_latency

    caption = (
        f"{config['tokens'] / 2**20:,.0f}M tokens ({config['layout']} layout), len {config['len']}, "
        f"batch {config['batch']}, {config['spb']} sequences per read block x {config['rbpsb']} "
        f"blocks per buffer, {config['streams']} stream(s); simulated step {config['step_ms']:g} ms "
        f"(sleep). Machine: {config.get('machine') or machine_description()}"
    )
    if "load_average" in config:
        before, after = config["load_average"]
        caption += f", 1-minute load average {before:g} before the runs and {after:g} after"
    caption += "."
    plot_boundary_latency(
        path,
        {
            "asyncflat (next buffer filled in the background)": runs["on"]["latencies"],
            "synchronous fills (seqax's ShufflingLoader)": runs["off"]["latencies"],
        },
        runs["on"]["minipoch_first_steps"][1:],
        caption=caption,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=REFERENCE_TOKENS)
    parser.add_argument("--layout", default="seqax", choices=["seqax", "aligned"])
    parser.add_argument("--len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--spb", type=int, default=512)
    parser.add_argument("--rbpsb", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--gc-freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.freeze() after start-up, as trainers do (default: on)",
    )
    parser.add_argument("--replot", metavar="JSON", help="redraw the figure of a saved run")
    parser.add_argument("--mode", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        return child(args)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        png = os.path.splitext(args.replot)[0] + ".png"
        plot(saved["runs"], png, saved["config"])
        print(json.dumps({"bench": "stall", "plot": png}))
        return None
    path = ensure_dataset(args.layout, args.tokens)
    load_before = os.getloadavg()[0]
    runs = {}
    for mode in ("on", "off"):
        cmd = [sys.executable, __file__, "--mode", mode, "--path", path] + sys.argv[1:]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    from asyncflat.cli.stall_figure import machine_description

    config = {
        "tokens": args.tokens,
        "layout": args.layout,
        "len": args.len,
        "batch": args.batch,
        "spb": args.spb,
        "rbpsb": args.rbpsb,
        "streams": args.streams,
        "step_ms": args.step_ms,
        "machine": machine_description(),
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }
    with open(out_dir() / "stall.json", "w") as f:
        json.dump({"config": config, "runs": runs}, f)
    png = out_dir() / "stall.png"
    plot(runs, str(png), config)
    on, off = summarize(runs["on"]), summarize(runs["off"])
    emit(
        {
            "bench": "stall",
            "tokens": args.tokens,
            "layout": args.layout,
            "step_ms": args.step_ms,
            "gc_freeze": args.gc_freeze,
            "steps": len(runs["on"]["latencies"]),
            "boundaries": len(runs["on"]["minipoch_first_steps"]) - 1,
            "prefetch_on": on,
            "prefetch_off": off,
            "target_max_over_median": 2.0,
            "meets_max_target": on["max_after_first_fill_over_median"] <= 2.0,
            "target_median_over_floor": 1.3,
            "meets_median_target": on["median_over_floor"] <= 1.3,
            "target_rss_over_buffer": 2.2,
            "meets_rss_target": on["peak_rss_over_buffer"] <= 2.2,
            "plot": str(png),
        }
    )


if __name__ == "__main__":
    main()
