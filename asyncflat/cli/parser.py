"""The argument parser of the ``asyncflat`` command: global options and one sub-parser per
command, each bound to the function that runs it."""

from __future__ import annotations

import argparse
import os

from asyncflat.cli.bench import cmd_bench
from asyncflat.cli.convert_cmd import cmd_convert
from asyncflat.cli.demo import cmd_demo
from asyncflat.cli.inspect_cmd import cmd_inspect
from asyncflat.cli.output import non_negative_float, positive

__all__ = ["build_parser"]


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
    from asyncflat import __version__

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
        type=positive,
        default=1 << 24,
        help="synthetic dataset size in tokens (default 16M)",
    )
    demo.add_argument("--steps", type=positive, help="stop after this many steps (default: all)")
    demo.add_argument(
        "--step-ms",
        type=non_negative_float,
        default=5.0,
        help="simulated train step time in ms (default 5)",
    )
    demo.add_argument(
        "--step",
        choices=("sleep", "matmul"),
        default="sleep",
        help="simulate the step by sleeping or by busy jitted matmuls (default sleep)",
    )
    demo.add_argument("--len", type=positive, default=1024, help="sequence length (default 1024)")
    demo.add_argument("--batch", type=positive, default=32, help="batch size (default 32)")
    demo.add_argument("--streams", type=positive, default=1, help="streams (default 1)")
    demo.add_argument(
        "--read-blocks-per-buffer",
        type=positive,
        default=32,
        help="read blocks per shuffle buffer (default 32)",
    )
    demo.add_argument(
        "--sequences-per-block",
        type=positive,
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
    insp.add_argument("--len", type=positive, help="loader sequence length")
    insp.add_argument("--batch", type=positive, help="loader batch size")
    insp.add_argument("--streams", type=positive, default=1, help="streams (default 1)")
    insp.add_argument(
        "--read-blocks-per-buffer",
        type=positive,
        default=64,
        help="read blocks per shuffle buffer (default 64)",
    )
    insp.add_argument(
        "--sequences-per-block",
        type=positive,
        help="sequences per read block (default: 1M tokens / len)",
    )
    insp.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    insp.add_argument("--no-packing", action="store_true", help="loader without sequence packing")
    insp.add_argument(
        "--hosts",
        type=positive,
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
        type=positive,
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
        type=positive,
        default=min(os.cpu_count() or 1, 16),
        help="tokenizer processes; 1 tokenizes in-process (default: the CPU count, at most 16)",
    )
    conv.add_argument(
        "--format", type=int, choices=(2, 3), default=3, help="zarr format (default 3)"
    )
    conv.add_argument(
        "--chunk-tokens",
        type=positive,
        default=1 << 20,
        help="tokens per chunk; match the loader's read block (default 1048576)",
    )
    conv.add_argument("--shard-tokens", type=positive, help="tokens per shard (zarr 3)")
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
