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

The package: :mod:`.entry` (``main``), :mod:`.parser` (the global options, assembling the
commands), one module per command (:mod:`.demo`, :mod:`.inspect_cmd`, :mod:`.convert_cmd`,
:mod:`.bench`), each with its ``cmd_*`` and the ``add_parser`` that builds its sub-parser,
:mod:`.output` (formatting and argparse types shared by them) and :mod:`.stall_figure` (the
figure of ``demo --plot``, also drawn by ``bench/stall.py``).

May import: ``*``; the command sits on top of the house, and nothing in the package imports it
but ``asyncflat.__main__``.
"""

from __future__ import annotations

from asyncflat.cli.entry import main
from asyncflat.cli.parser import build_parser

__all__ = ["build_parser", "main"]
