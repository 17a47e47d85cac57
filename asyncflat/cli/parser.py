"""The argument parser of the ``asyncflat`` command: the global options, and one sub-parser per
command that the command's own module builds (``add_parser`` next to its ``cmd_*``)."""

from __future__ import annotations

import argparse

from asyncflat.cli import bench, convert_cmd, demo, inspect_cmd

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
    """The whole command line: global options, ``--version`` and the commands, in help order."""
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
    for command in (demo, inspect_cmd, convert_cmd, bench):
        command.add_parser(commands, sub_options)
    return parser
