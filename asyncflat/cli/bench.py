"""``asyncflat bench``: run the benchmark scripts shipped in the source checkout's ``bench/``."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

from asyncflat.cli.output import Commands
from asyncflat.errors import AsyncflatError, ConfigError

__all__ = ["add_parser", "cmd_bench", "find_bench_dir"]

log = logging.getLogger(__name__)


def add_parser(commands: Commands, parents: list[argparse.ArgumentParser]) -> None:
    """The ``bench`` sub-parser, bound to :func:`cmd_bench`."""
    bench = commands.add_parser(
        "bench",
        parents=parents,
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


def _shipped_bench_dir() -> Path | None:
    """``bench/`` of the source checkout this package was imported from, if it is one.

    Only a directory next to the package whose ``pyproject.toml`` names the ``asyncflat``
    project counts: an installed wheel ships no benchmarks, and a ``bench/`` that happens to
    sit in ``site-packages`` (or in the current directory) is not ours to run.
    """
    here = Path(__file__).resolve()
    package = next((p for p in here.parents if p.name == "asyncflat"), None)
    if package is None:
        return None
    root = package.parent  # the directory that holds the asyncflat package
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
