"""The plan: the corpus cut into units of bounded size, and the fingerprint that pins it.

A unit is the smallest piece of input one task tokenizes: a whole file, a parquet row group, or a
newline-aligned byte range of a ``.txt`` / ``.jsonl`` file (a ``.gz`` file is one unit: gzip
cannot be entered in the middle). Units are listed in document order, so concatenating their
documents gives exactly the sequence :func:`asyncflat.writer.convert.iter_documents` yields.

The fingerprint covers everything the tokenized pieces depend on (the input files' sizes and
modification times, the tokenizer and its file's contents, the reading options and the unit
size), so pieces left by an interrupted run are reused only for the same conversion.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncflat.errors import ConfigError
from asyncflat.text.corpus import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    check_max_document_bytes,
    expand_inputs,
    file_suffix,
    open_parquet,
)

__all__ = ["Plan", "Unit", "make_plan", "tokenizer_fingerprint"]

#: Bump when the piece layout or the planning rule changes, so old pieces are never reused.
PLAN_VERSION = 1
_SCAN = 1 << 16


@dataclasses.dataclass(frozen=True)
class Unit:
    """One task's share of the input: ``[start, end)`` bytes, or row group ``start`` of a parquet."""

    index: int
    path: str
    kind: str  # "txt", "jsonl" or "parquet"
    gz: bool
    start: int
    end: int
    #: parquet: the row number of the row group's first row (for error messages)
    first_row: int
    #: input bytes, for progress and the ETA
    size: int


@dataclasses.dataclass(frozen=True)
class Plan:
    units: tuple[Unit, ...]
    fingerprint: dict[str, Any]

    @property
    def digest(self) -> str:
        blob = json.dumps(self.fingerprint, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": PLAN_VERSION,
                "fingerprint": self.fingerprint,
                "digest": self.digest,
                "units": [dataclasses.asdict(u) for u in self.units],
            },
            indent=1,
        )


def tokenizer_fingerprint(spec: str) -> str:
    """The spec, plus a hash of the tokenizer file's contents when it is a local file."""
    if spec == "bytes" or spec.startswith("tiktoken:"):
        return spec
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        return spec  # load_tokenizer reports the error
    return f"{spec} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"


def make_plan(
    inputs: Sequence[str | os.PathLike[str]],
    *,
    tokenizer: str,
    text_field: str,
    txt_mode: str,
    unit_bytes: int,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    follow_symlinks: bool = False,
) -> Plan:
    """Cut ``inputs`` (expanded as :func:`asyncflat.text.corpus.expand_inputs` does) into units of
    about ``unit_bytes`` (each a whole number of lines)."""
    check_max_document_bytes(max_document_bytes)
    if txt_mode not in ("line", "file"):
        raise ConfigError(f"txt_mode must be 'line' or 'file', got {txt_mode!r}")
    if isinstance(unit_bytes, bool) or not isinstance(unit_bytes, int) or unit_bytes < 1:
        raise ConfigError(f"unit_bytes must be an integer >= 1, got {unit_bytes!r}")
    files = expand_inputs(inputs, follow_symlinks=follow_symlinks)
    units: list[Unit] = []
    stamps = []
    for path in files:
        st = path.stat()
        stamps.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
        suffix = file_suffix(path)
        assert suffix is not None
        kind = suffix.removesuffix(".gz").lstrip(".")
        gz = suffix.endswith(".gz")
        # Absolute (workers may run elsewhere), not resolved: errors name the path as given.
        name = os.path.abspath(path)

        def add(start: int, end: int, first_row: int, size: int) -> None:
            units.append(Unit(len(units), name, kind, gz, start, end, first_row, size))  # noqa: B023

        if kind == "parquet":
            for group, first_row, size in _row_groups(path, text_field):
                add(group, group + 1, first_row, size)
        elif gz or (kind == "txt" and txt_mode == "file"):
            add(0, st.st_size, 0, st.st_size)
        else:
            bounds = _line_bounds(path, st.st_size, unit_bytes)
            for start, end in itertools.pairwise(bounds):
                add(start, end, 0, end - start)
    fingerprint = {
        "version": PLAN_VERSION,
        "inputs": stamps,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "text_field": text_field,
        "txt_mode": txt_mode,
        "unit_bytes": unit_bytes,
        # a piece tokenized under a larger bound may hold documents a smaller one refuses
        "max_document_bytes": max_document_bytes,
    }
    return Plan(tuple(units), fingerprint)


def _line_bounds(path: Path, size: int, unit_bytes: int) -> list[int]:
    """Offsets 0 < ... < size, each just after a ``\\n``, about ``unit_bytes`` apart."""
    bounds = [0]
    with open(path, "rb") as f:
        target = unit_bytes
        while target < size:
            f.seek(target)
            pos = target
            while True:
                block = f.read(_SCAN)
                if not block:
                    pos = size
                    break
                newline = block.find(b"\n")
                if newline >= 0:
                    pos += newline + 1
                    break
                pos += len(block)
            if pos >= size:
                break
            bounds.append(pos)
            target = pos + unit_bytes
    if size > 0:
        bounds.append(size)
    return bounds


def _row_groups(path: Path, text_field: str) -> list[tuple[int, int, int]]:
    """(row group, its first row, its compressed bytes) for each row group of a parquet file."""
    parquet = open_parquet(path, text_field)
    meta = parquet.metadata
    out = []
    row = 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        out.append((i, row, max(int(group.total_byte_size), 1)))
        row += group.num_rows
    return out
