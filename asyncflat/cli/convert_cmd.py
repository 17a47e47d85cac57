"""``asyncflat convert``: text files or a local Hugging Face dataset to flat-tokens."""

from __future__ import annotations

import argparse
import json
from typing import Any

from asyncflat.cli.output import print_json
from asyncflat.errors import AsyncflatError, ConfigError, StorageError

__all__ = ["cmd_convert"]


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

        # options.workers is not read there: the cluster's CPUs are the workers
        return convert_distributed(
            args.inputs,
            args.output,
            options=options,
            runner="ray",
            ray_address=args.ray_address,
            work_dir=args.work_dir,
            **reading,
        )
    from asyncflat.writer.convert import convert_files

    return convert_files(args.inputs, args.output, options=options, **reading)
