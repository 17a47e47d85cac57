"""Describe and verify flat-tokens datasets: what ``asyncflat inspect`` prints, as library calls.

* :func:`describe_split`: sizes, storage layout (zarr format, chunking, codecs, compression
  ratio) and, from one scan of ``seq_starts``, the sequence-length distribution.
* :func:`loader_figures`: what a given loader configuration costs on that split: steps,
  minipochs, shuffle-buffer memory per host and read amplification (chunk tokens decoded per
  token used), computed from the plan without reading any tokens.
* :func:`verify_split`: a full scan, chunk by chunk in bounded memory, of every invariant of the
  format (see ``docs/format.md``). It raises :class:`~asyncflat.errors.DatasetFormatError` (or
  :class:`~asyncflat.errors.CorruptChunkError` for bytes that do not decode, or a chunk that is
  missing) at the first violation, naming the array and the index.

Everything reads through the same guarded source as the loader, so local paths and fsspec URLs
(``gs://``, ``s3://``, ``memory://``) both work and a missing chunk is an error, not zeros.

The package: :mod:`.results` (the returned dataclasses), :mod:`.scan` (the helpers every call
shares: its own loop, the guarded source, checked windowed reads), one module per call
(:mod:`.describe`, :mod:`.figures`, :mod:`.verify`), and :mod:`.mixture` (what ``inspect
--mixture`` prints for a mixture config).

May import: ``source``, ``storage``, ``format``, ``plan``, ``engine.loop``, ``engine.units``,
``loader.mixture.config``, ``config`` and ``errors``: the read path's pieces (the engine's
in-flight budget for the memory figure), never a loader nor the write path.
"""

from __future__ import annotations

from asyncflat.inspection.describe import describe_split
from asyncflat.inspection.figures import loader_figures
from asyncflat.inspection.results import LengthStats, LoaderFigures, SplitSummary, VerifyReport
from asyncflat.inspection.verify import verify_split

__all__ = [
    "LengthStats",
    "LoaderFigures",
    "SplitSummary",
    "VerifyReport",
    "describe_split",
    "loader_figures",
    "verify_split",
]
