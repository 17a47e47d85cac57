"""permutation(seed, n) must equal seqax's ``_random_permutation`` bit for bit, forever."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflat.errors import AsyncflatError, ConfigError
from asyncflat.plan.kernel import CHUNK
from asyncflat.plan.permutation import (
    DRAW_THREAD,
    PYTHON_BELOW,
    YIELD_SLICE,
    Stop,
    Stopped,
    ensure_kernel,
    kernel_status,
    permutation,
    permutation_columns,
    whole_permutation_size,
)

# the module (``asyncflat.plan``'s attribute of that name is the function)
permutation_module = importlib.import_module("asyncflat.plan.permutation")
GOLDEN = json.loads((Path(__file__).parent / "golden_permutations.json").read_text())
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def _compiled_kernel() -> None:
    """Sizes from 2048 to 2**16 take the Python path until the kernel is compiled: compile it
    first, so that the tests below check the kernel (the Python path is checked on its own)."""
    ensure_kernel()


def slow_reference(seed: int, n: int) -> np.ndarray:
    """The frozen algorithm, written out literally."""
    swaps = np.random.Philox(seed).random_raw(n) % (np.arange(n, dtype=np.uint64) + 1)
    result = np.arange(n, dtype=np.uint32)
    for i in reversed(range(n)):
        j = swaps[i]
        result[i], result[j] = result[j], result[i]
    return result


def sha256_u32(values: np.ndarray) -> str:
    return hashlib.sha256(values.astype("<u4").tobytes()).hexdigest()


@pytest.mark.parametrize("case", GOLDEN["vectors"], ids=lambda c: f"seed{c['seed']}-n{c['n']}")
def test_golden_vectors(case: dict) -> None:
    got = permutation(case["seed"], case["n"])
    assert got.dtype == np.uint32
    assert got.tolist() == case["permutation"]


@pytest.mark.parametrize("case", GOLDEN["sha256"], ids=lambda c: f"seed{c['seed']}-n{c['n']}")
def test_golden_hashes(case: dict) -> None:
    assert sha256_u32(permutation(case["seed"], case["n"])) == case["sha256_le_u32"]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**70), n=st.integers(0, 3000))
def test_matches_reference(seed: int, n: int) -> None:
    got = permutation(seed, n)
    assert got.dtype == np.uint32 and got.shape == (n,)
    np.testing.assert_array_equal(got, slow_reference(seed, n))


@pytest.mark.parametrize(
    ("seed", "n"),
    [
        (0, PYTHON_BELOW - 1),
        (0, PYTHON_BELOW),
        (5, CHUNK),
        (5, CHUNK + 1),
        (2**40 + 7, 70_001),
        (2**100, 65_537),
        (2**64 - 1, 131_075),
    ],
)
def test_matches_reference_at_boundaries(seed: int, n: int) -> None:
    # 65536 is where the kernel switches from integer to float-quotient modulo.
    np.testing.assert_array_equal(permutation(seed, n), slow_reference(seed, n))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 2047, 5000, 9999])
def test_small_path_and_kernel_agree(n: int) -> None:
    kernel_result = permutation(11, n, method="kernel")
    small_result = permutation(11, n, method="python")
    assert kernel_result.dtype == small_result.dtype == np.uint32
    np.testing.assert_array_equal(kernel_result, small_result)
    np.testing.assert_array_equal(kernel_result, slow_reference(11, n))


@pytest.mark.parametrize("n", [0, 1, 100, 5000, 2**20])
def test_is_a_permutation(n: int) -> None:
    got = permutation(123, n)
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(np.sort(got), np.arange(n, dtype=np.uint32))


def test_accepts_numpy_integers() -> None:
    np.testing.assert_array_equal(permutation(np.uint64(9), np.int32(50)), permutation(9, 50))


@pytest.mark.parametrize(
    ("seed", "n", "name"),
    [
        (0, -1, "n"),
        (0, 2**32, "n"),
        (0, 2**40, "n"),
        (0, 1.5, "n"),
        (0, True, "n"),
        (0, "3", "n"),
        (-1, 10, "seed"),
        (0.5, 10, "seed"),
        (None, 10, "seed"),
        (False, 10, "seed"),
        (0, 10, "method"),
    ],
)
def test_rejects_bad_arguments(seed: object, n: object, name: str) -> None:
    method = "numba" if name == "method" else "auto"
    with pytest.raises(ConfigError, match=rf"\b{name}\b") as info:
        permutation(seed, n, method=method)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def _run_fresh(script: str, **env: str) -> str:
    """Run ``script`` in a fresh interpreter importing this checkout; return its stdout."""
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        **env,
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], env=full_env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # no warnings either
    return proc.stdout


def test_first_call_in_a_fresh_process_is_cheap_and_needs_no_numba(tmp_path: Path) -> None:
    # A restart pays for the kernel on its way to the first batch. With numba this cost 0.6-1.1 s
    # of CPU per process (0.4-0.6 s from numba's own on-disk cache); the llvmlite kernel ~0.1 s.
    # CPU time, not wall time, so other processes on the machine do not make this flaky.
    script = (
        "import sys, time, warnings, numpy as np\n"
        "from asyncflat.plan.permutation import permutation\n"
        "warnings.simplefilter('error')\n"
        "start = time.process_time()\n"
        "result = permutation(7, 2**20)\n"
        "cpu = time.process_time() - start\n"
        "print(cpu, 'numba' in sys.modules, result[:4].tolist())\n"
    )
    home = tmp_path / "home"
    home.mkdir()
    out = _run_fresh(script, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache")).split(maxsplit=2)
    cpu_s, numba_imported, head = float(out[0]), out[1], out[2].strip()
    assert head == str(slow_reference(7, 2**20)[:4].tolist())
    assert numba_imported == "False"
    assert cpu_s < 0.45, f"first permutation took {cpu_s:.3f} s of CPU"
    assert list(home.iterdir()) == []  # nothing cached on disk, so nothing to share or corrupt


def test_concurrent_first_calls_share_one_compile() -> None:
    # Threads racing to the first call (and a background warm-up) all get the right answer from
    # one compiled kernel: the compile's debug line is logged once, whatever runs after.
    script = (
        "import logging, sys, threading, numpy as np\n"
        "from asyncflat.plan.permutation import kernel_status, permutation, warm_up\n"
        "compiles = []\n"
        "class Count(logging.Handler):\n"
        "    def emit(self, record):\n"
        "        if 'compiled the permutation kernel' in record.getMessage():\n"
        "            compiles.append(record)\n"
        "logger = logging.getLogger('asyncflat.plan.permutation')\n"
        "logger.setLevel(logging.DEBUG)\n"
        "logger.addHandler(Count())\n"
        "warm_up(2**16 + 1)\n"
        "results = {}\n"
        "def work(seed):\n"
        "    results[seed] = permutation(seed, 2**16 + seed)\n"
        "threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "again = {s: permutation(s, 2**16 + s) for s in range(6)}\n"
        "assert kernel_status() == 'ready' and len(compiles) == 1, compiles\n"
        "np.save(sys.stdout.buffer, np.concatenate([results[s] for s in range(6)]))\n"
    )
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], env=full_env, capture_output=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr.decode()
    got = np.load(io.BytesIO(proc.stdout))
    expected = np.concatenate([slow_reference(s, 2**16 + s) for s in range(6)])
    np.testing.assert_array_equal(got, expected)


def test_warm_up_returns_before_the_compile_finishes() -> None:
    # The loader calls warm_up in its constructor; the compile must not be on that path.
    script = (
        "import time\n"
        "from asyncflat.plan.permutation import ensure_kernel, kernel_status, warm_up\n"
        "start = time.thread_time()\n"
        "warm_up(2**20)\n"
        "returned = time.thread_time() - start\n"
        "at_return = kernel_status()\n"
        "ensure_kernel()\n"  # waits for the background compile, does not start another
        "print(returned, at_return, kernel_status())\n"
    )
    returned_s, at_return, later = _run_fresh(script).split()
    assert at_return == "compiling" and later == "ready"
    # The caller's own CPU time (its wall time waits for the GIL on a busy machine): a compile
    # on its path costs it 0.1 s or more.
    assert float(returned_s) < 0.05


def test_sizes_up_to_2_16_never_compile_the_kernel() -> None:
    # A restart's first batch needs one buffer's row permutation (~10^4 rows): the Python path
    # gives it in milliseconds, and neither it nor a loader's warm-up for it loads LLVM (its
    # compile costs 0.1-0.3 s of CPU beside the trainer, its code ~64 MiB of resident memory).
    script = (
        "import sys\n"
        "import numpy as np\n"
        "from asyncflat.plan.permutation import kernel_status, permutation, warm_up\n"
        "warm_up(2**16)\n"
        "first = permutation(3, 40_000)\n"
        "edge = permutation(4, 2**16)\n"
        "assert kernel_status() == 'absent', kernel_status()\n"
        "assert 'llvmlite' not in sys.modules\n"
        "np.save(sys.stdout.buffer, np.concatenate([first, edge]))\n"
    )
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], env=full_env, capture_output=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr.decode()
    expected = np.concatenate([slow_reference(3, 40_000), slow_reference(4, 2**16)])
    np.testing.assert_array_equal(np.load(io.BytesIO(proc.stdout)), expected)


def test_a_compiled_kernel_serves_small_sizes_identically() -> None:
    # Once the kernel exists (a larger permutation compiled it), small sizes take it too.
    small = permutation(9, 40_000, method="python")
    ensure_kernel()
    assert kernel_status() == "ready"
    np.testing.assert_array_equal(permutation(9, 40_000), small)
    np.testing.assert_array_equal(small, slow_reference(9, 40_000))


@pytest.mark.parametrize("lo", [0, 4, 1000, 2**20, 2**32 - 70_000])
@pytest.mark.parametrize("size", [1, 3, 4, 4095, 4097, 65_536])
def test_the_kernels_draws_equal_numpys_and_find_what_the_table_flags(lo: int, size: int) -> None:
    """What the entries walk: ``r[i] = raw[i] % (i + 1)``, from any multiple of 4, any length
    (the kernel works in Philox blocks of 4 and chunks of 4,096), and the indices whose low
    bits a table flags: few, or more than the first call keeps."""
    draws = permutation_module.compiled_draws()
    assert draws is not None  # compiled by the module's fixture
    for seed in (0, 2**64 + 3):
        key = permutation_module.philox_key(seed)
        raw = np.random.Philox(key=key, counter=lo // 4).random_raw(size)
        expected = (raw % (np.arange(size, dtype=np.uint64) + np.uint64(lo + 1))).astype(np.uint32)
        for bits, flagged in ((16, [0, 7, 65535]), (4, [1, 2, 3]), (1, [0, 1])):
            table = np.zeros(1 << bits, bool)
            table[flagged] = True
            out = np.full(size, 0xDEADBEEF, np.uint32)
            got = draws(key, lo, out, table, None)
            np.testing.assert_array_equal(out, expected)
            np.testing.assert_array_equal(got, np.flatnonzero(table[expected & ((1 << bits) - 1)]))
            assert got.dtype == np.intp


def test_the_kernels_draws_refuse_what_they_cannot_use_and_stop_when_asked() -> None:
    draws = permutation_module.compiled_draws()
    assert draws is not None
    key, table = permutation_module.philox_key(1), np.zeros(1 << 16, bool)
    with pytest.raises(ValueError, match="multiple of 4"):
        draws(key, 2, np.empty(8, np.uint32), table, None)
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\*\*32\)"):
        draws(key, -4, np.empty(8, np.uint32), table, None)  # a modulo by 0 killed the process
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\*\*32\)"):
        draws(key, 2**32 - 4, np.empty(8, np.uint32), table, None)
    with pytest.raises(ValueError, match="uint32"):
        draws(key, 0, np.empty(8, np.uint64), table, None)
    with pytest.raises(ValueError, match="C-contiguous"):
        draws(key, 0, np.empty(16, np.uint32)[::2], table, None)
    read_only = np.empty(8, np.uint32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        draws(key, 0, read_only, table, None)
    with pytest.raises(ValueError, match="power of two"):
        draws(key, 0, np.empty(8, np.uint32), np.zeros(1000, bool), None)
    with pytest.raises(ValueError, match="power of two"):  # a mask of -1 read out of bounds
        draws(key, 0, np.empty(8, np.uint32), np.zeros(0, bool), None)
    too_long = np.lib.stride_tricks.as_strided(np.empty(1, np.uint32), ((1 << 31) + 4,), (0,))
    with pytest.raises(ValueError, match=r"at most 2\*\*31"):  # it keeps int32 indices
        draws(key, 0, too_long, table, None)
    with pytest.raises(ValueError, match="bool"):
        draws(key, 0, np.empty(8, np.uint32), np.zeros(1 << 16, np.uint8), None)
    stop = Stop()
    stop.set()
    with pytest.raises(Stopped):
        draws(key, 0, np.empty(1 << 16, np.uint32), table, stop)


def test_exit_waits_for_a_background_compile() -> None:
    # LLVM's static destructors run when the process exits; a compile still running on the
    # background thread then crashed short-lived processes (a restart that loaded one batch and
    # exited segfaulted in ~1 of 4 runs). The exit must wait for the compile to finish.
    script = (
        "import atexit\n"
        "from asyncflat.plan.permutation import kernel_status, warm_up\n"
        "def report():\n"  # registered first, so it runs after the module's own exit hook
        "    print(kernel_status())\n"
        "atexit.register(report)\n"
        "warm_up(2**20)\n"  # starts the compile, then the script ends
    )
    assert _run_fresh(script).split() == ["ready"]


def _python_loop_rate(seconds: float) -> float:
    """Iterations per second of a pure-Python loop that needs the GIL to make progress."""
    count = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        count += 1
    return count / (time.perf_counter() - start)


def _rate_while_shuffling(seconds: float) -> tuple[float, int]:
    stop = threading.Event()
    calls = 0

    def shuffle() -> None:
        nonlocal calls
        while not stop.is_set():
            permutation(calls, 2**22)
            calls += 1

    worker = threading.Thread(target=shuffle)
    worker.start()
    try:
        time.sleep(0.01)
        rate = _python_loop_rate(seconds)
    finally:
        stop.set()
        worker.join()
    return rate, calls


def test_releases_the_gil() -> None:
    # With a short switch interval, a worker holding the GIL through each ~25 ms call would leave
    # the main thread a few percent of its speed; with the GIL released it keeps most of it (half
    # if another process takes the second core). The best of three attempts absorbs noise.
    ensure_kernel()  # compile outside the measurement
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        fractions = []
        for _ in range(3):
            baseline = _python_loop_rate(0.2)
            rate, calls = _rate_while_shuffling(0.4)
            assert calls >= 1
            fractions.append(rate / baseline)
            if fractions[-1] > 0.3:
                break
    finally:
        sys.setswitchinterval(interval)
    assert max(fractions) > 0.3, fractions


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 2047, 2048, 4097, 1 << 16])
def test_yielding_the_gil_changes_nothing_of_the_result(n: int) -> None:
    for seed in (0, 3, 2**64 + 5):
        expected = slow_reference(seed, n) if n <= 4097 else permutation(seed, n, method="kernel")
        # the Python path, which is the one that yields
        got = permutation(seed, n, yield_gil=True, method="python")
        assert got.dtype == np.uint32
        np.testing.assert_array_equal(got, expected)


def _other_thread_runs_during(compute: Any) -> int:
    """How often another thread (needing the GIL after each short sleep) ran while ``compute()``
    ran, with a switch interval so long that only a voluntary release lets it in."""
    ticks = [0]
    stop, started = threading.Event(), threading.Event()

    def other() -> None:
        started.set()
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(1e-4)

    interval = sys.getswitchinterval()
    worker = threading.Thread(target=other)
    sys.setswitchinterval(10.0)
    try:
        worker.start()
        started.wait(5)
        time.sleep(0.01)
        before = ticks[0]
        compute()
        return ticks[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        worker.join()


def test_a_yielding_permutation_lets_other_threads_run_meanwhile() -> None:
    """The Python path holds the GIL throughout (a trainer thread waits for all of it); with
    ``yield_gil`` it lets other threads in between slices of swaps."""
    n = 1 << 15
    plain = _other_thread_runs_during(lambda: permutation(5, n, method="python"))
    yielding = _other_thread_runs_during(lambda: permutation(5, n, yield_gil=True, method="python"))
    slices = n // YIELD_SLICE
    assert yielding >= slices // 4, (yielding, plain, slices)
    assert plain < yielding // 4, (yielding, plain, slices)


@pytest.mark.parametrize(
    ("n", "pauses"),
    [
        (1, 0),
        (YIELD_SLICE, 0),
        (YIELD_SLICE + 1, 1),
        (3 * YIELD_SLICE, 2),
        (32 * YIELD_SLICE + 1, 33),
    ],
)
def test_a_yielding_permutation_pauses_only_between_its_slices(
    n: int, pauses: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each pause costs the computing thread a wait for the GIL (up to a switch interval when
    another thread runs Python): a permutation of one slice (a small buffer's rows, computed
    at every jump) takes none, and a longer one pauses between its slices only (its swaps,
    then its copy out in pieces of 32 slices), not after the last."""
    sleeps: list[float] = []
    sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (sleeps.append(s), sleep(s))[1])
    got = permutation(5, n, yield_gil=True, method="python")
    np.testing.assert_array_equal(got, permutation(5, n, method="python"))
    assert len(sleeps) == pauses, sleeps


# -- stopping ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda stop: permutation(5, 3 * CHUNK + 7, method="kernel", stop=stop),
        lambda stop: permutation(5, 3 * CHUNK + 7, method="python", yield_gil=True, stop=stop),
        lambda stop: permutation(5, 300, method="python", stop=stop),
        # the columns kernel (one column of eight), and the whole permutation it may fall back on
        lambda stop: permutation_columns(5, 8 * CHUNK, 8, (3,), method="kernel", stop=stop),
        lambda stop: permutation_columns(5, 8 * CHUNK, 8, tuple(range(8)), stop=stop),
    ],
    ids=["kernel", "python-yielding", "python", "columns-kernel", "columns-all"],
)
def test_a_stop_set_before_the_call_stops_it(call: Any) -> None:
    stop = Stop()
    expected = call(Stop())  # an unset flag changes nothing
    assert call(None).tolist() == expected.tolist()
    stop.set()
    with pytest.raises(Stopped):
        call(stop)


@pytest.mark.parametrize("columns", [False, True])
def test_a_stop_set_from_another_thread_ends_a_long_permutation_early(columns: bool) -> None:
    n = 1 << 24  # ~0.1-0.3 s of kernel on these machines

    def run(stop: Stop | None) -> Any:
        if columns:
            return permutation_columns(9, n, 1024, (512,), method="kernel", stop=stop)
        return permutation(9, n, method="kernel", stop=stop)

    started = time.perf_counter()
    run(None)
    whole = time.perf_counter() - started
    stop = Stop()
    timer = threading.Timer(0.005, stop.set)
    started = time.perf_counter()
    timer.start()
    with pytest.raises(Stopped):
        run(stop)
    assert time.perf_counter() - started < whole / 2, (time.perf_counter() - started, whole)


@pytest.mark.parametrize("method", ["python", "kernel"])
@pytest.mark.parametrize("n", [0, 1, 5000, CHUNK * 3 + 7])
def test_a_permutation_computed_in_a_given_array_is_the_same(method: str, n: int) -> None:
    """``out`` (an array whose pages the engine wrote ahead) changes where, never what."""
    out = np.full(n, 0xDEADBEEF, np.uint32)
    result = permutation(11, n, method=method, out=out)  # type: ignore[arg-type]
    assert result is out
    np.testing.assert_array_equal(out, permutation(11, n))


def _read_only(n: int) -> np.ndarray:
    out = np.empty(n, np.uint32)
    out.flags.writeable = False
    return out


@pytest.mark.parametrize(
    "out",
    [np.empty(9, np.uint32), np.empty(10, np.int64), np.empty(20, np.uint32)[::2], _read_only(10)],
    ids=["size", "dtype", "strided", "read-only"],
)
def test_a_wrong_array_to_compute_in_is_refused(out: np.ndarray) -> None:
    with pytest.raises(ConfigError, match="out must be a writeable C-contiguous uint32"):
        permutation(1, 10, out=out)


def test_columns_are_computed_in_the_given_array_only_on_the_whole_permutations_path() -> None:
    n, streams = 64 * CHUNK, 1024
    # every column served: the whole permutation, computed in ``out`` (the result is its view)
    assert whole_permutation_size(n, streams, streams) == n
    out = np.empty(n, np.uint32)
    every = permutation_columns(3, n, streams, tuple(range(streams)), out=out)
    assert np.shares_memory(every, out)
    np.testing.assert_array_equal(every.reshape(-1), permutation(3, n))
    # most served: the whole permutation too (smaller than the table), columns copied out of it
    most = tuple(range(1, streams))
    assert whole_permutation_size(n, streams, len(most)) == n
    np.testing.assert_array_equal(
        permutation_columns(3, n, streams, most, out=np.empty(n, np.uint32)), every[:, 1:]
    )
    # one column: the columns kernel's table, no array of n entries to compute in
    assert whole_permutation_size(n, streams, 1) == 0
    with pytest.raises(ConfigError, match="out is for the whole permutation"):
        permutation_columns(3, n, streams, (5,), out=out)


def test_a_stopped_kernel_does_not_even_write_its_array_first() -> None:
    """Its first pass (``arange``) first-writes the whole array (0.4-0.7 s at 95M entries):
    closing a loader must not wait for it."""
    stop = Stop()
    stop.set()
    out = np.full(40 * CHUNK, 0xDEADBEEF, np.uint32)
    with pytest.raises(Stopped):
        permutation(2, out.size, method="kernel", stop=stop, out=out)
    assert (out == 0xDEADBEEF).all()


def _draw_threads_started(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException | None = None
) -> list[str]:
    """The names of the helper threads the permutation starts from now on; with ``failure``,
    starting one raises it instead."""
    names: list[str] = []
    start = threading.Thread.start

    def recording(thread: threading.Thread) -> None:
        if thread.name == DRAW_THREAD:
            names.append(thread.name)
            if failure is not None:
                raise failure
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording)
    return names


@pytest.fixture
def helper_on_any_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper thread draws whatever the CPUs (CI has two)."""
    monkeypatch.setattr(permutation_module, "DRAW_HELPER_MIN_CPUS", 1)


@pytest.mark.usefixtures("helper_on_any_machine")
@pytest.mark.parametrize(
    ("piece", "n"),
    [
        (8 * 1024 + 2, 8 * 1024),  # (rounded down to 8,192) one piece: drawn on this thread
        (8 * 1024 + 2, 8 * 1024 + 1),
        (8 * 1024 + 2, 5 * 8 * 1024 + 3),
        (8 * 1024, 40_001),
        (6000, 60_001),  # pieces that are not whole kernel chunks
        (7, 3001),  # (rounded down to 4) hundreds of pieces, each of one Philox block
    ],
)
def test_pieces_drawn_ahead_on_a_helper_thread_give_the_same_permutation(
    monkeypatch: pytest.MonkeyPatch, piece: int, n: int
) -> None:
    """The kernel draws each piece's swap targets on a helper thread while it swaps the piece
    above: the swaps, their order and so the result are those of the frozen algorithm."""
    monkeypatch.setattr(permutation_module, "DRAW_PIECE", piece)
    helpers = _draw_threads_started(monkeypatch)
    got = permutation(2**64 - 3, n, method="kernel")
    np.testing.assert_array_equal(got, slow_reference(2**64 - 3, n))
    assert len(helpers) == (1 if n > piece - piece % 4 else 0)


@pytest.mark.usefixtures("helper_on_any_machine")
@pytest.mark.parametrize("case", GOLDEN["sha256"], ids=lambda c: f"seed{c['seed']}-n{c['n']}")
def test_golden_hashes_with_a_helper_thread(monkeypatch: pytest.MonkeyPatch, case: dict) -> None:
    monkeypatch.setattr(permutation_module, "DRAW_PIECE", 6000)
    assert sha256_u32(permutation(case["seed"], case["n"])) == case["sha256_le_u32"]


@pytest.mark.usefixtures("helper_on_any_machine")
def test_no_thread_to_be_had_draws_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(permutation_module, "DRAW_PIECE", 6000)
    _draw_threads_started(monkeypatch, RuntimeError("can't start new thread"))
    case = GOLDEN["sha256"][1]
    assert sha256_u32(permutation(case["seed"], case["n"])) == case["sha256_le_u32"]


@pytest.mark.usefixtures("helper_on_any_machine")
def test_an_interrupt_while_joining_the_helper_leaves_it_to_end_by_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while the caller waits for the helper: the interrupt goes up at once, and the
    helper (told to stop first) ends by itself, on arrays its own arguments keep alive."""
    monkeypatch.setattr(permutation_module, "DRAW_PIECE", 1 << 22)  # ~15 ms of draws a piece
    join = threading.Thread.join
    helpers: list[threading.Thread] = []

    def interrupted(thread: threading.Thread, timeout: float | None = None) -> None:
        if thread.name == DRAW_THREAD and not helpers:
            helpers.append(thread)
            raise KeyboardInterrupt
        join(thread, timeout)

    monkeypatch.setattr(threading.Thread, "join", interrupted)
    stop = Stop()
    threading.Timer(0.05, stop.set).start()  # the swaps stop mid-way, the helper may be drawing
    with pytest.raises(KeyboardInterrupt):
        permutation(4, 1 << 26, method="kernel", stop=stop)
    (helper,) = helpers
    helper.join(10)
    assert not helper.is_alive()


@pytest.mark.usefixtures("helper_on_any_machine")
def test_a_stopped_permutation_leaves_no_helper_thread_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    helpers = _draw_threads_started(monkeypatch)
    stop = Stop()
    timer = threading.Timer(0.005, stop.set)
    timer.start()
    with pytest.raises(Stopped):
        permutation(9, 1 << 24, method="kernel", stop=stop)
    assert helpers == [DRAW_THREAD]
    assert not [t for t in threading.enumerate() if t.name == DRAW_THREAD]


def test_too_few_cpus_draw_on_the_permutations_own_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No helper where it would take a trainer's CPU: the same permutation, each piece drawn
    before its swaps on the caller's thread."""
    monkeypatch.setattr(permutation_module, "DRAW_PIECE", 8 * 1024)
    monkeypatch.setattr(permutation_module, "DRAW_HELPER_MIN_CPUS", 10**6)
    helpers = _draw_threads_started(monkeypatch)
    case = GOLDEN["sha256"][0]  # 2**20 positions: 128 pieces
    assert (
        sha256_u32(permutation(case["seed"], case["n"], method="kernel")) == case["sha256_le_u32"]
    )
    assert helpers == []


@pytest.mark.usefixtures("helper_on_any_machine")
def test_an_interrupt_while_starting_the_helper_goes_up_as_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while ``Thread.start`` waits for the helper to run: the KeyboardInterrupt, not a
    RuntimeError from joining a thread that never started."""
    _draw_threads_started(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        permutation(1, 1 << 20, method="kernel")


@pytest.mark.usefixtures("helper_on_any_machine")
def test_a_helper_that_fails_fails_the_permutation_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The helper raising before it draws a piece: the swaps waiting for that piece return,
    and the call raises."""

    class FailsOnTheHelper(Stop):
        @property
        def address(self) -> int:
            if threading.current_thread().name == DRAW_THREAD:
                raise MemoryError("no memory on the helper's thread")
            return super().address

    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # (the helper's failure)
    with pytest.raises(AsyncflatError, match="swap targets failed"):
        permutation(1, 1 << 20, method="kernel", stop=FailsOnTheHelper())
    assert not [t for t in threading.enumerate() if t.name == DRAW_THREAD]
