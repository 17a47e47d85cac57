"""The machine's noise: does a thread lose CPU time when the other cores are busy?

    python bench/noise.py                 # ~50 s: alone, then beside 1 and beside all-CPUs busy processes
    python bench/noise.py --seconds 5     # a quick look

A fixed piece of work (a gather and a diff over small numpy arrays, ~0.3 ms, all in cache) runs
again and again with a 5 ms pause between, as a trainer's ``load()`` does, timed by its own
thread's CPU clock (``time.thread_time``) and by the wall clock: alone, then beside busy
processes at the engine's lower priority (``nice`` 10, as ``EngineOptions.engine_niceness``
runs the fill's threads) that stream through memory. On a machine that gives each core to one
thread, the work's own CPU time does not depend on what the other cores run: its worst stays
near its median. On a shared VM whose virtual CPUs share physical cores (or are descheduled by
the host without the guest seeing it as steal), the same work sometimes takes tens of times its
median in its *own* CPU time as soon as another core is busy.

That is how to read a worst load of ``bench/peers.py`` on such a machine: a loader that fills
its next buffer while the trainer runs keeps another core busy, and one of its ~1,000 loads may
land in such a moment, where the synchronous reference, idle between its boundaries, does not.
On the 2-core VM this project is developed on, the loader's rare 20-55 ms loads (1 run in 3-4
of ``bench/peers.py --size large --layout seqax --rbpsb 64``) were builds whose every part
(the step's index math, the gather of its rows) took 15-60x its median CPU time, with no page
fault, no garbage collection and no steal in ``/proc/stat``: this benchmark shows the same.

One JSON line: per case, iterations, the CPU time's median, p99.9 and max (ms), the wall
time's max, and how many iterations took over 10x the median CPU time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit

#: A busy process: streams through 256 MiB of memory until killed (decode-like work).
_BUSY = "import numpy as np\nx = np.ones(32 << 20)\nwhile True:\n    y = x * 2.0\n"


def measure(seconds: float, pause_s: float = 0.005) -> dict[str, Any]:
    """Time the fixed work for ``seconds``; its CPU and wall figures."""
    values = np.arange(1 << 16, dtype=np.int64)
    index = np.random.default_rng(0).integers(0, 1 << 16, 4096)
    cpu, wall = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(20):
            values[index].sum()
            np.diff(index)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
        time.sleep(pause_s)
    c, w = np.array(cpu) * 1e3, np.array(wall) * 1e3
    median = float(np.median(c))
    return {
        "iterations": len(c),
        "cpu_median_ms": round(median, 3),
        "cpu_p999_ms": round(float(np.percentile(c, 99.9)), 3),
        "cpu_max_ms": round(float(c.max()), 2),
        "wall_max_ms": round(float(w.max()), 2),
        "cpu_over_10x_median": int((c > 10 * median).sum()),
    }


def beside(busy: int, seconds: float) -> dict[str, Any]:
    """:func:`measure` beside ``busy`` processes at nice 10."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUSY],
            preexec_fn=(lambda: os.nice(10)) if hasattr(os, "nice") else None,
        )
        for _ in range(busy)
    ]
    try:
        time.sleep(0.5)  # they are running
        return measure(seconds)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="per case")
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    cases: dict[str, Any] = {"alone": measure(args.seconds)}
    for busy in sorted({1, cpus}):
        cases[f"beside_{busy}_busy"] = beside(busy, args.seconds)
        print(f"beside {busy}: {cases[f'beside_{busy}_busy']}", file=sys.stderr)
    emit({"bench": "noise", "cpus": cpus, "cases": cases})


if __name__ == "__main__":
    main()
