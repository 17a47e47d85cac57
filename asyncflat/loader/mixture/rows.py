"""Which source rows make a mixture step: the pure row arithmetic of a
:class:`~asyncflat.loader.mixture.loader.MixtureLoader`, the per-source row counts it reports,
and :class:`MixtureRows`, the :class:`~asyncflat.loader.shared.serving.RowServer` it hands the loaders'
lifecycle.

For each of this host's batch rows ``r`` (stream ``i = r // R``, position ``j = r % R``) the
:class:`~asyncflat.plan.mixture.Assignment` gives the source ``s`` and slot ``k``; slot
``k`` is row ``i * R + k % R`` of source step ``q = k // R`` in ``s``'s own order, pass
``q // step_count_s``, step ``q % step_count_s`` of that pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np

from asyncflat.engine import Engine, EngineStats, IntervalStats
from asyncflat.errors import StepOutOfRangeError
from asyncflat.loader.mixture.passes import Passes, RowGroup, SourceState
from asyncflat.plan.mixture import Assignment
from asyncflat.plan.shuffle import ShufflePlan

__all__ = ["MixtureRows", "batch_sources", "count_rows", "step_groups"]

#: What a mixture iterator pins: (source, pass, stream, minipoch, whether that pass is open)
#: of every source's position on each of this host's streams
PinKeys = tuple[tuple[int, int, int, int, bool], ...]

log = logging.getLogger("asyncflat.loader.mixture.loader")

#: the built steps whose groups are kept until delivered (a step built ahead and dropped, by
#: a retired builder or a closed iterator, is forgotten once this many newer ones are built)
_BUILT_GROUPS_KEPT = 64


def step_groups(
    assignment: Assignment,
    host_rows: np.ndarray,
    streams: tuple[int, ...],
    rows_per_stream: int,
    step_counts: np.ndarray,
    step: int,
) -> list[RowGroup]:
    """The groups of source rows (source, pass, source step, rows) that make ``host_rows`` of
    ``step``; ``streams`` are this host's streams, ``step_counts`` each source's steps per pass."""
    r = rows_per_stream
    hosts = host_rows
    sources = np.empty(len(hosts), np.int64)
    ks = np.empty(len(hosts), np.int64)
    for stream in streams:
        mine = np.flatnonzero(hosts // r == stream)
        src, k = assignment.step_slots(stream, step)
        sources[mine] = src[hosts[mine] % r]
        ks[mine] = k[hosts[mine] % r]
    passes_step = ks // r
    epochs = passes_step // step_counts[sources]
    source_steps = passes_step % step_counts[sources]
    rows = (hosts // r) * r + ks % r
    # One group per (source, pass, source step): the global source step ``passes_step``
    # holds the pass and step, so (passes_step, source) identifies a group.
    keys = passes_step * len(step_counts) + sources
    order = np.argsort(keys, kind="stable")
    starts = np.flatnonzero(np.diff(keys[order], prepend=-1))
    groups = []
    for out in np.split(order, starts[1:]):
        i = int(out[0])
        wanted, take = np.unique(rows[out], return_inverse=True)
        group = RowGroup(int(sources[i]), int(epochs[i]), int(source_steps[i]), wanted, out, take)
        groups.append(group)
    return groups


def batch_sources(
    assignment: Assignment, streams: int, batch: int, rows_per_stream: int, step: int
) -> np.ndarray:
    """The source index of every row of ``step``'s whole batch, all hosts (int64[batch])."""
    out = np.empty(batch, np.int64)
    r = rows_per_stream
    for stream in range(streams):
        out[stream * r : (stream + 1) * r] = assignment.step_slots(stream, step)[0]
    return out


def count_rows(sources: list[SourceState], groups: list[RowGroup], step: int) -> None:
    """Add ``groups``' rows to their sources' figures and note a source's new pass (call with
    the loader's lock held)."""
    for group in groups:
        source = sources[group.source]
        source.rows += len(group.out)
        if group.epoch + 1 > source.passes:
            source.passes = group.epoch + 1
            log.info(
                "mixture source %d (%s) ran out and starts pass %d at mixture step %d",
                source.index,
                source.where,
                source.passes,
                step,
            )


class MixtureRows:
    """A mixture's rows of a step, gathered from its sources' passes (:class:`Passes`), and
    the figures ``stats()`` reports (``steps_built`` and each source's rows, under ``lock``).
    Step ``s`` is the mixture's step ``first_step + s`` (a later epoch carries on)."""

    def __init__(
        self,
        passes: Passes,
        assignment: Assignment,
        host_rows: np.ndarray,
        rows_per_stream: int,
        seq_len: int,
        step_count: int,
        plans: list[ShufflePlan],
        *,
        first_step: int = 0,
    ) -> None:
        self.first_step = first_step
        self._plans = plans
        self.passes, self.sources = passes, passes.sources
        self._assignment, self._host_rows = assignment, host_rows
        self._rows_per_stream, self._seq_len = rows_per_stream, seq_len
        self.streams = tuple(np.unique(host_rows // rows_per_stream).tolist())
        self._step_counts = np.array([s.step_count for s in self.sources], np.int64)
        self._step_count = step_count
        self.lock = threading.Lock()
        self.steps_built = 0
        #: the groups of the steps built and not delivered yet (the newest, under ``lock``)
        self._built_groups: dict[int, list[RowGroup]] = {}
        self._loaded = False  # rows() has run (the first load's claim is made)

    @property
    def step_count(self) -> int:
        return self._step_count

    def check_step(self, step: int) -> None:
        if not 0 <= step < self._step_count:
            raise StepOutOfRangeError(
                f"step {step} is out of range: the mixture has {self._step_count} steps "
                f"(valid steps are 0..{self._step_count - 1})"
            )

    def groups(self, step: int) -> list[RowGroup]:
        """Which source rows (source, pass, source step, rows) make this host's rows of ``step``."""
        return step_groups(
            self._assignment,
            self._host_rows,
            self.streams,
            self._rows_per_stream,
            self._step_counts,
            self.first_step + step,
        )

    def ready_rows(self, step: int) -> np.ndarray | None:
        if not self._loaded:
            return None  # the first load runs on the loop (rows), which settles step 0's fills
        groups = self.groups(step)
        results = self.passes.try_gather(groups)
        return None if results is None else self._assemble(step, groups, results)

    async def rows(self, step: int) -> np.ndarray:
        groups = self.groups(step)
        if not self._loaded:
            self._loaded = True
            if self.first_step + step != 0:
                self.passes.stop_opening(self._at_pass_start(step))
        return self._assemble(step, groups, await self.passes.gather(groups))

    def _assemble(self, step: int, groups: list[RowGroup], results: list[np.ndarray]) -> np.ndarray:
        out = np.empty((len(self._host_rows), self._seq_len), np.uint32)
        for group, rows in zip(groups, results):
            out[group.out] = rows[group.take]
        with self.lock:
            self.steps_built += 1
            # Rows and passes count the batches delivered (:meth:`delivered`), not those
            # built ahead and maybe never handed out: keep the groups for that.
            self._built_groups[step] = groups
            while len(self._built_groups) > _BUILT_GROUPS_KEPT:
                del self._built_groups[next(iter(self._built_groups))]
        return out

    def delivered(self, step: int) -> None:
        """The batch of ``step`` was handed out: count its rows and passes (any thread)."""
        with self.lock:
            groups = self._built_groups.pop(step, None)
        if groups is None:  # built so long ago that its groups were dropped
            groups = self.groups(step)
        with self.lock:
            count_rows(self.sources, groups, step)

    def _standing(self, step: int) -> Iterator[tuple[int, int, int, int]]:
        """Where every source stands at ``step`` on each of this host's streams: (stream,
        source, pass, source step), whether or not ``step`` reads it."""
        r = self._rows_per_stream
        for stream in self.streams:
            before = self._assignment.count_before(stream, (self.first_step + step) * r)
            for source, k in enumerate(before.tolist()):
                epoch, source_step = divmod(k // r, int(self._step_counts[source]))
                yield stream, source, epoch, source_step

    def _at_pass_start(self, step: int) -> set[tuple[int, int]]:
        """The (source, pass) that stand at their step 0 on one of this host's streams at
        ``step``: their next read (this step's or a later one's) is their step 0."""
        return {(source, epoch) for _, source, epoch, at in self._standing(step) if at == 0}

    def pin_keys(self, step: int) -> PinKeys:
        """Where every source stands at ``step`` on each of this host's streams (its pass and
        minipoch), whether or not ``step`` reads it: equal for all the steps in which no
        source changes minipoch, so an iterator pins once per source minipoch."""
        keys = []
        for stream, source, epoch, source_step in self._standing(step):
            row = np.array([stream * self._rows_per_stream])
            minipoch = int(self._plans[source].locate(source_step, row).minipoch[0])
            is_open = self.passes.engine_now(source, epoch) is not None
            keys.append((source, epoch, stream, minipoch, is_open))
        return tuple(keys)

    def pin(self, keys: PinKeys) -> list[tuple[Engine, list[tuple[int, int]]]]:
        """Pin, in each open pass, the minipoch a source stands in and its next one (a pass
        opened later is pinned once the keys say it is open)."""
        wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for source, epoch, stream, minipoch, _ in keys:
            count = self._plans[source].minipoch_count
            more = [(stream, m) for m in (minipoch, minipoch + 1) if m < count]
            wanted.setdefault((source, epoch), []).extend(more)
        pinned = []
        for (source, epoch), engine_keys in wanted.items():
            engine = self.passes.engine_now(source, epoch)
            if engine is not None:
                engine.pin(engine_keys)
                pinned.append((engine, engine_keys))
        return pinned

    def unpin(self, pinned: list[tuple[Engine, list[tuple[int, int]]]]) -> None:
        for engine, keys in pinned:
            engine.unpin(keys)

    def stats(self) -> list[EngineStats]:
        """Each source's newest pass's engine figures."""
        return [s.engines[max(s.engines)].stats() for s in self.sources]

    def interval_stats(self) -> IntervalStats:
        interval = self.passes.interval_stats()
        assert interval is not None  # every source has a pass open from the start
        return interval

    async def aclose(self) -> None:
        await self.passes.aclose()

    def release(self) -> None:
        self.passes.release()
