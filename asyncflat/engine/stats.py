"""What the engine measures: typed snapshots, bounded history, and the lateness warning.

Everything here is kept small and bounded, whatever the run's length: per-step waits in a numpy
ring (no Python objects for the garbage collector to walk), fill records in a bounded window
with totals kept as counters, and the trainer's step rate over a window of wall time.

:class:`EngineStats` is the snapshot ``stats()`` returns: a frozen dataclass, flat scalar fields
first (``scalars()`` gives just those, ready for a tracker), then the bounded records. It also
reads like the dict earlier versions returned (``stats["retries"]``).
:class:`IntervalStats` is the view "since the last call", for logging every N steps.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = [
    "ActiveFill",
    "EngineStats",
    "FillHistory",
    "FillRecord",
    "IntervalStats",
    "LatenessMonitor",
    "RateLimitedLog",
    "Readable",
    "StepLog",
    "StepRate",
]

#: per-step wait records kept
STEP_HISTORY = 1 << 16
#: fill records kept (totals are counters, kept for the whole run)
FILL_HISTORY = 256


class Readable:
    """Dict-style reading of a frozen dataclass, as the stats dicts of earlier versions
    (``stats["requests"]``, ``.get``, ``.keys()``, ``in``), and :meth:`as_dict` for JSON."""

    def __getitem__(self, name: str) -> Any:
        if name not in self._field_names():
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self._field_names() else default

    def keys(self) -> list[str]:
        return list(self._field_names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._field_names())

    def __contains__(self, name: object) -> bool:
        return name in self._field_names()

    def as_dict(self) -> dict[str, Any]:
        """Every field; nested records as dicts, tuples as lists (JSON-ready)."""
        return {name: _plain(getattr(self, name)) for name in self._field_names()}

    @classmethod
    def _field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]


def _plain(value: Any) -> Any:
    if isinstance(value, Readable):
        return value.as_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class FillRecord(Readable):
    """One finished, failed or cancelled fill of a (stream, minipoch) buffer."""

    stream: int
    minipoch: int
    #: "prefetch" (started ahead of need), "open" (step 0's, started when the loader opened:
    #: ``EngineOptions.fill_on_open``) or "demand" (a load needed it first: a start without
    #: that, a resume, a jump, or prefetch=False)
    reason: str
    blocks: int
    blocks_done: int
    cancelled: bool
    failed: bool
    duration_s: float
    useful_bytes: int
    throughput_bytes_per_s: float | None
    #: the first step that needed it: the minipoch's first step for a prefetch, the step of the
    #: load that started it for a demand fill
    must_finish_by_step: int
    #: the last step loaded when it finished (None before any load)
    finished_at_step: int | None
    #: a load had to wait for it; for a prefetch that means it was late (a stall)
    waited_on: bool
    #: a prefetch that a load had to wait for: the stall the prefetch exists to avoid
    late: bool


@dataclasses.dataclass(frozen=True)
class ActiveFill(Readable):
    """A fill in progress."""

    stream: int
    minipoch: int
    reason: str
    blocks_done: int
    blocks: int
    must_finish_by_step: int


@dataclasses.dataclass(frozen=True)
class EngineStats(Readable):
    """A snapshot of the engine's figures (times in seconds, sizes in bytes).

    Fields up to ``build_median_s`` are scalars (see :meth:`scalars`); the records after them
    are bounded windows (the counters before them are totals over the whole run).
    """

    #: batches the trainer received: through ``ShufflingLoader``, each ``load()`` that returned
    #: and each item an iterator handed out, not the steps an iterator built ahead of the
    #: trainer; from :meth:`Engine.stats` alone, the engine's gathers
    steps_loaded: int
    #: median and maximum wait of the last ``len(step_waits_s)`` loads
    wait_median_s: float | None
    wait_max_s: float | None
    #: the trainer's sustained loads per second over the last seconds of wall time
    step_rate_per_s: float | None
    fills_completed: int
    fills_cancelled: int
    fills_failed: int
    #: prefetches a load had to wait for (each a stall)
    fills_late: int
    #: fills predicted to be late (each warned about once; the log is rate-limited)
    fills_predicted_late: int
    buffer_allocations: int
    rows_read_directly: int
    units_in_flight: int
    peak_units_in_flight: int
    bytes_read: int
    bytes_decoded: int
    bytes_useful: int
    read_amplification: float | None
    requests: int
    retries: int
    peak_requests_in_flight: int
    throttled: int
    concurrency_limit: int | None
    #: filled in by the loader (median time to build a batch's jax arrays, rows this host holds)
    build_median_s: float | None = None
    host_batch_rows: int | None = None
    #: the streams this host serves
    streams: tuple[int, ...] = ()
    #: ``(step, seconds)`` each recent load waited on the engine for its rows
    step_waits_s: tuple[tuple[int, float], ...] = ()
    #: the most recent fill records (at most 256), oldest first
    fills: tuple[FillRecord, ...] = ()
    active_fills: tuple[ActiveFill, ...] = ()

    def scalars(self) -> dict[str, float | int | None]:
        """The flat numeric fields, e.g. for ``tracker.log(stats.scalars(), step=step)``."""
        out: dict[str, float | int | None] = {}
        for name in self._field_names():
            value = getattr(self, name)
            if value is None or isinstance(value, (int, float)):
                out[name] = value
        return out


@dataclasses.dataclass(frozen=True)
class IntervalStats(Readable):
    """What happened since the previous :meth:`Engine.interval_stats` call (or the start)."""

    seconds: float
    steps_loaded: int
    wait_median_s: float | None
    wait_max_s: float | None
    fills_completed: int
    fills_late: int
    bytes_read: int
    bytes_useful: int
    requests: int
    retries: int


class StepLog:
    """``(step, wait)`` of the last :data:`STEP_HISTORY` loads, in numpy (no per-step objects:
    a full garbage collection in a jax process costs ~100 ms), and the total count."""

    def __init__(self, size: int = STEP_HISTORY) -> None:
        self._steps = np.zeros(size, np.int64)
        self._waits = np.zeros(size, np.float64)
        self.count = 0

    def add(self, step: int, wait: float) -> None:
        slot = self.count % len(self._steps)
        self._steps[slot], self._waits[slot] = step, wait
        self.count += 1

    def since(self, first: int) -> tuple[np.ndarray, np.ndarray]:
        """Steps and waits of loads number ``first`` onwards (those still kept)."""
        first = max(first, self.count - len(self._steps))
        order = np.arange(first, self.count) % len(self._steps)
        return self._steps[order], self._waits[order]


class StepRate:
    """The trainer's sustained rate of loads, over a window of wall time.

    With async dispatch the gaps between ``load()`` calls say little (a burst of ~1 ms gaps,
    then a long one when the device queue is full), so the rate is the loads in the last
    ``window_s`` seconds over the time they span; it is known once they span ``min_span_s``.
    """

    def __init__(
        self,
        window_s: float = 10.0,
        min_span_s: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.window_s, self.min_span_s, self._clock = window_s, min_span_s, clock
        self._times: collections.deque[float] = collections.deque()
        self._max_kept = 4096
        self.last_step: int | None = None
        #: seconds per step before the last jump: a resume keeps the trainer's pace
        self._pace_before_jump: float | None = None

    def add(self, step: int) -> None:
        if step == self.last_step:
            # The same step again: a mixture serves one source step over several of its own
            # steps (a source of weight < 1). Not a jump, and not a step of the pace.
            return
        now = self._clock()
        if self.last_step is not None and step != self.last_step + 1:
            # A jump (resume, random access): the window is not the trainer's pace any more.
            # The pace before it is kept for the loads that follow one jump (a resume in a
            # running job); a second jump before a new rate is known is random access: none.
            rate = self.per_second()
            self._pace_before_jump = 1.0 / rate if rate else None
            self._times.clear()
        self._times.append(now)
        self.last_step = step
        while self._times and (
            now - self._times[0] > self.window_s or len(self._times) > self._max_kept
        ):
            self._times.popleft()

    def per_second(self) -> float | None:
        """Loads per second, or None while the window is too short to tell."""
        if len(self._times) < 3:
            return None
        span = self._clock() - self._times[0]
        if span < self.min_span_s:
            return None
        return (len(self._times) - 1) / span

    def pace(self, step: int | None = None) -> float | None:
        """Seconds per step to plan a load of ``step`` with: the sustained rate now, else the
        one before the last jump when that jump followed a sustained run (a resume in a running
        job keeps its trainer's pace), else None (not known yet, or random access: a load that
        jumps again before a new rate is known)."""
        rate = self.per_second()
        if rate:
            return 1.0 / rate
        if step is not None and self.last_step is not None and step != self.last_step + 1:
            return None
        return self._pace_before_jump


class RateLimitedLog:
    """The first occurrence logged at once; later ones counted and summarised at most every
    ``interval_s`` seconds, with the count, so a warning never floods a run's log."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log, self.interval_s, self._clock = logger, interval_s, clock
        self._last: float | None = None
        self._suppressed = 0
        self.count = 0

    def warning(self, message: str, *args: Any) -> None:
        self.count += 1
        now = self._clock()
        if self._last is None:
            self._last = now
            self._log.warning(message, *args)
        elif now - self._last >= self.interval_s:
            self._log.warning(
                "%d more like this in the last %.0f s; the latest: " + message,
                self._suppressed + 1,
                now - self._last,
                *args,
            )
            self._last, self._suppressed = now, 0
        else:
            self._suppressed += 1


class LatenessMonitor:
    """Predicts whether a prefetch will finish after the step that needs it, and warns.

    The prediction uses the fill's own progress (blocks done over time since it started) and
    the trainer's sustained step rate (:class:`StepRate`). It warns once per fill, and only
    when ``stable`` consecutive checks, a fifth of the fill's blocks apart or more, all
    predict it late, so one slow read or one burst of fast loads does not trigger it.
    """

    def __init__(self, rate: StepRate, log: RateLimitedLog, *, stable: int = 3) -> None:
        self._rate, self._log, self._stable = rate, log, stable
        self.predicted_late = 0

    def check(
        self, progress: FillProgress, now: float, deadline_step: int
    ) -> tuple[float, float] | None:
        """Update ``progress``; returns (predicted finish, needed at) once, when it warns."""
        if progress.warned or not progress.blocks_done or now - progress.started < 0.05:
            return None
        per_second, step = self._rate.per_second(), self._rate.last_step
        if per_second is None or step is None or step >= deadline_step:
            return None
        elapsed = now - progress.started
        finish = progress.started + elapsed * progress.blocks / progress.blocks_done
        needed = now + (deadline_step - step) / per_second
        if finish <= needed:
            progress.late_checks = 0
            return None
        spacing = max(1, progress.blocks // 20)
        if progress.late_checks and progress.blocks_done - progress.last_late_at < spacing:
            return None  # too close to the last check to add evidence
        progress.late_checks += 1
        progress.last_late_at = progress.blocks_done
        if progress.late_checks < self._stable:
            return None
        progress.warned = True
        self.predicted_late += 1
        return finish, needed

    def warn(self, what: str, deadline_step: int, late_s: float, detail: str) -> None:
        self._log.warning(
            "%s is predicted to finish %.2f s after step %d needs it (%s); expect a stall "
            "there. To avoid it: faster or closer storage, a higher "
            "EngineOptions.max_concurrent_reads (remote stores), or a smaller "
            "read_blocks_per_shuffle_buffer (a smaller buffer fills sooner).",
            what,
            late_s,
            deadline_step,
            detail,
        )


@dataclasses.dataclass
class FillProgress:
    """What the lateness check keeps per fill."""

    started: float
    blocks: int
    blocks_done: int = 0
    late_checks: int = 0
    last_late_at: int = 0
    warned: bool = False


class FillHistory:
    """The last :data:`FILL_HISTORY` fill records, and totals over the whole run."""

    def __init__(self, size: int = FILL_HISTORY) -> None:
        self.records: collections.deque[FillRecord] = collections.deque(maxlen=size)
        self.completed = self.cancelled = self.failed = self.late = 0

    def add(self, record: FillRecord) -> None:
        self.records.append(record)
        if record.cancelled:
            self.cancelled += 1
        elif record.failed:
            self.failed += 1
        else:
            self.completed += 1
        if record.late:
            self.late += 1
