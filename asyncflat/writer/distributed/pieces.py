"""Tokenizing one unit to a piece, and reading pieces back.

A piece is three objects under ``<work_dir>/pieces/``: ``NNNNNNNN.tokens`` (the unit's token ids,
uint32 little-endian, documents back to back), ``NNNNNNNN.lengths`` (one int64 per document,
empty documents included: they count in the split assignment) and ``NNNNNNNN.json``, the
manifest, written last. A piece without a manifest (or whose manifest names another plan) is
not done, so a task killed mid-write is simply redone.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from asyncflat.errors import ConfigError
from asyncflat.text.corpus import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    iter_file_documents,
    iter_parquet_documents,
    iter_range_documents,
)
from asyncflat.text.tokenizer import Tokenizer, load_tokenizer, tokenize_batch
from asyncflat.writer.convert import DOCS_PER_BATCH
from asyncflat.writer.distributed.plan import Unit
from asyncflat.writer.distributed.storage import Location

__all__ = [
    "PIECES",
    "PieceInfo",
    "TokenizeJob",
    "is_piece_file",
    "piece_name",
    "read_manifests",
    "tokenize_unit",
]

#: the folder of ``work_dir`` that holds the pieces
PIECES = "pieces"
#: a piece's object, or a local write of one that a killed task left (``Location.put``)
_PIECE_FILE = re.compile(r"\d{8,}\.(tokens|lengths|json)(\.tmp-[0-9a-f]{8})?")


def piece_name(index: int, what: str) -> str:
    return f"{PIECES}/{index:08d}.{what}"


def is_piece_file(name: str) -> bool:
    """Whether ``name`` (an entry of the pieces folder) is one a conversion writes."""
    return _PIECE_FILE.fullmatch(name) is not None


@dataclasses.dataclass(frozen=True)
class PieceInfo:
    """A finished piece, as its manifest records it."""

    index: int
    documents: int
    empty_documents: int
    tokens: int
    max_token_id: int
    input_bytes: int


@dataclasses.dataclass(frozen=True)
class TokenizeJob:
    unit: Unit
    plan_digest: str
    tokenizer: str
    text_field: str
    txt_mode: str
    work: Location
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES


def read_manifests(work: Location, indices: list[int], plan_digest: str) -> dict[int, PieceInfo]:
    """The finished pieces among ``indices`` that belong to this plan, read in batches (one
    concurrent request per piece on an object store)."""
    found: dict[int, PieceInfo] = {}
    for lo in range(0, len(indices), 4096):
        batch = indices[lo : lo + 4096]
        for raw in work.get_many([piece_name(i, "json") for i in batch]):
            if raw is None:
                continue  # not finished
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # not a finished manifest
            if record.get("plan") == plan_digest:
                info = PieceInfo(**record["piece"])
                found[info.index] = info
    return found


_tokenizers: dict[str, Tokenizer] = {}


def _worker_tokenizer(spec: str) -> Tokenizer:
    tok = _tokenizers.get(spec)
    if tok is None:
        # One task is one core's worth of work: keep the tokenizers library's own thread pool
        # from multiplying that by the number of cores.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("RAYON_NUM_THREADS", "1")
        tok = _tokenizers[spec] = load_tokenizer(spec)
    return tok


def tokenize_unit(job: TokenizeJob) -> PieceInfo:
    """Read, tokenize and store one unit; returns its manifest. Input errors raise ConfigError."""
    tok = _worker_tokenizer(job.tokenizer)
    unit = job.unit
    docs = unit_documents(unit, job.text_field, job.txt_mode, job.max_document_bytes)
    ids_parts: list[np.ndarray] = []
    len_parts: list[np.ndarray] = []
    while batch := list(itertools.islice(docs, DOCS_PER_BATCH)):
        ids, lengths = tokenize_batch(tok, batch)
        ids_parts.append(ids)
        len_parts.append(lengths)
    ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.uint32)
    lengths = np.concatenate(len_parts) if len_parts else np.zeros(0, np.int64)
    info = PieceInfo(
        index=unit.index,
        documents=int(lengths.size),
        empty_documents=int(np.count_nonzero(lengths == 0)),
        tokens=int(ids.size),
        max_token_id=int(ids.max()) if ids.size else 0,
        input_bytes=unit.size,
    )
    job.work.put(piece_name(unit.index, "tokens"), ids.astype("<u4", copy=False).tobytes())
    job.work.put(piece_name(unit.index, "lengths"), lengths.astype("<i8", copy=False).tobytes())
    manifest = {"plan": job.plan_digest, "piece": dataclasses.asdict(info)}
    job.work.put(piece_name(unit.index, "json"), json.dumps(manifest).encode())
    return info


# --------------------------------------------------------------------------------------------
# Reading a unit's documents: asyncflat.text.corpus's readers, so the rules (document size bound,
# line numbering, errors) are the single-machine converter's
# --------------------------------------------------------------------------------------------


def unit_documents(
    unit: Unit,
    text_field: str,
    txt_mode: str,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
) -> Iterator[str]:
    """The documents of ``unit``, in order."""
    if unit.kind == "parquet":
        return iter_parquet_documents(
            unit.path,
            text_field=text_field,
            max_document_bytes=max_document_bytes,
            row_group=unit.start,
        )
    if unit.gz:
        return iter_file_documents(
            unit.path,
            text_field=text_field,
            txt_mode=txt_mode,
            max_document_bytes=max_document_bytes,
        )
    return iter_range_documents(
        unit.path,
        unit.start,
        unit.end,
        text_field=text_field,
        txt_mode=txt_mode,
        max_document_bytes=max_document_bytes,
    )


# --------------------------------------------------------------------------------------------
# Reading pieces back
# --------------------------------------------------------------------------------------------


def read_lengths(work: Location, index: int) -> np.ndarray:
    return read_lengths_many(work, [index])[0]


def read_lengths_many(work: Location, indices: list[int]) -> list[np.ndarray]:
    """The per-document lengths of each piece (fetched concurrently from an object store)."""
    names = [piece_name(i, "lengths") for i in indices]
    try:
        blobs = work.get_many_ranges([(name, 0, None) for name in names])
    except FileNotFoundError:
        missing = next(n for n in names if not work.exists(n))
        raise ConfigError(f"piece {work.path(missing)} is missing") from None
    return [np.frombuffer(blob, "<i8") for blob in blobs]


def read_token_ranges(work: Location, index: int, ranges: list[tuple[int, int]]) -> np.ndarray:
    """Token ids ``[a, b)`` of piece ``index`` for each (a, b), concatenated."""
    return read_token_ranges_many(work, [(index, ranges)])[0]


def read_token_ranges_many(
    work: Location, wanted: list[tuple[int, list[tuple[int, int]]]]
) -> list[np.ndarray]:
    """For each (piece index, ranges): its token ids ``[a, b)`` for each (a, b), concatenated;
    every range of every piece is requested at once (concurrently from an object store)."""
    requests: list[tuple[str, int, int | None]] = [
        (piece_name(index, "tokens"), 4 * a, 4 * b) for index, ranges in wanted for a, b in ranges
    ]
    blobs = iter(work.get_many_ranges(requests))
    out = []
    for _, ranges in wanted:
        data = b"".join(next(blobs) for _ in ranges)
        out.append(np.frombuffer(data, "<u4") if data else np.zeros(0, np.uint32))
    return out


def describe(info: PieceInfo) -> dict[str, Any]:
    return dataclasses.asdict(info)
