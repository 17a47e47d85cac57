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

from asyncflat.format.codec import MANY_CHUNKS, MIN_CHUNK_ELEMENTS, SPLITS, TOKEN_ID_LIMIT
from asyncflat.storage.gate import METADATA_MAX_BYTES, ChunkGate, Compressor
from asyncflat.storage.local_files import read_object

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

#: c-blosc's largest buffer (BLOSC_MAX_BUFFERSIZE): a bigger chunk is no plain one (zarr's open
#: then reports it), and its buffers are never allocated here.
_MAX_CHUNK_BYTES = 2**31 - 16
#: What zarr 3's Blosc codec accepts (zarr.codecs.blosc); numcodecs' keywords for zarr 2.
_V3_BLOSC_FIELDS = frozenset({"typesize", "cname", "clevel", "shuffle", "blocksize"})
_V3_BLOSC_CNAMES = frozenset({"lz4", "lz4hc", "blosclz", "snappy", "zlib", "zstd"})
_V3_BLOSC_SHUFFLES = frozenset({"noshuffle", "shuffle", "bitshuffle"})
_V2_BLOSC_FIELDS = frozenset({"id", "cname", "clevel", "shuffle", "blocksize", "typesize"})
#: The configuration keys of each zarr 3 codec this reader reads (crc32c has none).
_V3_CODEC_FIELDS = {"bytes": frozenset({"endian"}), "blosc": _V3_BLOSC_FIELDS}

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
    top = _document(root, "zarr.json", name)
    if top is not None:
        zarr_format = 3
        group = _document(root, f"{split}/zarr.json", name)
        if not (_v3_group(top) and group is not None and _v3_group(group)):
            return None
        attributes = group.get("attributes", {})
    elif (top := _document(root, ".zgroup", name)) is not None:
        zarr_format = 2
        group = _document(root, f"{split}/.zgroup", name)
        if not (_v2_group(top) and group is not None and _v2_group(group)):
            return None
        if os.path.lexists(os.path.join(root, split, ".zarray")):
            return None  # both an array and a group: zarr decides what it is
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
    """The rule zarr's open applies too (see :data:`~asyncflat.format.split.MANY_CHUNKS`), and no
    chunk bigger than a Blosc buffer (a chunk's buffer is allocated before its object is read)."""
    count = -(-array.length // array.chunk)
    if array.chunk_nbytes > _MAX_CHUNK_BYTES:
        return False
    return not (count > MANY_CHUNKS and array.chunk < MIN_CHUNK_ELEMENTS)


def _v3_group(doc: dict[str, Any]) -> bool:
    """A zarr 3 group document this reader may trust: no consolidated metadata (zarr's open may
    read the arrays' documents from there, which can disagree with theirs: zarr decides)."""
    return (
        doc.get("zarr_format") == 3
        and doc.get("node_type") == "group"
        and doc.get("consolidated_metadata") is None
        and isinstance(doc.get("attributes", {}), dict)
        and _extensions_ignorable(doc, _V3_GROUP_FIELDS)
    )


def _v2_group(doc: dict[str, Any]) -> bool:
    return doc == {"zarr_format": 2}


def _int(value: Any, low: int, high: int | None = None) -> bool:
    """``value`` is a JSON integer (not a bool) in ``[low, high]``."""
    return type(value) is int and value >= low and (high is None or value <= high)


def _fill_value_ok(value: Any, itemsize: int) -> bool:
    """An integer fill value the dtype holds (never used: missing chunks are refused)."""
    return _int(value, 0, 2 ** (8 * itemsize) - 1)


def _configuration(codec: dict[str, Any], fields: frozenset[str]) -> dict[str, Any] | None:
    """A zarr 3 named object's configuration (absent: empty), None unless a dict of ``fields``."""
    if not set(codec) <= {"name", "configuration"}:
        return None
    config = codec.get("configuration", {})
    if not isinstance(config, dict) or not set(config) <= fields:
        return None
    return config


def _v3_blosc_ok(config: dict[str, Any]) -> bool:
    return (
        config.get("cname", "zstd") in _V3_BLOSC_CNAMES
        and config.get("shuffle", "noshuffle") in _V3_BLOSC_SHUFFLES
        and _int(config.get("typesize", 1), 1)
        and _int(config.get("clevel", 5), 0, 9)
        and _int(config.get("blocksize", 0), 0)
    )


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
    gate = ChunkGate(path, nbytes, Compressor(codec, limit, exact), 1 if checksum else 0)
    return LocalArray(path, length, chunk, itemsize, codec, checksum, delta, infix, gate)


def _v2_array(doc: dict[str, Any], path: str, array: str) -> LocalArray | None:
    if doc.get("zarr_format") != 2 or doc.get("order") != "C":
        return None
    dtype = _DTYPES[array][0]
    if doc.get("dtype") != dtype or doc.get("dimension_separator", ".") not in (".", "/", None):
        return None
    fill_value = doc.get("fill_value", ...)  # required; null or a value of the dtype
    if fill_value is not None and not _fill_value_ok(fill_value, _DTYPES[array][2]):
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
    elif (
        isinstance(compressor, dict)
        and compressor.get("id") == "blosc"
        and set(compressor) <= _V2_BLOSC_FIELDS
    ):
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
    if not _fill_value_ok(doc.get("fill_value"), _DTYPES[array][2]):
        return None
    dimension_names = doc.get("dimension_names")
    if dimension_names is not None and not (
        isinstance(dimension_names, list)
        and len(dimension_names) == 1
        and (dimension_names[0] is None or isinstance(dimension_names[0], str))
    ):
        return None
    grid = doc.get("chunk_grid")
    if not isinstance(grid, dict) or grid.get("name") != "regular":
        return None
    grid_config = _configuration(grid, frozenset({"chunk_shape"}))
    if grid_config is None:
        return None
    dims = _one_dimension(doc.get("shape"), grid_config.get("chunk_shape"))
    if dims is None:
        return None
    encoding = doc.get("chunk_key_encoding")
    if not isinstance(encoding, dict):
        return None
    encoding_config = _configuration(encoding, frozenset({"separator"}))
    if encoding_config is None:
        return None
    separator = encoding_config.get("separator", ...)  # absent: the encoding's default
    if encoding.get("name") == "default" and separator in ("/", ".", ...):
        infix = "c." if separator == "." else "c/"
    elif encoding.get("name") == "v2" and separator in ("/", ".", ...):
        infix = ""  # one dimension: the key is the index alone
    else:
        return None
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or not codecs or not all(isinstance(c, dict) for c in codecs):
        return None
    names = [c.get("name") for c in codecs]
    configs = []
    for codec_doc, codec_name in zip(codecs, names):
        config = _configuration(codec_doc, _V3_CODEC_FIELDS.get(codec_name, frozenset()))
        if config is None:
            return None
        configs.append(config)
    if names[0] != "bytes" or configs[0].get("endian", "little") != "little":
        return None
    checksum = names[-1] == "crc32c"
    rest = names[1 : len(names) - checksum]
    if rest == []:
        codec = "raw"
    elif rest == ["blosc"] and _v3_blosc_ok(configs[1]):
        codec = "blosc"
    else:
        return None
    return _array(path, array, dims, codec, checksum, False, infix)
