"""GIL: what a background thread's permutation costs a trainer thread building batches.

A trainer thread builds 16 x 2048 batches (``BatchBuilder.build``: the host decode and the
sharded jax arrays on 8 CPU devices), one every ``--step-ms``, while another thread computes
row permutations back to back (a stress test: the engine computes one per fill): none, the
plain Python path (the GIL held throughout), and ``permutation(..., yield_gil=True)`` (the GIL
yielded every 256 swaps). Prints one JSON line: the build's median / p99 / max per case, and
one permutation's wall time.

    python bench/gil.py                  # 32,768 rows (a 256 MiB buffer of 2048-token rows)
    python bench/gil.py --rows 4096      # a 32 MiB buffer
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 15, help="permutation size (<= 2**16)")
    parser.add_argument("--builds", type=int, default=400)
    parser.add_argument("--step-ms", type=float, default=5.0)
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import numpy as np

    from asyncflat import permutation as permutation_module  # noqa: F401
    from asyncflat.loader.shared.batch import BatchBuilder, default_sharding

    impl: Any = sys.modules["asyncflat.plan.permutation"]
    builder = BatchBuilder(default_sharding(), (16, 2048))
    rows = np.random.default_rng(0).integers(0, 2**31, (16, 2048)).astype(np.uint32)
    for _ in range(50):
        jax.block_until_ready(builder.build(rows))

    def case(yield_gil: bool | None) -> dict[str, float]:
        stop = threading.Event()
        durations: list[float] = []

        def shuffle() -> None:
            seed = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                impl.permutation(seed, args.rows, yield_gil=bool(yield_gil))
                durations.append(time.perf_counter() - t0)
                seed += 1

        worker = threading.Thread(target=shuffle) if yield_gil is not None else None
        if worker is not None:
            worker.start()
        time.sleep(0.05)
        builds = []
        try:
            for _ in range(args.builds):
                t0 = time.perf_counter()
                jax.block_until_ready(builder.build(rows))
                builds.append(time.perf_counter() - t0)
                time.sleep(args.step_ms / 1e3)
        finally:
            stop.set()
            if worker is not None:
                worker.join()
        ms = np.array(builds) * 1e3
        figures = {
            "build_median_ms": round(float(np.median(ms)), 3),
            "build_p99_ms": round(float(np.quantile(ms, 0.99)), 3),
            "build_max_ms": round(float(ms.max()), 3),
        }
        if durations:
            figures["permutation_ms"] = round(float(np.median(durations)) * 1e3, 2)
        return figures

    # the Python path is the one measured: sizes up to 2**16 take it unless the kernel is loaded
    assert impl._kernel is None and args.rows <= 1 << 16, "the kernel would be measured instead"
    emit(
        {
            "bench": "gil",
            "rows": args.rows,
            "quiet": case(None),
            "plain_python_path": case(False),
            "yield_gil": case(True),
        }
    )


if __name__ == "__main__":
    main()
