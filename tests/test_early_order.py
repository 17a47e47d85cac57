"""A first load waits for the blocks of its own minipochs, not for the whole block order.

Where the whole order needs the compiled kernel (more than 2**16 read blocks), the blocks of a
first load's minipoch and the next are computed alone (``permutation_entries``: the
Fisher-Yates swaps walked backward for those few positions), and the whole order is computed
once a load returned, the opening's fills are done, or something needs a later minipoch:

* ``permutation_entries`` equals the permutation at any positions, for any size, seed, piece
  size and thread count, and stops when asked;
* the plan's early blocks equal the whole order's, and which minipochs get them;
* a loader, a resumed one and a mixture serve the batches of those minipochs, equal to the
  reference's, while computing the whole order is held back; a later minipoch waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from conftest import oracle, random_sequences, wait_until
from helpers.fake_source import SEQ_LEN, FakeSource, make_data

import asyncflat
import asyncflat.plan.entries as entries_module
from asyncflat import (
    EngineOptions,
    FlatTokensParams,
    MixtureLoader,
    MixtureParams,
    MixtureSource,
    ShufflePlan,
    ShufflingLoader,
    TokenBatchParams,
)
from asyncflat.engine import Engine
from asyncflat.engine.opening import EARLY_REQUESTS_MAX
from asyncflat.errors import ConfigError
from asyncflat.plan.entries import ENTRIES_COMPILE_MIN, permutation_entries
from asyncflat.plan.permutation import NO_COMPILE_MAX, Stop, Stopped, ensure_kernel, permutation
from asyncflat.plan.shuffle import EARLY_ENTRIES_MAX

pytestmark = pytest.mark.timeout(120)

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
# 4-token rows, one row a read block: 2**16 + some read blocks from ~270K tokens
BATCH = TokenBatchParams(len=4, batch=4)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 97, 1024, 5000, 70_001])
@pytest.mark.parametrize("seed", [0, 11, 2**64 + 3])
def test_entries_equal_the_permutation_at_their_positions(n: int, seed: int) -> None:
    full = permutation(seed, n)
    rng = np.random.default_rng(n)
    for positions in (
        list(range(min(n, 16))),
        rng.choice(n, size=min(n, 40), replace=False).tolist(),
        list(range(max(0, n - 8), n)),
        rng.choice(n, size=min(n, 256), replace=False).tolist(),  # EARLY_ENTRIES_MAX of them
    ):
        for piece, threads in ((1 << 18, 2), (64, 3), (4, 1)):
            if piece == 4 and n > 5000:
                continue  # ~18k pieces
            got = permutation_entries(seed, n, positions, piece=piece, threads=threads)
            np.testing.assert_array_equal(got, full[positions], f"{positions[:4]} {piece}")
            assert got.dtype == np.uint32


@pytest.mark.parametrize("draws", ["numpy", "kernel"])
@pytest.mark.parametrize("n", [5000, 70_001, 300_007])
def test_entries_are_the_same_drawn_by_numpy_or_by_the_compiled_kernel(
    n: int, draws: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draws of a piece come from the kernel once it is compiled (by the whole order, or
    by a large split's opening), else from numpy: the same entries either way."""
    if draws == "kernel":
        ensure_kernel()
    else:
        monkeypatch.setattr(entries_module, "compiled_draws", lambda: None)
    rng = np.random.default_rng(n)
    positions = rng.choice(n, size=64, replace=False).tolist()
    for seed in (3, 2**64 + 5):
        expected = permutation(seed, n)[positions]
        for piece, threads in ((1 << 18, 2), (1024, 3)):
            got = permutation_entries(seed, n, positions, piece=piece, threads=threads)
            np.testing.assert_array_equal(got, expected, f"{draws} {piece}")


def test_a_large_split_compiles_the_kernel_on_opening_for_its_early_draws() -> None:
    """From ``ENTRIES_COMPILE_MIN`` read blocks a loader's opening starts compiling the
    permutation kernel (the process's warm-up thread), beside the early blocks' first draws
    (their later pieces draw with it); below, and in the entries themselves, nothing loads
    LLVM before the whole order is wanted. Closing waits for no compile and leaves no thread
    of the loader. In fresh processes (the kernel is per process)."""
    script = (
        "import sys, threading, time\n"
        "import jax\n"
        "from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams\n"
        "from asyncflat.plan.entries import permutation_entries\n"
        "from asyncflat.plan.permutation import kernel_status\n"
        "from asyncflat.testing import SyntheticCounts\n"
        "import asyncflat.plan.kernel as kernel\n"
        "compile_kernel = kernel.compile_kernel\n"  # a compile of 3 s: closing must not wait
        "kernel.compile_kernel = lambda: (time.sleep(3), compile_kernel())[1]\n"
        "tokens = int(sys.argv[1])\n"
        "permutation_entries(7, 1 << 20, range(8))\n"
        "assert kernel_status() == 'absent'\n"
        "storage = {'tokens': tokens, 'chunk_tokens': 1 << 22, 'counts': SyntheticCounts()}\n"
        "params = FlatTokensParams('synthetic://c', 1, 16, 8, 0, True, storage_options=storage)\n"
        "single = jax.sharding.SingleDeviceSharding(jax.devices()[0])\n"
        "loader = ShufflingLoader('train', params, TokenBatchParams(len=2048, batch=8), single)\n"
        "opened = kernel_status()\n"
        "started = time.perf_counter()\n"
        "loader.close()\n"
        "closed_s = time.perf_counter() - started\n"
        "left = [t.name for t in threading.enumerate() if t.name.startswith('asyncflat')]\n"
        "print(opened, kernel_status() != 'absent', closed_s < 2 or closed_s, left)\n"
    )
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    blocks = 2048 * 8  # tokens per read block of these parameters
    for count, compiles in ((ENTRIES_COMPILE_MIN + 64, True), (1 << 20, False)):
        proc = subprocess.run(
            [sys.executable, "-c", script, str(count * blocks)],
            env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        # right after construction the compile is under way, and closing does not wait for
        # it (it took 0.17 s, seconds on a loaded machine, when it did)
        expected = "compiling True True []" if compiles else "absent False True []"
        assert proc.stdout.strip() == expected, proc.stdout


def test_entries_refuse_what_is_not_a_set_of_positions() -> None:
    with pytest.raises(ConfigError, match="distinct"):
        permutation_entries(0, 10, [1, 1])
    with pytest.raises(ConfigError, match="seed must be >= 0"):
        permutation_entries(-1, 10, [1])
    with pytest.raises(ConfigError, match=r"in \[0, 10\)"):
        permutation_entries(0, 10, [10])
    with pytest.raises(ConfigError, match="multiple of 4"):
        permutation_entries(0, 10, [1], piece=6)
    with pytest.raises(ConfigError, match="2\\*\\*32"):
        permutation_entries(0, 1 << 32, [1])


def test_entries_stop_when_asked() -> None:
    stop = Stop()
    threading.Timer(0.05, stop.set).start()
    started = time.perf_counter()
    with pytest.raises(Stopped):
        permutation_entries(0, 4_000_000_000, range(16), stop=stop)  # minutes, unstopped
    assert time.perf_counter() - started < 5


def test_entries_that_fail_leave_no_thread_while_the_error_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A walk that fails (a MemoryError, say) shuts its drawing pool down as it raises: the
    error's traceback, which a future keeps, held the pool's threads alive with it."""
    import heapq

    heapify = heapq.heapify

    def failing(items: list[int]) -> None:
        if threading.current_thread() is threading.main_thread():
            raise MemoryError("no room for the walk")
        heapify(items)

    monkeypatch.setattr(heapq, "heapify", failing)
    with pytest.raises(MemoryError) as failed:
        permutation_entries(0, 4_000_000, range(16), threads=2)
    drawing = [t for t in threading.enumerate() if t.name.startswith("asyncflat-entries")]
    assert drawing == [] and failed.value is not None


def plan_of(rows: int, served: tuple[int, ...] | None = None, streams: int = 2) -> ShufflePlan:
    """A plan (nothing computed) of ``rows`` 4-token rows, one a read block, 4 a buffer."""
    params = FlatTokensParams("fake://tokens", streams, 4, 1, seed=5, sequence_packing=True)
    batch = TokenBatchParams(len=4, batch=max(4, streams))
    return ShufflePlan.create(
        params, batch, token_count=rows * 4, sequence_count=rows, served_streams=served
    )


def big_plan(served: tuple[int, ...] | None = None, streams: int = 2) -> ShufflePlan:
    """A plan whose whole order needs the kernel: 2 x (2**16 + 300) read blocks."""
    return plan_of((NO_COMPILE_MAX + 300) * 2, served, streams)


@pytest.mark.parametrize("served", [None, (1,)])
def test_early_blocks_are_the_whole_orders(served: tuple[int, ...] | None) -> None:
    plan = big_plan(served)
    assert plan.read_block_count > NO_COMPILE_MAX
    last = plan.minipoch_count - 1
    assert plan.early_minipochs(0) == (0, 1)
    assert plan.early_minipochs(last) == (last,)
    fresh = big_plan(served)  # nothing computed yet
    for minipochs in ((0, 1), (7, 8), (last,)):
        fresh.compute_early_order(minipochs)
    for m in (0, 1, 7, 8, last):
        assert fresh.block_order_known(m)
        for stream in plan.served:
            np.testing.assert_array_equal(
                fresh.buffer_blocks(stream, m), plan.buffer_blocks(stream, m)
            )
    assert not fresh.block_order_known(2)
    assert "served_block_order" not in vars(fresh)  # none of it needed the whole order


def test_early_blocks_only_where_the_whole_order_needs_the_kernel() -> None:
    small = plan_of(1000)
    assert small.early_minipochs(0) == ()
    # 2 minipochs x 4 blocks x the streams served, at most EARLY_ENTRIES_MAX entries
    streams = EARLY_ENTRIES_MAX // 4
    assert big_plan(streams=streams).early_minipochs(0) == ()
    assert big_plan(tuple(range(streams // 2)), streams).early_minipochs(0) == (0, 1)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("early-order") / "data.zarr")
    seqs = random_sequences(13, 6700, max_len=80)
    asyncflat.write_flat_tokens(path, {"train": seqs}, chunk_tokens=1 << 14)
    return path


def params(path: str, seed: int = 5) -> FlatTokensParams:
    return FlatTokensParams(path, 2, 4, 1, seed, True)


#: how long computing a whole order is held back at most: a load that waited for it took this
HELD_S = 60


@pytest.fixture
def held_order(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Computing a whole block order waits for the first event; the second says one was
    asked for."""
    release, asked = threading.Event(), threading.Event()
    compute = ShufflePlan.compute_block_order

    def held(plan: ShufflePlan, *args: object, **kwargs: object) -> np.ndarray:
        if "served_block_order" not in vars(plan):
            asked.set()
            release.wait(HELD_S)
        return compute(plan, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ShufflePlan, "compute_block_order", held)
    yield release, asked
    release.set()


@pytest.fixture
def held_jumps(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Computing the early blocks of any minipoch but 0 waits for the event (set it before
    the loader closes: closing waits for those threads)."""
    gate, compute = threading.Event(), ShufflePlan.compute_early_order

    def gated(plan: ShufflePlan, minipochs: tuple[int, ...], *args: object) -> None:
        if minipochs[0] != 0:
            gate.wait(HELD_S)
        compute(plan, minipochs, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ShufflePlan, "compute_early_order", gated)
    yield gate
    gate.set()


def check(path: str, batch: object, step: int, seed: int = 5) -> None:
    want = oracle(path, params(path, seed), BATCH).batch(step)
    np.testing.assert_array_equal(np.asarray(batch.targets), want[0], f"step {step}")  # type: ignore[attr-defined]
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), want[1])  # type: ignore[attr-defined]


@pytest.mark.parametrize("first", [0, 2 * 7], ids=["fresh", "resume"])
def test_every_load_is_served_before_the_whole_order(
    dataset: str, held_order: tuple[threading.Event, threading.Event], first: int
) -> None:
    """Steps of the first load's minipoch and the next are right while the whole order is
    held back; it is asked for once a load returned, and a load of a later minipoch (two on,
    or a jump far ahead) computes its own blocks alone rather than wait for it."""
    release, asked = held_order
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE) as loader:
        assert loader.plan.read_block_count > NO_COMPILE_MAX
        started = time.perf_counter()
        for step in range(first, first + 4):  # two steps a minipoch
            check(dataset, loader.load(step), step)
        assert asked.wait(10)
        for step in (first + 4, first + 40):  # beyond the early blocks
            assert not loader.plan.block_order_known(step // 2)
            check(dataset, loader.load(step), step)
        assert time.perf_counter() - started < HELD_S / 2  # none waited for the whole order
        assert not loader.plan.block_order_known(first // 2 + 5)  # still held back
        release.set()
        wait_until(lambda: loader.plan.block_order_known(first // 2 + 5), "the whole order", 30)
        check(dataset, loader.load(first + 6), first + 6)


def test_the_whole_order_waits_for_a_load(
    dataset: str, held_order: tuple[threading.Event, threading.Event]
) -> None:
    """Nothing asks for the whole order before a load returned (or the opening's fills are
    done: none here), so it never competes with a first load's fills."""
    _, asked = held_order
    options = EngineOptions(fill_on_open="never")
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        assert not asked.wait(0.5)
        check(dataset, loader.load(1), 1)
        assert asked.wait(10)


def test_a_prefetch_held_for_the_whole_order_starts_once_it_lands(
    dataset: str, held_order: tuple[threading.Event, threading.Event]
) -> None:
    """Serving minipoch 1 makes minipoch 2's prefetch due; its blocks wait for the whole
    order, and it starts as that lands, before any load asks for minipoch 2."""
    release, asked = held_order
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE) as loader:
        for step in range(4):
            loader.load(step)
        assert asked.wait(10)

        def prefetched() -> set[int]:
            stats = loader.stats().as_dict()
            fills = stats["fills"] + stats["active_fills"]
            return {f["minipoch"] for f in fills if f["reason"] == "prefetch"}

        time.sleep(0.2)
        assert 2 not in prefetched()  # its blocks are not known
        release.set()
        wait_until(lambda: 2 in prefetched(), "minipoch 2's prefetch")
        check(dataset, loader.load(4), 4)


def test_a_mixtures_first_steps_are_served_before_the_whole_orders(
    dataset: str,
    held_order: tuple[threading.Event, threading.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each source's engine serves its first minipochs from early blocks; the batches equal
    those of the same mixture whose sources compute their whole orders first."""
    release, _ = held_order
    mixture = MixtureParams(
        (MixtureSource(params(dataset, 5), 0.5), MixtureSource(params(dataset, 9), 0.5)),
        seed=1,
        block_rows=2,
    )
    with MixtureLoader("train", mixture, BATCH, SINGLE) as loader:
        started = time.perf_counter()
        early = [loader.load(step) for step in range(3)]  # whole orders held back
        assert time.perf_counter() - started < HELD_S / 2
        release.set()
    monkeypatch.setattr(ShufflePlan, "early_minipochs", lambda plan, minipoch: ())
    with MixtureLoader("train", mixture, BATCH, SINGLE) as loader:
        for step, batch in enumerate(early):
            want = loader.load(step)
            np.testing.assert_array_equal(np.asarray(batch.targets), np.asarray(want.targets))


def test_the_openings_fills_are_awaited_without_a_task_per_block(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting for the opening's fills to ask for the whole order costs no coroutine per
    block: 2 streams x 4096 blocks left 8,205 waits pending at once on the loop (a first
    load 25-50% slower), although the order was wanted from the start (large buffers have no
    early blocks)."""
    pending = {"now": 0, "most": 0}
    wait = asyncio.Event.wait

    async def counted(event: asyncio.Event) -> bool:
        pending["now"] += 1
        pending["most"] = max(pending["most"], pending["now"])
        try:
            return await wait(event)
        finally:
            pending["now"] -= 1

    monkeypatch.setattr(asyncio.Event, "wait", counted)
    big = FlatTokensParams(dataset, 2, 4096, 1, 5, True)  # 4096 blocks a buffer
    options = EngineOptions(fill_on_open="always")
    with ShufflingLoader("train", big, BATCH, SINGLE, options=options) as loader:

        def opened() -> bool:
            fills = loader.stats().as_dict()["fills"]
            return sum(fill["reason"] == "open" for fill in fills) == 2

        wait_until(opened, "the opening's fills")
        assert pending["most"] < 256, pending


def test_computing_no_early_minipochs_computes_nothing() -> None:
    """Where the whole order comes first, ``early_minipochs`` is () and computing the early
    blocks of it does nothing (it raised numpy's 'need at least one array' ValueError)."""
    small = plan_of(1000)
    assert small.early_minipochs(0) == ()
    small.compute_early_order(small.early_minipochs(0))
    assert not small.block_order_known(0)
    assert "served_block_order" not in vars(small)


def test_early_blocks_computed_on_two_threads_at_once_are_both_kept() -> None:
    """``compute_early_order`` runs on any thread: two calls at once each keep their blocks
    (each merged what was known when it started, so the last to finish dropped the other's)."""
    plan = plan_of(20_000_000)  # ~0.2 s a call: the two overlap
    barrier = threading.Barrier(2)

    def compute(minipochs: tuple[int, ...]) -> None:
        barrier.wait()
        plan.compute_early_order(minipochs)

    threads = [threading.Thread(target=compute, args=(m,)) for m in ((0, 1), (7, 8))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(plan.block_order_known(m) for m in (0, 1, 7, 8))
    assert "served_block_order" not in vars(plan)


def early_threads() -> int:
    """The threads computing early blocks now (one a request)."""
    return sum(t.name == "asyncflat-early-blocks" for t in threading.enumerate())


def computing_early_blocks(label: str) -> ShufflingLoader:
    """A loader of 2x10^12 synthetic tokens (122M read blocks: ~2 s of draws), returned once
    its early blocks are being computed."""
    from asyncflat.testing import SyntheticCounts  # registers synthetic://

    storage = {"tokens": 2 * 10**12, "chunk_tokens": 1 << 22, "counts": SyntheticCounts()}
    big = FlatTokensParams(f"synthetic://{label}", 1, 16, 8, 0, True, storage_options=storage)
    loader = ShufflingLoader("train", big, TokenBatchParams(len=2048, batch=8), SINGLE)
    wait_until(lambda: early_threads() > 0, "the early blocks' thread")
    return loader


def test_closing_stops_the_early_blocks_and_leaves_no_thread() -> None:
    """A loader closed while its early blocks are computed (122M read blocks: ~2 s of draws)
    stops them within a piece, and no thread of it is left."""
    from helpers.resources import library_threads

    loader = computing_early_blocks("early")
    started = time.perf_counter()
    loader.close()
    assert time.perf_counter() - started < 1.0
    assert library_threads() == []


def test_a_load_waiting_for_its_early_blocks_is_not_stopped_by_another(
    dataset: str,
    held_order: tuple[threading.Event, threading.Event],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two first loads at once in different minipochs (two threads): each is served from its
    own early blocks. The second's request stopped the blocks the first waited for, and the
    first waited for the whole order (held back here: it never returned)."""
    release, _ = held_order
    compute, other = ShufflePlan.compute_early_order, threading.Event()

    def ordered(plan: ShufflePlan, minipochs: tuple[int, ...], *args: object) -> None:
        if minipochs[0] == 0:
            other.wait(10)  # until the other load's request is under way
        else:
            other.set()
        compute(plan, minipochs, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ShufflePlan, "compute_early_order", ordered)
    options = EngineOptions(fill_on_open="never")
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        batches: dict[int, object] = {}
        threads = {
            step: threading.Thread(target=lambda s=step: batches.update({s: loader.load(s)}))
            for step in (0, 2 * 7)
        }
        threads[0].start()
        time.sleep(0.3)  # waiting for minipoch 0's blocks
        threads[2 * 7].start()
        for thread in threads.values():
            thread.join(HELD_S / 3)
        served = sorted(batches)
        release.set()
        for thread in threads.values():
            thread.join(30)
        assert served == [0, 2 * 7]  # neither waited for the whole order
        for step, batch in batches.items():
            check(dataset, batch, step)


@pytest.mark.parametrize("wanted", [True, False], ids=["beside_the_order", "first_loads"])
def test_loads_jumping_to_many_minipochs_compute_few_early_blocks_at_once(
    dataset: str,
    held_order: tuple[threading.Event, threading.Event],
    held_jumps: threading.Event,
    wanted: bool,
) -> None:
    """Loads of five far minipochs at once: at most EARLY_REQUESTS_MAX compute their own
    blocks (each draws every swap of the split), one fewer once the whole order's walk is
    wanted (a load returned); the others wait for the whole order, which serves them all as
    it lands."""
    release, asked = held_order
    most = EARLY_REQUESTS_MAX - wanted
    options = EngineOptions(fill_on_open="never")  # nothing but a load asks for the order
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        if wanted:
            check(dataset, loader.load(0), 0)
        assert asked.wait(10 if wanted else 0.3) == wanted
        wait_until(lambda: early_threads() == 0, "the opening's early blocks")
        batches: dict[int, object] = {}
        steps = (10, 20, 30, 40, 50)  # minipochs 5, 10, 15, 20, 25
        threads = [
            threading.Thread(target=lambda s=step: batches.update({s: loader.load(s)}))
            for step in steps
        ]
        try:
            for thread in threads:
                thread.start()
            wait_until(lambda: early_threads() >= most, "the early requests")
            time.sleep(0.3)
            assert early_threads() == most and not batches
            release.set()  # the whole order lands: every load is served by it
            for thread in threads:
                thread.join(30)
        finally:
            held_jumps.set()
        assert sorted(batches) == list(steps)
        for step, batch in batches.items():
            check(dataset, batch, step)


def test_a_load_waiting_for_its_own_blocks_outlives_a_failed_whole_order(
    dataset: str, monkeypatch: pytest.MonkeyPatch, held_jumps: threading.Event
) -> None:
    """The whole order fails (say a MemoryError at 10^14 tokens) while a load waits for its
    own minipochs' blocks, computed alone: those still serve it (it raised the order's error)."""
    fail, gate = threading.Event(), held_jumps

    def failing(plan: ShufflePlan, *args: object, **kwargs: object) -> np.ndarray:
        fail.wait(HELD_S)
        raise RuntimeError("the whole order failed")

    monkeypatch.setattr(ShufflePlan, "compute_block_order", failing)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE) as loader:
        check(dataset, loader.load(0), 0)
        outcome: list[object] = []

        def load() -> None:
            try:
                outcome.append(loader.load(10))  # minipoch 5: beyond the opening's blocks
            except Exception as exc:  # asserted below
                outcome.append(exc)

        waiting = threading.Thread(target=load)
        try:
            waiting.start()
            time.sleep(0.3)  # waiting for its own blocks
            fail.set()
            time.sleep(0.3)  # the whole order failed meanwhile
            gate.set()
            waiting.join(30)
        finally:
            fail.set()
            gate.set()
        assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
        check(dataset, outcome[0], 10)


def test_a_loader_collected_on_a_thread_of_its_early_blocks_closes_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forgotten loader (only a garbage cycle holds it) collected on one of the threads
    that draw its early blocks: its close() must not wait for its loop, which waits for that
    very thread (it waited out the loop's 15 s join timeout)."""
    import gc

    from helpers.resources import library_threads

    armed, took = threading.Event(), []
    zeros = np.zeros  # each piece's filter table is made with it, numpy's draws or the kernel's

    def collecting(*args: Any, **kwargs: Any) -> np.ndarray:
        if armed.is_set() and threading.current_thread().name.startswith("asyncflat-entries"):
            armed.clear()
            started = time.perf_counter()
            gc.collect()  # a collection that happens to run there
            took.append(time.perf_counter() - started)
        return zeros(*args, **kwargs)

    monkeypatch.setattr(np, "zeros", collecting)
    loader = computing_early_blocks("early-gc")
    cycle: list[object] = [loader]
    cycle.append(cycle)
    gc.disable()  # collected on the drawing thread only
    try:
        del loader, cycle
        armed.set()
        wait_until(lambda: took, "a collection on a drawing thread", 30)
    finally:
        gc.enable()
    assert took[0] < 5, took
    wait_until(lambda: library_threads() == [], "no thread of the loader left")


def test_a_first_load_elsewhere_before_the_opening_asks_leaves_it_no_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A first load in minipoch 5 that asks for its blocks in the opening's own turn of the
    loop, before the fills on opening first ran, stops the opening's request; those fills then
    start no request of their own (it read the whole split's draws beside the load's for a
    step 0 no load asked for): two walks of the split, and the load is right."""
    asked: list[tuple[int, ...]] = []
    compute = ShufflePlan.compute_early_order

    def recorded(plan: ShufflePlan, minipochs: tuple[int, ...], *args: object) -> None:
        asked.append(minipochs)
        compute(plan, minipochs, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ShufflePlan, "compute_early_order", recorded)
    sequences = NO_COMPILE_MAX + 4000
    source = FakeSource(*make_data(rows=sequences), chunk=SEQ_LEN * 64)
    plan = plan_of(sequences * SEQ_LEN // 4)  # its 4-token rows, packed
    assert plan.early_minipochs(0) == (0, 1) and plan.step_count > 10
    engine = Engine(plan, source, range(2), EngineOptions(fill_on_open="always"))

    async def first_load() -> np.ndarray:
        try:
            engine.open(fill=True)
            return await engine.gather(10, np.arange(4))  # minipoch 5: two steps a minipoch
        finally:
            await engine.aclose()  # joins every thread that computed early blocks

    rows = asyncio.run(asyncio.wait_for(first_load(), 60))
    want = oracle((source.tokens, source.starts), plan).encoded_batch(10)
    np.testing.assert_array_equal(rows, want)
    assert asked == [(0, 1), (5, 6)]


def test_a_failed_early_request_falls_back_to_the_whole_order_with_a_warning(
    dataset: str,
    held_order: tuple[threading.Event, threading.Event],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Computing a jump's own blocks fails (say a MemoryError) while the whole order is held
    back: the load is served by the whole order once it lands, and a warning says why it
    waited for it."""
    release, _ = held_order
    compute = ShufflePlan.compute_early_order

    def failing(plan: ShufflePlan, minipochs: tuple[int, ...], *args: object) -> None:
        if minipochs[0] != 0:
            release.set()  # the whole order lands only after this request failed
            raise MemoryError("no room for the draws")
        compute(plan, minipochs, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ShufflePlan, "compute_early_order", failing)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE) as loader:
        check(dataset, loader.load(0), 0)
        with caplog.at_level(logging.WARNING, "asyncflat"):
            check(dataset, loader.load(40), 40)  # minipoch 20
    failures = [r.getMessage() for r in caplog.records if "early read blocks" in r.getMessage()]
    assert failures == [
        "computing early read blocks failed, waiting for the whole order: "
        "MemoryError('no room for the draws')"
    ]
