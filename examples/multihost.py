"""asyncflat on several hosts: run one copy of this script per process (docs/multihost.md).

Two local processes, 4 CPU devices each, one global mesh of 8 devices::

    python examples/multihost.py --process-id 0 &
    python examples/multihost.py --process-id 1

Process 0 writes a small demo dataset (unless ``--data`` already holds one), every process then
opens the same loader with the same parameters; each fills only the streams of its own batch
rows and builds its part of the global batch. A jitted reduction over the global batch (a
cross-process computation) shows both processes see the same data. Each prints what it read.
On real hosts, pass ``--coordinator host0:port`` and ``--local-devices 0`` (use the hardware).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also runs from a checkout


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--coordinator", default="127.0.0.1:8476", help="host:port of process 0")
    ap.add_argument(
        "--local-devices",
        type=int,
        default=4,
        help="CPU devices per process (0: do not force a CPU device count)",
    )
    ap.add_argument("--data", default="/tmp/asyncflat-multihost-demo.zarr")
    ap.add_argument("--streams", type=int, default=8, help="at least the number of processes")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--start-step", type=int, default=0, help="resume from this step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--timeout", type=int, default=60, help="seconds to wait for the other processes"
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.local_devices:  # must happen before jax is imported
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    import asyncflat

    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.timeout,
    )
    me = f"[process {jax.process_index()}/{jax.process_count()}]"
    print(f"{me} {jax.local_device_count()} local devices, {jax.device_count()} in all", flush=True)

    if jax.process_index() == 0 and not os.path.exists(args.data):
        rng = np.random.default_rng(0)
        sequences = [rng.integers(0, 32_000, rng.integers(16, 400)) for _ in range(20_000)]
        asyncflat.write_flat_tokens(
            args.data,
            {"train": sequences, "validation": sequences[:100]},
            chunk_tokens=64 * args.len,
        )
        print(f"{me} wrote {args.data}", flush=True)
    multihost_utils.sync_global_devices("asyncflat-demo-data-written")  # a barrier

    params = asyncflat.FlatTokensParams(
        filespec=args.data,
        streams=args.streams,
        read_blocks_per_shuffle_buffer=8,
        sequences_per_read_block=64,
        seed=0,
        sequence_packing=True,
    )
    batch_params = asyncflat.TokenBatchParams(len=args.len, batch=args.batch)

    @jax.jit
    def train_step(batch: asyncflat.TokenBatch) -> jax.Array:  # stands in for a real step
        return jnp.sum(batch.targets.astype(jnp.uint32)) + jnp.sum(batch.is_seq_start)

    # sharding=None: the batch axis over every device of every process (default_sharding()).
    with asyncflat.ShufflingLoader("train", params, batch_params) as loader:
        stop = min(loader.step_count, args.start_step + args.steps)
        t0 = time.perf_counter()
        iterator = loader.iter(args.start_step)  # keeps the next step built (prefetch_to_device)
        for step, batch in iterator:
            checksum = int(train_step(batch))  # the same value in every process
            if step % 5 == 0 or step == stop - 1:
                print(f"{me} step {step}: global checksum {checksum}", flush=True)
            if step == stop - 1:
                break
        iterator.close()
        elapsed = time.perf_counter() - t0
        stats = loader.stats()
    print(
        f"{me} {stop - args.start_step} steps in {elapsed:.2f} s; this host holds "
        f"{stats['host_batch_rows']}/{args.batch} batch rows, filled streams {stats['streams']} "
        f"of {args.streams}, {stats['bytes_useful'] / 2**20:.2f} MiB useful, "
        f"{stats['bytes_read'] / 2**20:.2f} MiB read",
        flush=True,
    )
    multihost_utils.sync_global_devices("asyncflat-demo-done")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
