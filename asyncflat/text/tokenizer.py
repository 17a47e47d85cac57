"""Tokenizers for the converter, loaded from a spec string, never downloaded.

A spec (:func:`load_tokenizer`) is ``"bytes"``, ``"tiktoken:NAME"`` (an encoding in tiktoken's
local cache), a local ``.tiktoken`` ranks file (or ``"tiktoken:NAME=PATH"``), or a local Hugging
Face ``tokenizer.json`` (or a directory holding one). Worker processes re-load the tokenizer
from its spec.

:func:`tokenize_batch` is the one place a tokenizer runs: any failure in it, including a Rust
panic from the ``tokenizers`` library (pyo3's ``PanicException`` derives from
``BaseException``, so ``except Exception`` misses it and a process pool loses the task and
waits forever), becomes a picklable :class:`TokenizerError` with a one-line message.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from asyncflat.errors import AsyncflatError, ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "BytesTokenizer",
    "HuggingFaceTokenizer",
    "TiktokenFileTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "tokenize_batch",
]

#: Longest tokenizer failure message kept (a panic can carry a long Rust backtrace).
_MESSAGE_CHARS = 400


class TokenizerError(AsyncflatError, RuntimeError):
    """The tokenizer failed on the input (an exception or a panic inside it, or a dead worker)."""


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

    def __init__(self, spec: str, name: str) -> None:
        try:
            import tiktoken
            import tiktoken.load
        except ImportError as exc:
            raise ConfigError(
                f"tokenizer {spec!r} needs the 'tiktoken' package: pip install 'asyncflat[convert]'"
            ) from exc

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
        except ValueError as exc:
            known = tiktoken.list_encoding_names()
            if name in known:  # it exists but did not load (its ranks): say why
                raise ConfigError(f"tokenizer {spec!r}: {exc}") from exc
            # an unknown name (tiktoken's message spans 3 lines)
            raise ConfigError(
                f"tokenizer {spec!r}: tiktoken has no encoding {name!r} "
                f"(it knows: {', '.join(known)})"
            ) from exc
        finally:
            tiktoken.load.read_file = original
        self.spec = spec
        self.vocab_size = int(self._encoding.n_vocab)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [
            np.asarray(ids, np.uint32) for ids in self._encoding.encode_ordinary_batch(list(texts))
        ]


class TiktokenFileTokenizer(TiktokenTokenizer):
    """A local ``.tiktoken`` ranks file (read with ``tiktoken.load.load_tiktoken_bpe``).

    A ranks file holds no split pattern: the pattern is that of the tiktoken encoding named by
    ``pattern`` (by default the file's stem, e.g. ``cl100k_base.tiktoken``). No special tokens.
    """

    def __init__(self, spec: str, path: str, pattern: str | None = None) -> None:
        try:
            import tiktoken
            import tiktoken.load
        except ImportError as exc:
            raise ConfigError(
                f"tokenizer {spec!r} needs the 'tiktoken' package: pip install 'asyncflat[convert]'"
            ) from exc
        name = pattern or os.path.basename(path).removesuffix(".tiktoken")
        pat_str = _tiktoken_pattern(name, spec)
        try:
            ranks = tiktoken.load.load_tiktoken_bpe(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot read tiktoken ranks file {path}: {type(exc).__name__}: {exc}"
            ) from None
        if not ranks:
            raise ConfigError(f"tiktoken ranks file {path} holds no tokens")
        self._encoding = tiktoken.Encoding(
            name=f"asyncflat:{name}", pat_str=pat_str, mergeable_ranks=ranks, special_tokens={}
        )
        self.spec = spec
        self.vocab_size = max(ranks.values()) + 1


def _tiktoken_pattern(name: str, spec: str) -> str:
    """The split pattern of tiktoken's encoding ``name``, without fetching its ranks."""
    import tiktoken.registry

    known = tiktoken.registry.list_encoding_names()
    if name not in known:
        raise ConfigError(
            f"tokenizer {spec!r}: a .tiktoken file holds no split pattern, and {name!r} names no "
            f"tiktoken encoding to take it from; name the file after one ({', '.join(known)}), "
            "e.g. cl100k_base.tiktoken, or write tiktoken:ENCODING=PATH"
        )
    constructor = tiktoken.registry.ENCODING_CONSTRUCTORS[name]  # type: ignore[index]
    module = sys.modules[constructor.__module__]
    # The constructor would download the ranks; stand in empty ones to learn only the pattern.
    saved = {n: getattr(module, n) for n in _RANK_LOADERS if hasattr(module, n)}
    try:
        for loader in saved:
            setattr(module, loader, lambda *args, **kwargs: {})
        return str(constructor()["pat_str"])
    finally:
        for loader, value in saved.items():
            setattr(module, loader, value)


#: Functions tiktoken's encoding constructors call to fetch ranks (stubbed out to get a pattern).
_RANK_LOADERS = ("load_tiktoken_bpe", "data_gym_to_mergeable_bpe_ranks")


def load_tokenizer(spec: str) -> Tokenizer:
    """A tokenizer from its spec; nothing is ever downloaded.

    * ``"bytes"``: UTF-8 bytes, id = byte + 1.
    * ``"tiktoken:NAME"``: a tiktoken encoding already in tiktoken's local cache.
    * ``"PATH.tiktoken"`` or ``"tiktoken:NAME=PATH"``: a local tiktoken ranks file, split with
      encoding NAME's pattern (by default the file's stem names it).
    * a path to a Hugging Face ``tokenizer.json`` (or a directory holding one).
    """
    if spec == "bytes":
        return BytesTokenizer()
    if spec.startswith("tiktoken:"):
        name = spec.removeprefix("tiktoken:")
        if "=" in name:
            pattern, ranks_file = name.split("=", 1)
            if not os.path.isfile(ranks_file):
                raise ConfigError(f"tokenizer {spec!r}: {ranks_file} is not a file")
            return TiktokenFileTokenizer(spec, ranks_file, pattern)
        return TiktokenTokenizer(spec, name)
    path = Path(spec)
    if path.is_file() and path.name.endswith(".tiktoken"):
        return TiktokenFileTokenizer(spec, str(path))
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"tokenizer must be 'bytes', 'tiktoken:NAME', a local .tiktoken file or a local "
            f"tokenizer.json (or a directory holding one); {spec!r} is none of these (asyncflat "
            "never downloads tokenizers)"
        )
    return HuggingFaceTokenizer(spec, str(path))


def tokenize_batch(
    tokenizer: Tokenizer, texts: Sequence[str], first: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``texts``, concatenated (uint32), and their lengths (int64).

    ``first`` is the index of ``texts[0]`` in the corpus, for the error message. Any failure of
    the tokenizer is a :class:`TokenizerError`.
    """
    try:
        seqs = tokenizer.encode_batch(texts)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 -- a Rust panic is a BaseException
        raise TokenizerError(
            one_line(
                f"tokenizer {tokenizer.spec} failed on documents {first}..{first + len(texts) - 1}"
                f": {type(exc).__name__}: {exc}"
            )
        ) from None
    lengths = np.fromiter((len(s) for s in seqs), np.int64, count=len(seqs))
    ids = np.concatenate(seqs).astype(np.uint32, copy=False) if seqs else np.zeros(0, np.uint32)
    return ids, lengths


def one_line(message: str) -> str:
    """``message`` on one line, cut to a readable length."""
    text = " ".join(message.split())
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def check_tokenizer(tok: Tokenizer) -> None:
    """Refuse a vocabulary over the format's id limit; warn when id 0 is an ordinary token."""
    from asyncflat.format.codec import TOKEN_ID_LIMIT

    if tok.vocab_size > TOKEN_ID_LIMIT:
        raise ConfigError(f"tokenizer {tok.spec!r} has {tok.vocab_size} ids, over the 2**31 limit")
    if not tok.zero_reserved:
        log.warning(
            "tokenizer %s uses id 0 for an ordinary token; flat-tokens loaders pad non-packed rows "
            "with id 0, so padding will look like that token",
            tok.spec,
        )
