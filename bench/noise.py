"""The machine's noise: what first-touching fresh memory on one core costs a thread on another.

    python bench/noise.py                 # ~45 s: alone, beside busy processes of each kind
    python bench/noise.py --seconds 5     # a quick look

A fixed piece of work (a gather and a diff over small numpy arrays, ~0.3-0.5 ms, all in cache)
runs again and again with a 5 ms pause between, as a trainer's ``load()`` does, timed by its
own thread's CPU clock (``time.thread_time``) and by the wall clock: alone; beside one busy
process per CPU that computes in 256 MiB it already holds; and beside as many that write each
result into a fresh 256 MiB, freeing the last (as a fill writing a fresh shuffle buffer does);
and beside as many doing the same in 4 KiB pages only. numpy asks for transparent huge pages
for large arrays (``madvise(MADV_HUGEPAGE)``), so a first write there maps 2 MiB at once where
the kernel allows it; the last case turns that off (``NUMPY_MADVISE_HUGEPAGE=0``). The busy
processes run at ``nice`` 10, as the engine's fill threads do
(``EngineOptions.engine_niceness``).

On the 2-core VM this project is developed on (a nested guest), the work never took more than
~0.9 ms of its own CPU time alone or beside the computing processes, and up to 14-31 ms beside
the first-touching ones (12-20 ms in 4 KiB pages only, against 17-29 ms with huge pages in the
same runs): whatever the host does for the other cores' first writes stalls this one too, and
the guest counts the stall as the thread's own CPU time, not as steal. The rare 20-55 ms load
of ``bench/peers.py --size large --layout seqax --phases steps --rbpsb 64`` there was the same:
the first prefetch first-writing its fresh 256 MiB buffer during the trainer's first steps (9
such loads in 46 runs; none in 46 with that buffer written before the steps), which is why a
loader now writes that buffer's pages when it opens. Linux only (``thread_time``'s resolution
and ``nice`` elsewhere do not allow the measurement).

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

#: Busy processes (nice 10, ending when their parent does): computing in place, or writing
#: each pass into a fresh 256 MiB.
_BUSY = {
    "computing": "x = np.ones(32 << 20)\nwhile os.getppid() == parent:\n    np.multiply(x, 2.0, out=x)\n",
    "first_touching": "x = np.ones(32 << 20)\nwhile os.getppid() == parent:\n    y = x * 2.0\n",
}
#: the cases: a kind of busy process, and what its environment adds
_CASES = {
    "computing": ("computing", {}),
    "first_touching": ("first_touching", {}),
    "first_touching_small_pages": ("first_touching", {"NUMPY_MADVISE_HUGEPAGE": "0"}),
}
_PRELUDE = "import os, sys\nimport numpy as np\nparent = int(sys.argv[1])\nos.nice(10)\n"


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
        "cpu_max_ms": round(float(c.max()), 3),
        "wall_max_ms": round(float(w.max()), 3),
        "cpu_over_10x_median": int((c > 10 * median).sum()),
    }


def beside(case: str, count: int, seconds: float) -> dict[str, Any]:
    """:func:`measure` beside ``count`` busy processes of ``case``."""
    kind, env = _CASES[case]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            command = [sys.executable, "-c", _PRELUDE + _BUSY[kind], str(os.getpid())]
            procs.append(subprocess.Popen(command, env={**os.environ, **env}))
        time.sleep(0.5)  # they are running
        return measure(seconds)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per case")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("bench/noise.py measures Linux threads only")
    cpus = len(os.sched_getaffinity(0))
    cases: dict[str, Any] = {"alone": measure(args.seconds)}
    for case in _CASES:
        cases[f"beside_{case}"] = beside(case, cpus, args.seconds)
        print(f"beside {cpus} {case}: {cases[f'beside_{case}']}", file=sys.stderr)
    emit({"bench": "noise", "cpus": cpus, "busy_processes": cpus, "cases": cases})


if __name__ == "__main__":
    main()
