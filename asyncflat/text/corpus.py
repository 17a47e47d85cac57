"""Reading text corpora: which files an input names, and the documents in each, in order.

* Inputs (:func:`expand_inputs`): ``.txt``, ``.jsonl``, ``.parquet``, ``.txt.gz``, ``.jsonl.gz``
  files, or directories standing for the supported files under them in sorted order. A symlink
  under a directory that resolves outside it is skipped with a warning unless
  ``follow_symlinks``: a corpus from elsewhere must not pull in files from the rest of the machine.
* Documents (:func:`iter_file_documents`, :func:`iter_documents`): ``.txt`` gives one document
  per line (or per file with ``txt_mode="file"``), ``.jsonl`` one JSON object per line with the
  text in ``text_field``, ``.parquet`` the string column ``text_field``.
* Every document is bounded by ``max_document_bytes`` *while it is read*: a line is read at most
  that long, so a gzip member that inflates to one 4 GiB line costs that bound, not 4 GiB; a
  longer document is a :class:`ConfigError` naming the file and line.

These are plain functions over one file each, so a distributed converter can read a unit of
work (a file) in a task with exactly the single-machine semantics.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import gzip
import io
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from asyncflat.errors import ConfigError

__all__ = [
    "DEFAULT_MAX_DOCUMENT_BYTES",
    "MAX_DOCUMENT_BYTES_LIMIT",
    "SUFFIXES",
    "InputProgress",
    "check_document_size",
    "expand_inputs",
    "iter_documents",
    "iter_file_documents",
    "iter_parquet_documents",
    "iter_range_documents",
]

log = logging.getLogger(__name__)

#: Input file suffixes, most specific first.
SUFFIXES = (".txt.gz", ".jsonl.gz", ".txt", ".jsonl", ".parquet")
#: The default bound on one document's UTF-8 size: a long book is a few MiB, and a document
#: is tokenized whole in memory (several times its size for a Hugging Face tokenizer).
DEFAULT_MAX_DOCUMENT_BYTES = 16 << 20
#: The largest ``max_document_bytes`` accepted (1 TiB): a line is read with a bound derived from
#: it, which must stay a C ``ssize_t``.
MAX_DOCUMENT_BYTES_LIMIT = 1 << 40
#: A ``.jsonl`` line may be this many times ``max_document_bytes`` (plus 1 MiB): JSON escapes
#: (``\\u00e9``) make the record longer than its text.
_JSON_RECORD_FACTOR = 4
#: Lines between progress updates (``tell()`` is a system call).
_PROGRESS_LINES = 1024
#: Rows per parquet batch read.
_PARQUET_BATCH_ROWS = 1024


@dataclasses.dataclass
class InputProgress:
    """Bytes of the input files read so far (compressed bytes for ``.gz``), for a progress bar."""

    total: int = 0
    done: int = 0


def file_suffix(path: Path) -> str | None:
    """The supported suffix of ``path`` (``.txt.gz`` before ``.txt``), or None."""
    name = path.name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def expand_inputs(
    inputs: Sequence[str | os.PathLike[str]], *, follow_symlinks: bool = False
) -> list[Path]:
    """The files ``inputs`` stand for, in order; a missing or unsupported input is an error."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = _walk(path, follow_symlinks)
            if not found:
                raise ConfigError(f"input directory {path} holds no {', '.join(SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if not file_suffix(path):
                raise ConfigError(
                    f"input {path}: unsupported file type (expected one of {', '.join(SUFFIXES)})"
                )
            files.append(path)
        elif path.exists():
            raise ConfigError(f"input {path} is not a regular file or a directory")
        else:
            raise ConfigError(f"input {path} does not exist")
    _warn_repeated(files)
    return files


def _warn_repeated(files: list[Path]) -> None:
    """One warning for each file that the inputs name more than once (given twice, inside a
    directory also given, or a symlink to it): its documents are read each time, as given."""
    first: dict[str, Path] = {}
    for path in files:
        real = os.path.realpath(path)
        if real in first:
            log.warning(
                "input %s is %s again: its documents are read twice (as the inputs say)",
                path,
                first[real],
            )
        else:
            first[real] = path


def _walk(root: Path, follow_symlinks: bool) -> list[Path]:
    """Supported regular files under ``root``, sorted; see the module docstring for symlinks."""
    real_root = os.path.realpath(root)
    seen_dirs = {real_root}
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_symlinks):
        kept = []
        for name in sorted(dirnames):  # sorted: which alias of a directory is walked is fixed
            link = Path(dirpath, name)
            if link.is_symlink() and not follow_symlinks:
                if not _inside(link, real_root):
                    _warn_outside(link, root)
                continue  # not walked: it must not claim its target in seen_dirs
            real = os.path.realpath(link)
            if real not in seen_dirs:  # a symlink cycle is walked once
                seen_dirs.add(real)
                kept.append(name)
        dirnames[:] = kept
        for name in filenames:
            path = Path(dirpath, name)
            if not file_suffix(path) or not path.is_file():  # FIFOs, devices, dangling links
                continue
            if path.is_symlink() and not follow_symlinks and not _inside(path, real_root):
                _warn_outside(path, root)
                continue
            found.append(path)
    return sorted(found)


def _warn_outside(link: Path, root: Path) -> None:
    log.warning(
        "skipping %s: a symlink to %s, outside the input directory %s "
        "(--follow-symlinks / follow_symlinks=True reads it)",
        link,
        os.path.realpath(link),
        root,
    )


def _inside(path: Path, real_root: str) -> bool:
    real = os.path.realpath(path)
    return os.path.commonpath([real, real_root]) == real_root


def _open_text(
    path: Path, raw: io.BufferedIOBase | None = None, *, at_start: bool = True
) -> io.TextIOBase:
    """``path`` (or its already open ``raw`` bytes, which the caller closes) as UTF-8 text,
    gunzipped for ``.gz``; lines split as Python's universal newlines. A byte-order mark at the
    file's start (``at_start``: these bytes begin the file) is no text: it is dropped, so both
    engines read a file alike however it is split."""
    binary: Any
    if raw is None:
        binary = _open_binary(path)
    else:
        gz = path.name.lower().endswith(".gz")
        binary = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
    return io.TextIOWrapper(binary, encoding="utf-8-sig" if at_start else "utf-8", newline="")


def _open_binary(path: Path) -> Any:
    """``path``'s bytes, gunzipped for ``.gz``."""
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def check_document_size(text: str, limit: int, where: str, what: str = "document") -> None:
    """Raise ConfigError when ``text`` is over ``limit`` bytes of UTF-8 (cheap for short texts)."""
    if len(text) * 4 <= limit:  # a character is at most 4 bytes
        return
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        bound = "max_document_bytes" if what == "document" else "the JSON record bound"
        raise ConfigError(
            f"{where}: {what} of at least {size:,} bytes is over {bound} "
            f"({limit:,}; set by max_document_bytes, --max-document-bytes on the command line)"
        )


def _read_bounded(f: io.TextIOBase, most: int) -> str:
    """Up to ``most`` characters of ``f``, read a MiB at a time: one ``read(most)`` allocates
    ``most`` bytes at once (a ``MemoryError`` for a generous bound on a small file)."""
    parts: list[str] = []
    left = most
    while left > 0:
        part = f.read(min(1 << 20, left))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return "".join(parts)


def json_record_limit(max_document_bytes: int) -> int:
    """The longest ``.jsonl`` line read: room for JSON escapes of the text and other fields."""
    return _JSON_RECORD_FACTOR * max_document_bytes + (1 << 20)


def _bounded_lines(
    f: io.TextIOBase, limit: int, name: Callable[[int], str], what: str = "document"
) -> Iterator[tuple[int, str]]:
    """``(line number, line without its ending)``, reading no line longer than ``limit``;
    ``name(lineno)`` is where an error says the line is."""
    lineno = 0
    while True:
        line = f.readline(limit + 3)  # the document, its line ending, and one more
        if not line:
            return
        lineno += 1
        text = line.rstrip("\r\n")
        if len(text) * 4 > limit:  # the cheap test first: this runs for every line
            check_document_size(text, limit, name(lineno), what)
        yield lineno, text


def _text_value(value: Any, where: str, text_field: str) -> str:
    if value is None:
        return ""  # a null text is an empty document (skipped)
    if not isinstance(value, str):
        raise ConfigError(
            f"{where}: field {text_field!r} is {type(value).__name__}, expected a string"
        )
    return value


def _json_text(line: str, where: Callable[[], str], text_field: str) -> str:
    """The text of one ``.jsonl`` record; ``where()`` names it in an error (only then called:
    naming a line of a byte range counts the lines before it)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where()}: invalid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:  # an integer of 4,300+ digits, deep nesting
        raise ConfigError(
            f"{where()}: JSON record not readable: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(record, dict):
        raise ConfigError(
            f"{where()}: expected a JSON object with field {text_field!r}, "
            f"got a {type(record).__name__}"
        )
    if text_field not in record:
        present = ", ".join(repr(k) for k in list(record)[:20]) or "none"
        raise ConfigError(
            f"{where()}: no field {text_field!r} in this record (fields: {present}); "
            "choose one with text_field / --text-field"
        )
    value = record[text_field]
    if not isinstance(value, str):
        return _text_value(value, where(), text_field)
    if "\\u" in line and not value.isascii():  # only a JSON escape makes a lone surrogate
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(
                f"{where()}: field {text_field!r} holds a lone surrogate "
                f"({value[exc.start]!r}, a \\u escape of half a UTF-16 pair): not text"
            ) from None
    return value


def iter_file_documents(
    path: str | os.PathLike[str],
    *,
    text_field: str = "text",
    txt_mode: str = "line",
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    progress: InputProgress | None = None,
) -> Iterator[str]:
    """Yield the documents of one input file in order (see the module docstring)."""
    if txt_mode not in ("line", "file"):
        raise ConfigError(f"txt_mode must be 'line' or 'file', got {txt_mode!r}")
    path = Path(path)
    suffix = file_suffix(path)
    if suffix is None:
        raise ConfigError(f"input {path}: unsupported file type (expected one of {SUFFIXES})")
    if suffix == ".parquet":
        yield from iter_parquet_documents(
            path, text_field=text_field, max_document_bytes=max_document_bytes
        )
        if progress is not None:
            progress.done += path.stat().st_size
        return
    with open(path, "rb") as raw:
        start = progress.done if progress is not None else 0

        def tick() -> None:
            if progress is not None:
                progress.done = start + raw.tell()

        yield from _text_documents(
            path,
            _open_text(path, raw),
            suffix,
            text_field,
            txt_mode,
            max_document_bytes,
            lambda lineno: f"{path}:{lineno}",
            tick,
            lambda: _open_binary(path),
        )
        if progress is not None:
            progress.done = start + path.stat().st_size


def iter_range_documents(
    path: str | os.PathLike[str],
    start: int,
    end: int,
    *,
    text_field: str = "text",
    txt_mode: str = "line",
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
) -> Iterator[str]:
    """Yield the documents of bytes ``[start, end)`` of an uncompressed ``.txt`` / ``.jsonl``
    file, with exactly :func:`iter_file_documents`' rules; ``start`` must begin a line (0, or
    just after a ``\\n``). Errors name the line of the file, counted from its start.

    Concatenating the documents of consecutive ranges that cover a file gives the file's."""
    if txt_mode not in ("line", "file"):
        raise ConfigError(f"txt_mode must be 'line' or 'file', got {txt_mode!r}")
    path = Path(path)
    suffix = file_suffix(path)
    if suffix not in (".txt", ".jsonl"):
        raise ConfigError(f"input {path}: a byte range needs an uncompressed .txt or .jsonl file")
    if not 0 <= start <= end:
        raise ConfigError(f"input {path}: invalid byte range [{start}, {end})")
    with open(path, "rb") as raw:
        before: list[int] = []

        def name(lineno: int) -> str:
            if not before:  # counted only for an error message
                before.append(_count_lines(path, start))
            return f"{path}:{before[0] + lineno}"

        raw.seek(start)
        text = _open_text(path, io.BufferedReader(_ByteRange(raw, end - start)), at_start=not start)

        def reopen() -> io.BufferedIOBase:
            again = open(path, "rb")
            again.seek(start)
            return io.BufferedReader(_ByteRange(again, end - start, owned=True))

        yield from _text_documents(
            path, text, suffix, text_field, txt_mode, max_document_bytes, name, None, reopen
        )


def _text_documents(
    path: Path,
    f: io.TextIOBase,
    suffix: str,
    text_field: str,
    txt_mode: str,
    max_document_bytes: int,
    name: Callable[[int], str],
    tick: Callable[[], None] | None,
    reopen: Callable[[], Any],
) -> Iterator[str]:
    """The documents of an open ``.txt`` / ``.jsonl`` text stream (closed afterwards);
    ``reopen()`` gives its bytes again from the start, to find the line of invalid UTF-8."""
    try:
        with f:
            if txt_mode == "file" and suffix in (".txt", ".txt.gz"):
                text = _read_bounded(f, max_document_bytes + 1)
                check_document_size(text, max_document_bytes, str(path))
                yield text
            elif suffix in (".txt", ".txt.gz"):
                for lineno, text in _bounded_lines(f, max_document_bytes, name):
                    if tick is not None and not lineno % _PROGRESS_LINES:
                        tick()
                    yield text
            else:
                record_limit = json_record_limit(max_document_bytes)
                for lineno, line in _bounded_lines(f, record_limit, name, "JSON record"):
                    if tick is not None and not lineno % _PROGRESS_LINES:
                        tick()
                    if line.strip():
                        text = _json_text(line, lambda: name(lineno), text_field)  # noqa: B023
                        if len(text) * 4 > max_document_bytes:
                            check_document_size(text, max_document_bytes, name(lineno))
                        yield text
    except UnicodeDecodeError as exc:
        # exc's position is in the decoder's last block: name the line from the bytes instead
        try:
            with contextlib.closing(reopen()) as again:
                lineno = _invalid_utf8_line(again)
        except (gzip.BadGzipFile, EOFError, zlib.error) as bad:  # damaged past the bad byte
            raise ConfigError(f"{path}: not a valid gzip file: {bad}") from None
        byte = exc.object[exc.start : exc.start + 1]
        raise ConfigError(
            f"{name(lineno)}: not valid UTF-8 text: {exc.reason} ({byte!r})"
        ) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # zlib: a corrupt deflate stream
        raise ConfigError(f"{path}: not a valid gzip file: {exc}") from None


def _invalid_utf8_line(binary: Any) -> int:
    """The line (from 1, universal newlines) of the first byte of ``binary`` that is not UTF-8."""
    lines, pending, carried_cr = 1, b"", False
    while True:
        block = binary.read(1 << 20)
        data = pending + block
        try:
            used, bad = codecs.utf_8_decode(data, "strict", not block)[1], False
        except UnicodeDecodeError as exc:
            used, bad = exc.start, True
        good = data[:used]
        lines += _line_endings(good, carried_cr)
        if good:
            carried_cr = good.endswith(b"\r")
        if bad or not block:
            return lines
        pending = data[used:]


class _ByteRange(io.RawIOBase):
    """The next ``size`` bytes of an open binary file, as a stream of their own (the file
    itself is left open, unless ``owned``)."""

    def __init__(self, raw: io.BufferedIOBase, size: int, *, owned: bool = False) -> None:
        self._raw = raw
        self._left = size
        self._owned = owned

    def close(self) -> None:
        if self._owned:
            self._raw.close()
        super().close()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._left)
        if n <= 0:
            return 0
        got = self._raw.readinto(memoryview(buffer).cast("B")[:n])
        self._left -= got
        return got


def _line_endings(block: bytes, after_cr: bool) -> int:
    """Universal line endings in ``block`` (``\\n``, ``\\r\\n``, a lone ``\\r``); ``after_cr``:
    the bytes before it ended in ``\\r`` (a ``\\r\\n`` split between them counts once, as
    its ``\\r``)."""
    split_crlf = after_cr and block.startswith(b"\n")
    return block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n") - split_crlf


def _count_lines(path: Path, end: int) -> int:
    """Lines in bytes ``[0, end)`` of ``raw`` split as universal newlines (``\\n``, ``\\r\\n``,
    a lone ``\\r``), ``end`` being just after a line ending; read in blocks, never whole lines."""
    lines = 0
    left = end
    carried_cr = False
    with open(path, "rb") as raw:
        while left > 0:
            block = raw.read(min(left, 1 << 20))
            if not block:
                break
            left -= len(block)
            lines += _line_endings(block, carried_cr)
            carried_cr = block.endswith(b"\r")
    return lines


def iter_documents(
    inputs: Sequence[str | os.PathLike[str]],
    *,
    text_field: str = "text",
    txt_mode: str = "line",
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    follow_symlinks: bool = False,
    progress: InputProgress | None = None,
) -> Iterator[str]:
    """Yield the documents of ``inputs`` in order (see the module docstring for the formats).

    With ``progress``, its ``total`` is set to the input files' size and ``done`` advances as
    they are read.
    """
    if txt_mode not in ("line", "file"):
        raise ConfigError(f"txt_mode must be 'line' or 'file', got {txt_mode!r}")
    check_max_document_bytes(max_document_bytes)
    files = expand_inputs(inputs, follow_symlinks=follow_symlinks)
    if progress is not None:
        progress.total = sum(p.stat().st_size for p in files)
    for path in files:
        yield from iter_file_documents(
            path,
            text_field=text_field,
            txt_mode=txt_mode,
            max_document_bytes=max_document_bytes,
            progress=progress,
        )


def check_max_document_bytes(value: Any) -> int:
    """``value`` as a valid ``max_document_bytes`` (an integer in [1, 2**40]), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"max_document_bytes must be an integer >= 1, got {value!r}")
    if value > MAX_DOCUMENT_BYTES_LIMIT:
        raise ConfigError(f"max_document_bytes must be at most 2**40, got {value!r}")
    return value


def open_parquet(path: Path, text_field: str) -> Any:
    """A ``pyarrow.parquet.ParquetFile`` that has a ``text_field`` column, or a clear error."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(
            f"{path}: reading parquet needs pyarrow: pip install 'asyncflat[convert]'"
        ) from exc
    try:
        parquet = pq.ParquetFile(path)
    except (ValueError, OSError) as exc:  # ArrowInvalid (a ValueError), ArrowIOError (OSError)
        raise _unreadable_parquet(path, exc) from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise ConfigError(f"{path}: no column {text_field!r} (columns: {', '.join(names)})")
    return parquet


def _unreadable_parquet(path: Path, exc: Exception) -> ConfigError:
    return ConfigError(f"{path}: not a readable parquet file: {type(exc).__name__}: {exc}")


def iter_parquet_documents(
    path: str | os.PathLike[str],
    *,
    text_field: str = "text",
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    row_group: int | None = None,
) -> Iterator[str]:
    """Yield the documents of a ``.parquet`` file, or of one of its row groups, with exactly
    :func:`iter_file_documents`' rules (errors name the row of the file)."""
    path = Path(path)
    parquet = open_parquet(path, text_field)
    row = 0
    groups = None
    if row_group is not None:
        meta = parquet.metadata
        if not 0 <= row_group < meta.num_row_groups:
            raise ConfigError(f"{path}: no row group {row_group}")
        row = sum(meta.row_group(i).num_rows for i in range(row_group))
        groups = [row_group]
    batches = parquet.iter_batches(
        batch_size=_PARQUET_BATCH_ROWS, row_groups=groups, columns=[text_field]
    )
    while True:
        try:  # a damaged page: ArrowInvalid, OSError, or bytes that are not UTF-8
            batch = next(batches, None)
            values = [] if batch is None else batch.column(0).to_pylist()
        except (ValueError, OSError) as exc:
            raise _unreadable_parquet(path, exc) from None
        if batch is None:
            return
        for value in values:
            where = f"{path} row {row}"
            text = _text_value(value, where, text_field)
            check_document_size(text, max_document_bytes, where)
            yield text
            row += 1
