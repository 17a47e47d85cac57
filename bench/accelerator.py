"""Throughput and stalls with the batches on an accelerator, under a real jitted train step.

Runs each loader (asyncflat's ``load(step)``, asyncflat's ``iter()`` and the synchronous
seqax-style loader of ``bench/seqax_style.py``) in a fresh process on jax's default device (a
TPU or GPU where one is present, else the CPU), over the same generated tokens, twice:

* **loader only**: every step of one epoch loaded back to back, each batch's arrays ready on the
  device (``block_until_ready``): tokens/s with host-to-device copies included;
* **training**: the same epoch under a jitted step (an embedding, ``--layers`` dense layers of
  ``--dim`` in bfloat16, forward and backward, parameters updated in place), with one step in
  flight as a trainer keeps it: ``load(step + 1)`` runs on the host while the device computes
  step ``step``, and the host waits for step ``step - 1``'s loss before it dispatches. Reported:
  each ``load`` wait (median / p99.9 / max, worst boundary), the epoch's wall time against the
  device's own time for the same steps on a resident batch (``overhead``: the share of the
  epoch the device spent waiting for data).

Prints a markdown table on stderr and one JSON line on stdout::

    python bench/accelerator.py                       # 2^27 tokens, asyncflat's layout
    python bench/accelerator.py --layout seqax        # seqax's layout (4M-token chunks)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, ensure_dataset

LOADERS = ("asyncflat", "asyncflat-iter", "seqax")


def make_step(vocab: int, dim: int, layers: int) -> tuple[Any, Any]:
    """(initial parameters, jitted ``step(params, targets, is_seq_start) -> (params, loss)``)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), layers + 1)
    emb = jax.random.normal(keys[0], (vocab, dim), jnp.bfloat16)
    ws = tuple(
        jax.random.normal(k, (dim, dim), jnp.bfloat16) / np.sqrt(dim).astype(np.float32)
        for k in keys[1:]
    )

    def loss_fn(params: Any, targets: Any, is_seq_start: Any) -> Any:
        emb, ws = params
        x = emb[targets % vocab]
        for w in ws:
            x = jnp.tanh(x @ w)
        per_token = (x.astype(jnp.float32) ** 2).mean(-1)
        return jnp.mean(jnp.where(is_seq_start, 0.0, per_token))

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(params: Any, targets: Any, is_seq_start: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, targets, is_seq_start)
        params = jax.tree.map(lambda p, g: (p - 1e-3 * g).astype(p.dtype), params, grads)
        return params, loss

    return (emb, ws), step


def open_batches(args: argparse.Namespace, kind: str) -> tuple[Any, Any]:
    """(iterator over (targets, is_seq_start) from step 0, close) for loader ``kind``."""
    import peers

    ns = argparse.Namespace(
        child=kind,
        path=args.path,
        rbpsb=args.rbpsb,
        spb=args.spb,
        seq_len=args.len,
        batch=args.batch,
        steps=args.steps,
    )
    return peers.open_loader(ns, 0)


def child(args: argparse.Namespace) -> None:
    import jax

    figures: dict[str, Any] = {"loader": args.child, "machine": machine()}

    # loader only: every batch ready on the device, back to back
    batches, close = open_batches(args, args.child)
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    try:
        first = jax.block_until_ready(next(batches))
        for _ in range(args.steps - 1):
            jax.block_until_ready(next(batches))
    finally:
        elapsed = time.perf_counter() - t0
        close()
    gc.unfreeze()
    figures["loader_tokens_per_s"] = args.steps * args.batch * args.len / elapsed

    # The step is compiled for the loader's arrays (their sharding is part of jit's cache key,
    # as in a trainer), then timed on a resident batch of that sharding: the device's own time.
    params, step = make_step(args.vocab, args.dim, args.layers)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.len)
    resident = (
        jax.device_put(rng.integers(0, args.vocab, shape, dtype=np.uint32), first[0].sharding),
        jax.device_put(rng.random(shape) < 0.001, first[1].sharding),
    )
    del first
    # Warm-up before anything is timed: a chip's first few hundred steps after a compile run
    # slower than later ones (clocks, caches); timed cold, the device's own time would be
    # overstated and the loaders' overhead understated.
    for _ in range(max(1, args.warmup)):
        params, loss = step(params, *resident)
    jax.block_until_ready(loss)
    compiled = step._cache_size()

    def epoch(params: Any, setup_steps: int) -> tuple[Any, float, float, list[list[float]], Any]:
        """One training epoch: one step in flight, the next batch loaded while the device
        computes. The clock starts before the loader's construction (start-up included);
        ``setup_steps`` steps on the resident batch between construction and the first load
        stand for a trainer's own set-up there (seqax's ``train.py`` builds its loader before
        it initialises and compiles the model) and are left out of the clock."""
        gc.collect()
        gc.freeze()
        t_start = time.perf_counter()
        batches, close = open_batches(args, args.child)
        construct_s = time.perf_counter() - t_start
        for _ in range(setup_steps):
            params, loss = step(params, *resident)
        if setup_steps:
            jax.block_until_ready(loss)
        setup_s = time.perf_counter() - t_start - construct_s
        waits, dispatches, syncs = [], [], []
        losses: list[Any] = []
        try:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                targets, is_seq_start = next(batches)
                t1 = time.perf_counter()
                params, loss = step(params, targets, is_seq_start)
                t2 = time.perf_counter()
                losses.append(loss)
                if len(losses) >= 2:
                    losses[-2].block_until_ready()
                waits.append(t1 - t0)
                dispatches.append(t2 - t1)
                syncs.append(time.perf_counter() - t2)
            jax.block_until_ready(losses[-1])
        finally:
            wall = time.perf_counter() - t_start - setup_s
            close()
        gc.unfreeze()
        return params, wall, construct_s, [waits, dispatches, syncs], losses

    params, wall, construct_s, (waits, dispatches, syncs), losses = epoch(params, 0)
    if args.setup_steps:
        params, wall_setup, _, (waits_setup, _, _), _ = epoch(params, args.setup_steps)

    # The device's own time per step, on the resident batch, measured after the training loop
    # (the chip as warm as it was during it).
    n = min(200, args.steps)
    t0 = time.perf_counter()
    for _ in range(n):
        params, loss = step(params, *resident)
    jax.block_until_ready(loss)
    device_step_s = (time.perf_counter() - t0) / n
    figures["device_step_ms"] = device_step_s * 1e3
    gc.unfreeze()
    ms = np.array(waits) * 1e3
    later = ms[1:]
    figures.update(
        train_tokens_per_s=args.steps * args.batch * args.len / wall,
        wall_s=wall,
        construct_s=construct_s,
        # the whole epoch, the loader's construction and first loads included
        overhead=wall / (args.steps * device_step_s) - 1,
        idle_share=1 - args.steps * device_step_s / wall,
        # the same from the first load on (construction left out)
        overhead_after_construct=(wall - construct_s) / (args.steps * device_step_s) - 1,
        # the loader built before a trainer's set-up (--setup-steps), which then hides its
        # first fill: construction and the whole epoch, the set-up left out
        idle_share_after_setup=(
            1 - args.steps * device_step_s / wall_setup if args.setup_steps else None
        ),
        first_ms_after_setup=float(waits_setup[0]) * 1e3 if args.setup_steps else None,
        later_max_ms_after_setup=(
            float(np.max(waits_setup[1:])) * 1e3 if args.setup_steps else None
        ),
        waits_ms=float(np.sum(waits)) * 1e3,
        waits_ms_after_setup=float(np.sum(waits_setup)) * 1e3 if args.setup_steps else None,
        wall_s_after_setup=wall_setup if args.setup_steps else None,
        first_ms=float(ms[0]),
        median_ms=float(np.median(later)),
        p999_ms=float(np.quantile(later, 0.999)),
        max_ms=float(later.max()),
        max_step=int(np.argmax(later)) + 1,
        boundary_ms=max((float(ms[s]) for s in args.boundaries if s < len(ms)), default=0.0),
        final_loss=float(losses[-1]),
        dispatch_median_ms=float(np.median(dispatches)) * 1e3,
        dispatch_max_ms=float(np.max(dispatches)) * 1e3,
        sync_median_ms=float(np.median(syncs)) * 1e3,
        recompiled=step._cache_size() - compiled,
        sharding=repr(resident[0].sharding),
    )
    print(json.dumps(figures), flush=True)


def machine() -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device": device.device_kind,
        "devices": jax.device_count(),
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def row(r: dict[str, Any]) -> str:
    return (
        f"| {r['loader']} | {r['loader_tokens_per_s'] / 1e6:.0f}M "
        f"| {r['train_tokens_per_s'] / 1e6:.1f}M | {r['device_step_ms']:.2f} "
        f"| {100 * r['overhead']:.1f}% ({100 * r['idle_share']:.2f}% idle) | {r['first_ms']:.0f} "
        f"| {_share(r.get('idle_share_after_setup'))} / {_ms(r.get('first_ms_after_setup'))} "
        f"| {r['median_ms']:.2f} / {r['p999_ms']:.2f} / {r['max_ms']:.1f} ({r['max_step']}) "
        f"| {r['boundary_ms']:.1f} | {r['final_loss']:.6f} |"
    )


def parent(args: argparse.Namespace) -> None:
    # The parent only plans, on the CPU: one process at a time may hold a TPU, and each child
    # must find it free.
    child_env = dict(os.environ)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import asyncflat

    args.path = ensure_dataset(args.layout, args.tokens)
    params = asyncflat.FlatTokensParams(
        args.path, 1, args.rbpsb, args.spb, seed=0, sequence_packing=True
    )
    with asyncflat.ShufflingLoader(
        "train", params, asyncflat.TokenBatchParams(len=args.len, batch=args.batch)
    ) as loader:
        plan = loader.plan
        steps = loader.step_count
    boundaries = [plan.first_step(m) for m in range(1, plan.minipoch_count)]
    steps = steps if args.steps is None else min(args.steps, steps)
    results = []
    for kind in args.loaders.split(","):
        command = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--path",
            args.path,
            "--steps",
            str(steps),
            "--boundaries",
            ",".join(map(str, boundaries)),
        ]
        for name in ("len", "batch", "spb", "rbpsb", "dim", "layers", "vocab", "warmup"):
            command += [f"--{name}", str(getattr(args, name))]
        command += ["--setup-steps", str(args.setup_steps)]
        out = subprocess.run(command, capture_output=True, text=True, check=False, env=child_env)
        if out.returncode:
            sys.stderr.write(out.stderr[-6000:])
            raise SystemExit(f"{kind}: child failed with exit status {out.returncode}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{kind}: done", file=sys.stderr, flush=True)
    config = {
        "tokens": args.tokens,
        "layout": args.layout,
        "batch": args.batch,
        "len": args.len,
        "buffer_mib": plan.buffer_bytes / 2**20,
        "steps": steps,
        "boundaries": boundaries,
        "dim": args.dim,
        "layers": args.layers,
    }
    info = results[0]["machine"]
    print(
        f"\n{info['device']} ({info['platform']}, {info['devices']} device(s)), host "
        f"{info['host']}, jax {info['jax']}; {args.tokens / 2**20:.0f}M tokens, "
        f"{args.layout} layout, batch {args.batch} x {args.len}, "
        f"{plan.buffer_bytes / 2**20:.0f} MiB buffer, {steps} steps, boundaries at {boundaries}; "
        f"step: {args.layers} layers of {args.dim} (bf16)\n",
        file=sys.stderr,
    )
    print(
        "| loader | loader only (tokens/s) | training (tokens/s) | device step (ms) "
        "| overhead (idle share), start-up included | first load (ms) "
        "| built before a set-up: idle share / first load (ms) "
        "| later loads: median / p99.9 / max (ms, at step) "
        "| worst boundary (ms) | final loss |\n|---|---|---|---|---|---|---|---|---|---|",
        file=sys.stderr,
    )
    for r in results:
        print(row(r), file=sys.stderr)
    emit({"machine": info, "config": config, "results": results})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 27)
    parser.add_argument("--layout", default="aligned", choices=["seqax", "aligned"])
    parser.add_argument("--len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--spb", type=int, default=512, help="sequences per read block")
    parser.add_argument("--rbpsb", type=int, default=64, help="read blocks per shuffle buffer")
    parser.add_argument("--steps", type=int, default=None, help="at most this many (one epoch)")
    parser.add_argument("--dim", type=int, default=1024, help="the train step's model width")
    parser.add_argument("--layers", type=int, default=1, help="the train step's dense layers")
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument(
        "--warmup", type=int, default=300, help="untimed train steps after the compile"
    )
    parser.add_argument(
        "--setup-steps",
        type=int,
        default=100,
        help="a second epoch with this many resident-batch steps between the loader's "
        "construction and its first load (a trainer's set-up); 0: none",
    )
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--boundaries", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.boundaries = [int(s) for s in args.boundaries.split(",") if s]
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
