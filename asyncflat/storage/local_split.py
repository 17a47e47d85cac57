"""A plain local split's metadata, read without zarr: how a local dataset opens in milliseconds.

Importing zarr costs 0.1-0.3 s (its codec registry, entry points, fsspec), about what the rest of
a restart's first batch costs. A split whose two arrays are a plain chunk grid of little-endian
items, each chunk one Blosc frame or raw bytes (optionally followed by zarr 3's crc32c; for
``seq_starts`` also seqax's delta filter), needs none of zarr to be read: its documents are parsed
here and its chunk objects read and decoded by the reader itself.

:func:`parse_local_split` recognises that case and nothing else. Whatever it does not fully
understand, or finds invalid, answers None: the caller then opens the split through zarr, whose
checks report the problem with their usual messages. So this module never raises for a bad store.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ..format import MANY_CHUNKS, MIN_CHUNK_ELEMENTS, SPLITS, TOKEN_ID_LIMIT
from .gate import METADATA_MAX_BYTES, ChunkGate, _Compressor
from .local_files import read_object

__all__ = ["LocalArray", "LocalSplit", "parse_local_split"]

#: The fields of zarr 3's array and group documents. Any other field is an extension, which a
#: reader must refuse unless it is marked ``"must_understand": false`` (zarr's open does).
_V3_ARRAY_FIELDS = frozenset(
    {
        "zarr_format",
        "node_type",
        "shape",
        "data_type",
        "chunk_grid",
        "chunk_key_encoding",
        "fill_value",
        "codecs",
        "attributes",
        "dimension_names",
        "storage_transformers",
    }
)
_V3_GROUP_FIELDS = frozenset({"zarr_format", "node_type", "attributes", "consolidated_metadata"})

#: Each array's dtype as zarr 2 and zarr 3 spell it, and its item size.
_DTYPES = {"encoded_tokens": ("<u4", "uint32", 4), "seq_starts": ("<u8", "uint64", 8)}


@dataclasses.dataclass(frozen=True)
class LocalArray:
    """One 1-D array of a plain local split: where its chunks are and how they are encoded."""

    path: str  #: key prefix of the array, e.g. ``train/encoded_tokens``
    length: int
    chunk: int
    itemsize: int
    codec: str  #: "blosc" or "raw"
    checksum: bool  #: each object ends with zarr's crc32c of the rest
    #: seqax's ``Delta(dtype="<i8", astype="<i8")`` filter (seq_starts): values are a cumsum.
    delta: bool
    #: What a chunk key is between the array's path and the chunk index (``c/``, ``c.``, or
    #: nothing for zarr 2 keys).
    key_infix: str
    gate: ChunkGate

    def key(self, chunk_id: int) -> str:
        return f"{self.path}/{self.key_infix}{chunk_id}"

    @property
    def chunk_nbytes(self) -> int:
        return self.chunk * self.itemsize


@dataclasses.dataclass(frozen=True)
class LocalSplit:
    """A plain local split, parsed: enough to read it without zarr."""

    root: str
    split: str
    zarr_format: int
    max_token_id: int
    encoded_tokens: LocalArray
    seq_starts: LocalArray


def parse_local_split(root: str, split: str, name: str) -> LocalSplit | None:
    """The split ``split`` of the local store ``root`` when it is plain (see the module), else
    None. Blocking file reads (a few small documents): call it on a thread."""
    if split not in SPLITS or not os.path.isdir(root):
        return None
    try:
        return _parse(root, split, name)
    except Exception:  # noqa: BLE001 - zarr's open reports it, with its messages
        return None


def _document(root: str, key: str, name: str) -> dict[str, Any] | None:
    data = read_object(root, key, name=name, max_bytes=METADATA_MAX_BYTES, missing_ok=True)
    if data is None:
        return None
    doc = json.loads(data.tobytes())
    return doc if isinstance(doc, dict) else None


def _parse(root: str, split: str, name: str) -> LocalSplit | None:
    if _document(root, "zarr.json", name) is not None:
        zarr_format = 3
        group = _document(root, f"{split}/zarr.json", name)
        if group is None or group.get("node_type") != "group" or group.get("zarr_format") != 3:
            return None
        if not _extensions_ignorable(group, _V3_GROUP_FIELDS):
            return None
        attributes = group.get("attributes", {})
    elif _document(root, ".zgroup", name) is not None:
        zarr_format = 2
        if _document(root, f"{split}/.zgroup", name) is None:
            return None
        attributes = _document(root, f"{split}/.zattrs", name)
    else:
        return None
    if not isinstance(attributes, dict):
        return None
    max_token_id = attributes.get("max_token_id")
    if type(max_token_id) is not int or not 0 <= max_token_id < TOKEN_ID_LIMIT:
        return None
    arrays = []
    for array in ("encoded_tokens", "seq_starts"):
        path = f"{split}/{array}"
        if zarr_format == 3:
            doc = _document(root, f"{path}/zarr.json", name)
            parsed = None if doc is None else _v3_array(doc, path, array)
        else:
            doc = _document(root, f"{path}/.zarray", name)
            parsed = None if doc is None else _v2_array(doc, path, array)
        if parsed is None or not _chunking_ok(parsed):
            return None
        arrays.append(parsed)
    tokens, starts = arrays
    if tokens.delta or starts.length < 1:
        return None
    return LocalSplit(root, split, zarr_format, max_token_id, tokens, starts)


def _chunking_ok(array: LocalArray) -> bool:
    """The rule zarr's open applies too (see :data:`~asyncflat.format.MANY_CHUNKS`)."""
    count = -(-array.length // array.chunk)
    return not (count > MANY_CHUNKS and array.chunk < MIN_CHUNK_ELEMENTS)


def _extensions_ignorable(doc: dict[str, Any], fields: frozenset[str]) -> bool:
    """Whether every field of a zarr 3 document beyond ``fields`` may be ignored: an extension
    this reader does not know is safe to skip only when it says ``"must_understand": false``."""
    return all(
        isinstance(value, dict) and value.get("must_understand") is False
        for key, value in doc.items()
        if key not in fields
    )


def _one_dimension(shape: Any, chunks: Any) -> tuple[int, int] | None:
    if not (isinstance(shape, list) and isinstance(chunks, list)):
        return None
    if len(shape) != 1 or len(chunks) != 1:
        return None
    length, chunk = shape[0], chunks[0]
    if type(length) is not int or type(chunk) is not int or length < 0 or chunk < 1:
        return None
    return length, chunk


def _array(
    path: str,
    array: str,
    dims: tuple[int, int],
    codec: str,
    checksum: bool,
    delta: bool,
    infix: str,
) -> LocalArray:
    length, chunk = dims
    itemsize = _DTYPES[array][2]
    nbytes = chunk * itemsize
    # The gate zarr's open builds for these codecs (asyncflat.storage.gate.gate_for): a filter
    # doubles the bound and makes it inexact there, so it does here too.
    limit, exact = (2 * nbytes, False) if delta else (nbytes, True)
    gate = ChunkGate(path, nbytes, _Compressor(codec, limit, exact), 1 if checksum else 0)
    return LocalArray(path, length, chunk, itemsize, codec, checksum, delta, infix, gate)


def _v2_array(doc: dict[str, Any], path: str, array: str) -> LocalArray | None:
    if doc.get("zarr_format") != 2 or doc.get("order", "C") != "C":
        return None
    dtype = _DTYPES[array][0]
    if doc.get("dtype") != dtype:
        return None
    dims = _one_dimension(doc.get("shape"), doc.get("chunks"))
    if dims is None:
        return None
    filters = doc.get("filters") or []
    delta = False
    if filters:
        # seqax's seq_starts: Delta(dtype="<i8", astype="<i8") (same item size, exact decode)
        if array != "seq_starts" or filters != [{"id": "delta", "dtype": "<i8", "astype": "<i8"}]:
            return None
        delta = True
    compressor = doc.get("compressor")
    if compressor is None:
        codec = "raw"
    elif isinstance(compressor, dict) and compressor.get("id") == "blosc":
        codec = "blosc"
    else:
        return None
    return _array(path, array, dims, codec, False, delta, "")


def _v3_array(doc: dict[str, Any], path: str, array: str) -> LocalArray | None:
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        return None
    if not _extensions_ignorable(doc, _V3_ARRAY_FIELDS):
        return None
    if doc.get("storage_transformers") or doc.get("data_type") != _DTYPES[array][1]:
        return None
    grid = doc.get("chunk_grid")
    if not isinstance(grid, dict) or grid.get("name") != "regular":
        return None
    dims = _one_dimension(doc.get("shape"), (grid.get("configuration") or {}).get("chunk_shape"))
    if dims is None:
        return None
    encoding = doc.get("chunk_key_encoding")
    if not isinstance(encoding, dict):
        return None
    separator = (encoding.get("configuration") or {}).get("separator")
    if encoding.get("name") == "default" and separator in ("/", ".", None):
        infix = f"c{separator or '/'}"
    elif encoding.get("name") == "v2" and separator in ("/", ".", None):
        infix = ""  # one dimension: the key is the index alone
    else:
        return None
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or not codecs or not all(isinstance(c, dict) for c in codecs):
        return None
    names = [c.get("name") for c in codecs]
    if names[0] != "bytes":
        return None
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    if endian != "little":
        return None
    checksum = names[-1] == "crc32c"
    rest = names[1 : len(names) - checksum]
    if rest == []:
        codec = "raw"
    elif rest == ["blosc"]:
        codec = "blosc"
    else:
        return None
    return _array(path, array, dims, codec, checksum, False, infix)
