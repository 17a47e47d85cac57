"""``asyncflat inspect``: describe a dataset, what loader parameters cost on it, and verify it."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from asyncflat.cli.output import Commands, human_bytes, positive, print_json
from asyncflat.errors import ConfigError

__all__ = ["add_parser", "cmd_inspect"]

log = logging.getLogger(__name__)


def add_parser(commands: Commands, parents: list[argparse.ArgumentParser]) -> None:
    """The ``inspect`` sub-parser, bound to :func:`cmd_inspect`."""
    insp = commands.add_parser(
        "inspect",
        parents=parents,
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
    insp.set_defaults(func=cmd_inspect, check_usage=_check_usage)


def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations argparse cannot express, reported as usage errors (exit status 2)."""
    if (args.len is None) != (args.batch is None):
        parser.error("inspect: --len and --batch go together (loader figures need both)")
    if not args.mixture:
        return
    # the config file holds each source's loader parameters: these flags would be ignored
    ignored = [
        flag
        for flag, given in (
            ("--verify", args.verify),
            ("--streams", args.streams != 1),
            ("--read-blocks-per-buffer", args.read_blocks_per_buffer != 64),
            ("--sequences-per-block", args.sequences_per_block is not None),
            ("--seed", args.seed != 0),
            ("--no-packing", args.no_packing),
        )
        if given
    ]
    if ignored:
        parser.error(
            f"inspect --mixture: {', '.join(ignored)} do not apply (each source's loader "
            "parameters are in the config; --verify each source's store on its own)"
        )


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
        f"{' + '.join(s.token_codecs) or 'uncompressed'}; {human_bytes(s.tokens_nbytes)} -> "
        f"{human_bytes(s.tokens_nbytes_stored)} stored ({ratio})"
    )
    codecs = " + ".join(s.seq_starts_codecs) or "uncompressed"
    print(
        f"  seq_starts: chunks of {s.seq_starts_chunk:,}, {codecs}; "
        f"{human_bytes(s.seq_starts_nbytes)} -> {human_bytes(s.seq_starts_nbytes_stored)} stored"
    )
    print(f"  checksums: {_checksums_line(s)}")


def _checksums_line(s: Any) -> str:
    """Whether the chunks carry crc32c checksums (verified on every read) or not."""
    if s.token_checksums:
        also = " and seq_starts" if s.seq_starts_checksums else ""
        return f"crc32c on every chunk of encoded_tokens{also}, verified on every read"
    if s.seq_starts_checksums:
        return "crc32c on seq_starts only; encoded_tokens has none (damage may go unnoticed)"
    return "none (a damaged chunk may decode into wrong tokens unnoticed)"


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
        f"    shuffle buffer {human_bytes(f.buffer_bytes)}; per host ({f.hosts} hosts) "
        f"{human_bytes(f.buffer_bytes_per_host)} ({f.buffers_per_stream} x {f.streams_per_host} "
        f"streams), for a split of "
        f"{human_bytes(f.split_bytes)} (as uint32); read amplification {amp} (chunk tokens decoded "
        "per token used)"
    )
    print(
        f"    expected peak memory per host {human_bytes(f.memory_bytes_per_host)} (the buffers, "
        "the compressed reads in flight, ~24 MiB fixed)"
    )
    unit = "tokens" if not args.no_packing else "sequences"
    print(f"    dropped by rounding: {f.dropped_fraction:.1%} of the split's {unit} per epoch")
    if f.sizing_warning:
        print(f"    warning: {f.sizing_warning}")


def _inspect_mixture(args: argparse.Namespace) -> int:
    from asyncflat.inspection.mixture import figures_text, inspect_mixture

    figures = inspect_mixture(args.path, args.len, args.batch, args.split, args.hosts)
    if args.json:
        print_json(figures)
    else:
        print(figures_text(figures, args.hosts))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from asyncflat.config import FlatTokensParams, TokenBatchParams
    from asyncflat.format.codec import SPLITS
    from asyncflat.inspection import describe_split, loader_figures, verify_split

    if args.mixture:
        return _inspect_mixture(args)
    splits = [args.split] if args.split else list(SPLITS)
    loader_args = (args.len, args.batch)
    spb = args.sequences_per_block or (max(1, (1 << 20) // args.len) if args.len else 1)
    from asyncflat.errors import redact

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
                if figures.sizing_warning:  # the loader's own warning, word for word
                    log.warning("%s", figures.sizing_warning)
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
        print_json(report)
    return 0
