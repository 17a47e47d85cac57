"""Convert text corpora to flat-tokens datasets: ``asyncflat convert`` as library calls.

The pipeline: documents are read in order from the inputs (:mod:`asyncflat.text.corpus`), cut into
batches, tokenized in worker processes (:mod:`asyncflat.text.tokenizer`; results are collected in
submission order, so the output does not depend on the number of workers), assigned to a split,
and appended through :class:`FlatTokensWriter`, whose staged commit means a conversion that
fails or is killed leaves no dataset at the output (a local path or any fsspec URL).

* Inputs (:func:`iter_documents`): ``.txt`` (one document per line, or per file with
  ``txt_mode="file"``), ``.jsonl`` (one JSON object per line, text in ``text_field``) and
  ``.parquet`` (a string column ``text_field``, read with pyarrow); ``.txt.gz`` and ``.jsonl.gz``
  too. A directory stands for the supported files under it, in sorted order; symlinks leading
  out of it are skipped unless ``follow_symlinks``. No document may exceed
  ``max_document_bytes`` (checked while reading).
* Tokenizers (:func:`load_tokenizer`): ``"bytes"`` (UTF-8 bytes, id = byte + 1, so id 0 stays
  free for padding, as seqax's ``bytes_utf8``); a local Hugging Face ``tokenizer.json`` (or a
  directory holding one), via the ``tokenizers`` library; ``"tiktoken:NAME"`` when tiktoken's
  encoding file is already in its local cache, or a local ``.tiktoken`` file. Nothing is ever
  downloaded. A tokenizer failure in any worker is a :class:`TokenizerError`; the workers are
  stopped and the partial output removed.
* Splits: document ``i`` (counting every document read, empty ones included) goes to
  ``validation`` when ``splitmix64(seed, i) / 2**64 < validation_fraction``, else to ``train``:
  deterministic, independent of batching and workers, and stable when the corpus grows at its
  end. Documents that tokenize to nothing are skipped (a flat-tokens sequence has >= 1 token).

The stored ``max_token_id`` is the largest id that occurs in each split (the writer's rule).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from asyncflat.errors import ConfigError
from asyncflat.format.codec import SPLITS
from asyncflat.text.corpus import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    InputProgress,
    check_document_size,
    check_max_document_bytes,
    expand_inputs,
    iter_documents,
    iter_file_documents,
)
from asyncflat.text.pool import tokenized_batches
from asyncflat.text.tokenizer import (  # the tokenizer classes are re-exported for existing callers
    BytesTokenizer,
    HuggingFaceTokenizer,
    TiktokenFileTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerError,
    check_tokenizer,
    load_tokenizer,
    tokenize_batch,
)
from asyncflat.writer.flat_tokens import FlatTokensWriter

__all__ = [
    "DEFAULT_MAX_DOCUMENT_BYTES",
    "BytesTokenizer",
    "ConvertReport",
    "HuggingFaceTokenizer",
    "TiktokenFileTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
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
#: Characters per tokenization task at most (a batch ends at whichever bound comes first), so
#: a batch of long documents does not multiply the per-document bound by 512.
CHARS_PER_BATCH = 8 << 20
#: A split with fewer sequences than this is reported as tiny.
_TINY_SEQUENCES = 16


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


def _tokenize(
    tokenizer: Tokenizer, texts: Sequence[str], first: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``texts``, concatenated (uint32), and their lengths (int64)."""
    return tokenize_batch(tokenizer, texts, first)


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


def _batched(items: Iterable[Any], size: int, chars: int = CHARS_PER_BATCH) -> Iterator[list[Any]]:
    """``(split, text)`` items in lists of at most ``size`` items and about ``chars`` characters."""
    batch: list[Any] = []
    batch_chars = 0
    for item in items:
        batch.append(item)
        batch_chars += len(item[1])
        if len(batch) == size or batch_chars >= chars:
            yield batch
            batch, batch_chars = [], 0
    if batch:
        yield batch


def _check_options(tok: Tokenizer, validation_fraction: float, workers: Any) -> None:
    check_tokenizer(tok)
    validation_mask(np.zeros(0), validation_fraction, seed=0)  # validate the fraction up front
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"workers must be an integer >= 0, got {workers!r}")


def _warn_small_splits(report: ConvertReport, chunk_tokens: int, fraction: float) -> None:
    """A split that is empty or tiny is almost always a mistake; say so, with the figures."""
    for split in SPLITS:
        sequences, tokens = report.sequences[split], report.tokens[split]
        if sequences == 0:
            log.warning(
                "split %r of %s is empty (%d documents, validation_fraction=%g): a loader "
                "cannot read it; adjust --validation-fraction",
                split,
                report.output,
                report.documents,
                fraction,
            )
        elif sequences < _TINY_SEQUENCES or tokens < chunk_tokens:
            log.warning(
                "split %r of %s is tiny: %d sequences, %d tokens (a loader reading blocks "
                "of one %d-token chunk may get no full block from it); adjust "
                "--validation-fraction or add data",
                split,
                report.output,
                sequences,
                tokens,
                chunk_tokens,
            )


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
    storage_options: Mapping[str, Any] | None = None,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    input_progress: InputProgress | None = None,
) -> ConvertReport:
    """Tokenize ``(split, text)`` pairs and write them as a flat-tokens dataset at ``output``.

    ``split`` is ``"train"``, ``"validation"`` or None (assigned by :func:`validation_mask`
    from the document's index). The other arguments are those of :func:`convert_texts`;
    ``input_progress`` (filled by :func:`iter_documents`) makes the progress bar count input
    bytes towards their total.
    """
    t0 = time.perf_counter()
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    _check_options(tok, validation_fraction, workers)
    check_max_document_bytes(max_document_bytes)

    counts = {"documents": 0, "empty": 0}
    sequences = dict.fromkeys(SPLITS, 0)
    tokens = dict.fromkeys(SPLITS, 0)
    max_id = 0
    batch_splits: collections.deque[list[str | None]] = collections.deque()

    def texts_only() -> Iterator[list[str]]:
        # Batches go to the workers as bare texts; their splits wait here, in order.
        index = 0
        for batch in _batched(documents, DOCS_PER_BATCH):
            splits = [s for s, _ in batch]
            for split, text in batch:
                if split is not None and split not in SPLITS:
                    raise ConfigError(f"split must be one of {SPLITS} or None, got {split!r}")
                check_document_size(text, max_document_bytes, f"document {index}")
                index += 1
            batch_splits.append(splits)
            yield [text for _, text in batch]

    writer = FlatTokensWriter(
        output,
        zarr_format=zarr_format,
        chunk_tokens=chunk_tokens,
        shard_tokens=shard_tokens,
        overwrite=overwrite,
        storage_options=storage_options,
    )
    bar = _progress_bar(progress, input_progress)
    try:
        # closing(): on any failure the workers are killed now, not when the traceback dies.
        with writer, contextlib.closing(tokenized_batches(tok, texts_only(), workers)) as batches:
            for ids, lengths in batches:
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
                bar.update(_advance(bar, len(lengths), input_progress))
                bar.set_postfix(
                    docs=counts["documents"], tokens=sum(tokens.values()), refresh=False
                )
    finally:
        bar.close()
    report = ConvertReport(
        output=writer.path,
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
    _warn_small_splits(report, chunk_tokens, validation_fraction)
    return report


def _progress_bar(enabled: bool, input_progress: InputProgress | None) -> Any:
    """Counts input bytes towards their total when reading files, else documents."""
    if input_progress is not None:
        return tqdm(
            total=input_progress.total or None,
            unit="B",
            unit_scale=True,
            desc="convert",
            disable=not enabled,
            dynamic_ncols=True,
        )
    return tqdm(unit=" docs", desc="convert", disable=not enabled, dynamic_ncols=True)


def _advance(bar: Any, documents: int, input_progress: InputProgress | None) -> int:
    if input_progress is None:
        return documents
    return max(0, input_progress.done - int(bar.n))


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
    storage_options: Mapping[str, Any] | None = None,
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
    input_progress: InputProgress | None = None,
) -> ConvertReport:
    """Tokenize ``texts`` (documents, in order) and write them as a flat-tokens dataset.

    * ``output``: a local path or an fsspec URL (``gs://``, ``s3://``, ...; see
      :class:`FlatTokensWriter`), with ``storage_options`` for its filesystem.
    * ``tokenizer``: see :func:`load_tokenizer`.
    * ``validation_fraction`` / ``seed``: which documents go to ``validation`` (module docstring).
    * ``workers``: tokenizer processes; 0 or 1 tokenizes in this process. The output is the same
      for every value.
    * ``zarr_format``, ``chunk_tokens``, ``shard_tokens``, ``overwrite``: as
      :class:`FlatTokensWriter` (match ``chunk_tokens`` to the loader's read block).
    * ``max_document_bytes``: the largest document accepted (UTF-8 bytes); a larger one is a
      :class:`ConfigError` naming it.

    Nothing appears at ``output`` unless the whole conversion succeeds. Afterwards an empty or
    tiny split is reported as a warning.
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
        storage_options=storage_options,
        max_document_bytes=max_document_bytes,
        input_progress=input_progress,
    )


def convert_files(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    text_field: str = "text",
    txt_mode: str = "line",
    follow_symlinks: bool = False,
    **options: Any,
) -> ConvertReport:
    """Convert ``.txt`` / ``.jsonl`` / ``.parquet`` files (see :func:`iter_documents`); the other
    keyword arguments are those of :func:`convert_texts`. With ``progress`` the bar counts input
    bytes towards their total."""
    # Fail on a missing or unsupported input before creating anything.
    files = expand_inputs(inputs, follow_symlinks=follow_symlinks)
    max_document_bytes = check_max_document_bytes(
        options.get("max_document_bytes", DEFAULT_MAX_DOCUMENT_BYTES)
    )
    if txt_mode not in ("line", "file"):
        raise ConfigError(f"txt_mode must be 'line' or 'file', got {txt_mode!r}")
    input_progress = InputProgress(total=sum(p.stat().st_size for p in files))

    def documents() -> Iterator[str]:
        for path in files:
            yield from iter_file_documents(
                path,
                text_field=text_field,
                txt_mode=txt_mode,
                max_document_bytes=max_document_bytes,
                progress=input_progress,
            )

    return convert_texts(documents(), output, input_progress=input_progress, **options)


# Names kept for callers of the helpers that moved to asyncflat.text.corpus.
_expand = expand_inputs
