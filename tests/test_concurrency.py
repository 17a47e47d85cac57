"""Many threads on one loader: every load succeeds with the oracle's batch, on every read path.

A trainer walking the epoch with device prefetch, a second walker using ``load()``, and threads
loading random steps all share one loader with small buffers (many minipochs, so their fills
compete for the two buffers of each stream) over a store that answers with a little jittered
latency, so fills are in flight while other threads need other minipochs. Before fills had owners
a prefetch started by one thread cancelled the fill another thread's load was waiting for
(``LoaderClosedError: ... fill cancelled``).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from conftest import oracle, random_sequences

import asyncflat
from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.testing.faults import FaultyStore

pytestmark = pytest.mark.timeout(120)

REPO = str(Path(__file__).resolve().parents[1])
SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
BATCH = TokenBatchParams(len=16, batch=8)

#: name -> (writer keyword arguments, sequence packing): direct Blosc on zarr 2 and 3, zarr's
#: decoder through shards, and the unpacked path (seq_starts then tokens per block)
PATHS: dict[str, tuple[dict[str, Any], bool]] = {
    "blosc-v2": ({"zarr_format": 2, "chunk_tokens": 512}, True),
    "blosc-v3": ({"zarr_format": 3, "chunk_tokens": 512}, True),
    "sharded-v3": ({"zarr_format": 3, "chunk_tokens": 256, "shard_tokens": 1024}, True),
    "unpacked": ({"zarr_format": 3, "chunk_tokens": 512}, False),
}


@pytest.fixture(scope="module")
def sequences() -> list[np.ndarray]:
    return random_sequences(11, 300, max_len=60)


@pytest.mark.parametrize("kind", list(PATHS))
def test_threads_loading_random_and_sequential_steps_all_get_the_oracles_batches(
    kind: str, sequences: list[np.ndarray], tmp_path: Path
) -> None:
    writer_kwargs, packing = PATHS[kind]
    path = str(tmp_path / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": sequences}, **writer_kwargs)
    params = FlatTokensParams(path, 2, 2, 4, seed=5, sequence_packing=packing)
    expected = oracle(path, params, BATCH)
    options = EngineOptions(prefetch_to_device=2, max_concurrent_reads=4)

    def slow(store: Any) -> FaultyStore:
        return FaultyStore(
            store, latency_s=0.0005, latency_jitter_s=0.001, fault_keys="train/*/c/*", seed=1
        )

    errors: list[tuple[str, BaseException]] = []
    checked = [0]
    count_lock = threading.Lock()
    started = time.monotonic()
    with ShufflingLoader(
        "train", params, BATCH, SINGLE, options=options, store_wrapper=slow
    ) as loader:
        steps = loader.step_count
        assert steps > 30  # many minipochs: the threads' fills compete for the buffers

        def check(step: int, batch: Any) -> None:
            targets, starts = expected.batch(step)
            np.testing.assert_array_equal(np.asarray(batch.targets), targets, err_msg=str(step))
            np.testing.assert_array_equal(np.asarray(batch.is_seq_start), starts)
            with count_lock:
                checked[0] += 1

        def guarded(name: str, work: Any) -> Any:
            def run() -> None:
                try:
                    work()
                except BaseException as exc:
                    errors.append((name, exc))

            return threading.Thread(target=run, name=f"test-{name}")

        def trainer() -> None:  # walks the epoch through an iterator (device prefetch)
            for step, batch in loader.iter():
                check(step, batch)

        def walker() -> None:  # walks the epoch from the middle with load()
            for step in range(steps // 2, steps):
                check(step, loader.load(step))

        def random_loads(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for step in rng.integers(0, steps, 80).tolist():
                check(step, loader.load(step))

        threads = [
            guarded("trainer", trainer),
            guarded("walker", walker),
            *(guarded(f"random-{i}", lambda i=i: random_loads(i)) for i in range(3)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not any(t.is_alive() for t in threads), "a loading thread hung"
        stats = loader.stats()
    assert not errors, errors
    assert checked[0] == steps + (steps - steps // 2) + 3 * 80
    assert time.monotonic() - started < 60
    # What concurrency costs: at most two extra buffers per stream, allocated once each.
    assert stats.buffer_allocations <= 2 * (2 + 2), stats.buffer_allocations


class PinLog:
    """Every pin the engines' fill tables take and drop (``FillTable.pin``), and what is held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from asyncflat.engine.table import FillTable

        self.calls: list[tuple[tuple[int, int], ...]] = []  # the keys of each pin taken
        self.net: collections.Counter[tuple[int, tuple[int, int]]] = collections.Counter()
        real_pin = FillTable.pin

        def pin(table: FillTable, keys: list[tuple[int, int]], delta: int) -> None:
            if delta > 0:
                self.calls.append(tuple(keys))
            for key in keys:
                self.net[(id(table), key)] += delta
            real_pin(table, keys, delta)

        monkeypatch.setattr(FillTable, "pin", pin)

    def held(self) -> dict[tuple[int, tuple[int, int]], int]:
        return {key: n for key, n in self.net.items() if n}


def pin_keys(plan: ShufflePlan, step: int, rows: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The (stream, minipoch) buffers an iterator at ``step`` holds: those the step reads and
    the next ones."""
    loc = plan.locate(step, rows)
    keys = set(zip(loc.stream.tolist(), loc.minipoch.tolist()))
    keys |= {(s, m + 1) for s, m in keys if m + 1 < plan.minipoch_count}
    return tuple(sorted(keys))


@pytest.mark.parametrize("depth", [0, 2])
def test_an_iterator_pins_each_minipoch_once_not_each_step(
    depth: int, sequences: list[np.ndarray], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An iterator holds a pin on the minipochs it is in (and the next): taken when it enters
    them, released when it leaves, not taken and released again on every ``next()``; while it
    walks, exactly its current keys are pinned, once each; closing it leaves no pin."""
    path = str(tmp_path / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": sequences}, zarr_format=3, chunk_tokens=512)
    params = FlatTokensParams(path, 2, 2, 16, seed=5, sequence_packing=True)
    log = PinLog(monkeypatch)
    options = EngineOptions(prefetch_to_device=depth)
    with ShufflingLoader("train", params, BATCH, SINGLE, options=options) as loader:
        steps = loader.step_count
        wanted = [pin_keys(loader.plan, step, loader.host_rows) for step in range(steps)]
        changes = [k for i, k in enumerate(wanted) if i == 0 or k != wanted[i - 1]]
        assert len(changes) < steps // 3  # many steps per minipoch: the case that matters
        iterator = loader.iter()
        for step, _batch in iterator:
            if step + 1 < steps:
                pins = {key: n for (_, key), n in log.held().items()}
                assert pins == dict.fromkeys(wanted[step + 1], 1), (step, pins)
        assert log.calls == changes
        assert not log.held()  # the finished iterator let go of everything
        log.calls.clear()
        iterator = loader.iter(steps // 2)
        next(iterator)
        iterator.close()
        assert not log.held()
        assert len(log.calls) <= 2


class HeldCounters:
    """Makes the engine's lock be held, on demand, until released: a source's counters that
    block, when armed, as the engine reads them (under its lock, for ``stats()``)."""

    def __init__(self, counters: Any) -> None:
        self.counters = counters
        self.armed = False
        self.holding = threading.Event()  # the engine's lock is held now
        self.release = threading.Event()

    def read(self) -> Any:
        if self.armed:
            self.armed = False
            self.holding.set()
            assert self.release.wait(30)
        return self.counters


def test_a_pin_released_while_another_thread_holds_the_engine_lock_is_gone_when_it_returns(
    sequences: list[np.ndarray], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An iterator closed while another thread holds the engine's lock: once ``close()`` has
    returned and the lock is free, no pin is left. The release used to be queued for the
    lock's next holder, so the pin stayed (for as long as nothing else took the lock: here, for
    good, with prefetch off and every fill done)."""
    import asyncio

    from asyncflat.source.local_source import LocalTokenSource

    path = str(tmp_path / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": sequences}, zarr_format=3, chunk_tokens=512)
    source = asyncio.run(LocalTokenSource.open_plain(path, "train"))
    assert source is not None
    held = HeldCounters(source.io)
    monkeypatch.setattr(LocalTokenSource, "io", property(lambda _: held.read()), raising=False)
    log = PinLog(monkeypatch)
    params = FlatTokensParams(path, 2, 2, 4, seed=0, sequence_packing=True)
    options = EngineOptions(prefetch=False, prefetch_to_device=0)
    with ShufflingLoader("train", params, BATCH, SINGLE, source=source, options=options) as loader:
        iterator = loader.iter()
        next(iterator)
        assert log.held()
        held.armed = True
        reader = threading.Thread(target=loader.stats, name="stats-reader")
        reader.start()
        assert held.holding.wait(30)  # the engine's lock is held by the reader's call
        closer = threading.Thread(target=iterator.close, name="closer")
        closer.start()
        closer.join(1.0)  # the old code queued the release and returned at once
        held.release.set()
        for thread in (reader, closer):
            thread.join(30)
            assert not thread.is_alive(), thread.name
        assert not log.held()  # exact: nothing queued behind the lock


#: A collected iterator's finalizer run by a full collection on the engine's loop thread while
#: that thread holds the engine's lock (a source whose counters the engine reads under it).
PIN_RELEASED_UNDER_THE_LOCK = """
    import asyncio, faulthandler, gc, sys
    import jax
    import asyncflat
    from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
    from asyncflat.source.local_source import LocalTokenSource

    faulthandler.dump_traceback_later(30, exit=True)  # a deadlock fails fast, with the stacks


    class CollectingSource(LocalTokenSource):
        # Runs a full collection when the engine reads its counters (under the engine's lock).

        armed = False

        @property
        def io(self):
            if CollectingSource.armed:
                CollectingSource.armed = False
                gc.collect()
                print("collected", flush=True)
            return self._counters

        @io.setter
        def io(self, value):
            self._counters = value


    path, depth = sys.argv[1], int(sys.argv[2])
    source = asyncio.run(CollectingSource.open_plain(path, "train"))
    params = FlatTokensParams(path, 2, 2, 4, 0, True)
    options = EngineOptions(prefetch_to_device=depth)
    with ShufflingLoader("train", params, TokenBatchParams(len=16, batch=8),
                         jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                         source=source, options=options) as loader:
        iterator = loader.iter()
        next(iterator)
        cycle = [iterator]
        cycle.append(cycle)  # only the collector frees it: its finalizer runs inside gc.collect()
        del iterator, cycle
        CollectingSource.armed = True
        loader.stats()  # the engine's lock is held while it reads source.io
        assert not CollectingSource.armed
        for step in range(loader.step_count):  # the released pin lets loads evict as before
            loader.load(step)
    print("ok", flush=True)
"""


@pytest.mark.parametrize("depth", [0, 2])
def test_an_iterator_collected_while_its_thread_holds_the_engine_lock_does_not_deadlock(
    depth: int, sequences: list[np.ndarray], tmp_path: Path
) -> None:
    """The garbage collector runs finalizers on whatever thread allocates. An iterator dropped
    in a reference cycle, collected on a thread holding the engine's lock, released its pin
    there: ``Engine.unpin`` took the same lock and the thread hung for good. Now the finalizer
    hands the release to the loop's thread (``Lifecycle.release_collected``) and ``unpin``
    never waits for a lock its own thread holds (that release is applied by the next holder). In a
    subprocess, with a faulthandler guard: a deadlock fails in seconds, with the stacks."""
    path = str(tmp_path / "data.zarr")
    asyncflat.write_flat_tokens(path, {"train": sequences}, zarr_format=3, chunk_tokens=512)
    script = textwrap.dedent(PIN_RELEASED_UNDER_THE_LOCK)
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", script, path, str(depth)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["collected", "ok"], result.stdout
