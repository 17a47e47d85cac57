"""``asyncflat demo``: a synthetic dataset, a simulated train step, and the loader's figures."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncflat.cli.output import (
    Commands,
    human_bytes,
    ms,
    non_negative_float,
    positive,
    print_json,
)

if TYPE_CHECKING:
    from asyncflat.engine.stats import EngineStats

__all__ = ["add_parser", "cmd_demo"]

log = logging.getLogger(__name__)


def _synthetic_dataset(
    path: Path, tokens: int, seed: int, chunk_tokens: int, vocab: int = 32000
) -> None:
    """Zipf-distributed token ids (id 0 left free) in log-normal-length documents."""
    import numpy as np

    from asyncflat.writer.flat_tokens import FlatTokensWriter

    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab, dtype=np.float64)
    cdf = np.cumsum(1.0 / (ranks + 2.7) ** 1.1)
    cdf /= cdf[-1]
    lengths = np.clip(rng.lognormal(5.5, 1.0, tokens // 100 + 16), 1, 8192).astype(np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    validation = max(1, len(lengths) // 100)
    with FlatTokensWriter(path, chunk_tokens=chunk_tokens) as writer:
        for split, part in (("validation", lengths[:validation]), ("train", lengths[validation:])):
            for lo in range(0, len(part), 4096):  # bounded memory: a few M tokens per append
                group = part[lo : lo + 4096]
                ids = np.searchsorted(cdf, rng.random(int(group.sum()))).astype(np.uint32) + 1
                writer.append(split, np.split(ids, np.cumsum(group)[:-1]))


def _demo_sharding(batch: int) -> Any:
    import jax
    from jax.sharding import SingleDeviceSharding

    from asyncflat.loader.shared.batch import default_sharding

    if batch % len(jax.devices()) == 0:
        return default_sharding()
    return SingleDeviceSharding(jax.devices()[0])


def _train_step_fn(kind: str, step_s: float) -> Any:
    import jax
    import jax.numpy as jnp

    if kind == "sleep":

        def sleep_step(batch: Any) -> None:
            jax.block_until_ready(batch)
            time.sleep(step_s)

        return sleep_step

    weights = jnp.ones((256, 256), jnp.float32) / 256

    @jax.jit
    def matmul(targets: jax.Array) -> jax.Array:
        x = targets[:, :256].astype(jnp.float32) / 32000.0
        for _ in range(4):
            x = jnp.tanh(x @ weights)
        return x.sum()

    def matmul_step(batch: Any) -> None:
        # Busy for step_s: compute contends for the cores like a real step would.
        deadline = time.perf_counter() + step_s
        matmul(batch.targets).block_until_ready()
        while time.perf_counter() < deadline:
            matmul(batch.targets).block_until_ready()

    return matmul_step


def add_parser(commands: Commands, parents: list[argparse.ArgumentParser]) -> None:
    """The ``demo`` sub-parser, bound to :func:`cmd_demo`."""
    demo = commands.add_parser(
        "demo",
        parents=parents,
        help="train on a synthetic dataset with a simulated step and report the figures",
        description="Write a synthetic Zipf-token dataset (or reuse --path), run a ShufflingLoader "
        "over it with a simulated train step, and print throughput, load() latency and "
        "the engine's fill figures.",
    )
    demo.add_argument(
        "--path",
        help="dataset location: reused if it exists, else written there "
        "(default: a temporary directory, removed afterwards)",
    )
    demo.add_argument(
        "--tokens",
        type=positive,
        default=1 << 24,
        help="synthetic dataset size in tokens (default 16M)",
    )
    demo.add_argument("--steps", type=positive, help="stop after this many steps (default: all)")
    demo.add_argument(
        "--step-ms",
        type=non_negative_float,
        default=5.0,
        help="simulated train step time in ms (default 5)",
    )
    demo.add_argument(
        "--step",
        choices=("sleep", "matmul"),
        default="sleep",
        help="simulate the step by sleeping or by busy jitted matmuls (default sleep)",
    )
    demo.add_argument("--len", type=positive, default=1024, help="sequence length (default 1024)")
    demo.add_argument("--batch", type=positive, default=32, help="batch size (default 32)")
    demo.add_argument("--streams", type=positive, default=1, help="streams (default 1)")
    demo.add_argument(
        "--read-blocks-per-buffer",
        type=positive,
        default=32,
        help="read blocks per shuffle buffer (default 32)",
    )
    demo.add_argument(
        "--sequences-per-block",
        type=positive,
        default=64,
        help="sequences per read block (default 64; chunks are written to match)",
    )
    demo.add_argument("--seed", type=int, default=0, help="data and shuffle seed (default 0)")
    demo.add_argument(
        "--no-packing", action="store_true", help="one document per row, truncated/padded"
    )
    demo.add_argument(
        "--no-prefetch",
        action="store_true",
        help="do not fill the next buffer in the background (the reference's behaviour)",
    )
    demo.add_argument("--json", action="store_true", help="print the figures as JSON")
    demo.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the worst load() after each minipoch boundary to FILE (.png, .svg, "
        ".pdf; needs matplotlib)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=cmd_demo, check_usage=_check_usage)


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--plot`` without matplotlib is a usage error (exit status 2), found before any work."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("demo --plot needs matplotlib: pip install matplotlib (or '.[dev]')")


@dataclasses.dataclass
class _Run:
    """What one demo run measured: each step's load() latency and the loader's figures."""

    latencies: Any  # np.ndarray of seconds, one per step
    wall_s: float
    stats: EngineStats
    first_steps: list[int]  # the first step of every minipoch after the first

    @property
    def steps(self) -> int:
        return len(self.latencies)


def cmd_demo(args: argparse.Namespace) -> int:
    tmp = None
    if args.path is None:
        tmp = tempfile.mkdtemp(prefix="asyncflat-demo-")
        path = Path(tmp) / "demo.zarr"
    else:
        path = Path(args.path)
    try:
        if not path.exists():
            t0 = time.perf_counter()
            chunk_tokens = args.sequences_per_block * args.len
            _synthetic_dataset(path, args.tokens, args.seed, chunk_tokens=chunk_tokens)
            elapsed = time.perf_counter() - t0
            log.info("wrote %d synthetic tokens to %s in %.1f s", args.tokens, path, elapsed)
        else:
            log.info("using the existing dataset at %s", path)
        run = _train(args, path)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result = _figures(args, run)
    if args.plot:
        _demo_plot(args, run.latencies, run.first_steps)
        result["plot"] = args.plot
    if args.json:
        print_json(result)
    else:
        _print_figures(args, result)
    return 0


def _train(args: argparse.Namespace, path: Path) -> _Run:
    """Run the loader over ``path`` with the simulated step, timing every load()."""
    import numpy as np
    from tqdm.auto import tqdm

    from asyncflat.config import EngineOptions, FlatTokensParams, TokenBatchParams
    from asyncflat.loader.shuffling import ShufflingLoader

    params = FlatTokensParams(
        filespec=str(path),
        streams=args.streams,
        read_blocks_per_shuffle_buffer=args.read_blocks_per_buffer,
        sequences_per_read_block=args.sequences_per_block,
        seed=args.seed,
        sequence_packing=not args.no_packing,
    )
    batch_params = TokenBatchParams(len=args.len, batch=args.batch)
    options = EngineOptions(prefetch=not args.no_prefetch)
    train_step = _train_step_fn(args.step, args.step_ms / 1e3)
    with ShufflingLoader(
        "train", params, batch_params, _demo_sharding(args.batch), options=options
    ) as loader:
        plan = loader.plan
        steps = plan.step_count if args.steps is None else min(args.steps, plan.step_count)
        latencies = np.zeros(steps)
        t_start = time.perf_counter()
        for step in tqdm(range(steps), desc="demo", unit=" steps", disable=args.no_progress):
            t0 = time.perf_counter()
            batch = loader.load(step)
            latencies[step] = time.perf_counter() - t0
            train_step(batch)
        wall = time.perf_counter() - t_start
        first_steps = [plan.first_step(m) for m in range(1, plan.minipoch_count)]
        return _Run(latencies, wall, loader.stats(), first_steps)


def _figures(args: argparse.Namespace, run: _Run) -> dict[str, Any]:
    """The demo's figures (its ``--json`` output) from one run."""
    import numpy as np

    latencies, stats, steps = run.latencies, run.stats, run.steps
    fills = [f for f in stats["fills"] if not f["cancelled"]]
    durations = [f["duration_s"] for f in fills]
    fill_rates = [f["throughput_bytes_per_s"] for f in fills if f["throughput_bytes_per_s"]]
    # Step 0 pays the cold start (compilation, the first fill): report the worst after it too.
    later = latencies[1:] if steps > 1 else latencies
    return {
        "steps": steps,
        "prefetch": not args.no_prefetch,
        "minipoch_boundaries_crossed": sum(1 for step in run.first_steps if step < steps),
        "wall_s": run.wall_s,
        "tokens_per_s": steps * args.batch * args.len / run.wall_s,
        "load_median_s": float(np.median(latencies)),
        "load_p99_s": float(np.quantile(latencies, 0.99)),
        "load_max_s": float(latencies.max()),
        "load_max_step": int(latencies.argmax()),
        "load_max_after_first_s": float(later.max()),
        "load_max_after_first_step": int(later.argmax()) + (1 if steps > 1 else 0),
        "fills": len(fills),
        "fills_prefetch": sum(f["reason"] == "prefetch" for f in fills),
        "fills_demand": sum(f["reason"] == "demand" for f in fills),
        "fills_open": sum(f["reason"] == "open" for f in fills),
        "fill_median_s": float(np.median(durations)) if durations else None,
        "fill_max_s": float(max(durations)) if durations else None,
        "fill_median_bytes_per_s": float(np.median(fill_rates)) if fill_rates else None,
        "engine_wait_median_s": stats["wait_median_s"],
        "engine_wait_max_s": stats["wait_max_s"],
        "read_amplification": stats["read_amplification"],
        "buffer_allocations": stats["buffer_allocations"],
        "bytes_read": stats["bytes_read"],
    }


def _print_figures(args: argparse.Namespace, result: dict[str, Any]) -> None:
    print(
        f"asyncflat demo: {result['steps']} steps of {args.batch} x {args.len} tokens, "
        f"{result['minipoch_boundaries_crossed']} minipoch boundaries crossed, "
        f"prefetch {'on' if result['prefetch'] else 'off'}"
    )
    print(
        f"  throughput        {result['tokens_per_s'] / 1e6:.2f} M tokens/s "
        f"({result['wall_s']:.2f} s, simulated step {args.step_ms:g} ms, {args.step})"
    )
    print(
        f"  load() latency    median {ms(result['load_median_s'])}, p99 {ms(result['load_p99_s'])}, "
        f"worst {ms(result['load_max_s'])} (step {result['load_max_step']})"
    )
    print(
        f"                    worst after the first step {ms(result['load_max_after_first_s'])} "
        f"(step {result['load_max_after_first_step']})"
    )
    print(
        f"  fills             {result['fills']} ({result['fills_prefetch']} prefetch, "
        f"{result['fills_open']} on opening, {result['fills_demand']} on demand), median {ms(result['fill_median_s'])}, "
        f"worst {ms(result['fill_max_s'])}, "
        f"{(result['fill_median_bytes_per_s'] or 0) / 1e9:.2f} GB/s useful"
    )
    print(
        f"  engine waits      median {ms(result['engine_wait_median_s'])}, "
        f"worst {ms(result['engine_wait_max_s'])}"
    )
    amp = result["read_amplification"]
    print(
        f"  read              {human_bytes(result['bytes_read'])} from storage, read amplification "
        f"{'-' if amp is None else f'{amp:.2f}'}, {result['buffer_allocations']} buffers allocated"
    )


def _demo_plot(args: argparse.Namespace, latencies: Any, first_steps: list[int]) -> None:
    from asyncflat.cli.stall_figure import machine_description, plot_boundary_latency

    label = "asyncflat (prefetch)" if not args.no_prefetch else "synchronous fills (no prefetch)"
    caption = (
        f"asyncflat demo: {len(latencies)} steps of batch {args.batch} x len {args.len}, "
        f"{args.sequences_per_block} sequences per block x {args.read_blocks_per_buffer} blocks "
        f"per buffer, {args.streams} stream(s), simulated step {args.step_ms:g} ms ({args.step}). "
        f"Machine: {machine_description()}."
    )
    plot_boundary_latency(args.plot, {label: latencies}, first_steps, caption=caption)
    log.info("wrote %s", args.plot)
