"""Hugging Face ``datasets`` support (the optional ``hf`` extra): conversion and a streaming loader.

* :func:`convert_hf_dataset` writes a local ``datasets`` dataset (a ``save_to_disk`` directory,
  a directory of data files, or one data file) as a flat-tokens store, with the same
  tokenizers, split rule and crash safety as :mod:`asyncflat.writer.convert`.
* :class:`HuggingFaceDataLoader` is the reference's streaming loader, for parity: it tokenizes
  documents on the fly and packs ``sequences_packed_per_batch`` of them into each
  ``(batch, len)`` batch exactly as the reference's ``collate`` does. It reads strictly in order,
  so it cannot resume instantly: ``load(step)`` after a restart re-reads and re-tokenizes every
  earlier batch to get there. For training runs, convert once and use :class:`ShufflingLoader`.

Only local data is read; nothing is fetched from the Hugging Face Hub, and tokenizers are local
``tokenizer.json`` files (see :func:`asyncflat.text.tokenizer.load_tokenizer`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Sharding

from asyncflat.config import HuggingFaceDataParams, TokenBatchParams, step_argument
from asyncflat.errors import ConfigError, LoaderClosedError, StepOutOfRangeError
from asyncflat.loader.shared.batch import BatchBuilder, BatchType, TokenBatch, default_sharding
from asyncflat.text.tokenizer import Tokenizer, load_tokenizer
from asyncflat.writer.convert import ConvertOptions, ConvertReport, convert_documents

__all__ = ["HuggingFaceDataLoader", "convert_hf_dataset", "open_hf_dataset"]

log = logging.getLogger(__name__)

#: Builders of ``datasets`` for single data files, by suffix.
_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".csv": "csv",
    ".arrow": "arrow",
}


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(
            "Hugging Face datasets support needs the 'datasets' package: pip install 'asyncflat[hf]'"
        ) from exc
    return datasets


def open_hf_dataset(path: str | os.PathLike[str], name: str | None = None) -> dict[str, Any]:
    """The splits of a local dataset, by split name (``Dataset`` or streaming ``IterableDataset``).

    ``path`` is a ``save_to_disk`` directory (read with ``load_from_disk``), a directory of data
    files (split names inferred by ``datasets`` from file names, e.g. ``train.jsonl``), or one
    data file (``.jsonl``/``.json``/``.parquet``/``.txt``/``.csv``/``.arrow``; its split is
    ``train``). Data files are streamed, so no Arrow cache is written.
    """
    datasets = _datasets()
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            f"{path}: no such local dataset (asyncflat reads local data files or save_to_disk "
            "directories only; it never downloads from the Hugging Face Hub)"
        )
    try:
        if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "state.json").exists()):
            loaded = datasets.load_from_disk(str(p))
        elif p.is_dir():
            loaded = datasets.load_dataset(str(p), name, streaming=True)
        else:
            builder = _BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise ConfigError(f"{path}: unsupported data file type {p.suffix!r}")
            loaded = datasets.load_dataset(
                builder, name, data_files={"train": str(p)}, streaming=True
            )
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{path}: cannot open as a datasets dataset: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return dict(loaded)
    return {"train": loaded}


def _iter_texts(dataset: Any, text_field: str, where: str) -> Iterator[str]:
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise ConfigError(f"{where}: no column {text_field!r} (columns: {', '.join(columns)})")
    batches = iter(dataset.select_columns([text_field]).iter(batch_size=1000))
    while True:
        try:  # a streamed data file is parsed here: a malformed record fails in datasets/pyarrow
            batch = next(batches, None)
        except Exception as exc:  # datasets and pyarrow raise many kinds
            raise ConfigError(f"{where}: cannot read: {type(exc).__name__}: {exc}") from exc
        if batch is None:
            return
        for value in batch[text_field]:
            if value is not None and not isinstance(value, str):
                raise ConfigError(
                    f"{where}: column {text_field!r} holds {type(value).__name__}, not text"
                )
            yield value or ""


def convert_hf_dataset(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    options: ConvertOptions | None = None,
    name: str | None = None,
    text_field: str = "text",
) -> ConvertReport:
    """Convert a local ``datasets`` dataset (see :func:`open_hf_dataset`) to flat-tokens.

    Its ``train`` split becomes ``train``. When it has a ``validation`` split, that becomes
    ``validation``; otherwise ``validation`` is drawn from ``train`` by the converter's
    deterministic ``validation_fraction`` rule. Other splits are ignored. ``output`` and
    ``options`` (a :class:`~asyncflat.writer.options.ConvertOptions`) are those of
    :func:`asyncflat.writer.convert.convert_texts`.
    """
    splits = open_hf_dataset(path, name)
    if "train" not in splits:
        raise ConfigError(f"{path}: no 'train' split (splits: {', '.join(splits)})")
    ignored = sorted(set(splits) - {"train", "validation"})
    if ignored:
        log.info("%s: ignoring splits %s", path, ignored)
    has_validation = "validation" in splits

    def documents() -> Iterator[tuple[str | None, str]]:
        for text in _iter_texts(splits["train"], text_field, f"{path} [train]"):
            yield ("train" if has_validation else None), text
        if has_validation:
            for text in _iter_texts(splits["validation"], text_field, f"{path} [validation]"):
                yield "validation", text

    return convert_documents(documents(), output, options=options)


class HuggingFaceDataLoader:
    """The reference's streaming loader over a local dataset (see the module docstring).

    Each batch takes the next ``config.sequences_packed_per_batch`` documents of ``split``
    (column ``text``), tokenized without special tokens, and packs them back to back into
    ``batch * len`` slots: ``targets`` holds the token ids (zeros after the last document),
    ``is_seq_start`` marks each document's first slot; a document that does not fit is cut at
    the end of the batch, and documents after it are dropped. A final group of fewer than
    ``sequences_packed_per_batch`` documents is dropped (the reference's ``drop_last``).

    ``config.tokenizer`` is ``"bytes"`` or a local ``tokenizer.json`` (or a directory holding one)
    whose id 0 is a special token. ``config.num_workers > 0`` tokenizes and packs on a
    background thread, up to ``2 * num_workers`` batches ahead; the batches are the same either
    way. ``load(step)`` must be called with non-decreasing steps; a jump forward reads (and
    discards) the batches in between. Batches are ``batch_type(targets=, is_seq_start=)``, as
    for :class:`~asyncflat.loader.shuffling.ShufflingLoader`.
    """

    def __init__(
        self,
        split: str,
        config: HuggingFaceDataParams,
        token_batch_params: TokenBatchParams,
        sharding: Sharding | None = None,
        *,
        batch_type: BatchType = TokenBatch,
    ) -> None:
        self.split, self.config, self.token_batch_params = split, config, token_batch_params
        self.tokenizer: Tokenizer = load_tokenizer(config.tokenizer)
        if not self.tokenizer.zero_reserved:
            raise ConfigError(
                f"HuggingFaceDataParams.tokenizer {config.tokenizer!r}: id 0 must be a special "
                "token (it marks padding), as the reference loader requires"
            )
        self.max_token_id = self.tokenizer.vocab_size - 1
        self.sharding = default_sharding() if sharding is None else sharding
        self._shape = (token_batch_params.batch, token_batch_params.len)
        self._builder = BatchBuilder(self.sharding, self._shape, batch_type)
        splits = open_hf_dataset(config.path, config.name)
        if split not in splits:
            raise ConfigError(f"{config.path}: no split {split!r} (splits: {', '.join(splits)})")
        texts = _iter_texts(splits[split], "text", f"{config.path} [{split}]")
        self._batches = _packed_batches(
            texts, self.tokenizer, config.sequences_packed_per_batch, self._shape
        )
        self._next_step = 0
        self._closed = False
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        if config.num_workers > 0:
            # The thread holds the generator, the queue and the event, never the loader itself,
            # so a forgotten loader is still collected (and its __del__ stops the thread).
            self._queue = queue.Queue(maxsize=2 * config.num_workers)
            self._thread = threading.Thread(
                target=_produce,
                args=(self._batches, self._queue, self._stop),
                name="asyncflat-hf",
                daemon=True,
            )
            self._thread.start()

    # -- batches ------------------------------------------------------------------------------

    def collate(self, sequences: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Pack token-id sequences into ``(targets, is_seq_start)`` as the reference does."""
        return collate(sequences, self._shape)

    def _next_batch(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self._queue is None:
            return next(self._batches, None)
        kind, value = self._queue.get()
        if kind != "batch":
            self._queue.put((kind, value))  # later loads end (or fail) the same way
            if kind == "error":
                raise value
            return None
        return value

    # -- the reference's API ------------------------------------------------------------------

    def load(self, step: int) -> Any:
        """The batch of ``step``: the next one in order (steps must not go backwards)."""
        step = step_argument(step)
        if self._closed:
            raise LoaderClosedError("this HuggingFaceDataLoader is closed")
        if step < self._next_step:
            raise StepOutOfRangeError(
                f"HuggingFaceDataLoader streams in order: step {step} was already served (next is "
                f"{self._next_step}); it cannot go back or resume instantly, create a new loader "
                "or convert the dataset to flat-tokens"
            )
        if step > self._next_step:
            log.warning(
                "HuggingFaceDataLoader: reading and discarding %d batches to reach step %d",
                step - self._next_step,
                step,
            )
        while True:
            batch = self._next_batch()
            if batch is None:
                raise StepOutOfRangeError(
                    f"step {step} is out of range: {self.config.path} [{self.split}] ran out after "
                    f"{self._next_step} batches"
                )
            self._next_step += 1
            if self._next_step > step:
                break
        targets, is_start = batch
        return self._builder.build_full(targets, is_start)

    def close(self) -> None:
        """Stop the background thread (if any). Idempotent."""
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> HuggingFaceDataLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()


def collate(
    sequences: Iterable[np.ndarray], shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """The reference's collate: sequences back to back in ``batch * len`` slots, cut at the end."""
    size = shape[0] * shape[1]
    flat = np.zeros(size, np.uint32)
    is_start = np.zeros(size, np.bool_)
    start = 0
    for seq in sequences:
        end = min(start + len(seq), size)
        is_start[start] = True
        flat[start:end] = seq[: end - start]
        start += len(seq)
        if start >= size:
            break
    return flat.reshape(shape), is_start.reshape(shape)


def _packed_batches(
    texts: Iterator[str], tokenizer: Tokenizer, per_batch: int, shape: tuple[int, int]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    while True:
        group = []
        for text in texts:
            group.append(text)
            if len(group) == per_batch:
                break
        if len(group) < per_batch:
            return  # the reference's drop_last
        yield collate(tokenizer.encode_batch(group), shape)


def _produce(batches: Iterator[Any], out: queue.Queue[Any], stop: threading.Event) -> None:
    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for batch in batches:
            if not put(("batch", batch)):
                return
        put(("end", None))
    except BaseException as exc:  # noqa: BLE001 (handed to load(), which re-raises it)
        put(("error", exc))
