"""Convert text corpora to flat-tokens datasets: ``asyncflat convert`` as library calls.

The pipeline: documents are read in order from the inputs, cut into batches, tokenized in worker
processes (results are collected in submission order, so the output does not depend on the
number of workers), assigned to a split, and appended through :class:`FlatTokensWriter`, whose
staged commit means a conversion that fails or is killed leaves no store at the output path.

* Inputs (:func:`iter_documents`): ``.txt`` (one document per line, or per file with
  ``txt_mode="file"``), ``.jsonl`` (one JSON object per line, text in ``text_field``) and
  ``.parquet`` (a string column ``text_field``, read with pyarrow); ``.txt.gz`` and ``.jsonl.gz``
  too. A directory stands for the supported files under it, in sorted order.
* Tokenizers (:func:`load_tokenizer`): ``"bytes"`` (UTF-8 bytes, id = byte + 1, so id 0 stays
  free for padding, as seqax's ``bytes_utf8``); a local Hugging Face ``tokenizer.json`` (or a
  directory holding one), via the ``tokenizers`` library; ``"tiktoken:NAME"`` when tiktoken's
  encoding file is already in its local cache. Nothing is ever downloaded.
* Splits: document ``i`` (counting every document read, empty ones included) goes to
  ``validation`` when ``splitmix64(seed, i) / 2**64 < validation_fraction``, else to ``train``:
  deterministic, independent of batching and workers, and stable when the corpus grows at its
  end. Documents that tokenize to nothing are skipped (a flat-tokens sequence has >= 1 token).

The stored ``max_token_id`` is the largest id that occurs in each split (the writer's rule).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import io
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm.auto import tqdm

from .errors import ConfigError
from .format import SPLITS, TOKEN_ID_LIMIT
from .writer import FlatTokensWriter

__all__ = [
    "ConvertReport",
    "Tokenizer",
    "convert_documents",
    "convert_files",
    "convert_texts",
    "iter_documents",
    "load_tokenizer",
    "validation_mask",
]

log = logging.getLogger(__name__)

#: Documents per tokenization task: large enough to amortise inter-process transfer, small
#: enough that a few tasks per worker in flight keep memory bounded.
DOCS_PER_BATCH = 512
#: Input file suffixes, most specific first.
_SUFFIXES = (".txt.gz", ".jsonl.gz", ".txt", ".jsonl", ".parquet")


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class Tokenizer(Protocol):
    """What the converter needs from a tokenizer."""

    #: The spec it was loaded from (re-loaded from it in each worker process).
    spec: str
    #: Ids are in [0, vocab_size).
    vocab_size: int
    #: Whether id 0 is reserved (never an ordinary token): non-packed rows are padded with id 0.
    zero_reserved: bool

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


class BytesTokenizer:
    """UTF-8 bytes, shifted by one: id = byte + 1 (ids 1..256), id 0 reserved."""

    spec = "bytes"
    vocab_size = 257
    zero_reserved = True

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint32) + 1 for t in texts]


class HuggingFaceTokenizer:
    """A local ``tokenizer.json`` loaded with the ``tokenizers`` library (no special tokens added)."""

    def __init__(self, spec: str, path: str) -> None:
        try:
            import tokenizers
        except ImportError as exc:
            raise ConfigError(
                f"tokenizer {spec!r} needs the 'tokenizers' package: pip install 'asyncflat[hf]'"
            ) from exc
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(path)
        except Exception as exc:
            raise ConfigError(f"cannot load tokenizer {path}: {type(exc).__name__}: {exc}") from exc
        self.spec = spec
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        added = self._tokenizer.get_added_tokens_decoder()
        self.zero_reserved = 0 in added and bool(added[0].special)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]


class TiktokenTokenizer:
    """A tiktoken encoding whose files are already cached locally (``encode_ordinary``)."""

    zero_reserved = False

    def __init__(self, spec: str, name: str, path: Path | None = None) -> None:
        try:
            import tiktoken
            import tiktoken.load
        except ImportError as exc:
            raise ConfigError(
                f"tokenizer {spec!r} needs the 'tiktoken' package: pip install 'asyncflat[convert]'"
            ) from exc
        if path is not None:
            self._encoding = _tiktoken_from_file(spec, path)
            self.spec = spec
            self.vocab_size = int(self._encoding.n_vocab)
            return

        original = tiktoken.load.read_file

        def offline_read_file(blobpath: str) -> bytes:
            # tiktoken only calls read_file on a cache miss; a URL there would be a download.
            if "://" in blobpath:
                cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
                raise ConfigError(
                    f"tiktoken encoding {name!r} needs {blobpath}, which is not in tiktoken's cache "
                    f"({'TIKTOKEN_CACHE_DIR=' + cache if cache else 'the default cache directory'}); "
                    "asyncflat never downloads: fetch it once on a machine with network access and "
                    "copy tiktoken's cache (or set TIKTOKEN_CACHE_DIR), or use a local tokenizer.json"
                )
            return original(blobpath)

        tiktoken.load.read_file = offline_read_file
        try:
            self._encoding = tiktoken.get_encoding(name)
        except ConfigError:
            raise
        except ValueError as exc:  # unknown encoding name
            raise ConfigError(f"tokenizer {spec!r}: {exc}") from exc
        finally:
            tiktoken.load.read_file = original
        self.spec = spec
        self.vocab_size = int(self._encoding.n_vocab)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [
            np.asarray(ids, np.uint32) for ids in self._encoding.encode_ordinary_batch(list(texts))
        ]


def _tiktoken_from_file(spec: str, path: Path) -> Any:
    """A local ``NAME.tiktoken`` file of tiktoken's encoding NAME: the ranks from the file, the
    split pattern and special tokens from tiktoken's own definition of NAME (no download)."""
    import tiktoken
    import tiktoken.load
    import tiktoken_ext.openai_public as public

    name = path.name[: -len(".tiktoken")]
    known = sorted(set(public.ENCODING_CONSTRUCTORS) - {"gpt2"})  # gpt2 is not a .tiktoken file
    if name not in known:
        raise ConfigError(
            f"tokenizer {spec!r}: name a .tiktoken file after its encoding ({', '.join(known)}), "
            f"so its split pattern and special tokens are known; got {name!r}"
        )
    if not path.is_file():
        raise ConfigError(f"tokenizer {spec!r}: no such file")
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    except Exception as exc:
        raise ConfigError(f"cannot load tokenizer {path}: {type(exc).__name__}: {exc}") from exc
    original = public.load_tiktoken_bpe
    public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
    try:
        params = public.ENCODING_CONSTRUCTORS[name]()
    finally:
        public.load_tiktoken_bpe = original
    params.pop("explicit_n_vocab", None)
    return tiktoken.Encoding(**params)


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"``, ``"tiktoken:NAME"``, a local ``NAME.tiktoken`` file, or a path to a
    ``tokenizer.json`` (or a directory with one)."""
    if spec == "bytes":
        return BytesTokenizer()
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec, spec.removeprefix("tiktoken:"))
    if spec.endswith(".tiktoken"):
        return TiktokenTokenizer(spec, "", Path(spec))
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"tokenizer must be 'bytes', 'tiktoken:NAME', a local NAME.tiktoken file or a local "
            f"tokenizer.json (or a directory holding one); {spec!r} is none of these (asyncflat "
            "never downloads tokenizers)"
        )
    return HuggingFaceTokenizer(spec, str(path))


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in _SUFFIXES if name.endswith(s)), None)


def _expand(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    files = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p))
            if not found:
                raise ConfigError(f"input directory {path} holds no {', '.join(_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if not _suffix(path):
                raise ConfigError(
                    f"input {path}: unsupported file type (expected one of {', '.join(_SUFFIXES)})"
                )
            files.append(path)
        else:
            raise ConfigError(f"input {path} does not exist")
    return files


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")  # type: ignore[return-value]
    return open(path, encoding="utf-8", newline="")


def _text_value(value: Any, where: str, text_field: str) -> str:
    if value is None:
        return ""  # a null text is an empty document (skipped)
    if not isinstance(value, str):
        raise ConfigError(
            f"{where}: field {text_field!r} is {type(value).__name__}, expected a string"
        )
    return value


def _jsonl_text(line: str, where: str, text_field: str) -> str | None:
    """The document of one ``.jsonl`` line; None for a blank line (not a document)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: invalid JSON: {exc}") from exc
    if not isinstance(record, dict) or text_field not in record:
        raise ConfigError(f"{where}: no field {text_field!r} in this record")
    return _text_value(record[text_field], where, text_field)


def iter_documents(
    inputs: Sequence[str | os.PathLike[str]], *, text_field: str = "text", txt_mode: str = "line"
) -> Iterator[str]:
    """Yield the documents of ``inputs`` in order (see the module docstring for the formats)."""
    if txt_mode not in ("line", "file"):
        raise ConfigError(f"txt_mode must be 'line' or 'file', got {txt_mode!r}")
    for path in _expand(inputs):
        suffix = _suffix(path)
        try:
            if suffix in (".txt", ".txt.gz"):
                with _open_text(path) as f:
                    if txt_mode == "file":
                        yield f.read()
                    else:
                        for line in f:
                            yield line.rstrip("\r\n")
            elif suffix in (".jsonl", ".jsonl.gz"):
                with _open_text(path) as f:
                    for lineno, line in enumerate(f, 1):
                        text = _jsonl_text(line, f"{path}:{lineno}", text_field)
                        if text is not None:
                            yield text
            else:
                yield from _iter_parquet(path, text_field)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not valid UTF-8 text: {exc}") from exc


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(
            f"{path}: reading parquet needs pyarrow: pip install 'asyncflat[convert]'"
        ) from exc
    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise ConfigError(f"{path}: no column {text_field!r} (columns: {', '.join(names)})")
    row = 0
    for batch in parquet.iter_batches(batch_size=4096, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            yield _text_value(value, f"{path} row {row}", text_field)
            row += 1


# --------------------------------------------------------------------------------------------
# Split assignment
# --------------------------------------------------------------------------------------------


def validation_mask(indices: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """True for the document indices that go to ``validation`` (splitmix64 of seed and index)."""
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"validation_fraction must be in [0, 1], got {fraction}")
    with np.errstate(over="ignore"):
        golden = np.uint64(0x9E3779B97F4A7C15)
        x = np.asarray(indices, np.uint64) + np.uint64(seed & (2**64 - 1)) * golden + golden
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    # Compare the top 53 bits with the fraction scaled to them: exact, no float rounding of x.
    return (x >> np.uint64(11)) < np.uint64(int(fraction * 2**53))


# --------------------------------------------------------------------------------------------
# Tokenization, in worker processes
# --------------------------------------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    # Each worker is one core's worth of work: keep the tokenizers library's own thread pool
    # from multiplying that by the number of cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _worker_tokenizer = load_tokenizer(spec)


def _tokenize(tokenizer: Tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``texts``, concatenated (uint32), and their lengths (int64)."""
    seqs = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(s) for s in seqs), np.int64, count=len(seqs))
    ids = np.concatenate(seqs).astype(np.uint32, copy=False) if seqs else np.zeros(0, np.uint32)
    return ids, lengths


def _tokenize_in_worker(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None, "worker initializer did not run"
    return _tokenize(_worker_tokenizer, texts)


def _tokenized_batches(
    tokenizer: Tokenizer, batches: Iterable[list[str]], workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Tokenize ``batches`` in order, with at most ``4 * workers`` batches in flight."""
    if workers <= 1:
        for texts in batches:
            yield _tokenize(tokenizer, texts)
        return
    # spawn, not fork: the parent may run jax and other threads, which fork would break.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer.spec,)) as pool:
        in_flight: collections.deque[Any] = collections.deque()
        for texts in batches:
            in_flight.append(pool.apply_async(_tokenize_in_worker, (texts,)))
            if len(in_flight) >= 4 * workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


# --------------------------------------------------------------------------------------------
# The conversion
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    """What a conversion wrote."""

    output: str
    tokenizer: str
    documents: int
    empty_documents: int
    sequences: dict[str, int]
    tokens: dict[str, int]
    max_token_id: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens.values()) / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tokens_per_s"] = self.tokens_per_s
        return out


def _batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def convert_documents(
    documents: Iterable[tuple[str | None, str]],
    output: str | os.PathLike[str],
    *,
    tokenizer: str | Tokenizer = "bytes",
    validation_fraction: float = 0.01,
    seed: int = 0,
    workers: int = 1,
    zarr_format: int = 3,
    chunk_tokens: int = 1 << 20,
    shard_tokens: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> ConvertReport:
    """Tokenize ``(split, text)`` pairs and write them as a flat-tokens dataset at ``output``.

    ``split`` is ``"train"``, ``"validation"`` or None (assigned by :func:`validation_mask`
    from the document's index). The other arguments are those of :func:`convert_texts`.
    """
    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if tok.vocab_size > TOKEN_ID_LIMIT:
        raise ConfigError(f"tokenizer {tok.spec!r} has {tok.vocab_size} ids, over the 2**31 limit")
    if not tok.zero_reserved:
        log.warning(
            "tokenizer %s uses id 0 for an ordinary token; flat-tokens loaders pad non-packed rows "
            "with id 0, so padding will look like that token",
            tok.spec,
        )
    validation_mask(np.zeros(0), validation_fraction, seed)  # validate the fraction up front
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"workers must be an integer >= 0, got {workers!r}")

    counts = {"documents": 0, "empty": 0}
    sequences = dict.fromkeys(SPLITS, 0)
    tokens = dict.fromkeys(SPLITS, 0)
    max_id = 0
    batch_splits: collections.deque[list[str | None]] = collections.deque()

    def texts_only() -> Iterator[list[str]]:
        # Batches go to the workers as bare texts; their splits wait here, in order.
        for batch in _batched(documents, DOCS_PER_BATCH):
            splits = [s for s, _ in batch]
            for split in splits:
                if split is not None and split not in SPLITS:
                    raise ConfigError(f"split must be one of {SPLITS} or None, got {split!r}")
            batch_splits.append(splits)
            yield [text for _, text in batch]

    bar = tqdm(unit=" docs", desc="convert", disable=not progress, dynamic_ncols=True)
    try:
        with FlatTokensWriter(
            output,
            zarr_format=zarr_format,
            chunk_tokens=chunk_tokens,
            shard_tokens=shard_tokens,
            overwrite=overwrite,
        ) as writer:
            for ids, lengths in _tokenized_batches(tok, texts_only(), workers):
                splits = batch_splits.popleft()
                first = counts["documents"]
                counts["documents"] += len(lengths)
                indices = np.arange(first, first + len(lengths))
                is_val = validation_mask(indices, validation_fraction, seed)
                seqs = np.split(ids, np.cumsum(lengths)[:-1])
                chosen: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
                for seq, forced, val in zip(seqs, splits, is_val.tolist()):
                    if not seq.size:
                        counts["empty"] += 1
                        continue
                    chosen[forced or ("validation" if val else "train")].append(seq)
                if ids.size:
                    max_id = max(max_id, int(ids.max()))
                for split, split_seqs in chosen.items():
                    if split_seqs:
                        writer.append(split, split_seqs)
                        sequences[split] += len(split_seqs)
                        tokens[split] += sum(s.size for s in split_seqs)
                bar.update(len(lengths))
                bar.set_postfix(tokens=sum(tokens.values()), refresh=False)
    finally:
        bar.close()
    report = ConvertReport(
        output=os.path.abspath(os.fspath(output)),
        tokenizer=tok.spec,
        documents=counts["documents"],
        empty_documents=counts["empty"],
        sequences=sequences,
        tokens=tokens,
        max_token_id=max_id,
        seconds=time.perf_counter() - t0,
    )
    log.info(
        "converted %d documents (%d empty, skipped) to %s: %s tokens, %.0f tokens/s",
        report.documents,
        report.empty_documents,
        report.output,
        report.tokens,
        report.tokens_per_s,
    )
    return report


def convert_texts(
    texts: Iterable[str],
    output: str | os.PathLike[str],
    *,
    tokenizer: str | Tokenizer = "bytes",
    validation_fraction: float = 0.01,
    seed: int = 0,
    workers: int = 1,
    zarr_format: int = 3,
    chunk_tokens: int = 1 << 20,
    shard_tokens: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> ConvertReport:
    """Tokenize ``texts`` (documents, in order) and write them as a flat-tokens dataset.

    * ``tokenizer``: see :func:`load_tokenizer`.
    * ``validation_fraction`` / ``seed``: which documents go to ``validation`` (module docstring).
    * ``workers``: tokenizer processes; 0 or 1 tokenizes in this process. The output is the same
      for every value.
    * ``zarr_format``, ``chunk_tokens``, ``shard_tokens``, ``overwrite``: as
      :class:`FlatTokensWriter` (match ``chunk_tokens`` to the loader's read block).

    Nothing appears at ``output`` unless the whole conversion succeeds.
    """
    return convert_documents(
        ((None, text) for text in texts),
        output,
        tokenizer=tokenizer,
        validation_fraction=validation_fraction,
        seed=seed,
        workers=workers,
        zarr_format=zarr_format,
        chunk_tokens=chunk_tokens,
        shard_tokens=shard_tokens,
        overwrite=overwrite,
        progress=progress,
    )


def convert_files(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    text_field: str = "text",
    txt_mode: str = "line",
    **options: Any,
) -> ConvertReport:
    """Convert ``.txt`` / ``.jsonl`` / ``.parquet`` files (see :func:`iter_documents`); the other
    keyword arguments are those of :func:`convert_texts`."""
    _expand(inputs)  # fail on a missing or unsupported input before creating anything
    return convert_texts(
        iter_documents(inputs, text_field=text_field, txt_mode=txt_mode), output, **options
    )
