"""The ``asyncflat`` command (also ``python -m asyncflat``).

Commands (``asyncflat COMMAND --help`` for each):

* ``demo``: write a synthetic dataset and train on it with a simulated step; shows throughput,
  load() latency and the engine's fill figures (``--no-prefetch`` for the reference's behaviour).
* ``inspect``: sizes, layout, compression and sequence lengths of a dataset; with loader
  parameters, what they cost; ``--verify`` scans every chunk and checks every invariant.
* ``convert``: text (``.txt``, ``.jsonl``, ``.parquet``) or a local Hugging Face dataset to
  flat-tokens, tokenized in parallel.
* ``bench``: run the benchmark scripts shipped in the source checkout's ``bench/`` (or those of
  an explicit ``--bench-dir``) and print their JSON.

The command's results go to stdout; progress bars and log messages go to stderr. Exit status
(``docs/cli.md``): 0 on success; 1 when the command fails (a library error,
:class:`~asyncflat.errors.AsyncflatError`, printed as one line ``asyncflat COMMAND: error: ...``);
2 for a usage error (argparse's message); 130 when interrupted; 141 when stdout is closed early
(``asyncflat bench --list | head``), without a traceback.

Global options (``-v``/``--verbose``, ``-q``/``--quiet``) are accepted before or after the
command. Environment defaults: ``ASYNCFLAT_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``,
``ERROR``: the level of asyncflat's own loggers when neither ``-v`` nor ``-q`` is given) and
``ASYNCFLAT_NO_PROGRESS`` (any non-empty value but ``0``: no progress bars, as ``--no-progress``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import AsyncflatError, ConfigError, StorageError

__all__ = ["build_parser", "main"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Formatting helpers
# --------------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def _positive(text: str) -> int:
    value = int(text, 0)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


# --------------------------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------------------------


def _synthetic_dataset(
    path: Path, tokens: int, seed: int, chunk_tokens: int, vocab: int = 32000
) -> None:
    """Zipf-distributed token ids (id 0 left free) in log-normal-length documents."""
    import numpy as np

    from .writer import FlatTokensWriter

    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab, dtype=np.float64)
    cdf = np.cumsum(1.0 / (ranks + 2.7) ** 1.1)
    cdf /= cdf[-1]
    lengths = np.clip(rng.lognormal(5.5, 1.0, tokens // 100 + 16), 1, 8192).astype(np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    validation = max(1, len(lengths) // 100)
    with FlatTokensWriter(path, chunk_tokens=chunk_tokens) as writer:
        for split, part in (("validation", lengths[:validation]), ("train", lengths[validation:])):
            for lo in range(0, len(part), 4096):  # bounded memory: a few M tokens per append
                group = part[lo : lo + 4096]
                ids = np.searchsorted(cdf, rng.random(int(group.sum()))).astype(np.uint32) + 1
                writer.append(split, np.split(ids, np.cumsum(group)[:-1]))


def _demo_sharding(batch: int) -> Any:
    import jax
    from jax.sharding import SingleDeviceSharding

    from .loader import default_sharding

    if batch % len(jax.devices()) == 0:
        return default_sharding()
    return SingleDeviceSharding(jax.devices()[0])


def _train_step_fn(kind: str, step_s: float) -> Any:
    import jax
    import jax.numpy as jnp

    if kind == "sleep":

        def sleep_step(batch: Any) -> None:
            jax.block_until_ready(batch)
            time.sleep(step_s)

        return sleep_step

    weights = jnp.ones((256, 256), jnp.float32) / 256

    @jax.jit
    def matmul(targets: jax.Array) -> jax.Array:
        x = targets[:, :256].astype(jnp.float32) / 32000.0
        for _ in range(4):
            x = jnp.tanh(x @ weights)
        return x.sum()

    def matmul_step(batch: Any) -> None:
        # Busy for step_s: compute contends for the cores like a real step would.
        deadline = time.perf_counter() + step_s
        matmul(batch.targets).block_until_ready()
        while time.perf_counter() < deadline:
            matmul(batch.targets).block_until_ready()

    return matmul_step


def cmd_demo(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm.auto import tqdm

    from .config import EngineOptions, FlatTokensParams, TokenBatchParams
    from .loader import ShufflingLoader

    tmp = None
    if args.path is None:
        tmp = tempfile.mkdtemp(prefix="asyncflat-demo-")
        path = Path(tmp) / "demo.zarr"
    else:
        path = Path(args.path)
    try:
        spb = args.sequences_per_block
        if not path.exists():
            t0 = time.perf_counter()
            _synthetic_dataset(path, args.tokens, args.seed, chunk_tokens=spb * args.len)
            log.info(
                "wrote %d synthetic tokens to %s in %.1f s",
                args.tokens,
                path,
                time.perf_counter() - t0,
            )
        else:
            log.info("using the existing dataset at %s", path)
        params = FlatTokensParams(
            filespec=str(path),
            streams=args.streams,
            read_blocks_per_shuffle_buffer=args.read_blocks_per_buffer,
            sequences_per_read_block=spb,
            seed=args.seed,
            sequence_packing=not args.no_packing,
        )
        batch_params = TokenBatchParams(len=args.len, batch=args.batch)
        options = EngineOptions(prefetch=not args.no_prefetch)
        train_step = _train_step_fn(args.step, args.step_ms / 1e3)
        with ShufflingLoader(
            "train", params, batch_params, _demo_sharding(args.batch), options=options
        ) as loader:
            plan = loader.plan
            steps = plan.step_count if args.steps is None else min(args.steps, plan.step_count)
            latencies = np.zeros(steps)
            t_start = time.perf_counter()
            for step in tqdm(range(steps), desc="demo", unit=" steps", disable=args.no_progress):
                t0 = time.perf_counter()
                batch = loader.load(step)
                latencies[step] = time.perf_counter() - t0
                train_step(batch)
            wall = time.perf_counter() - t_start
            stats = loader.stats()
            first_steps = [plan.first_step(m) for m in range(1, plan.minipoch_count)]
            boundaries = sum(1 for step in first_steps if step < steps)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    fills = [f for f in stats["fills"] if not f["cancelled"]]
    durations = [f["duration_s"] for f in fills]
    fill_rates = [f["throughput_bytes_per_s"] for f in fills if f["throughput_bytes_per_s"]]
    # Step 0 pays the cold start (compilation, the first fill): report the worst after it too.
    later = latencies[1:] if steps > 1 else latencies
    result = {
        "steps": steps,
        "prefetch": not args.no_prefetch,
        "minipoch_boundaries_crossed": boundaries,
        "wall_s": wall,
        "tokens_per_s": steps * args.batch * args.len / wall,
        "load_median_s": float(np.median(latencies)),
        "load_p99_s": float(np.quantile(latencies, 0.99)),
        "load_max_s": float(latencies.max()),
        "load_max_step": int(latencies.argmax()),
        "load_max_after_first_s": float(later.max()),
        "load_max_after_first_step": int(later.argmax()) + (1 if steps > 1 else 0),
        "fills": len(fills),
        "fills_prefetch": sum(f["reason"] == "prefetch" for f in fills),
        "fills_demand": sum(f["reason"] == "demand" for f in fills),
        "fill_median_s": float(np.median(durations)) if durations else None,
        "fill_max_s": float(max(durations)) if durations else None,
        "fill_median_bytes_per_s": float(np.median(fill_rates)) if fill_rates else None,
        "engine_wait_median_s": stats["wait_median_s"],
        "engine_wait_max_s": stats["wait_max_s"],
        "read_amplification": stats["read_amplification"],
        "buffer_allocations": stats["buffer_allocations"],
        "bytes_read": stats["bytes_read"],
    }
    if args.plot:
        _demo_plot(args, latencies, first_steps)
        result["plot"] = args.plot
    if args.json:
        _print_json(result)
        return 0
    print(
        f"asyncflat demo: {steps} steps of {args.batch} x {args.len} tokens, "
        f"{boundaries} minipoch boundaries crossed, prefetch {'on' if result['prefetch'] else 'off'}"
    )
    print(
        f"  throughput        {result['tokens_per_s'] / 1e6:.2f} M tokens/s "
        f"({wall:.2f} s, simulated step {args.step_ms:g} ms, {args.step})"
    )
    print(
        f"  load() latency    median {_ms(result['load_median_s'])}, p99 {_ms(result['load_p99_s'])}, "
        f"worst {_ms(result['load_max_s'])} (step {result['load_max_step']})"
    )
    print(
        f"                    worst after the first step {_ms(result['load_max_after_first_s'])} "
        f"(step {result['load_max_after_first_step']})"
    )
    print(
        f"  fills             {result['fills']} ({result['fills_prefetch']} prefetch, "
        f"{result['fills_demand']} on demand), median {_ms(result['fill_median_s'])}, "
        f"worst {_ms(result['fill_max_s'])}, "
        f"{(result['fill_median_bytes_per_s'] or 0) / 1e9:.2f} GB/s useful"
    )
    print(
        f"  engine waits      median {_ms(result['engine_wait_median_s'])}, "
        f"worst {_ms(result['engine_wait_max_s'])}"
    )
    amp = result["read_amplification"]
    print(
        f"  read              {_bytes(result['bytes_read'])} from storage, read amplification "
        f"{'-' if amp is None else f'{amp:.2f}'}, {result['buffer_allocations']} buffers allocated"
    )
    return 0


def _demo_plot(args: argparse.Namespace, latencies: Any, first_steps: list[int]) -> None:
    from .plotting import machine_description, plot_boundary_latency

    label = "asyncflat (prefetch)" if not args.no_prefetch else "synchronous fills (no prefetch)"
    caption = (
        f"asyncflat demo: {len(latencies)} steps of batch {args.batch} x len {args.len}, "
        f"{args.sequences_per_block} sequences per block x {args.read_blocks_per_buffer} blocks "
        f"per buffer, {args.streams} stream(s), simulated step {args.step_ms:g} ms ({args.step}). "
        f"Machine: {machine_description()}."
    )
    plot_boundary_latency(args.plot, {label: latencies}, first_steps, caption=caption)
    log.info("wrote %s", args.plot)


# --------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------


def _print_summary(summary: Any) -> None:
    s = summary
    print(
        f"{s.split}: {s.token_count:,} tokens, {s.sequence_count:,} sequences, "
        f"max_token_id {s.max_token_id:,} (zarr format {s.zarr_format})"
    )
    if s.lengths is not None:
        ls = s.lengths
        print(
            f"  sequence lengths: min {ls.min:,}, median {ls.median:,}, p90 {ls.p90:,}, "
            f"max {ls.max:,}, mean {ls.mean:,.1f}"
        )
        buckets = [f"[{1 << k},{1 << (k + 1)}) {n:,}" for k, n in enumerate(ls.log2_histogram) if n]
        print(f"  length histogram: {' | '.join(buckets)}")
    shards = f", shards of {s.shard_tokens:,}" if s.shard_tokens else ""
    ratio = (
        f"{s.tokens_nbytes / s.tokens_nbytes_stored:.2f}x"
        if s.tokens_nbytes and s.tokens_nbytes_stored
        else "-"
    )
    print(
        f"  encoded_tokens: chunks of {s.chunk_tokens:,} tokens{shards}, "
        f"{' + '.join(s.token_codecs) or 'uncompressed'}; {_bytes(s.tokens_nbytes)} -> "
        f"{_bytes(s.tokens_nbytes_stored)} stored ({ratio})"
    )
    codecs = " + ".join(s.seq_starts_codecs) or "uncompressed"
    print(
        f"  seq_starts: chunks of {s.seq_starts_chunk:,}, {codecs}; "
        f"{_bytes(s.seq_starts_nbytes)} -> {_bytes(s.seq_starts_nbytes_stored)} stored"
    )


def _print_figures(f: Any, args: argparse.Namespace, spb: int) -> None:
    packing = "no packing" if args.no_packing else "packing"
    print(
        f"  loader (len {args.len}, batch {args.batch}, streams {args.streams}, "
        f"{args.read_blocks_per_buffer} blocks x {spb} sequences per buffer, "
        f"{packing}):"
    )
    print(
        f"    steps {f.step_count:,}, minipochs {f.minipoch_count:,}, read blocks "
        f"{f.read_block_count:,}, rows used {f.rows_used:,} of {f.seq_count:,}"
    )
    amp = "-" if f.read_amplification is None else f"{f.read_amplification:.2f}"
    print(
        f"    shuffle buffer {_bytes(f.buffer_bytes)}; per host ({f.hosts} hosts) "
        f"{_bytes(f.buffer_bytes_per_host)} (2 x {f.streams_per_host} streams), for a split of "
        f"{_bytes(f.split_bytes)} (as uint32); read amplification {amp} (chunk tokens decoded "
        "per token used)"
    )
    unit = "tokens" if not args.no_packing else "sequences"
    print(f"    dropped by rounding: {f.dropped_fraction:.1%} of the split's {unit} per epoch")
    if f.sizing_warning:
        print(f"    warning: {f.sizing_warning}")


def _inspect_mixture(args: argparse.Namespace) -> int:
    from .mixture.figures import figures_text, inspect_mixture

    figures = inspect_mixture(args.path, args.len, args.batch, args.split, args.hosts)
    if args.json:
        _print_json(figures)
    else:
        print(figures_text(figures, args.hosts))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .config import FlatTokensParams, TokenBatchParams
    from .format import SPLITS
    from .inspection import describe_split, loader_figures, verify_split

    if args.mixture:
        return _inspect_mixture(args)
    splits = [args.split] if args.split else list(SPLITS)
    loader_args = (args.len, args.batch)
    spb = args.sequences_per_block or (max(1, (1 << 20) // args.len) if args.len else 1)
    from .errors import redact

    report: dict[str, Any] = {"path": redact(args.path), "splits": {}}
    if not args.json:
        print(redact(args.path))
    for split in splits:
        summary = describe_split(
            args.path, split, scan_lengths=not args.no_lengths, progress=not args.no_progress
        )
        entry: dict[str, Any] = {"summary": summary.to_dict()}
        if not args.json:
            _print_summary(summary)
        if None not in loader_args and summary.sequence_count:
            params = FlatTokensParams(
                filespec=args.path,
                streams=args.streams,
                read_blocks_per_shuffle_buffer=args.read_blocks_per_buffer,
                sequences_per_read_block=spb,
                seed=args.seed,
                sequence_packing=not args.no_packing,
            )
            try:
                batch_params = TokenBatchParams(len=args.len, batch=args.batch)
                figures = loader_figures(summary, params, batch_params, hosts=args.hosts)
            except ConfigError as exc:  # e.g. too small a split for these parameters
                entry["loader_error"] = str(exc)
                if not args.json:
                    print(f"  loader: {exc}")
            else:
                entry["loader"] = figures.to_dict()
                if figures.sizing_warning:
                    log.warning("%s: %s", split, figures.sizing_warning)
                if not args.json:
                    _print_figures(figures, args, spb)
        if args.verify:
            result = verify_split(args.path, split, progress=not args.no_progress)
            entry["verify"] = result.to_dict()
            if not args.json:
                print(
                    f"  verify: ok ({result.token_count:,} tokens and {result.sequence_count + 1:,} "
                    f"offsets checked in {result.seconds:.2f} s)"
                )
        report["splits"][split] = entry
    if args.json:
        _print_json(report)
    return 0


# --------------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    if bool(args.inputs) == bool(args.hf_dataset):
        raise ConfigError("give either input files/directories or --hf-dataset PATH (not both)")
    if args.engine != "ray" and (args.ray_address or args.work_dir):
        raise ConfigError("--ray-address and --work-dir need --engine ray")
    if args.engine == "ray" and args.hf_dataset:
        raise ConfigError("--engine ray converts files; --hf-dataset runs on this machine only")
    from .writer import OutputExistsError

    try:
        report = _run_convert(args)
    except OutputExistsError as exc:
        raise ConfigError(f"{exc.where} already exists (pass --overwrite to replace it)") from None
    except OSError as exc:
        if isinstance(exc, AsyncflatError):
            raise
        # An I/O failure outside the writer (reading an input, a tokenizer file): one line.
        where = f" {exc.filename}" if exc.filename else ""
        raise StorageError(f"{exc.strerror or exc}{where}") from exc
    if args.json:
        _print_json(report.to_dict())
        return 0
    print(f"wrote {report.output} ({report.tokenizer} tokenizer)")
    print(f"  documents {report.documents:,} ({report.empty_documents:,} empty, skipped)")
    for split in report.sequences:
        print(f"  {split}: {report.sequences[split]:,} sequences, {report.tokens[split]:,} tokens")
    print(
        f"  max token id {report.max_token_id:,}; {report.seconds:.1f} s, "
        f"{report.tokens_per_s / 1e6:.2f} M tokens/s"
    )
    return 0


def _run_convert(args: argparse.Namespace) -> Any:
    storage_options = None
    if args.storage_options:
        try:
            storage_options = json.loads(args.storage_options)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--storage-options must be a JSON object: {exc}") from None
        if not isinstance(storage_options, dict):
            raise ConfigError("--storage-options must be a JSON object")
    options = dict(
        tokenizer=args.tokenizer,
        validation_fraction=args.validation_fraction,
        seed=args.seed,
        workers=args.workers,
        zarr_format=args.format,
        chunk_tokens=args.chunk_tokens,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        storage_options=storage_options,
        max_document_bytes=args.max_document_bytes,
    )
    if args.hf_dataset:
        from .hf import convert_hf_dataset

        return convert_hf_dataset(
            args.hf_dataset, args.output, name=args.hf_name, text_field=args.text_field, **options
        )
    if args.engine == "ray":
        from .distributed import convert_distributed

        del options["workers"]  # the cluster's CPUs are the workers
        del options["max_document_bytes"]  # not yet enforced by the distributed reader
        return convert_distributed(
            args.inputs,
            args.output,
            text_field=args.text_field,
            txt_mode=args.txt_mode,
            engine="ray",
            ray_address=args.ray_address,
            work_dir=args.work_dir,
            **options,
        )
    from .convert import convert_files

    return convert_files(
        args.inputs,
        args.output,
        text_field=args.text_field,
        txt_mode=args.txt_mode,
        follow_symlinks=args.follow_symlinks,
        **options,
    )


# --------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------


def _shipped_bench_dir() -> Path | None:
    """``bench/`` of the source checkout this package was imported from, if it is one.

    Only a directory next to the package whose ``pyproject.toml`` names the ``asyncflat``
    project counts: an installed wheel ships no benchmarks, and a ``bench/`` that happens to
    sit in ``site-packages`` (or in the current directory) is not ours to run.
    """
    root = Path(__file__).resolve().parent.parent
    bench, pyproject = root / "bench", root / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    if bench.is_dir() and re.search(r'(?m)^name\s*=\s*"asyncflat"\s*$', text):
        return bench
    return None


def find_bench_dir(explicit: str | None = None) -> Path:
    """``--bench-dir`` when given, else the ``bench/`` shipped with this checkout.

    The current directory is never searched: ``asyncflat bench`` must not run whatever
    ``./bench/*.py`` happens to be where the command is typed.
    """
    if explicit:
        if not Path(explicit).is_dir():
            raise ConfigError(f"--bench-dir {explicit} is not a directory")
        return Path(explicit)
    shipped = _shipped_bench_dir()
    if shipped is None:
        raise ConfigError(
            "no benchmarks found: they ship with asyncflat's source checkout (bench/ next to the "
            "package), not with an installed wheel; run from a checkout installed with "
            "`pip install -e .`, or pass --bench-dir DIR"
        )
    return shipped


def _bench_scripts(bench_dir: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(bench_dir.glob("*.py")) if not p.name.startswith("_")}


def _first_doc_line(path: Path) -> str:
    import ast

    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return ""
    return doc.strip().splitlines()[0] if doc else ""


def cmd_bench(args: argparse.Namespace) -> int:
    bench_dir = find_bench_dir(args.bench_dir)
    scripts = _bench_scripts(bench_dir)
    if args.list:
        for name, path in scripts.items():
            print(f"{name:24s} {_first_doc_line(path)}")
        return 0
    names = args.name.split(",") if args.name else list(scripts)
    unknown = [n for n in names if n not in scripts]
    if unknown:
        raise ConfigError(
            f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(scripts) or 'none'}"
        )
    if args.args and not args.name:
        raise ConfigError("benchmark arguments need a benchmark NAME before them")
    failed = []
    for name in names:
        command = [sys.executable, str(scripts[name]), *args.args]
        log.info("running %s", " ".join(command))
        with subprocess.Popen(
            command, cwd=bench_dir.parent, stdout=subprocess.PIPE, text=True
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                try:
                    is_json = isinstance(json.loads(line), dict)
                except ValueError:
                    is_json = False
                print(line, file=sys.stdout if is_json else sys.stderr, flush=True)
        if proc.returncode != 0:
            failed.append(f"{name} (exit status {proc.returncode})")
    if failed:
        raise AsyncflatError(f"failed: {', '.join(failed)}")
    return 0


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------


def _global_options(sub: bool) -> argparse.ArgumentParser:
    """-v/-q, accepted before the command and after it: the command's own copies write to other
    destinations (their defaults suppressed), and :func:`main` adds both counts up."""
    suffix = "_sub" if sub else ""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("global options")
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        dest="verbose" + suffix,
        default=argparse.SUPPRESS if sub else 0,
        help="asyncflat's logs at info (-v) or debug (-vv) level on stderr; other libraries "
        "stay at warnings",
    )
    group.add_argument(
        "-q",
        "--quiet",
        action="count",
        dest="quiet" + suffix,
        default=argparse.SUPPRESS if sub else 0,
        help="errors only, and no progress bars",
    )
    return options


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="asyncflat",
        description="Tools for flat-tokens datasets and the asyncflat loader.",
        epilog="Environment: ASYNCFLAT_LOG_LEVEL (default log level of asyncflat's loggers), "
        "ASYNCFLAT_NO_PROGRESS=1 (no progress bars). Exit status: 0 ok, 1 error, 2 usage error.",
        parents=[_global_options(sub=False)],
    )
    parser.add_argument("--version", action="version", version=f"asyncflat {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub_options = [_global_options(sub=True)]

    demo = commands.add_parser(
        "demo",
        parents=sub_options,
        help="train on a synthetic dataset with a simulated step and report the figures",
        description="Write a synthetic Zipf-token dataset (or reuse --path), run a ShufflingLoader "
        "over it with a simulated train step, and print throughput, load() latency and "
        "the engine's fill figures.",
    )
    demo.add_argument(
        "--path",
        help="dataset location: reused if it exists, else written there "
        "(default: a temporary directory, removed afterwards)",
    )
    demo.add_argument(
        "--tokens",
        type=_positive,
        default=1 << 24,
        help="synthetic dataset size in tokens (default 16M)",
    )
    demo.add_argument("--steps", type=_positive, help="stop after this many steps (default: all)")
    demo.add_argument(
        "--step-ms",
        type=_non_negative_float,
        default=5.0,
        help="simulated train step time in ms (default 5)",
    )
    demo.add_argument(
        "--step",
        choices=("sleep", "matmul"),
        default="sleep",
        help="simulate the step by sleeping or by busy jitted matmuls (default sleep)",
    )
    demo.add_argument("--len", type=_positive, default=1024, help="sequence length (default 1024)")
    demo.add_argument("--batch", type=_positive, default=32, help="batch size (default 32)")
    demo.add_argument("--streams", type=_positive, default=1, help="streams (default 1)")
    demo.add_argument(
        "--read-blocks-per-buffer",
        type=_positive,
        default=32,
        help="read blocks per shuffle buffer (default 32)",
    )
    demo.add_argument(
        "--sequences-per-block",
        type=_positive,
        default=64,
        help="sequences per read block (default 64; chunks are written to match)",
    )
    demo.add_argument("--seed", type=int, default=0, help="data and shuffle seed (default 0)")
    demo.add_argument(
        "--no-packing", action="store_true", help="one document per row, truncated/padded"
    )
    demo.add_argument(
        "--no-prefetch",
        action="store_true",
        help="do not fill the next buffer in the background (the reference's behaviour)",
    )
    demo.add_argument("--json", action="store_true", help="print the figures as JSON")
    demo.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the worst load() after each minipoch boundary to FILE (.png, .svg, "
        ".pdf; needs matplotlib)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=cmd_demo)

    insp = commands.add_parser(
        "inspect",
        parents=sub_options,
        help="describe a dataset (and what loader parameters cost); --verify scans it",
        description="Describe a flat-tokens dataset: sizes, sequence lengths, storage layout and "
        "compression. With --len and --batch, also the loader's steps, minipochs, "
        "buffer memory and read amplification. --verify reads every chunk and checks "
        "every invariant, exiting with status 1 on the first violation.",
    )
    insp.add_argument("path", help="dataset path or fsspec URL")
    insp.add_argument("--split", choices=("train", "validation"), help="only this split")
    insp.add_argument("--len", type=_positive, help="loader sequence length")
    insp.add_argument("--batch", type=_positive, help="loader batch size")
    insp.add_argument("--streams", type=_positive, default=1, help="streams (default 1)")
    insp.add_argument(
        "--read-blocks-per-buffer",
        type=_positive,
        default=64,
        help="read blocks per shuffle buffer (default 64)",
    )
    insp.add_argument(
        "--sequences-per-block",
        type=_positive,
        help="sequences per read block (default: 1M tokens / len)",
    )
    insp.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    insp.add_argument("--no-packing", action="store_true", help="loader without sequence packing")
    insp.add_argument(
        "--hosts",
        type=_positive,
        default=1,
        help="hosts sharing the batch, for memory per host (default 1)",
    )
    insp.add_argument(
        "--no-lengths", action="store_true", help="skip the seq_starts scan (no length statistics)"
    )
    insp.add_argument(
        "--mixture",
        action="store_true",
        help="PATH is a MixtureParams config (JSON or YAML): per-source steps, passes, memory",
    )
    insp.add_argument("--verify", action="store_true", help="full scan of every invariant")
    insp.add_argument("--json", action="store_true", help="print everything as JSON")
    insp.add_argument("--no-progress", action="store_true", help="no progress bars")
    insp.set_defaults(func=cmd_inspect)

    conv = commands.add_parser(
        "convert",
        parents=sub_options,
        help="tokenize text files or a local Hugging Face dataset into flat-tokens",
        description="Tokenize documents into a new flat-tokens dataset. Inputs: .txt (a document "
        "per line, or per file with --txt-mode file), .jsonl (--text-field), .parquet "
        "(--text-field column), .gz of txt/jsonl, or directories of them; or "
        "--hf-dataset PATH. The dataset appears at --output only when complete.",
    )
    conv.add_argument("inputs", nargs="*", help="input files or directories, in order")
    conv.add_argument(
        "-o",
        "--output",
        required=True,
        help="the new dataset: a local directory or an fsspec URL (gs://, s3://, ...)",
    )
    conv.add_argument(
        "--storage-options",
        metavar="JSON",
        help="fsspec options for an --output URL, as a JSON object (e.g. an endpoint_url)",
    )
    conv.add_argument(
        "--tokenizer",
        default="bytes",
        help="'bytes' (UTF-8 byte + 1), PATH to tokenizer.json (or its directory), "
        "or tiktoken:NAME (cached encodings only) (default bytes)",
    )
    conv.add_argument(
        "--text-field", default="text", help="JSON field / column of the text (default text)"
    )
    conv.add_argument(
        "--txt-mode",
        choices=("line", "file"),
        default="line",
        help=".txt inputs: a document per line or per file (default line)",
    )
    conv.add_argument(
        "--hf-dataset",
        metavar="PATH",
        help="a local datasets dataset: a save_to_disk directory, a directory of "
        "data files, or one data file",
    )
    conv.add_argument("--hf-name", help="the dataset configuration name, for --hf-dataset")
    conv.add_argument(
        "--validation-fraction",
        type=float,
        default=0.01,
        help="fraction of documents for validation, chosen by a hash of the "
        "document index (default 0.01)",
    )
    conv.add_argument(
        "--seed", type=int, default=0, help="seed of the validation choice (default 0)"
    )
    conv.add_argument(
        "--max-document-bytes",
        type=_positive,
        default=16 << 20,
        help="largest document accepted, in UTF-8 bytes, checked while reading (default 16 MiB)",
    )
    conv.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="read symlinks under an input directory that lead outside it (skipped by default)",
    )
    conv.add_argument(
        "--workers",
        type=_positive,
        default=min(os.cpu_count() or 1, 16),
        help="tokenizer processes; 1 tokenizes in-process (default: the CPU count, at most 16)",
    )
    conv.add_argument(
        "--format", type=int, choices=(2, 3), default=3, help="zarr format (default 3)"
    )
    conv.add_argument(
        "--chunk-tokens",
        type=_positive,
        default=1 << 20,
        help="tokens per chunk; match the loader's read block (default 1048576)",
    )
    conv.add_argument("--shard-tokens", type=_positive, help="tokens per shard (zarr 3)")
    conv.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing flat-tokens dataset (or an empty directory); anything else "
        "at the output is refused",
    )
    conv.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: worker processes on this machine; ray: tasks on a Ray cluster "
        "(pip install 'asyncflat[distributed]'); same output (default local)",
    )
    conv.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="--engine ray: the cluster to join (host:port, or 'auto'); default: a new local one",
    )
    conv.add_argument(
        "--work-dir",
        metavar="PATH_OR_URL",
        help="--engine ray: where tokenized pieces go, reachable by every worker; a rerun "
        "resumes from them (default OUTPUT.pieces)",
    )
    conv.add_argument("--json", action="store_true", help="print the report as JSON")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv.set_defaults(func=cmd_convert)

    bench = commands.add_parser(
        "bench",
        parents=sub_options,
        help="run the benchmarks shipped with asyncflat and print their JSON lines",
        description="Run the benchmark bench/NAME.py of asyncflat's source checkout (all of them "
        "when no NAME is given) with this Python, in a subprocess from the checkout's root; JSON "
        "lines go to stdout, anything else the scripts print to stderr. Everything after NAME is "
        "passed to the script (asyncflat bench cloud --tokens-mib 8). Only the checkout's own "
        "benchmarks run, never a bench/ of the current directory; --bench-dir runs others.",
    )
    bench.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="benchmark to run, or several separated by commas (default: all)",
    )
    bench.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the benchmark"
    )
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument(
        "--bench-dir",
        metavar="DIR",
        help="run the scripts of DIR instead of the checkout's bench/ (only when given)",
    )
    bench.set_defaults(func=cmd_bench)
    return parser


_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING}
_LEVELS["ERROR"] = logging.ERROR


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _log_level(verbose: int, quiet: int) -> int:
    """-v/-q win; else ``ASYNCFLAT_LOG_LEVEL``; else warnings."""
    if verbose or quiet:
        return max(logging.DEBUG, min(logging.ERROR, logging.WARNING - 10 * (verbose - quiet)))
    env = os.environ.get("ASYNCFLAT_LOG_LEVEL", "").strip().upper()
    if env and env not in _LEVELS:
        raise ConfigError(
            f"ASYNCFLAT_LOG_LEVEL={env!r} is not one of {', '.join(_LEVELS)} (environment)"
        )
    return _LEVELS.get(env, logging.WARNING)


def _configure_logging(level: int) -> None:
    """One stderr handler on the root logger at WARNING; only asyncflat's loggers go lower, so
    -v shows asyncflat's info lines, not jax's or absl's."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(max(level, logging.WARNING))
    logging.getLogger("asyncflat").setLevel(level)


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations argparse cannot express; reported as usage errors (exit status 2)."""
    if args.command == "inspect" and (args.len is None) != (args.batch is None):
        parser.error("inspect: --len and --batch go together (loader figures need both)")
    if args.command == "demo" and args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("demo --plot needs matplotlib: pip install matplotlib (or '.[dev]')")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose = args.verbose + getattr(args, "verbose_sub", 0)
    args.quiet = args.quiet + getattr(args, "quiet_sub", 0)
    _check_usage(parser, args)
    try:
        _configure_logging(_log_level(args.verbose, args.quiet))
        if hasattr(args, "no_progress") and (args.quiet or _env_flag("ASYNCFLAT_NO_PROGRESS")):
            args.no_progress = True
        status = int(args.func(args))
        sys.stdout.flush()  # a closed pipe is reported here, not at interpreter exit
        return status
    except AsyncflatError as exc:
        print(f"asyncflat {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"asyncflat {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`asyncflat bench --list | head`): stop quietly, as Unix tools do.
        # Python would otherwise fail again flushing stdout at exit; point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
