"""``main``: parse, set up logging and progress from the options and the environment, run the
command, and map its outcome to the documented exit status."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from asyncflat.cli.parser import build_parser
from asyncflat.errors import AsyncflatError, ConfigError

__all__ = ["main"]


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose = args.verbose + getattr(args, "verbose_sub", 0)
    args.quiet = args.quiet + getattr(args, "quiet_sub", 0)
    if hasattr(args, "check_usage"):  # combinations argparse cannot express: exit status 2
        args.check_usage(parser, args)
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
