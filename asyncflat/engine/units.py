"""Reading one unit into its fill's buffer: the body the scheduler's workers run.

A unit the waiting load needs goes ahead of every other request at the store; a unit that
fails fails its fill (the load that needs it raises the error); the last unit of a fill hands
the fill's transient reads back to the allocator.
"""

from __future__ import annotations

import asyncio

from asyncflat.config import EngineOptions
from asyncflat.engine.fill import FillWriter, Unit, read_unpacked_rows
from asyncflat.engine.heap import trim_later
from asyncflat.engine.recorder import Recorder, log
from asyncflat.plan.shuffle import ShufflePlan
from asyncflat.source.protocol import TokenSource

__all__ = ["UnitReader", "inflight_budget", "inflight_budget_for"]


def inflight_budget(plan: ShufflePlan, source: TokenSource, options: EngineOptions) -> int:
    """Decoded bytes of reads in flight (the scheduler's byte budget)."""
    return inflight_budget_for(plan, source.token_chunk, remote=source.remote, options=options)


def inflight_budget_for(
    plan: ShufflePlan, token_chunk: int, *, remote: bool, options: EngineOptions
) -> int:
    """:func:`inflight_budget` from a chunk size (what ``inspect`` knows of a store)."""
    # An eighth of a buffer keeps peak memory near two buffers per stream; a few whole chunks
    # keep the read window open on small buffers. Behind a network, latency is hidden only by
    # keeping the whole read window busy.
    if options.max_inflight_bytes is not None:
        return options.max_inflight_bytes
    reads = options.reads_in_flight(token_chunk=token_chunk, remote=remote)
    window = reads if remote else min(reads, 4)
    return max(plan.buffer_bytes // 8, window * token_chunk * 4)


class UnitReader:
    """Reads units into their fills' buffers; :meth:`run` is the scheduler's worker body.

    Construct it on the engine's loop (its semaphore binds there).
    """

    def __init__(
        self, plan: ShufflePlan, source: TokenSource, recorder: Recorder, decode_threads: int
    ) -> None:
        self._plan = plan
        self._source = source
        self._recorder = recorder
        # Prefetch fills decode on all but one CPU thread, leaving a core to the trainer; a fill
        # that a load is waiting for (urgent) uses them all.
        self._background_decodes = asyncio.Semaphore(max(1, decode_threads - 1))
        #: the step of the load waiting right now, if any: the units it needs are demand reads
        self.waiting_step: int | None = None

    async def run(self, unit: Unit) -> None:
        fill = unit.fill
        waiting = self.waiting_step
        try:
            # A unit the waiting load needs goes ahead of every other request at the store.
            with self._source.demand(waiting is not None and unit.priority <= waiting):
                await self._read(unit)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - kept by the fill, raised by the load needing it
            log.debug(
                "read %d:%d of stream %d minipoch %d failed",
                unit.start,
                unit.stop,
                fill.stream,
                fill.minipoch,
                exc_info=True,
            )
            fill.fail(exc)
            return
        if fill.cancelled:
            return
        fill.unit_done(unit)
        self._recorder.unit_done(fill, sum(piece[3] for piece in unit.pieces) * 4)
        if fill.done:
            trim_later(asyncio.get_running_loop())  # the fill's transient reads, freed

    async def _read(self, unit: Unit) -> None:
        fill = unit.fill
        flat = fill.buffer.reshape(-1)
        slot_tokens = self._plan.sequences_per_read_block * self._plan.seq_len
        writer = FillWriter(fill, self._background_decodes)
        if self._plan.sequence_packing:
            lo = unit.start // self._source.token_chunk * self._source.token_chunk
            targets = [
                (unit.start - lo + src, flat[slot * slot_tokens + offset :][:length])
                for slot, offset, src, length in unit.pieces
            ]
            await self._source.read_into(unit.start, unit.stop, targets, writer)
            return
        rows = await read_unpacked_rows(self._source, unit.start, unit.stop, self._plan.seq_len)
        ((slot, _, _, length),) = unit.pieces
        view = flat[slot * slot_tokens :][:length]

        def copy() -> None:
            view[:] = rows.reshape(-1)

        await writer.write(copy)
