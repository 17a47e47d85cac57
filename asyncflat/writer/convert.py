"""Convert text corpora to flat-tokens datasets: ``asyncflat convert`` as library calls.

The pipeline: documents are read in order from the inputs (:mod:`asyncflat.text.corpus`), cut into
batches, tokenized in worker processes (:mod:`asyncflat.text.tokenizer`; results are collected in
submission order, so the output does not depend on the number of workers), assigned to a split,
and appended through :class:`FlatTokensWriter`, whose staged commit means a conversion that
fails or is killed leaves no dataset at the output (a local path or any fsspec URL).

* Inputs (:func:`asyncflat.text.corpus.iter_documents`): ``.txt`` (one document per line, or per file with
  ``txt_mode="file"``), ``.jsonl`` (one JSON object per line, text in ``text_field``) and
  ``.parquet`` (a string column ``text_field``, read with pyarrow); ``.txt.gz`` and ``.jsonl.gz``
  too. A directory stands for the supported files under it, in sorted order; symlinks leading
  out of it are skipped unless ``follow_symlinks``. No document may exceed
  ``max_document_bytes`` (checked while reading).
* Tokenizers (:func:`asyncflat.text.tokenizer.load_tokenizer`): ``"bytes"`` (UTF-8 bytes,
  id = byte + 1, so id 0 stays free for padding, as seqax's ``bytes_utf8``); a local Hugging
  Face ``tokenizer.json`` (or a directory holding one), via the ``tokenizers`` library;
  ``"tiktoken:NAME"`` when tiktoken's encoding file is already in its local cache, or a local
  ``.tiktoken`` file. Nothing is ever downloaded. A tokenizer failure in any worker is a
  :class:`~asyncflat.text.tokenizer.TokenizerError`; the workers are stopped and the partial
  output removed.
* Splits: document ``i`` (counting every document read, empty ones included) goes to
  ``validation`` when ``splitmix64(seed, i) / 2**64 < validation_fraction``, else to ``train``:
  deterministic, independent of batching and workers, and stable when the corpus grows at its
  end. Documents that tokenize to nothing are skipped (a flat-tokens sequence has >= 1 token).

The stored ``max_token_id`` is the largest id that occurs in each split (the writer's rule).
Every converter takes its settings as one :class:`~asyncflat.writer.options.ConvertOptions`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from asyncflat.errors import ConfigError
from asyncflat.format.codec import SPLITS
from asyncflat.text.corpus import (
    InputProgress,
    check_document_size,
    expand_inputs,
    iter_file_documents,
)
from asyncflat.text.pool import tokenized_batches
from asyncflat.text.tokenizer import check_tokenizer, load_tokenizer
from asyncflat.writer.flat_tokens import FlatTokensWriter
from asyncflat.writer.options import ConvertOptions

__all__ = [
    "ConvertOptions",
    "ConvertReport",
    "convert_documents",
    "convert_files",
    "convert_texts",
    "options_or_default",
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

    def summary(self) -> str:
        """One line for the log: documents, output, tokens per split, speed."""
        return (
            f"converted {self.documents} documents ({self.empty_documents} empty, skipped) to "
            f"{self.output}: {self.tokens} tokens, {self.tokens_per_s:.0f} tokens/s"
        )


def options_or_default(options: ConvertOptions | None) -> ConvertOptions:
    """``options``, or the defaults for None; anything else is a ConfigError."""
    if options is None:
        return ConvertOptions()
    if not isinstance(options, ConvertOptions):
        raise ConfigError(
            f"options must be a ConvertOptions, got {type(options).__name__} (build one with "
            "asyncflat.writer.convert.ConvertOptions(...))"
        )
    return options


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


@dataclasses.dataclass
class _Tally:
    """What a conversion has written so far."""

    documents: int = 0
    empty: int = 0
    max_id: int = 0
    sequences: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    tokens: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(SPLITS, 0))

    def report(self, output: str, tokenizer: str, seconds: float) -> ConvertReport:
        return ConvertReport(
            output=output,
            tokenizer=tokenizer,
            documents=self.documents,
            empty_documents=self.empty,
            sequences=self.sequences,
            tokens=self.tokens,
            max_token_id=self.max_id,
            seconds=seconds,
        )


def _text_batches(
    documents: Iterable[tuple[str | None, str]],
    max_document_bytes: int,
    batch_splits: collections.deque[list[str | None]],
) -> Iterator[list[str]]:
    """Batches of bare texts for the workers; each batch's forced splits wait, in order, in
    ``batch_splits``. Checks every document's split and size on the way."""
    index = 0
    for batch in _batched(documents, DOCS_PER_BATCH):
        for split, text in batch:
            if split is not None and split not in SPLITS:
                raise ConfigError(f"split must be one of {SPLITS} or None, got {split!r}")
            check_document_size(text, max_document_bytes, f"document {index}")
            index += 1
        batch_splits.append([s for s, _ in batch])
        yield [text for _, text in batch]


def _append_batch(
    writer: FlatTokensWriter,
    tally: _Tally,
    tokenized: tuple[np.ndarray, np.ndarray],
    forced: list[str | None],
    options: ConvertOptions,
) -> None:
    """Assign one tokenized batch's documents to their splits and append them."""
    ids, lengths = tokenized
    first = tally.documents
    tally.documents += len(lengths)
    is_val = validation_mask(
        np.arange(first, first + len(lengths)), options.validation_fraction, options.seed
    )
    chosen: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    for seq, split, val in zip(np.split(ids, np.cumsum(lengths)[:-1]), forced, is_val.tolist()):
        if not seq.size:
            tally.empty += 1
            continue
        chosen[split or ("validation" if val else "train")].append(seq)
    if ids.size:
        tally.max_id = max(tally.max_id, int(ids.max()))
    for split, split_seqs in chosen.items():
        if split_seqs:
            writer.append(split, split_seqs)
            tally.sequences[split] += len(split_seqs)
            tally.tokens[split] += sum(s.size for s in split_seqs)


def _open_writer(output: str | os.PathLike[str], options: ConvertOptions) -> FlatTokensWriter:
    return FlatTokensWriter(
        output,
        zarr_format=options.zarr_format,
        chunk_tokens=options.chunk_tokens,
        shard_tokens=options.shard_tokens,
        overwrite=options.overwrite,
        storage_options=options.storage_options,
    )


def convert_documents(
    documents: Iterable[tuple[str | None, str]],
    output: str | os.PathLike[str],
    *,
    options: ConvertOptions | None = None,
    input_progress: InputProgress | None = None,
) -> ConvertReport:
    """Tokenize ``(split, text)`` pairs and write them as a flat-tokens dataset at ``output``.

    ``split`` is ``"train"``, ``"validation"`` or None (assigned by :func:`validation_mask`
    from the document's index). ``output`` and ``options`` are those of :func:`convert_texts`;
    ``input_progress`` (filled while reading files) makes the progress bar count input bytes
    towards their total.
    """
    options = options_or_default(options)
    t0 = time.perf_counter()
    tok = (
        load_tokenizer(options.tokenizer)
        if isinstance(options.tokenizer, str)
        else options.tokenizer
    )
    check_tokenizer(tok)
    tally = _Tally()
    forced: collections.deque[list[str | None]] = collections.deque()
    texts = _text_batches(documents, options.max_document_bytes, forced)
    writer = _open_writer(output, options)
    bar = _progress_bar(options.progress, input_progress)
    try:
        # closing(): on any failure the workers are killed now, not when the traceback dies.
        with writer, contextlib.closing(tokenized_batches(tok, texts, options.workers)) as batches:
            for ids, lengths in batches:
                _append_batch(writer, tally, (ids, lengths), forced.popleft(), options)
                bar.update(_advance(bar, len(lengths), input_progress))
                bar.set_postfix(
                    docs=tally.documents, tokens=sum(tally.tokens.values()), refresh=False
                )
    finally:
        bar.close()
    report = tally.report(writer.path, tok.spec, time.perf_counter() - t0)
    log.info("%s", report.summary())
    _warn_small_splits(report, options.chunk_tokens, options.validation_fraction)
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
    options: ConvertOptions | None = None,
) -> ConvertReport:
    """Tokenize ``texts`` (documents, in order) and write them as a flat-tokens dataset.

    ``output`` is a local path or an fsspec URL (``gs://``, ``s3://``, ...; see
    :class:`FlatTokensWriter`); ``options`` (a :class:`ConvertOptions`, default: its defaults)
    says how: the tokenizer, the split rule, the workers, the stored layout, ``overwrite``.

    Nothing appears at ``output`` unless the whole conversion succeeds. Afterwards an empty or
    tiny split is reported as a warning.
    """
    return convert_documents(((None, text) for text in texts), output, options=options)


def convert_files(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    options: ConvertOptions | None = None,
    text_field: str = "text",
    txt_mode: str = "line",
    follow_symlinks: bool = False,
) -> ConvertReport:
    """Convert ``.txt`` / ``.jsonl`` / ``.parquet`` files (see
    :func:`asyncflat.text.corpus.iter_documents`); ``output`` and ``options`` are those of
    :func:`convert_texts`. With ``options.progress`` the bar counts input bytes towards their
    total."""
    options = options_or_default(options)
    # Fail on a missing or unsupported input before creating anything.
    files = expand_inputs(inputs, follow_symlinks=follow_symlinks)
    if txt_mode not in ("line", "file"):
        raise ConfigError(f"txt_mode must be 'line' or 'file', got {txt_mode!r}")
    input_progress = InputProgress(total=sum(p.stat().st_size for p in files))

    def documents() -> Iterator[tuple[str | None, str]]:
        for path in files:
            for text in iter_file_documents(
                path,
                text_field=text_field,
                txt_mode=txt_mode,
                max_document_bytes=options.max_document_bytes,
                progress=input_progress,
            ):
                yield None, text

    return convert_documents(documents(), output, options=options, input_progress=input_progress)
