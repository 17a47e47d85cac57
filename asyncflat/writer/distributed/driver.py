"""The distributed conversion: plan, tokenize to pieces, prefix sums, write, commit, clean up."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from asyncflat._typecheck import checked
from asyncflat.errors import ConfigError
from asyncflat.format.codec import SPLITS
from asyncflat.text.tokenizer import check_tokenizer, load_tokenizer
from asyncflat.writer.convert import ConvertOptions, ConvertReport, options_or_default
from asyncflat.writer.distributed.layout import SplitLayout, StatsJob, plan_writes, split_stats
from asyncflat.writer.distributed.pieces import (
    PIECES,
    PieceInfo,
    TokenizeJob,
    is_piece_file,
    read_manifests,
    tokenize_unit,
)
from asyncflat.writer.distributed.plan import Plan, make_plan
from asyncflat.writer.distributed.progress import Progress
from asyncflat.writer.distributed.runners import InProcessRunner, RayRunner, TaskRunner
from asyncflat.writer.distributed.storage import Location
from asyncflat.writer.distributed.write import (
    OutputTarget,
    WriteTask,
    commit_output,
    create_arrays,
    run_write_job,
)
from asyncflat.writer.options import positive_int
from asyncflat.writer.output import Output, check_output, display_url, open_output

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
    runner: str | TaskRunner = "ray",
    options: ConvertOptions | None = None,
    text_field: str = "text",
    txt_mode: str = "line",
    follow_symlinks: bool = False,
    ray_address: str | None = None,
    ray_init_options: Mapping[str, Any] | None = None,
    work_dir: str | None = None,
    unit_bytes: int = 64 << 20,
    write_run_tokens: int = 1 << 26,
    keep_pieces: bool = False,
) -> DistributedReport:
    """Convert files like :func:`asyncflat.writer.convert.convert_files`, as tasks on a cluster.

    The output equals the single-machine converter's, array for array and chunk for chunk, for
    the same inputs and options, whatever the number of workers. It is committed by the same
    protocol (:mod:`asyncflat.writer.output`): ``options.overwrite`` replaces only a flat-tokens
    dataset, and a failed run leaves nothing at ``output``.

    * ``options``: a :class:`~asyncflat.writer.options.ConvertOptions`; its ``tokenizer`` a spec
      (every task loads it); its ``workers`` unread (the parallelism is the cluster's).
    * ``runner``: ``"ray"`` (connects to ``ray_address``, or to the cluster this process is
      already connected to, or starts a local one, with ``ray_init_options`` for ``ray.init``;
      only once the inputs, work dir and output have passed their checks), ``"local"`` (in
      this process), or a :class:`~asyncflat.writer.distributed.runners.TaskRunner`.
    * ``output``: a local path or an fsspec URL (``gs://``, ``s3://``, ...) with
      ``options.storage_options``. Every worker must reach it, the inputs (at the same paths)
      and ``work_dir``.
    * ``work_dir``: where the tokenized pieces go (default ``<output>.pieces``); they take about
      4 bytes per token plus 8 per document, and are removed after the commit unless
      ``keep_pieces``. A rerun with the same inputs, tokenizer and reading options reuses the
      finished pieces there; anything else is refused.
    * ``follow_symlinks``, ``text_field``, ``txt_mode``, ``options.max_document_bytes``: read
      as :func:`~asyncflat.writer.convert.convert_files` reads (same functions, same errors).
    * ``unit_bytes``: input bytes per tokenize task (what a killed task loses);
      ``write_run_tokens``: tokens per write task (rounded to whole stored objects).
    """
    options = options_or_default(options)
    t0 = time.perf_counter()
    spec = _tokenizer_spec(options)
    write_run_tokens = _check_arguments(runner, write_run_tokens)
    read = _ReadOptions(spec, text_field, txt_mode, options.max_document_bytes)
    plan = make_plan(
        inputs, **dataclasses.asdict(read), unit_bytes=unit_bytes, follow_symlinks=follow_symlinks
    )
    root = Location(os.fspath(output), options.storage_dict).root
    work = Location(work_dir or f"{root}.pieces", options.storage_dict)
    resuming = _check_work_dir(work, plan, root)  # before anything is started, opened or removed
    # an output that would be refused is refused before the cluster starts (read only)
    check_output(output, overwrite=options.overwrite, storage_options=options.storage_dict)
    with _task_runner(runner, ray_address, ray_init_options) as run:
        # once the runner is up: a cluster that cannot be reached leaves the output as it was
        out = _open_output(output, options, plan)
        try:
            if not resuming:
                work.put("plan.json", plan.to_json().encode())
            pieces, resumed = _tokenize_pass(run, plan, work, read, options.progress)
            layouts = _layouts(run, pieces, work, options.validation_fraction, options.seed)
            tasks = _write_pass(run, out, layouts, work, options, write_run_tokens)
        except BaseException:
            out.abort()
            raise
        parallelism = run.parallelism
    log.info("committed %s (%d write tasks)", root, tasks)
    if not keep_pieces:
        _remove_pieces(work)
    report = dataclasses.replace(
        _report(root, spec, plan, pieces, layouts, time.perf_counter() - t0),
        units_resumed=resumed,
        parallelism=parallelism,
        work_dir=work.root,
    )
    log.info("%s", report.summary())
    return report


def _open_output(output: str | os.PathLike[str], options: ConvertOptions, plan: Plan) -> Output:
    """The single-machine writer's checks and staging, the root metadata held back until the
    commit, the array metadata written for the tasks to open."""
    return open_output(
        output,
        overwrite=options.overwrite,
        storage_options=options.storage_dict,
        hold_back="root",
        staging_tag=plan.digest[:12],
    )


def _remove_pieces(work: Location) -> None:
    """Remove the pieces and the plan: only what a conversion writes (the folder may hold
    more)."""
    ours = [f"{PIECES}/{name}" for name in work.names(PIECES) if is_piece_file(name)]
    work.remove(*ours, "plan.json")


def _report(
    root: str,
    spec: str,
    plan: Plan,
    pieces: list[PieceInfo],
    layouts: dict[str, SplitLayout],
    seconds: float,
) -> DistributedReport:
    return DistributedReport(
        output=root,
        tokenizer=spec,
        documents=sum(p.documents for p in pieces),
        empty_documents=sum(p.empty_documents for p in pieces),
        sequences={s: layouts[s].sequences for s in SPLITS},
        tokens={s: layouts[s].tokens for s in SPLITS},
        max_token_id=max((p.max_token_id for p in pieces), default=0),
        seconds=seconds,
        units=len(plan.units),
    )


def _check_arguments(runner: str | TaskRunner, write_run_tokens: int) -> int:
    """Refuse an unknown runner name; returns ``write_run_tokens`` checked."""
    if isinstance(runner, str) and runner not in ("ray", "local"):
        raise ConfigError(f"runner must be 'ray', 'local' or a TaskRunner, got {runner!r}")
    return positive_int("write_run_tokens", write_run_tokens)


def _tokenizer_spec(options: ConvertOptions) -> str:
    """The tokenizer's spec (every task loads it by spec), checked here once."""
    if not isinstance(options.tokenizer, str):
        raise ConfigError(
            "convert_distributed needs ConvertOptions.tokenizer as a spec string (every task "
            f"loads it by spec), got a {type(options.tokenizer).__name__}"
        )
    tok = load_tokenizer(options.tokenizer)
    check_tokenizer(tok)
    return tok.spec


@contextlib.contextmanager
def _task_runner(
    runner: str | TaskRunner, ray_address: str | None, init_options: Mapping[str, Any] | None
) -> Iterator[TaskRunner]:
    """The runner asked for; one made here is closed on the way out."""
    if not isinstance(runner, str):
        yield runner
        return
    made: TaskRunner = (
        RayRunner(ray_address, init_options=dict(init_options or {}))
        if runner == "ray"
        else InProcessRunner()
    )
    try:
        yield made
    finally:
        made.close()


def _write_pass(
    runner: TaskRunner,
    out: Output,
    layouts: dict[str, SplitLayout],
    work: Location,
    options: ConvertOptions,
    write_run_tokens: int,
) -> int:
    """Create the arrays, run the write tasks, commit; returns how many tasks ran."""
    zarr_format: Literal[2, 3] = 3 if options.zarr_format == 3 else 2
    target = OutputTarget(Location(out.location, options.storage_dict), zarr_format)
    object_tokens = options.shard_tokens or options.chunk_tokens
    run_objects = max(1, write_run_tokens // object_tokens)
    tasks = [
        WriteTask(job, target, work, options.validation_fraction, options.seed)
        for split in SPLITS
        for job in plan_writes(layouts[split], object_tokens, run_objects)
    ]
    create_arrays(
        out,
        {s: (layouts[s].tokens, layouts[s].sequences + 1) for s in SPLITS},
        zarr_format=zarr_format,
        chunk_tokens=options.chunk_tokens,
        shard_tokens=options.shard_tokens,
    )
    max_ids = dict.fromkeys(SPLITS, 0)
    for _, (split, _array, max_id) in runner.map(run_write_job, tasks):
        max_ids[split] = max(max_ids[split], max_id)
    commit_output(out, max_ids, zarr_format)
    return len(tasks)


@dataclasses.dataclass(frozen=True)
class _ReadOptions:
    """What every tokenize task reads and tokenizes with."""

    tokenizer: str
    text_field: str
    txt_mode: str
    max_document_bytes: int


def _check_work_dir(work: Location, plan: Plan, output_root: str) -> bool:
    """Whether ``work`` holds this plan's pieces (a rerun resumes from them); refuse one inside
    the output, one that holds another conversion's, or a ``pieces/`` folder of the user's.
    Reads only."""
    # locally as the paths resolve (a symlink may lead into the output; realpath resolves the
    # parts that exist, so a work dir not made yet is placed too)
    inner, outer = (
        (os.path.realpath(work.root), os.path.realpath(output_root))
        if work.local
        else (work.root, output_root)
    )
    if inner == outer or inner.startswith(f"{outer.rstrip('/')}/"):
        # the commit would find the output taken (locally), or the dataset would hold the pieces
        raise ConfigError(
            f"work directory {display_url(work.root)} is inside the output "
            f"{display_url(output_root)}, which must hold the dataset alone; pass a work_dir "
            "outside it"
        )
    raw = work.get("plan.json")
    if raw is None:
        theirs = [name for name in work.names(PIECES) if not is_piece_file(name)]
        if theirs:  # a folder of the user's, which removing the pieces would empty
            raise ConfigError(
                f"work directory {work.root} has a {PIECES}/ folder holding files no conversion "
                f"writes ({', '.join(theirs[:3])}); pass another work_dir"
            )
        return False
    try:
        previous = json.loads(raw)
    except ValueError:
        previous = None
    if not (isinstance(previous, dict) and isinstance(previous.get("fingerprint"), dict)):
        raise ConfigError(
            f"work directory {work.root} holds a plan.json that no conversion wrote; pass "
            "another work_dir"
        )
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
    return True


def _tokenize_pass(
    runner: TaskRunner,
    plan: Plan,
    work: Location,
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
                        read.tokenizer,
                        read.text_field,
                        read.txt_mode,
                        work,
                        read.max_document_bytes,
                    )
                )
            else:
                pieces[unit.index] = info
                progress.resumed(info.tokens, info.input_bytes)
        for _, info in runner.map(tokenize_unit, todo):
            pieces[info.index] = info
            progress.finished(info.tokens, info.input_bytes)
    finally:
        progress.close()
    return [pieces[u.index] for u in plan.units], progress.resumed_units


def _layouts(
    runner: TaskRunner, pieces: list[PieceInfo], work: Location, fraction: float, seed: int
) -> dict[str, SplitLayout]:
    docs = np.array([p.documents for p in pieces], np.int64)
    doc_offset = np.concatenate(([0], np.cumsum(docs)[:-1])).astype(np.int64)
    nonempty = [(p.index, int(off)) for p, off in zip(pieces, doc_offset) if p.tokens]
    jobs = [
        StatsJob(work, tuple(nonempty[i : i + _STATS_BATCH]), fraction, seed)
        for i in range(0, len(nonempty), _STATS_BATCH)
    ]
    rows: list[tuple[int, int, int, int, int]] = []
    for _, batch in runner.map(split_stats, jobs):
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
