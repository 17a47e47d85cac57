"""The recorder alone: fill outcomes, late prefetches, snapshots and intervals."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from asyncflat.engine.fill import Fill
from asyncflat.engine.recorder import Recorder
from asyncflat.engine.stats import FillProgress
from asyncflat.storage import IOCounters


def fill(reason: str, *, waited_on: bool, done: bool = True) -> Fill:
    blocks = np.arange(4)
    return Fill(
        stream=0,
        minipoch=1,
        buffer_index=0,
        buffer=np.zeros((4, 2), np.uint32),
        perm=np.arange(4),
        blocks=blocks,
        deadlines=np.zeros(4, np.int64),
        reason=reason,
        needed_from=16,
        pending=np.zeros(4, np.int64),
        ready=[asyncio.Event() for _ in blocks],
        started=0.0,
        progress=FillProgress(0.0, 4),
        finished=2.0 if done else None,
        blocks_done=4 if done else 1,
        useful_bytes=4000,
        waited_on=waited_on,
    )


def test_only_a_prefetch_a_load_waited_for_is_late() -> None:
    recorder = Recorder()
    recorder.fill_ended(fill("prefetch", waited_on=True))
    recorder.fill_ended(fill("prefetch", waited_on=False))
    recorder.fill_ended(fill("demand", waited_on=True))  # a resume waits by nature: not late
    recorder.fill_ended(fill("prefetch", waited_on=False, done=False), cancelled=True)
    late = [r.late for r in recorder.history.records]
    assert late == [True, False, False, False]
    assert (recorder.history.completed, recorder.history.cancelled, recorder.history.late) == (
        3,
        1,
        1,
    )
    assert recorder.history.records[0].throughput_bytes_per_s == 2000.0


def test_snapshot_and_interval() -> None:
    recorder = Recorder()
    io = IOCounters(bytes_read=100, requests=2, bytes_decoded=80)
    workers = SimpleNamespace(running=1, peak_running=3)
    running = fill("prefetch", waited_on=False, done=False)
    for step in range(5):
        recorder.step(step, 0.001 * step)
    recorder.unit_done(fill("demand", waited_on=True), 40)
    snap = recorder.snapshot(fills=[running], allocations=2, workers=workers, io=io, streams=(0,))
    assert snap.steps_loaded == 5 and snap.wait_max_s == 0.004
    assert snap.bytes_useful == 40 and snap.read_amplification == 2.0
    assert snap.peak_units_in_flight == 3 and snap.fills_completed == 1
    assert [(a.minipoch, a.blocks_done) for a in snap.active_fills] == [(1, 1)]
    first = recorder.interval(snap)
    assert first.steps_loaded == 5 and first.bytes_read == 100
    recorder.step(5, 0.5)
    io.bytes_read += 50
    later = recorder.snapshot(fills=[], allocations=2, workers=workers, io=io, streams=(0,))
    second = recorder.interval(later)
    assert (second.steps_loaded, second.bytes_read, second.wait_max_s) == (1, 50, 0.5)
