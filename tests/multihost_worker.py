"""One process of a multi-host test run (started by tests/test_multihost.py, never by pytest).

Usage: ``python tests/multihost_worker.py SPEC.json PROCESS_ID``. The spec names the dataset,
the number of processes and local devices, the coordinator port, the output directory and the
cases to run. For every case this process:

1. loads steps ``start .. start+count-1`` in order with ``load()``, letting the engine settle
   after each (so the bytes it read are deterministic), and records ``stats()``;
2. iterates the same steps with ``iter(start)`` (device prefetch on), plus a few steps out of
   order with ``load()``, and for each step saves
   * ``gathered``: the global batch gathered with ``process_allgather`` (targets, is_seq_start);
   * ``local``: the global batch as seen through this process's addressable shards only, with a
     mask of the rows/columns they cover.

Results go to ``OUT/result-<process_id>.npz`` and ``OUT/stats-<process_id>.json``. The parent
compares them with the oracle (tests/reference_impl.py) and with the other runs.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time

with open(sys.argv[1]) as _f:
    SPEC = json.load(_f)
PROCESS_ID = int(sys.argv[2])
# Before jax is imported anywhere.
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={SPEC['local_devices']}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import asyncflat  # noqa: E402

SETTLE_TIMEOUT_S = 20.0


def make_sharding(kind: str) -> jax.sharding.Sharding | None:
    """The sharding of a case; the same construction in a 1-process and a 2-process run."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n = len(devices)
    if kind == "default":
        return None
    if kind == "interleaved":  # batch rows alternate between processes: non-contiguous host rows
        order = [devices[(i % 2) * (n // 2) + i // 2] for i in range(n)]
        return NamedSharding(Mesh(np.array(order), ("batch",)), PartitionSpec("batch", None))
    if kind == "batch_seq":  # batch over 4, sequence axis over 2 (within a process)
        mesh = Mesh(np.array(devices).reshape(n // 2, 2), ("batch", "seq"))
        return NamedSharding(mesh, PartitionSpec("batch", "seq"))
    if kind == "replicated_over_processes":  # every process holds the whole batch
        mesh = Mesh(np.array(devices).reshape(2, n // 2), ("replica", "batch"))
        return NamedSharding(mesh, PartitionSpec("batch", None))
    raise ValueError(kind)


def settle(loader: asyncflat.ShufflingLoader) -> None:
    """Wait until no fill is running, so the bytes read so far no longer depend on timing."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        stats = loader.stats()
        if not stats["active_fills"] and stats["units_in_flight"] == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"fills still running after {SETTLE_TIMEOUT_S} s: {stats['active_fills']}"
            )
        time.sleep(0.002)


def local_view(array: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """The global array as far as this process's shards show it, and the mask they cover."""
    values = np.zeros(array.shape, np.dtype(array.dtype))
    covered = np.zeros(array.shape, bool)
    for shard in array.addressable_shards:
        assert shard.device.process_index == jax.process_index()
        values[shard.index] = np.asarray(shard.data)
        covered[shard.index] = True
    return values, covered


def run_case(case: dict, results: dict[str, np.ndarray]) -> dict:
    name = case["name"]
    params = asyncflat.FlatTokensParams(
        SPEC["dataset"], case["streams"], case["rbpsb"], case["spb"], case["seed"], case["packing"]
    )
    batch_params = asyncflat.TokenBatchParams(len=case["len"], batch=case["batch"])
    # No load-ahead and no fill on opening: the byte counts below are those of exactly these
    # steps' fills (a build of the step after the last could start one more, and step 0's
    # fills, cancelled by a first load elsewhere, a part of theirs that depends on timing);
    # iter() below still builds ahead.
    options = asyncflat.EngineOptions(
        prefetch_to_device=case.get("prefetch_to_device", 1), load_ahead=False, fill_on_open="never"
    )
    steps = list(range(case["start"], case["start"] + case["count"]))
    with asyncflat.ShufflingLoader(
        "train", params, batch_params, make_sharding(case["sharding"]), options=options
    ) as loader:
        read_at_open = loader.stats()["bytes_read"]  # metadata, seq_starts
        for step in steps:
            loader.load(step)
            settle(loader)
        stats = loader.stats()
        record = {
            key: stats[key]
            for key in ("streams", "bytes_read", "bytes_useful", "bytes_decoded", "host_batch_rows")
        }
        record["bytes_read"] -= read_at_open
        record["fill_streams"] = sorted({f["stream"] for f in stats["fills"]})
        record["step_count"] = loader.step_count

        served: list[tuple[int, asyncflat.TokenBatch]] = []
        progress(f"case {name}: iterating")
        iterator = loader.iter(case["start"])
        for step, batch in iterator:
            served.append((step, batch))
            if len(served) == len(steps):
                break
        iterator.close()
        progress(f"case {name}: out of order")
        for step in case["out_of_order"]:
            served.append((step, loader.load(step)))

        progress(f"case {name}: gathering")
        save_served(name, case, served, results)
        record["served"] = len(served)
    # No asyncflat thread may outlive close().
    record["threads_after_close"] = [t.name for t in threading.enumerate() if "asyncflat" in t.name]
    return record


def save_served(name: str, case: dict, served: list, results: dict[str, np.ndarray]) -> None:
    """Save each served step's gathered global batch and this process's own view of it."""
    for i, (step, batch) in enumerate(served):
        assert batch.targets.shape == (case["batch"], case["len"])
        targets = multihost_utils.process_allgather(batch.targets, tiled=True)
        starts = multihost_utils.process_allgather(batch.is_seq_start, tiled=True)
        local_t, covered = local_view(batch.targets)
        local_s, _ = local_view(batch.is_seq_start)
        results[f"{name}/{i}/step"] = np.array(step)
        results[f"{name}/{i}/targets"] = np.asarray(targets)
        results[f"{name}/{i}/is_seq_start"] = np.asarray(starts)
        results[f"{name}/{i}/local_targets"] = local_t
        results[f"{name}/{i}/local_is_seq_start"] = local_s
        results[f"{name}/{i}/covered"] = covered


def run_mixture(case: dict, results: dict[str, np.ndarray]) -> dict:
    """A mixture of sources over the same store (different seeds): load, iterate, out of order."""
    sources = tuple(
        asyncflat.MixtureSource(
            asyncflat.FlatTokensParams(
                SPEC["dataset"], case["streams"], case["rbpsb"], case["spb"], seed, True
            ),
            weight,
        )
        for seed, weight in zip(case["seeds"], case["weights"])
    )
    mixture = asyncflat.MixtureParams(
        sources, seed=case["mix_seed"], block_rows=case["block_rows"], steps=case["steps"]
    )
    batch_params = asyncflat.TokenBatchParams(len=case["len"], batch=case["batch"])
    options = asyncflat.EngineOptions(prefetch_to_device=1)
    with asyncflat.ShufflingLoader("train", mixture, batch_params, options=options) as loader:
        served = [(step, batch) for step, batch in loader.iter(case["start"])]
        served += [(step, loader.load(step)) for step in case["out_of_order"]]
        save_served(case["name"], case, served, results)
        stats = loader.stats()
        record = {
            "served": len(served),
            "host_rows": len(loader.host_rows),
            "source_streams": [list(s.engine.streams) for s in stats.sources],
            "fill_streams": [sorted({f.stream for f in s.engine.fills}) for s in stats.sources],
        }
    record["threads_after_close"] = [t.name for t in threading.enumerate() if "asyncflat" in t.name]
    return record


class _DropSplitLoss(logging.Filter):
    """Drop the loader's expected "tokens are never served" warning: it would fill the log tail
    the parent shows on a failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "are never served" not in record.getMessage()


def progress(message: str) -> None:
    """One line per phase, so a failing run's log says where each process was."""
    print(
        f"[{time.strftime('%H:%M:%S')} process {PROCESS_ID}] {message}", file=sys.stderr, flush=True
    )


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropSplitLoss())
    # A hung run shows every thread's stack in the log before the parent's deadline kills it.
    faulthandler.dump_traceback_later(SPEC["dump_stacks_after_s"], exit=False)
    t0 = time.perf_counter()
    if SPEC["num_processes"] > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{SPEC['port']}",
            num_processes=SPEC["num_processes"],
            process_id=PROCESS_ID,
            initialization_timeout=SPEC["init_timeout_s"],
            heartbeat_timeout_seconds=10,
            shutdown_timeout_seconds=10,
        )
    assert jax.process_count() == SPEC["num_processes"]
    assert len(jax.devices()) == SPEC["num_processes"] * SPEC["local_devices"]
    init_s = time.perf_counter() - t0
    results: dict[str, np.ndarray] = {}
    stats = {"init_s": init_s, "process_index": jax.process_index(), "cases": {}}
    progress(f"initialized in {init_s:.1f} s")
    for case in SPEC["cases"]:
        progress(f"case {case['name']}")
        stats["cases"][case["name"]] = run_case(case, results)
    for case in SPEC.get("mixtures", []):
        progress(f"mixture {case['name']}")
        stats["cases"][case["name"]] = run_mixture(case, results)
    progress("saving results")
    stats["total_s"] = time.perf_counter() - t0
    out = SPEC["out"]
    np.savez(os.path.join(out, f"result-{PROCESS_ID}.npz"), **results)
    with open(os.path.join(out, f"stats-{PROCESS_ID}.json"), "w") as f:
        json.dump(stats, f)
    if SPEC["num_processes"] > 1:
        multihost_utils.sync_global_devices("asyncflat-multihost-worker-done")
        jax.distributed.shutdown()
    # Everything this worker checks is saved. The interpreter's exit (jax's teardown, gloo's
    # threads, atexit hooks) once hung for minutes after this point in a CI run: if it hangs
    # again, every thread's stack goes to the log and the worker exits with status 1, which
    # the parent reports apart from the results (EXIT_GRACE_S in tests/test_multihost.py).
    faulthandler.cancel_dump_traceback_later()
    progress("done")
    faulthandler.dump_traceback_later(SPEC["exit_grace_s"], exit=True)


if __name__ == "__main__":
    main()
