"""Benchmark the hand-off from gathered numpy rows to a sharded, decoded jax batch; one JSON line.

    python bench/handoff.py [--batch 64] [--len 2048] [--builds 200] [--tokens 16777216]
                            [--steps 40] [--train-ms 50]

8 CPU devices (set here, before jax is imported), batch axis sharded over all of them.

* ``build_ms``: per-step build of one (batch, len) uint32 array from host rows, plus the jitted
  decode, for each way of building it (median / p90 over ``--builds`` random batches):
  - ``callback_views``: ``jax.make_array_from_callback`` whose callback returns views of the
    rows (what ShufflingLoader does);
  - ``callback_fancy``: the same with a fancy-indexed copy per shard (the loader before);
  - ``device_put_batched``: ``jax.device_put(pieces, devices)`` +
    ``jax.make_array_from_single_device_arrays`` (jax#19919's suggestion);
  - ``device_put_loop``: one ``jax.device_put`` per device + ``make_array_from_single_device_arrays``.
  ``dispatch`` is the time until the call returns, ``ready`` until the decoded arrays exist.
  Also ``*_replicated``: a (4, 2) mesh with the batch over 4 and replicated over 2 (each piece
  sent to two devices).
* ``next_ms``: latency of ``next()`` on ``loader.iter()`` with ``prefetch_to_device`` 0 (off)
  and 1, under a simulated train step of ``--train-ms`` (a sleep: the host thread is free, as it
  is while an accelerator runs the step), over ``--steps`` steps (median / p90 / max, first step
  excluded). Dataset: the ``aligned`` layout of bench/_common.py with ``--tokens`` tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import numpy as np
from _common import emit, ensure_dataset
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import asyncflat


def _decode(encoded: jax.Array) -> tuple[jax.Array, jax.Array]:
    return encoded >> 1, (encoded & 1) == 1


DECODE = jax.jit(_decode)


def builders(sharding: jax.sharding.Sharding, shape: tuple[int, int]) -> dict:
    index_map = sharding.addressable_devices_indices_map(shape)
    devices = list(index_map)
    indices = [index_map[d] for d in devices]
    row_of = np.arange(shape[0])

    def callback_views(rows: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(shape, sharding, lambda i: rows[i], dtype=np.uint32)

    def callback_fancy(rows: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(
            shape, sharding, lambda i: rows[row_of[i[0]], i[1]], dtype=np.uint32
        )

    def device_put_batched(rows: np.ndarray) -> jax.Array:
        pieces = [rows[i] for i in indices]
        return jax.make_array_from_single_device_arrays(
            shape, sharding, jax.device_put(pieces, devices)
        )

    def device_put_loop(rows: np.ndarray) -> jax.Array:
        pieces = [jax.device_put(rows[i], d) for i, d in zip(indices, devices)]
        return jax.make_array_from_single_device_arrays(shape, sharding, pieces)

    return {
        f.__name__: f for f in (callback_views, callback_fancy, device_put_batched, device_put_loop)
    }


def time_builds(shape: tuple[int, int], builds: int, sharding: jax.sharding.Sharding) -> dict:
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 1 << 31, shape, dtype=np.uint32) for _ in range(4)]
    out = {}
    for name, build in builders(sharding, shape).items():
        for rows in pool:  # warm up (compile decode) and check
            targets, _ = DECODE(build(rows))
            assert np.array_equal(np.asarray(targets), rows >> 1), name
        dispatch, ready = [], []
        for k in range(builds):
            rows = pool[k % len(pool)].copy()  # fresh rows each step, as the engine gives
            t0 = time.perf_counter()
            decoded = DECODE(build(rows))
            t1 = time.perf_counter()
            jax.block_until_ready(decoded)
            t2 = time.perf_counter()
            dispatch.append(t1 - t0)
            ready.append(t2 - t0)
        out[name] = {
            "dispatch_median": _ms(statistics.median(dispatch)),
            "ready_median": _ms(statistics.median(ready)),
            "ready_p90": _ms(float(np.percentile(ready, 90))),
        }
    return out


def time_next(path: str, seq_len: int, batch: int, steps: int, train_s: float, depth: int) -> dict:
    params = asyncflat.FlatTokensParams(path, 1, 2, 512, 0, True)
    options = asyncflat.EngineOptions(prefetch_to_device=depth)
    with asyncflat.ShufflingLoader(
        "train", params, asyncflat.TokenBatchParams(len=seq_len, batch=batch), options=options
    ) as loader:
        steps = min(steps, loader.step_count)
        iterator = loader.iter(0)
        waits = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _, _batch_arrays = next(iterator)
            waits.append(time.perf_counter() - t0)
            time.sleep(train_s)  # the train step (uses the batch on the device)
        iterator.close()
        stats = loader.stats()
    waits = waits[1:]
    return {
        "median": _ms(statistics.median(waits)),
        "p90": _ms(float(np.percentile(waits, 90))),
        "max": _ms(max(waits)),
        "steps": len(waits),
        "engine_wait_median": _ms(stats["wait_median_s"]),
        "build_median": _ms(stats["build_median_s"]),
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--builds", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=1 << 24)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--train-ms", type=float, default=50.0)
    args = ap.parse_args()
    assert len(jax.devices()) == 8
    shape = (args.batch, args.len)
    devices = np.array(jax.devices())
    flat = NamedSharding(Mesh(devices, ("batch",)), PartitionSpec("batch", None))
    replicated = NamedSharding(
        Mesh(devices.reshape(4, 2), ("batch", "r")), PartitionSpec("batch", None)
    )
    build = time_builds(shape, args.builds, flat)
    build.update(
        {f"{k}_replicated": v for k, v in time_builds(shape, args.builds, replicated).items()}
    )
    path = ensure_dataset("aligned", args.tokens)
    train_s = args.train_ms / 1e3
    next_ms = {
        f"prefetch_{d}": time_next(path, args.len, args.batch, args.steps, train_s, d)
        for d in (0, 1)
    }
    emit(
        {
            "bench": "handoff",
            "devices": 8,
            "batch": args.batch,
            "len": args.len,
            "jax": jax.__version__,
            "build_ms": build,
            "train_step_ms": args.train_ms,
            "next_ms": next_ms,
        }
    )


if __name__ == "__main__":
    main()
