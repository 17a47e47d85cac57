"""Step 0's fill starts when a loader opens (``EngineOptions.fill_on_open``), not at its first load.

* a trainer that sets up between construction and its first load finds step 0's buffer
  filled: the fill is recorded as ``"open"``, no load waited on it, the batches are right;
* a first load elsewhere (a resume, in another minipoch or later in minipoch 0) cancels what
  is not done of those fills before its own reads are queued, and is served right;
* a remote store (``memory://`` here) is filled on opening only with ``"always"``;
* a mixture starts its sources' fills once its budget is checked, keeps them at a fresh start
  whatever streams a source's first step reads, and a resume cancels those of passes it does
  not read;
* ``fill_on_open="never"`` (or ``prefetch=False``) starts nothing before the first load;
* a loader closed before any load cancels the fill and leaves no thread behind;
* step 0's buffers are faulted in on the CPU pool meanwhile, and the first prefetch's on the
  loop's background thread, never delaying step 0's fill: the fills write into them only once
  every page is written (slow page writes never land on decoded rows, a resume's included), a
  mixture refused by its budget writes none, a bucket's only where it fills on opening, and
  closing stops them; a split of one minipoch, or whose minipoch 1 serves no row (no prefetch
  to come), has only step 0's written.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import jax
import numpy as np
import pytest
from conftest import oracle, random_sequences, random_store, wait_until
from helpers.resources import library_threads

import asyncflat
import asyncflat.engine.fill
from asyncflat import EngineOptions, FlatTokensParams, ShufflingLoader, TokenBatchParams
from asyncflat.engine.table import FillTable
from asyncflat.testing.faults import FaultyStore

pytestmark = pytest.mark.timeout(120)

SINGLE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
BATCH = TokenBatchParams(len=16, batch=8)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return random_store(tmp_path_factory, "fill-on-open", 5, 600, validation=50, chunk_tokens=256)


def params(path: str) -> FlatTokensParams:
    return FlatTokensParams(path, 2, 3, 4, 7, True)


def check(path: str, batch: Any, step: int) -> None:
    want = oracle(path, params(path), BATCH).batch(step)
    np.testing.assert_array_equal(np.asarray(batch.targets), np.asarray(want[0]), f"step {step}")
    np.testing.assert_array_equal(np.asarray(batch.is_seq_start), np.asarray(want[1]))


def fills(loader: Any) -> list[dict[str, Any]]:
    return [f.as_dict() for f in loader.stats().fills]


def test_the_first_fill_runs_while_the_trainer_sets_up(dataset: str) -> None:
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE) as loader:
        # the trainer's set-up: nobody has asked for a batch
        wait_until(lambda: len(fills(loader)) == 2, "step 0's fills (one per stream) to finish")
        records = fills(loader)
        assert {(f["stream"], f["minipoch"], f["reason"]) for f in records} == {
            (0, 0, "open"),
            (1, 0, "open"),
        }
        assert not any(f["waited_on"] or f["cancelled"] for f in records)
        for step in range(4):
            check(dataset, loader.load(step), step)


def test_a_first_load_elsewhere_cancels_the_fill_it_does_not_read(dataset: str) -> None:
    made: list[FaultyStore] = []

    def slow(store: Any) -> FaultyStore:
        # every chunk read takes 0.3 s: step 0's fill cannot finish before the first load
        made.append(FaultyStore(store, latency_s=0.3, fault_keys="*encoded_tokens/c*", seed=1))
        return made[-1]

    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, store_wrapper=slow) as loader:
        plan = loader.plan
        resume = plan.first_step(plan.minipoch_count - 1) + 1  # a resume in the last minipoch
        assert plan.minipoch_count >= 3
        # the trainer's set-up: long enough for step 0's fills to start, not to finish
        wait_until(
            lambda: len(loader.stats().as_dict()["active_fills"]) == 2, "step 0's fills to start"
        )
        check(dataset, loader.load(resume), resume)
        records = fills(loader)
        opened = [f for f in records if f["reason"] == "open"]
        assert len(opened) == 2 and all(
            f["cancelled"] and f["blocks_done"] < f["blocks"] for f in opened
        ), records
        served = {f["minipoch"] for f in records if not f["cancelled"]}
        assert served <= {plan.minipoch_count - 1}, records
        check(dataset, loader.load(resume + 1), resume + 1)


@pytest.mark.parametrize(
    "options", [EngineOptions(fill_on_open="never"), EngineOptions(prefetch=False)]
)
def test_nothing_is_filled_before_the_first_load_when_turned_off(
    dataset: str, options: EngineOptions
) -> None:
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        time.sleep(0.3)
        stats = loader.stats().as_dict()
        assert stats["fills"] == [] and stats["active_fills"] == []
        check(dataset, loader.load(0), 0)
        assert {f["reason"] for f in fills(loader)} <= {"demand", "prefetch"}


def test_a_loader_closed_before_any_load_leaves_nothing_running(dataset: str) -> None:
    def slow(store: Any) -> FaultyStore:
        return FaultyStore(store, latency_s=0.2, fault_keys="*encoded_tokens/c*", seed=1)

    for _ in range(3):
        loader = ShufflingLoader("train", params(dataset), BATCH, SINGLE, store_wrapper=slow)
        loader.close()
    wait_until(lambda: library_threads() == [], "the loaders' threads to end")


@pytest.mark.parametrize("value", [True, 1, "sometimes"])
def test_fill_on_open_must_be_one_of_its_modes(value: Any) -> None:
    with pytest.raises(asyncflat.ConfigError, match="fill_on_open must be one of 'local'"):
        EngineOptions(fill_on_open=value)


def slow_chunks(latency_s: float) -> Any:
    def wrap(store: Any) -> FaultyStore:
        return FaultyStore(store, latency_s=latency_s, fault_keys="*encoded_tokens/c*", seed=1)

    return wrap


def test_a_first_load_later_in_minipoch_0_takes_the_fill_over_from_its_step(
    dataset: str,
) -> None:
    """Step 0's fills were planned from step 0: a resume later in minipoch 0 keeps them (the
    blocks already read stay) re-planned from its step, and does not wait for the blocks only
    earlier steps read (one read at a time here: the fill's 16 blocks take seconds)."""
    wide = FlatTokensParams(dataset, 1, 16, 4, 7, True)
    options = EngineOptions(max_concurrent_reads=1)
    with ShufflingLoader(
        "train", wide, BATCH, SINGLE, options=options, store_wrapper=slow_chunks(0.15)
    ) as loader:
        wait_until(lambda: loader.stats().as_dict()["active_fills"] != [], "step 0's fill to start")
        resume = loader.plan.first_step(1) - 1  # the last step of minipoch 0
        batch = loader.load(resume)
        (active,) = [f for f in loader.stats().as_dict()["active_fills"] if f["minipoch"] == 0]
        assert active["reason"] == "open" and active["must_finish_by_step"] == resume
        assert active["blocks_done"] < active["blocks"], active  # it did not wait for them all
        want = oracle(dataset, wide, BATCH).batch(resume)
        np.testing.assert_array_equal(np.asarray(batch.targets), np.asarray(want[0]))
        assert not [f for f in fills(loader) if f["minipoch"] == 0 and f["cancelled"]]


def memory_dataset(name: str) -> str:
    url = f"memory://fill-on-open-{name}.zarr"
    seqs = random_sequences(5, 600, max_len=80)
    asyncflat.write_flat_tokens(url, {"train": seqs, "validation": seqs[:50]}, chunk_tokens=256)
    return url


@pytest.mark.parametrize("mode", ["local", "always"])
def test_a_remote_store_is_filled_on_opening_only_when_asked(mode: str) -> None:
    url = memory_dataset(mode)
    options = EngineOptions(fill_on_open=mode)
    with ShufflingLoader("train", params(url), BATCH, SINGLE, options=options) as loader:
        time.sleep(0.5)
        stats = loader.stats().as_dict()
        started = {f["reason"] for f in stats["fills"] + stats["active_fills"]}
        assert started == ({"open"} if mode == "always" else set()), stats
        check(url, loader.load(0), 0)


# -- mixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def second(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("fill-on-open-b") / "b.zarr")
    seqs = [s + 1000 for s in random_sequences(6, 600, max_len=80)]
    asyncflat.write_flat_tokens(path, {"train": seqs, "validation": seqs[:50]}, chunk_tokens=256)
    return path


def mixture(a: str, b: str, weight_b: float = 0.5, block_rows: int = 2) -> Any:
    from asyncflat import MixtureParams, MixtureSource

    return MixtureParams(
        (MixtureSource(params(a), 1 - weight_b), MixtureSource(params(b), weight_b)),
        seed=1,
        block_rows=block_rows,
    )


def source_fills(loader: Any, index: int) -> list[dict[str, Any]]:
    engine = loader.stats().sources[index].engine.as_dict()
    return engine["fills"] + engine["active_fills"]


def opened(loader: Any, sources: int = 2) -> None:
    """Wait until every source's step 0 fills have started (the trainer's set-up)."""

    def started() -> bool:
        return all(
            {f["stream"] for f in source_fills(loader, i) if f["reason"] == "open"} == {0, 1}
            for i in range(sources)
        )

    wait_until(started, "the sources' fills on opening to start")


def test_a_mixture_keeps_its_sources_fills_at_a_fresh_start(dataset: str, second: str) -> None:
    """A source of small weight reads one stream at its first step: its other stream's fill is
    still step 0's, and must not be cancelled."""
    mix = mixture(dataset, second, 0.125, block_rows=16)
    with ShufflingLoader("train", mix, BATCH, SINGLE) as loader:
        opened(loader)
        wait_until(  # done: the first load could be served off the loop (it must not be)
            lambda: all(
                f.get("blocks_done") == f["blocks"] for i in (0, 1) for f in source_fills(loader, i)
            ),
            "the fills on opening to finish",
        )
        for step in range(6):
            loader.load(step)
            time.sleep(0.02)
        for index in (0, 1):
            records = source_fills(loader, index)
            assert {f["stream"] for f in records if f["reason"] == "open"} == {0, 1}, records
            assert not any(f.get("cancelled") for f in records), records


def test_a_mixture_resumed_elsewhere_cancels_its_sources_fills(dataset: str, second: str) -> None:
    wrap = slow_chunks(0.3)
    with ShufflingLoader(
        "train", mixture(dataset, second), BATCH, SINGLE, store_wrapper=[wrap, wrap]
    ) as loader:
        opened(loader)
        loader.load(5)  # still every source's first pass (its figures are the newest pass's)
        for index in (0, 1):
            records = source_fills(loader, index)
            started = [f for f in records if f["reason"] == "open"]
            assert started and all(f.get("cancelled") for f in started), records


@pytest.mark.parametrize("read_before", [True, False])
def test_a_mixture_resume_keeps_the_fills_of_a_source_that_still_stands_at_its_step_0(
    dataset: str, second: str, read_before: bool
) -> None:
    """A resume at a step that reads nothing of a source: if the source is past its step 0 on
    every stream (a source step is 4 rows of a stream here), its step 0 fills are of no use
    any more (cancelled); if it is still at its step 0 on a stream, its next read there is
    that step (kept)."""
    wrap = slow_chunks(3.0)  # b's step 0 fills cannot finish before the resume
    mix = mixture(dataset, second, 0.125, block_rows=16)  # 2 of every 16 rows of a stream
    with ShufflingLoader("train", mix, BATCH, SINGLE, store_wrapper=[None, wrap]) as loader:
        rows_b = np.array([loader.sources(s).reshape(2, 4) == 1 for s in range(40)])
        reads_b = rows_b.any(axis=(1, 2)).tolist()
        before = np.cumsum(rows_b.sum(axis=2), axis=0)  # b's rows of each stream, to step s
        resume = next(
            s for s in range(1, 40) if not reads_b[s] and (before[s - 1].min() >= 4) == read_before
        )
        opened(loader)
        loader.load(resume)
        started = [f for f in source_fills(loader, 1) if f["reason"] == "open"]
        assert len(started) == 2
        assert all(bool(f.get("cancelled")) == read_before for f in started), started


def test_a_mixture_refused_by_its_budget_has_read_nothing(
    dataset: str, second: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = SlowPages(monkeypatch, 0.0)
    made: list[FaultyStore] = []

    def counted(store: Any) -> FaultyStore:
        made.append(FaultyStore(store, latency_s=0.001, fault_keys="*encoded_tokens/c*"))
        return made[-1]

    def slow_to_open(store: Any) -> FaultyStore:  # the other source opens 0.5 s later
        return FaultyStore(store, latency_s=0.1, fault_keys=["*zarr.json", "*.zarray", "*.zattrs"])

    options = EngineOptions(max_buffer_bytes=1)
    with pytest.raises(asyncflat.ConfigError, match="max_buffer_bytes"):
        ShufflingLoader(
            "train",
            mixture(dataset, second),
            BATCH,
            SINGLE,
            options=options,
            store_wrapper=[counted, slow_to_open],
        )
    assert made and all(store.counts.delayed == 0 for store in made)
    time.sleep(0.2)
    assert pages.calls == 0  # nor faulted a buffer in


def test_a_load_while_iterating_starts_no_second_builder(dataset: str) -> None:
    options = EngineOptions(prefetch_to_device=2)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        with loader.iter(0) as iterator:
            for step, batch in iterator:
                check(dataset, batch, step)
                if step in (3, 4):  # two consecutive loads beside it
                    check(dataset, loader.load(step), step)
                time.sleep(0.02)
                if step == 8:
                    break
            names = [t for t in library_threads() if "prefetch" in t]
            assert len(names) == 1, names  # the iterator's


class SlowPages:
    """``ctypes.memset`` (what a PageWriter writes pages with), each call ``delay_s`` late; on
    the loop's background thread (the first prefetch's buffers) ``background_s`` late instead;
    a call into the first prefetch's buffers only once ``gate`` is set, where one is given."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        delay_s: float,
        background_s: float | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.calls = 0  # finished
        self.background_calls = 0  # of them, on the background thread
        self._lock = threading.Lock()
        real = ctypes.memset
        prefetch_buffers: list[tuple[int, int]] = []  # (address, bytes) of each buffer 1
        real_fault_in = FillTable.fault_in

        def fault_in(table: FillTable, stream: int, index: int) -> Any:
            fresh = real_fault_in(table, stream, index)
            if fresh is not None and index == 1:
                prefetch_buffers.append((fresh[0].ctypes.data, fresh[0].nbytes))
            return fresh

        def memset(address: int, value: int, size: int) -> Any:
            background = "-background" in threading.current_thread().name
            if gate is not None and any(a <= address < a + n for a, n in prefetch_buffers):
                gate.wait()
            time.sleep(background_s if background and background_s is not None else delay_s)
            with self._lock:
                self.calls += 1
                self.background_calls += background
            return real(address, value, size)

        monkeypatch.setattr(ctypes, "memset", memset)
        monkeypatch.setattr(FillTable, "fault_in", fault_in)
        # 768-byte buffers: 12 pieces each
        monkeypatch.setattr(asyncflat.engine.fill, "PAGES_PIECE_BYTES", 64)


def test_the_buffers_are_written_before_the_fills_write_into_them(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # more pool threads than pieces: step 0's pieces sleep at once while the fills read and
    # decode; the first prefetch's, one after another on the background thread
    pages = SlowPages(monkeypatch, 0.3, background_s=0.05)
    options = EngineOptions(decode_threads=64)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        assert loader.plan.minipoch_count > 2
        # every row of step 0's buffers and of the first prefetch's (minipoch 1)
        for step in range(loader.plan.first_step(2)):
            check(dataset, loader.load(step), step)
        # both streams' two buffers, every piece once: written on opening, reused ever after
        assert (pages.calls, pages.background_calls) == (2 * 2 * 12, 2 * 12)


def test_the_first_prefetchs_slow_page_writes_never_land_on_its_rows(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 0's buffers are written at once, the first prefetch's slowly: minipoch 0 is served
    while they are still written, and the prefetch decodes into its buffer only after them."""
    pages = SlowPages(monkeypatch, 0.0, background_s=0.1)  # 24 pieces, one after another
    options = EngineOptions(decode_threads=64, load_ahead=False)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        plan = loader.plan
        for step in range(plan.first_step(1)):
            check(dataset, loader.load(step), step)
        assert pages.background_calls < 2 * 12  # minipoch 1's buffers are still being written
        for step in range(plan.first_step(1), plan.first_step(2)):
            check(dataset, loader.load(step), step)
        # every write has landed: minipoch 1's rows, read again from its buffers, still stand
        wait_until(lambda: pages.calls == 2 * 2 * 12, "the last page writes")
        for step in range(plan.first_step(1), plan.first_step(2)):
            check(dataset, loader.load(step), step)


def test_the_first_prefetchs_page_writes_hold_up_no_permutation(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They go on the background thread a piece at a time, so minipoch 1's permutations,
    computed on the same thread, are not queued behind all of them: its prefetch starts (and
    reads) while they are still written, and decodes once they are."""
    pages = SlowPages(monkeypatch, 0.0, background_s=0.1)  # 24 pieces: 2.4 s in all
    options = EngineOptions(decode_threads=64, load_ahead=False)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        plan = loader.plan
        check(dataset, loader.load(0), 0)

        def prefetching() -> bool:
            return any(f["minipoch"] == 1 for f in loader.stats().as_dict()["active_fills"])

        wait_until(prefetching, "minipoch 1's prefetch to start")
        assert pages.background_calls < 2 * 12 - 4  # well before the last piece
        for step in range(1, plan.first_step(2)):
            check(dataset, loader.load(step), step)
    assert pages.calls == 2 * 2 * 12


def test_the_first_prefetchs_page_writes_never_delay_step_0s_fill(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They run on the loop's background thread, not the CPU pool: held up, they leave a
    one-thread pool to minipoch 0's reads and decodes (on the pool, that thread would wait for
    them); once they land, minipoch 1 is right."""
    gate = threading.Event()
    pages = SlowPages(monkeypatch, 0.0, gate=gate)
    options = EngineOptions(decode_threads=1, load_ahead=False)
    served: list[int] = []
    try:
        with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
            plan = loader.plan

            def minipoch_0() -> None:
                for step in range(plan.first_step(1)):
                    check(dataset, loader.load(step), step)
                    served.append(step)

            thread = threading.Thread(target=minipoch_0)
            thread.start()
            thread.join(30)
            assert served == list(range(plan.first_step(1))), "minipoch 0 waited for the pages"
            assert pages.background_calls == 0  # nothing of the prefetch's buffers written yet
            gate.set()
            for step in range(plan.first_step(1), plan.first_step(2)):
                check(dataset, loader.load(step), step)
        assert (pages.calls, pages.background_calls) == (2 * 2 * 12, 2 * 12)
    finally:
        gate.set()  # a thread stuck above ends


def test_a_minipoch_1_that_serves_no_row_has_no_buffer_written(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path_factory.mktemp("fill-on-open-unserved") / "u.zarr")
    seqs = [np.arange(1 + 10 * i, 11 + 10 * i, dtype=np.uint32) for i in range(35)]
    asyncflat.write_flat_tokens(path, {"train": seqs})
    unserved = FlatTokensParams(path, 1, 4, 4, 7, True)
    batch = TokenBatchParams(len=16, batch=16)  # one step: minipoch 1's rows are never read
    pages = SlowPages(monkeypatch, 0.0)
    with ShufflingLoader("train", unserved, batch, SINGLE) as loader:
        plan = loader.plan
        assert plan.minipoch_count == 2 and plan.served_rows(1) == 0
        pieces = plan.buffer_bytes // 64
        wait_until(lambda: pages.calls == pieces, "step 0's buffer's pages to be written")
        time.sleep(0.2)
        loader.load(0)
    assert pages.calls == pieces  # no prefetch will ever take a second buffer


def test_a_split_of_one_minipoch_has_only_step_0s_buffers_written(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = random_store(tmp_path_factory, "fill-on-open-one", 5, 12, validation=4, chunk_tokens=256)
    one = FlatTokensParams(path, 1, 16, 4, 7, True)  # every block in one buffer
    pages = SlowPages(monkeypatch, 0.0)
    with ShufflingLoader("train", one, BATCH, SINGLE) as loader:
        assert loader.plan.minipoch_count == 1
        pieces = loader.plan.buffer_bytes // 64
        wait_until(lambda: pages.calls == pieces, "step 0's buffer's pages to be written")
        time.sleep(0.2)
        check_one = oracle(path, one, BATCH).batch(0)
        np.testing.assert_array_equal(np.asarray(loader.load(0).targets), np.asarray(check_one[0]))
    assert pages.calls == pieces  # no second buffer: no prefetch will ever take one


def test_a_resume_while_step_0s_pages_are_written_is_served_right(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    SlowPages(monkeypatch, 0.3, background_s=0.02)
    # no step built ahead: every load below reads the buffer when it is asked
    options = EngineOptions(decode_threads=32, load_ahead=False)
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        plan = loader.plan
        last = plan.first_step(plan.minipoch_count - 1)
        # step 0's fills have started (and wait for the pages): the resume cancels them and
        # takes the buffer they leave, whose page writes must not land on its rows (they are
        # held back twice: by the hand-off of BufferPair.release, and by the cancelled fills'
        # units, which keep the engine's workers until the pages are written)
        wait_until(lambda: len(loader.stats().as_dict()["active_fills"]) == 2, "fills to start")
        check(dataset, loader.load(last), last)
        time.sleep(0.5)  # every page write has landed: the rows read again must still be right
        # the whole last minipoch (again), then the whole first (whichever took which buffer)
        for step in [*range(last, plan.step_count), *range(plan.first_step(1))]:
            check(dataset, loader.load(step), step)


def test_no_page_is_written_ahead_when_nothing_is_filled_on_opening(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = SlowPages(monkeypatch, 0.0)
    options = EngineOptions(fill_on_open="never")
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        time.sleep(0.2)
        assert pages.calls == 0
        check(dataset, loader.load(0), 0)
    assert pages.calls == 0  # buffers allocated by the fills themselves are not written ahead


def test_closing_stops_writing_pages(dataset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 x 12 pieces on the pool's two threads (1.2 s) and 2 x 12 on the background thread
    # (4.8 s) if not stopped
    pages = SlowPages(monkeypatch, 0.2)
    loader = ShufflingLoader("train", params(dataset), BATCH, SINGLE)
    start = time.perf_counter()
    loader.close()
    assert time.perf_counter() - start < 1.5
    wait_until(lambda: library_threads() == [], "the loader's threads to end")
    assert pages.calls < 4 * 12


@pytest.mark.parametrize("mode", ["local", "always"])
def test_a_remote_stores_buffers_are_written_on_opening_only_where_they_fill(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a bucket by default nothing starts on opening: a resume's first load right after
    construction must not find its decodes queued behind page writes."""
    url = memory_dataset(f"pages-{mode}")
    pages = SlowPages(monkeypatch, 0.0)
    options = EngineOptions(fill_on_open=mode)
    written = 2 * 2 * 12 if mode == "always" else 0  # two streams' two buffers
    with ShufflingLoader("train", params(url), BATCH, SINGLE, options=options) as loader:
        wait_until(lambda: pages.calls == written, "the buffers' pages to be written")
        time.sleep(0.2)
        for step in range(4):
            check(url, loader.load(step), step)
    assert pages.calls == written  # never again: the fills reuse those buffers


def test_a_mixture_writes_its_sources_buffers_when_it_fills_them_on_opening(
    dataset: str, second: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflat import MixtureLoader

    pages = SlowPages(monkeypatch, 0.0)
    with MixtureLoader("train", mixture(dataset, second), BATCH, SINGLE) as loader:
        # each source's first pass: two streams, step 0's buffer and the first prefetch's each
        wait_until(lambda: pages.calls == 2 * 2 * 2 * 12, "the sources' buffers' pages")
        for step in range(4):
            loader.load(step)


def test_the_block_orders_array_is_written_before_the_order_is_computed_in_it(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large order's array has its pages written on the pool while the kernel compiles: the
    order is computed in it only once they are, and it is the plan's order from then on."""
    import asyncflat.engine.opening
    from asyncflat.plan.shuffle import ShufflePlan

    pages = SlowPages(monkeypatch, 0.1)
    monkeypatch.setattr(asyncflat.engine.opening, "ORDER_PAGES_MIN", 1)  # this small dataset's
    monkeypatch.setattr(asyncflat.engine.opening, "ORDER_PAGES_PIECE_BYTES", 64)
    seen: list[tuple[np.ndarray | None, int]] = []
    real = ShufflePlan.compute_block_order

    def compute(self: ShufflePlan, stop: Any = None, out: np.ndarray | None = None) -> np.ndarray:
        seen.append((out, pages.calls))
        return real(self, stop, out)

    monkeypatch.setattr(ShufflePlan, "compute_block_order", compute)
    options = EngineOptions(fill_on_open="never")  # the order's pages alone
    with ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options) as loader:
        check(dataset, loader.load(0), 0)
        [(out, written)] = seen
        assert out is not None and out.size == loader.plan.read_block_count
        assert written == -(-out.nbytes // 64)  # every piece, before the order was computed
        assert np.shares_memory(loader.plan.served_block_order, out)
        for step in range(1, loader.plan.first_step(2)):
            check(dataset, loader.load(step), step)


def test_closing_while_the_block_orders_pages_are_written_ends_at_once(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncflat.engine.opening

    pages = SlowPages(monkeypatch, 0.2)
    monkeypatch.setattr(asyncflat.engine.opening, "ORDER_PAGES_MIN", 1)
    monkeypatch.setattr(asyncflat.engine.opening, "ORDER_PAGES_PIECE_BYTES", 8)
    options = EngineOptions(fill_on_open="never")
    loader = ShufflingLoader("train", params(dataset), BATCH, SINGLE, options=options)
    wait_until(lambda: pages.calls >= 1, "the order's first page write")
    start = time.perf_counter()
    loader.close()
    assert time.perf_counter() - start < 1.5  # not the pieces' 0.2 s each, one after another
    wait_until(lambda: library_threads() == [], "the loader's threads to end")
    with pytest.raises(asyncflat.LoaderClosedError):
        loader.load(0)
