"""``asyncflat convert``: text files or a local Hugging Face dataset to flat-tokens."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from asyncflat.cli.output import Commands, positive, print_json
from asyncflat.errors import AsyncflatError, ConfigError, StorageError

__all__ = ["add_parser", "cmd_convert"]


def add_parser(commands: Commands, parents: list[argparse.ArgumentParser]) -> None:
    """The ``convert`` sub-parser, bound to :func:`cmd_convert`."""
    conv = commands.add_parser(
        "convert",
        parents=parents,
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
    _add_reading_options(conv)
    _add_writing_options(conv)
    conv.add_argument("--json", action="store_true", help="print the report as JSON")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv.set_defaults(func=cmd_convert)


def _add_reading_options(conv: argparse.ArgumentParser) -> None:
    """How documents are read, split and tokenized."""
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


def _add_writing_options(conv: argparse.ArgumentParser) -> None:
    """The output's layout, and where the work runs."""
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


def cmd_convert(args: argparse.Namespace) -> int:
    if bool(args.inputs) == bool(args.hf_dataset):
        raise ConfigError("give either input files/directories or --hf-dataset PATH (not both)")
    if args.engine != "ray" and (args.ray_address or args.work_dir):
        raise ConfigError("--ray-address and --work-dir need --engine ray")
    if args.engine == "ray" and args.hf_dataset:
        raise ConfigError("--engine ray converts files; --hf-dataset runs on this machine only")
    from asyncflat.writer.output import OutputExistsError

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
        print_json(report.to_dict())
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
    from asyncflat.writer.options import ConvertOptions

    storage_options = None
    if args.storage_options:
        try:
            storage_options = json.loads(args.storage_options)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--storage-options must be a JSON object: {exc}") from None
        if not isinstance(storage_options, dict):
            raise ConfigError("--storage-options must be a JSON object")
    options = ConvertOptions(
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
        from asyncflat.integrations.hf import convert_hf_dataset

        return convert_hf_dataset(
            args.hf_dataset,
            args.output,
            options=options,
            name=args.hf_name,
            text_field=args.text_field,
        )
    reading = dict(
        text_field=args.text_field, txt_mode=args.txt_mode, follow_symlinks=args.follow_symlinks
    )
    if args.engine == "ray":
        from asyncflat.writer.distributed import convert_distributed

        # The cluster is started (or joined) there, once the inputs and the output pass their
        # checks. With --json stdout carries the report alone: Ray forwards its workers' and
        # raylet's log lines ("A worker died ...") to the driver's stdout unless told not to.
        # options.workers is not read there: the cluster's CPUs are the workers.
        return convert_distributed(
            args.inputs,
            args.output,
            options=options,
            runner="ray",
            ray_address=args.ray_address,
            ray_init_options={"log_to_driver": not args.json},
            work_dir=args.work_dir,
            **reading,
        )
    from asyncflat.writer.convert import convert_files

    return convert_files(args.inputs, args.output, options=options, **reading)
