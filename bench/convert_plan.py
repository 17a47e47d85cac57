"""Converting a corpus of ``--tokens`` tokens on Ray, on paper: tasks, driver memory, bytes, time.

Measured here, on the real classes of ``asyncflat.writer.distributed``:

* the driver's memory per unit: ``--sample-units`` units with their tokenize jobs, finished
  pieces, the two splits' layouts and the write tasks ``plan_writes`` makes for them (Python
  heap, ``tracemalloc``), scaled to the corpus;
* with ``--measure``, the tokenize rate of one core: ``bench/convert.py --workers 1`` (its
  jsonl corpus and byte-level BPE tokenizer, generated locally), whose raw tokenizer rate, Ray
  rate (one task at a time: tokenize, pieces, classification, write and commit) and input bytes
  per token are used below; without it, the rates given by ``--raw-rate``/``--ray-rate``.

Computed from those: units and tasks of each pass, piece and output bytes, and wall time for
``--workers`` (comma-separated) one-CPU workers at the one-core rate (perfect scaling: the passes
share nothing but the storage). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tracemalloc
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit

UNIT_BYTES = 64 << 20  # convert_distributed's unit_bytes
WRITE_RUN_TOKENS = 1 << 26  # its write_run_tokens
CHUNK_TOKENS = 1 << 22
SEQ_STARTS_CHUNK = 65536
STATS_BATCH = 64  # pieces per classification task


def driver_bytes_per_unit(units: int, tokens_per_unit: int, docs_per_unit: int) -> float:
    """Python heap the driver holds per unit (units, jobs, pieces, layouts, write tasks)."""
    from asyncflat.writer.distributed.layout import SplitLayout, plan_writes
    from asyncflat.writer.distributed.pieces import PieceInfo, TokenizeJob
    from asyncflat.writer.distributed.plan import Unit
    from asyncflat.writer.distributed.storage import Location

    work = Location("/tmp/asyncflat-plan-work")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    path = "/data/corpus/shard-00000.jsonl"
    held: list[Any] = []
    for i in range(units):
        unit = Unit(i, path, "jsonl", False, i * UNIT_BYTES, (i + 1) * UNIT_BYTES, 0, UNIT_BYTES)
        held.append(TokenizeJob(unit, "d" * 64, "tokenizer.json", "text", "line", work))
        held.append(PieceInfo(i, docs_per_unit, 0, tokens_per_unit, 100_000, UNIT_BYTES))
    offsets = np.arange(units + 1, dtype=np.int64)
    layout = SplitLayout(
        "train",
        np.arange(units, dtype=np.int64),
        offsets[:-1] * docs_per_unit,
        offsets * docs_per_unit,
        offsets * tokens_per_unit,
    )
    held.append(layout)
    held.append(plan_writes(layout, CHUNK_TOKENS, WRITE_RUN_TOKENS // CHUNK_TOKENS))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / units


def measured_rates(mib: int) -> dict[str, Any]:
    """bench/convert.py with one worker: its JSON figures (raw and Ray tokens/s, ...)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "convert.py")
    done = subprocess.run(
        [sys.executable, script, "--workers", "1", "--mib", str(mib), "--rounds", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"bench/convert.py: {figures}", file=sys.stderr)
    return figures


def plan(args: argparse.Namespace, rates: dict[str, float], per_unit: float) -> dict[str, Any]:
    tokens = args.tokens
    input_bytes = tokens * args.bytes_per_token
    units = -(-int(input_bytes) // UNIT_BYTES)
    documents = tokens / args.tokens_per_document
    write_tasks = -(-tokens // WRITE_RUN_TOKENS) + -(
        -int(documents) // (SEQ_STARTS_CHUNK * (WRITE_RUN_TOKENS // CHUNK_TOKENS))
    )
    pieces_bytes = 4 * tokens + 8 * documents
    output_bytes = 4 * tokens / args.compression + 8 * documents / 2
    rate = rates["ray_tokens_per_s"]
    return {
        "tokens": tokens,
        "input_tb": input_bytes / 1e12,
        "units": units,
        "tasks": {
            "tokenize": units,
            "classify": -(-units // STATS_BATCH),
            "write": write_tasks,
        },
        "driver_bytes_per_unit": round(per_unit, 1),
        "driver_gib": round(per_unit * units / 2**30, 2),
        "pieces_tb": pieces_bytes / 1e12,
        "output_tb": output_bytes / 1e12,
        "written_tb": (pieces_bytes + output_bytes) / 1e12,
        "read_tb": (input_bytes + pieces_bytes) / 1e12,
        "core_hours": tokens / rate / 3600,
        "wall_hours": {str(n): round(tokens / rate / n / 3600, 2) for n in args.workers},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=lambda s: int(float(s)), default=15 * 10**12)
    parser.add_argument(
        "--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 256, 1024, 4096]
    )
    parser.add_argument("--measure", action="store_true", help="run bench/convert.py first")
    parser.add_argument("--mib", type=int, default=8, help="bench/convert.py's corpus (MiB)")
    parser.add_argument("--raw-rate", type=float, default=476e3, help="tokens/s, one core")
    parser.add_argument("--ray-rate", type=float, default=388e3, help="tokens/s, one Ray task")
    parser.add_argument(
        "--bytes-per-token",
        type=float,
        default=4.5,
        help="input bytes per token (a Llama-3-like tokenizer on English jsonl)",
    )
    parser.add_argument("--tokens-per-document", type=float, default=1000)
    parser.add_argument("--compression", type=float, default=2.0, help="Blosc's ratio")
    parser.add_argument("--sample-units", type=int, default=20_000)
    args = parser.parse_args()
    rates: dict[str, float] = {
        "raw_tokens_per_s": args.raw_rate,
        "ray_tokens_per_s": args.ray_rate,
    }
    if args.measure:
        measured = measured_rates(args.mib)
        rates = {
            "raw_tokens_per_s": measured["raw_tokenizer_1_process_tokens_per_s"],
            "ray_tokens_per_s": measured["ray_1_worker_tokens_per_s"],
            "ray_2_vs_1_on_this_machine": measured["ray_2_vs_1"],
            "cpus_here": os.cpu_count() or 0,
            "bench_corpus_bytes_per_token": measured["corpus_mib"] * 2**20 / measured["tokens"],
        }
    tokens_per_unit = int(UNIT_BYTES / args.bytes_per_token)
    per_unit = driver_bytes_per_unit(
        args.sample_units, tokens_per_unit, int(tokens_per_unit / args.tokens_per_document)
    )
    emit(
        {"bench": "convert_plan", "measured": args.measure, **rates, **plan(args, rates, per_unit)}
    )


if __name__ == "__main__":
    main()
