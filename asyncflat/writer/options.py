"""The converters' one options object: what every converter (single machine, distributed,
Hugging Face, the CLI) is told the same way, checked once, when it is made."""

from __future__ import annotations

import dataclasses
import numbers
import reprlib
from collections.abc import Mapping
from typing import Any

from asyncflat.errors import ConfigError
from asyncflat.format.codec import CHUNK_TOKENS_MAX
from asyncflat.text.corpus import DEFAULT_MAX_DOCUMENT_BYTES, MAX_DOCUMENT_BYTES_LIMIT
from asyncflat.text.tokenizer import Tokenizer

__all__ = ["ConvertOptions", "chunk_tokens_arg", "positive_int"]


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` >= 1 (numpy integers too), else a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")
    return int(value)


def chunk_tokens_arg(name: str, value: Any) -> int:
    """``value`` as the tokens of a chunk that is written: :func:`positive_int`, and at most
    :data:`~asyncflat.format.codec.CHUNK_TOKENS_MAX` (refused here, not after hours of work)."""
    tokens = positive_int(name, value)
    if tokens > CHUNK_TOKENS_MAX:
        raise ConfigError(
            f"{name} must be at most {CHUNK_TOKENS_MAX} (a Blosc chunk holds under 2 GiB), "
            f"got {tokens}"
        )
    return tokens


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """How a corpus is converted: the tokenizer, the split rule, the stored layout, the output.

    * ``tokenizer``: a spec (see :func:`asyncflat.text.tokenizer.load_tokenizer`) or a loaded
      :class:`~asyncflat.text.tokenizer.Tokenizer` (the distributed converter needs a spec).
    * ``validation_fraction`` / ``seed``: document ``i`` goes to ``validation`` when
      ``splitmix64(seed, i) / 2**64 < validation_fraction`` (see :mod:`asyncflat.writer.convert`).
    * ``workers``: tokenizer processes on this machine; 0 or 1 tokenizes in the calling process.
      The output is the same for every value. The distributed converter's parallelism is its
      cluster's, so it does not read this.
    * ``zarr_format``, ``chunk_tokens``, ``shard_tokens``, ``overwrite``: as
      :class:`~asyncflat.writer.flat_tokens.FlatTokensWriter` (match ``chunk_tokens`` to the
      loader's read block; ``overwrite`` replaces only a flat-tokens dataset).
    * ``progress``: show a progress bar (a log line per interval on the distributed converter).
    * ``storage_options``: for an fsspec URL output (credentials, ``endpoint_url``, ...).
    * ``max_document_bytes``: the largest document accepted (UTF-8 bytes); a larger one is a
      :class:`ConfigError` naming it.

    Every field is checked here: a bad value is a :class:`ConfigError` naming the field.
    """

    tokenizer: str | Tokenizer = "bytes"
    validation_fraction: float = 0.01
    seed: int = 0
    workers: int = 1
    zarr_format: int = 3
    chunk_tokens: int = 1 << 20
    shard_tokens: int | None = None
    overwrite: bool = False
    progress: bool = False
    storage_options: Mapping[str, Any] | None = None
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES

    def __post_init__(self) -> None:
        self._check_tokenizer()
        fraction = self.validation_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, numbers.Real)
            or not 0.0 <= fraction <= 1.0  # also refuses NaN
        ):
            self._fail("validation_fraction must be in [0, 1]", fraction)
        if not _is_int(self.seed):
            self._fail("seed must be an integer", self.seed)
        if not _is_int(self.workers) or self.workers < 0:
            self._fail("workers must be an integer >= 0", self.workers)
        if isinstance(self.zarr_format, bool) or self.zarr_format not in (2, 3):
            self._fail("zarr_format must be 2 or 3", self.zarr_format)
        chunk_tokens_arg("ConvertOptions.chunk_tokens", self.chunk_tokens)
        self._check_shards()
        for name in ("overwrite", "progress"):
            if not isinstance(getattr(self, name), bool):
                self._fail(f"{name} must be a bool", getattr(self, name))
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ConfigError(
                "ConvertOptions.storage_options must be a mapping or None, got "
                f"{type(self.storage_options).__name__}"
            )
        if not _is_int(self.max_document_bytes) or self.max_document_bytes < 1:
            self._fail("max_document_bytes must be an integer >= 1", self.max_document_bytes)
        if self.max_document_bytes > MAX_DOCUMENT_BYTES_LIMIT:
            self._fail("max_document_bytes must be at most 2**40", self.max_document_bytes)

    def _fail(self, rule: str, value: Any) -> None:
        raise ConfigError(f"ConvertOptions.{rule}, got {reprlib.repr(value)}")

    def _check_tokenizer(self) -> None:
        tok = self.tokenizer
        if isinstance(tok, str):
            if not tok:
                self._fail("tokenizer must name a tokenizer", tok)
        elif not (hasattr(tok, "encode_batch") and hasattr(tok, "spec")):
            self._fail("tokenizer must be a spec string or a Tokenizer", tok)

    def _check_shards(self) -> None:
        if self.shard_tokens is None:
            return
        shard = positive_int("ConvertOptions.shard_tokens", self.shard_tokens)
        if self.zarr_format != 3 or shard % self.chunk_tokens:
            raise ConfigError(
                f"ConvertOptions.shard_tokens ({shard}) needs zarr_format=3 (got "
                f"{self.zarr_format}) and a multiple of chunk_tokens ({self.chunk_tokens})"
            )

    @property
    def storage_dict(self) -> dict[str, Any] | None:
        """``storage_options`` as a plain dict (None when empty), as the outputs take them."""
        return dict(self.storage_options) if self.storage_options else None
