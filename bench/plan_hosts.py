"""The plan at scale: one host's plan memory and construction time against corpus size and hosts.

    python bench/plan_hosts.py            # every case, each in a fresh process; one JSON line

A case opens the loader's engine (``asyncflat.loader.shared.open.open_engine``, what a
``ShufflingLoader`` runs on its loop, below jax) over a synthetic split of ``tokens`` tokens
whose chunks are generated on demand (nothing stored), with seqax's recommended layout:
512-sequence read blocks of 2048 tokens, 4M-token chunks, 64 MiB shuffle buffers. Host ``host``
of ``hosts`` is simulated by handing the engine the batch rows the default sharding gives that
process (``batch / hosts`` contiguous rows), which is all a process index and count decide.

Figures per case: ``construct_s`` (open_engine), ``planned_s`` (until the block order of the
host's streams is computed, from the start of construction; it runs off the loop), ``first_s``
(the first batch after construction; skipped when ``first`` is False, and then no fill starts on
opening either: the all-streams host's step-0 buffers would need 64 GiB), ``plan_bytes`` (the
block order kept), ``plan_peak_bytes`` (tracemalloc's peak while computing it again, alone),
``rss_above_baseline_mib`` (peak resident memory above the process before construction).

:func:`case` is importable (``from plan_hosts import case``) for other benches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from asyncflat.config import EngineOptions, FlatTokensParams, TokenBatchParams
from asyncflat.engine.loop import LoopThread
from asyncflat.loader.shared.open import open_engine
from asyncflat.source.protocol import Targets, UnitWriter
from asyncflat.storage.counters import IOCounters

SEQ_LEN = 2048
SPB = 512
CHUNK_TOKENS = 4 << 20
BUFFER_BYTES = 64 << 20


class _LazySource:
    """A flat-tokens split of ``tokens`` tokens generated on demand: token ``t`` encodes
    ``t % 2**30`` and every ``SEQ_LEN``-th token starts a sequence (the engine's TokenSource)."""

    def __init__(self, tokens: int) -> None:
        self.name = f"synthetic://{tokens}"
        self.token_count, self.sequence_count = tokens, tokens // SEQ_LEN
        self.max_token_id = (1 << 30) - 1
        self.token_chunk = CHUNK_TOKENS
        self.remote, self.partial_reads = False, False
        self.io = IOCounters()

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        position = np.arange(start, stop, dtype=np.uint64)
        codes = ((position % (1 << 30)) * 2).astype(np.uint32)
        codes[(position % SEQ_LEN) == 0] |= 1
        return codes

    async def read_tokens(self, start: int, stop: int) -> np.ndarray:
        return self._tokens(start, stop)

    async def read_seq_starts(self, start: int, stop: int) -> np.ndarray:
        return np.arange(start, stop, dtype=np.uint64) * SEQ_LEN

    async def read_into(self, start: int, stop: int, targets: Targets, writer: UnitWriter) -> None:
        chunk_start = start // CHUNK_TOKENS * CHUNK_TOKENS

        def fill_targets() -> None:
            for first_item, out in targets:
                begin = chunk_start + first_item
                out[:] = self._tokens(begin, begin + len(out))

        await writer.write(fill_targets)

    async def read_items(self, chunk_id: int, first_item: int, out: np.ndarray) -> None:
        raise NotImplementedError("no partial reads")

    @contextlib.contextmanager
    def demand(self, needed: bool = True) -> Iterator[None]:
        yield

    async def aclose(self) -> None:
        pass


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def case(
    tokens: int, *, hosts: int = 1, host: int = 0, streams: int = 1, first: bool = True
) -> dict[str, Any]:
    """The figures of one case (in this process; run it in a fresh one for the memory)."""
    batch = max(hosts, streams)
    params = FlatTokensParams(
        filespec="synthetic",
        streams=streams,
        read_blocks_per_shuffle_buffer=BUFFER_BYTES // (SPB * SEQ_LEN * 4),
        sequences_per_read_block=SPB,
        seed=0,
        sequence_packing=True,
    )
    batch_params = TokenBatchParams(len=SEQ_LEN, batch=batch)
    per_host = batch // hosts
    host_rows = np.arange(host * per_host, (host + 1) * per_host, dtype=np.int64)
    loop = LoopThread(name="asyncflat-bench")
    baseline = _rss_kib()
    started = time.perf_counter()
    # A case that serves nothing starts no fills on opening: the all-streams host's 1,024 step-0
    # buffers (64 GiB) would be allocated and their pages written, which is not the plan's cost.
    options = EngineOptions() if first else EngineOptions(fill_on_open="never")
    engine = loop.run(
        open_engine("train", params, batch_params, host_rows, options, source=_LazySource(tokens))
    )
    construct = time.perf_counter() - started
    loop.run(engine.planned())
    planned = time.perf_counter() - started
    first_s = None
    if first:
        started = time.perf_counter()
        loop.run(engine.gather(0, host_rows))
        first_s = time.perf_counter() - started
    plan = engine.plan
    rss = (_peak_rss_kib() - baseline) / 1024
    loop.close(engine.aclose())
    tracemalloc.start()
    again = dataclasses.replace(plan)  # a fresh plan: nothing cached
    kept = again.served_block_order.nbytes
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "tokens": tokens,
        "hosts": hosts,
        "streams": streams,
        "served_streams": len(plan.served),
        "read_blocks": plan.read_block_count,
        "served_blocks": plan.served_block_count,
        "construct_s": round(construct, 4),
        "planned_s": round(planned, 4),
        "first_s": None if first_s is None else round(first_s, 4),
        "plan_bytes": kept,
        "plan_bytes_per_served_block": kept / plan.served_block_count,
        "plan_peak_bytes": peak,
        "rss_above_baseline_mib": round(rss, 1),
    }


CASES: list[dict[str, Any]] = [
    {"tokens": 10**9},
    {"tokens": 10**11},
    {"tokens": 15 * 10**12},
    {"tokens": 10**14},
    # one host of 1,024 (streams 1,024) against one host serving all 1,024 streams
    {"tokens": 15 * 10**12, "hosts": 1024, "host": 517, "streams": 1024, "first": True},
    {"tokens": 15 * 10**12, "hosts": 1, "streams": 1024, "first": False},
]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        print(json.dumps(case(**json.loads(sys.argv[2]))))
        return
    results = []
    for spec in CASES:
        out = subprocess.run(
            [sys.executable, __file__, "--case", json.dumps(spec)],
            check=True,
            capture_output=True,
            text=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    one, all_streams = results[-2], results[-1]
    print(
        json.dumps(
            {
                "cases": results,
                "construct_ratio_1_5e13_over_1e9": round(
                    results[2]["construct_s"] / results[0]["construct_s"], 3
                ),
                "host_of_1024_over_all_streams": {
                    key: round(one[key] / all_streams[key], 5)
                    for key in ("plan_bytes", "plan_peak_bytes", "construct_s", "planned_s")
                },
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(asyncio.sleep(0))  # asyncio imported and initialised before any timing
    main()
