"""``asyncflat demo``: a synthetic dataset, a simulated train step, and the loader's figures."""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncflat.cli.output import human_bytes, ms, print_json

__all__ = ["cmd_demo"]

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

    from asyncflat.loader.batch import default_sharding

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


def cmd_demo(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm.auto import tqdm

    from asyncflat.config import EngineOptions, FlatTokensParams, TokenBatchParams
    from asyncflat.loader.shuffling import ShufflingLoader

    tmp = None
    if args.path is None:
        tmp = tempfile.mkdtemp(prefix="asyncflat-demo-")
        path = Path(tmp) / "demo.zarr"
    else:
        path = Path(args.path)
    try:
        spb = args.sequences_per_block
        if not path.exists():
            t0 = time.perf_counter()
            _synthetic_dataset(path, args.tokens, args.seed, chunk_tokens=spb * args.len)
            log.info(
                "wrote %d synthetic tokens to %s in %.1f s",
                args.tokens,
                path,
                time.perf_counter() - t0,
            )
        else:
            log.info("using the existing dataset at %s", path)
        params = FlatTokensParams(
            filespec=str(path),
            streams=args.streams,
            read_blocks_per_shuffle_buffer=args.read_blocks_per_buffer,
            sequences_per_read_block=spb,
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
            stats = loader.stats()
            first_steps = [plan.first_step(m) for m in range(1, plan.minipoch_count)]
            boundaries = sum(1 for step in first_steps if step < steps)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    fills = [f for f in stats["fills"] if not f["cancelled"]]
    durations = [f["duration_s"] for f in fills]
    fill_rates = [f["throughput_bytes_per_s"] for f in fills if f["throughput_bytes_per_s"]]
    # Step 0 pays the cold start (compilation, the first fill): report the worst after it too.
    later = latencies[1:] if steps > 1 else latencies
    result = {
        "steps": steps,
        "prefetch": not args.no_prefetch,
        "minipoch_boundaries_crossed": boundaries,
        "wall_s": wall,
        "tokens_per_s": steps * args.batch * args.len / wall,
        "load_median_s": float(np.median(latencies)),
        "load_p99_s": float(np.quantile(latencies, 0.99)),
        "load_max_s": float(latencies.max()),
        "load_max_step": int(latencies.argmax()),
        "load_max_after_first_s": float(later.max()),
        "load_max_after_first_step": int(later.argmax()) + (1 if steps > 1 else 0),
        "fills": len(fills),
        "fills_prefetch": sum(f["reason"] == "prefetch" for f in fills),
        "fills_demand": sum(f["reason"] == "demand" for f in fills),
        "fill_median_s": float(np.median(durations)) if durations else None,
        "fill_max_s": float(max(durations)) if durations else None,
        "fill_median_bytes_per_s": float(np.median(fill_rates)) if fill_rates else None,
        "engine_wait_median_s": stats["wait_median_s"],
        "engine_wait_max_s": stats["wait_max_s"],
        "read_amplification": stats["read_amplification"],
        "buffer_allocations": stats["buffer_allocations"],
        "bytes_read": stats["bytes_read"],
    }
    if args.plot:
        _demo_plot(args, latencies, first_steps)
        result["plot"] = args.plot
    if args.json:
        print_json(result)
        return 0
    print(
        f"asyncflat demo: {steps} steps of {args.batch} x {args.len} tokens, "
        f"{boundaries} minipoch boundaries crossed, prefetch {'on' if result['prefetch'] else 'off'}"
    )
    print(
        f"  throughput        {result['tokens_per_s'] / 1e6:.2f} M tokens/s "
        f"({wall:.2f} s, simulated step {args.step_ms:g} ms, {args.step})"
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
        f"{result['fills_demand']} on demand), median {ms(result['fill_median_s'])}, "
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
    return 0


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
