"""The distributed conversion: plan, tokenize to pieces, prefix sums, write, commit, clean up."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncflat._typecheck import checked
from asyncflat.errors import ConfigError
from asyncflat.format.codec import SPLITS
from asyncflat.text.corpus import DEFAULT_MAX_DOCUMENT_BYTES
from asyncflat.text.tokenizer import check_tokenizer
from asyncflat.writer.convert import ConvertReport, load_tokenizer, validation_mask
from asyncflat.writer.distributed.engines import Engine, InProcessEngine, RayEngine
from asyncflat.writer.distributed.layout import SplitLayout, StatsJob, plan_writes, split_stats
from asyncflat.writer.distributed.pieces import (
    PieceInfo,
    TokenizeJob,
    read_manifests,
    tokenize_unit,
)
from asyncflat.writer.distributed.plan import Plan, make_plan
from asyncflat.writer.distributed.progress import Progress
from asyncflat.writer.distributed.storage import Location, is_url
from asyncflat.writer.distributed.write import OutputTarget, WriteTask, run_write_job
from asyncflat.writer.flat_tokens import _positive_int

__all__ = ["DistributedReport", "convert_distributed"]

log = logging.getLogger("asyncflat.writer.distributed")

#: Pieces whose lengths one stats task classifies.
_STATS_BATCH = 64


@dataclasses.dataclass(frozen=True)
class DistributedReport(ConvertReport):
    """A :class:`ConvertReport` plus what the distributed run did."""

    units: int = 0
    units_resumed: int = 0
    parallelism: int = 1
    work_dir: str = ""


@checked
def convert_distributed(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    tokenizer: str = "bytes",
    text_field: str = "text",
    txt_mode: str = "line",
    validation_fraction: float = 0.01,
    seed: int = 0,
    zarr_format: int = 3,
    chunk_tokens: int = 1 << 20,
    shard_tokens: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
    engine: str | Engine = "ray",
    ray_address: str | None = None,
    work_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    unit_bytes: int = 64 << 20,
    write_run_tokens: int = 1 << 26,
    keep_pieces: bool = False,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    follow_symlinks: bool = False,
) -> DistributedReport:
    """Convert files like :func:`asyncflat.writer.convert.convert_files`, as tasks on a cluster.

    The output equals the single-machine converter's, array for array and chunk for chunk, for
    the same inputs and parameters, whatever the number of workers.

    * ``engine``: ``"ray"`` (connects to ``ray_address``, or to the cluster this process is
      already connected to, or starts a local one), ``"local"`` (in this process), or an
      :class:`~asyncflat.writer.distributed.engines.Engine`.
    * ``output``: a local path or an fsspec URL (``gs://``, ``s3://``, ...) with
      ``storage_options``. Every worker must reach it, the inputs (at the same paths) and
      ``work_dir``.
    * ``work_dir``: where the tokenized pieces go (default ``<output>.pieces``); they take about
      4 bytes per token plus 8 per document, and are removed after the commit unless
      ``keep_pieces``. A rerun with the same inputs, tokenizer and reading options reuses the
      finished pieces there; anything else is refused.
    * ``max_document_bytes``, ``follow_symlinks``, ``text_field``, ``txt_mode``: read as
      :func:`asyncflat.writer.convert.convert_files` reads (the same functions, the same errors).
    * ``unit_bytes``: input bytes per tokenize task (what a killed task loses);
      ``write_run_tokens``: tokens per write task (rounded to whole stored objects).
    """
    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer)
    check_tokenizer(tok)
    validation_mask(np.zeros(0), validation_fraction, seed)
    if isinstance(engine, str) and engine not in ("ray", "local"):
        raise ConfigError(f"engine must be 'ray', 'local' or an Engine, got {engine!r}")
    chunk_tokens = _positive_int("chunk_tokens", chunk_tokens)
    write_run_tokens = _positive_int("write_run_tokens", write_run_tokens)
    if isinstance(zarr_format, bool) or zarr_format not in (2, 3):
        raise ConfigError(f"zarr_format must be 2 or 3, got {zarr_format!r}")
    if shard_tokens is not None:
        shard_tokens = _positive_int("shard_tokens", shard_tokens)
        if zarr_format != 3 or shard_tokens % chunk_tokens:
            raise ConfigError(
                f"shard_tokens ({shard_tokens}) needs zarr_format=3 and a multiple of "
                f"chunk_tokens ({chunk_tokens})"
            )

    plan = make_plan(
        inputs,
        tokenizer=tok.spec,
        text_field=text_field,
        txt_mode=txt_mode,
        unit_bytes=unit_bytes,
        max_document_bytes=max_document_bytes,
        follow_symlinks=follow_symlinks,
    )
    out = Location(os.fspath(output), storage_options)
    staging = out if is_url(out.root) else Location(f"{out.root}.partial-{plan.digest[:12]}")
    target = OutputTarget(out, staging, 3 if zarr_format == 3 else 2)
    target.prepare(overwrite)
    work = Location(work_dir or f"{out.root}.pieces", storage_options)
    _claim_work_dir(work, plan)

    eng: Engine
    if not isinstance(engine, str):
        eng = engine
    elif engine == "ray":
        eng = RayEngine(ray_address)
    else:
        eng = InProcessEngine()
    try:
        read = _ReadOptions(text_field, txt_mode, max_document_bytes)
        pieces, resumed = _tokenize_pass(eng, plan, work, tok.spec, read, progress)
        layouts = _layouts(eng, pieces, work, validation_fraction, seed)
        shapes = {s: (layouts[s].tokens, layouts[s].sequences + 1) for s in SPLITS}
        object_tokens = shard_tokens or chunk_tokens
        run_objects = max(1, write_run_tokens // object_tokens)
        tasks = [
            WriteTask(job, target, work, validation_fraction, seed)
            for split in SPLITS
            for job in plan_writes(layouts[split], object_tokens, run_objects)
        ]
        try:
            withheld = target.create(shapes, chunk_tokens=chunk_tokens, shard_tokens=shard_tokens)
            max_ids = dict.fromkeys(SPLITS, 0)
            for _, (split, _array, max_id) in eng.map(run_write_job, tasks):
                max_ids[split] = max(max_ids[split], max_id)
            target.commit(max_ids, withheld)
        except BaseException:
            target.discard()
            raise
        log.info("committed %s (%d write tasks)", out.root, len(tasks))
        if not keep_pieces:
            work.remove("pieces", "plan.json")
    finally:
        if eng is not engine:
            eng.close()
    report = DistributedReport(
        output=out.root,
        tokenizer=tok.spec,
        documents=sum(p.documents for p in pieces),
        empty_documents=sum(p.empty_documents for p in pieces),
        sequences={s: layouts[s].sequences for s in SPLITS},
        tokens={s: layouts[s].tokens for s in SPLITS},
        max_token_id=max((p.max_token_id for p in pieces), default=0),
        seconds=time.perf_counter() - t0,
        units=len(plan.units),
        units_resumed=resumed,
        parallelism=eng.parallelism,
        work_dir=work.root,
    )
    log.info(
        "converted %d documents (%d empty, skipped) to %s: %s tokens, %.0f tokens/s",
        report.documents,
        report.empty_documents,
        report.output,
        report.tokens,
        report.tokens_per_s,
    )
    return report


@dataclasses.dataclass(frozen=True)
class _ReadOptions:
    text_field: str
    txt_mode: str
    max_document_bytes: int


def _claim_work_dir(work: Location, plan: Plan) -> None:
    """Record the plan in ``work``; refuse a work dir that holds another conversion's pieces."""
    raw = work.get("plan.json")
    if raw is not None:
        previous = json.loads(raw)
        if previous.get("digest") != plan.digest:
            old = previous.get("fingerprint", {})
            changed = sorted(
                k for k in set(old) | set(plan.fingerprint) if old.get(k) != plan.fingerprint.get(k)
            )
            raise ConfigError(
                f"work directory {work.root} holds pieces of a different conversion (changed since: "
                f"{', '.join(changed)}); delete it, or pass another work_dir, to start afresh"
            )
        log.info("resuming from the pieces in %s", work.root)
        return
    work.put("plan.json", plan.to_json().encode())


def _tokenize_pass(
    engine: Engine,
    plan: Plan,
    work: Location,
    spec: str,
    read: _ReadOptions,
    bar: bool,
) -> tuple[list[PieceInfo], int]:
    progress = Progress(len(plan.units), sum(u.size for u in plan.units), bar=bar)
    pieces: dict[int, PieceInfo] = {}
    todo = []
    try:
        finished = read_manifests(work, [u.index for u in plan.units], plan.digest)
        for unit in plan.units:
            info = finished.get(unit.index)
            if info is None:
                todo.append(
                    TokenizeJob(
                        unit,
                        plan.digest,
                        spec,
                        read.text_field,
                        read.txt_mode,
                        work,
                        read.max_document_bytes,
                    )
                )
            else:
                pieces[unit.index] = info
                progress.resumed(info.tokens, info.input_bytes)
        for _, info in engine.map(tokenize_unit, todo):
            pieces[info.index] = info
            progress.finished(info.tokens, info.input_bytes)
    finally:
        progress.close()
    return [pieces[u.index] for u in plan.units], progress.resumed_units


def _layouts(
    engine: Engine, pieces: list[PieceInfo], work: Location, fraction: float, seed: int
) -> dict[str, SplitLayout]:
    docs = np.array([p.documents for p in pieces], np.int64)
    doc_offset = np.concatenate(([0], np.cumsum(docs)[:-1])).astype(np.int64)
    nonempty = [(p.index, int(off)) for p, off in zip(pieces, doc_offset) if p.tokens]
    jobs = [
        StatsJob(work, tuple(nonempty[i : i + _STATS_BATCH]), fraction, seed)
        for i in range(0, len(nonempty), _STATS_BATCH)
    ]
    rows: list[tuple[int, int, int, int, int]] = []
    for _, batch in engine.map(split_stats, jobs):
        rows.extend(batch)
    rows.sort()
    offsets = dict(nonempty)
    layouts = {}
    for k, split in enumerate(SPLITS):
        mine = [r for r in rows if r[1 + 2 * k] > 0]
        seqs = np.array([r[1 + 2 * k] for r in mine], np.int64)
        toks = np.array([r[2 + 2 * k] for r in mine], np.int64)
        layouts[split] = SplitLayout(
            split=split,
            piece_index=np.array([r[0] for r in mine], np.int64),
            doc_offset=np.array([offsets[r[0]] for r in mine], np.int64),
            seq_offset=np.concatenate(([0], np.cumsum(seqs))).astype(np.int64),
            tok_offset=np.concatenate(([0], np.cumsum(toks))).astype(np.int64),
        )
    return layouts
