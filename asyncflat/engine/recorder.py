"""The engine's figures as they happen: loads, fills, bytes, and the lateness check.

:class:`Recorder` is fed by the engine (a load served, a unit done, a fill ended) and turns what
it kept into the snapshots of :mod:`.stats`. Everything it keeps is bounded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from asyncflat.engine.fill import Fill
from asyncflat.engine.stats import (
    ActiveFill,
    EngineStats,
    FillHistory,
    FillRecord,
    IntervalStats,
    LatenessMonitor,
    RateLimitedLog,
    StepLog,
    StepRate,
)
from asyncflat.plan.coverage import format_bytes
from asyncflat.source.protocol import ReadCounters

__all__ = ["Recorder"]

#: the engine's logger: lateness warnings are the engine's to the user
log = logging.getLogger("asyncflat.engine")


class _Workers(Protocol):
    running: int
    peak_running: int


class Recorder:
    """Step waits, fill records and totals, the trainer's step rate, the lateness warning.

    Not locked itself: the engine calls it under its own lock where threads meet.
    """

    def __init__(self) -> None:
        self.steps = StepLog()
        self.rate = StepRate()
        self.history = FillHistory()
        self.lateness = LatenessMonitor(self.rate, RateLimitedLog(log))
        self.rows_read_directly = 0
        self.useful_bytes = 0
        self._started = time.perf_counter()
        self._last_interval: tuple[float, EngineStats] | None = None

    def step(self, step: int, wait: float) -> None:
        self.steps.add(step, wait)
        self.rate.add(step)

    def unit_done(self, fill: Fill, useful_bytes: int) -> None:
        self.useful_bytes += useful_bytes
        if fill.done:
            self.fill_ended(fill)
        else:
            self._check_late(fill)

    def fill_ended(self, fill: Fill, *, cancelled: bool = False, failed: bool = False) -> None:
        end = fill.finished or time.perf_counter()
        duration = end - fill.started
        self.history.add(
            FillRecord(
                stream=fill.stream,
                minipoch=fill.minipoch,
                reason=fill.reason,
                blocks=len(fill.blocks),
                blocks_done=fill.blocks_done,
                cancelled=cancelled,
                failed=failed,
                duration_s=duration,
                useful_bytes=fill.useful_bytes,
                throughput_bytes_per_s=fill.useful_bytes / duration if duration > 0 else None,
                must_finish_by_step=fill.needed_from,
                finished_at_step=self.rate.last_step,
                waited_on=fill.waited_on,
                late=fill.reason == "prefetch" and fill.waited_on,
            )
        )

    def _check_late(self, fill: Fill) -> None:
        """Warn once when a prefetch nobody waits for yet is predicted to be late."""
        if fill.reason != "prefetch" or fill.urgent:
            return
        now = time.perf_counter()
        verdict = self.lateness.check(fill.progress, now, fill.needed_from)
        if verdict is None:
            return
        finish, needed = verdict
        elapsed = now - fill.started
        rate = fill.useful_bytes / elapsed if elapsed > 0 else 0.0
        self.lateness.warn(
            f"fill of stream {fill.stream} minipoch {fill.minipoch}",
            fill.needed_from,
            finish - needed,
            f"{fill.blocks_done}/{len(fill.blocks)} blocks after {elapsed:.2f} s at "
            f"{format_bytes(rate)}/s; the trainer loads {self.rate.per_second() or 0:.1f} steps/s",
        )

    def snapshot(
        self,
        *,
        fills: Iterable[Fill],
        allocations: int,
        workers: _Workers,
        io: ReadCounters,
        streams: tuple[int, ...],
    ) -> EngineStats:
        steps, waits = self.steps.since(0)
        active = tuple(
            ActiveFill(f.stream, f.minipoch, f.reason, f.blocks_done, len(f.blocks), f.needed_from)
            for f in fills
            if not f.done and f.error is None
        )
        history = self.history
        return EngineStats(
            steps_loaded=self.steps.count,
            wait_median_s=float(np.median(waits)) if len(waits) else None,
            wait_max_s=float(waits.max()) if len(waits) else None,
            step_rate_per_s=self.rate.per_second(),
            fills_completed=history.completed,
            fills_cancelled=history.cancelled,
            fills_failed=history.failed,
            fills_late=history.late,
            fills_predicted_late=self.lateness.predicted_late,
            buffer_allocations=allocations,
            rows_read_directly=self.rows_read_directly,
            units_in_flight=workers.running,
            peak_units_in_flight=workers.peak_running,
            bytes_read=io.bytes_read,
            bytes_decoded=io.bytes_decoded,
            bytes_useful=self.useful_bytes,
            read_amplification=(
                io.bytes_decoded / self.useful_bytes if self.useful_bytes else None
            ),
            requests=io.requests,
            retries=io.retries,
            peak_requests_in_flight=io.peak_in_flight,
            throttled=io.throttled,
            concurrency_limit=io.concurrency_limit,
            streams=streams,
            step_waits_s=tuple(zip(steps.tolist(), waits.tolist())),
            fills=tuple(history.records),
            active_fills=active,
        )

    def interval(self, current: EngineStats) -> IntervalStats:
        """What changed between the previous call's snapshot (or the start) and ``current``."""
        now = time.perf_counter()
        since, before = self._last_interval or (self._started, None)
        self._last_interval = (now, current)
        first = before.steps_loaded if before is not None else 0
        _, waits = self.steps.since(first)

        def delta(name: str) -> int:
            return int(current[name] - (before[name] if before is not None else 0))

        return IntervalStats(
            seconds=now - since,
            steps_loaded=delta("steps_loaded"),
            wait_median_s=float(np.median(waits)) if len(waits) else None,
            wait_max_s=float(waits.max()) if len(waits) else None,
            fills_completed=delta("fills_completed"),
            fills_late=delta("fills_late"),
            bytes_read=delta("bytes_read"),
            bytes_useful=delta("bytes_useful"),
            requests=delta("requests"),
            retries=delta("retries"),
        )
