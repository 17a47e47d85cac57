"""What the inspection calls return: frozen dataclasses with ``to_dict()``."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["LengthStats", "LoaderFigures", "SplitSummary", "VerifyReport"]


@dataclasses.dataclass(frozen=True)
class LengthStats:
    """Sequence lengths of a split (exact; percentiles are the smallest length L such that at
    least that fraction of sequences is <= L). ``log2_histogram[k]`` counts lengths in
    ``[2**k, 2**(k+1))``."""

    count: int
    min: int
    median: int
    p90: int
    max: int
    mean: float
    log2_histogram: list[int]


@dataclasses.dataclass(frozen=True)
class SplitSummary:
    """What :func:`describe_split` found; ``lengths`` is None when not scanned or empty."""

    filespec: str
    split: str
    zarr_format: int
    token_count: int
    sequence_count: int
    max_token_id: int
    chunk_tokens: int
    shard_tokens: int | None
    seq_starts_chunk: int
    token_codecs: list[str]
    seq_starts_codecs: list[str]
    tokens_nbytes: int
    tokens_nbytes_stored: int
    seq_starts_nbytes: int
    seq_starts_nbytes_stored: int
    lengths: LengthStats | None
    #: The filespec as given, credentials included, for :func:`loader_figures`' own reads (None:
    #: ``filespec``). Never shown: ``repr()`` and :meth:`to_dict` leave it out.
    read_filespec: str | None = dataclasses.field(default=None, repr=False, compare=False)
    #: Every ``encoded_tokens`` chunk (inside a shard: every inner chunk) ends with zarr's
    #: crc32c, which the loader verifies on every read (writer default in format 3).
    token_checksums: bool = False
    #: The same for ``seq_starts``.
    seq_starts_checksums: bool = False

    @property
    def compression_ratio(self) -> float | None:
        """Uncompressed over stored bytes of both arrays (None for an empty split)."""
        stored = self.tokens_nbytes_stored + self.seq_starts_nbytes_stored
        raw = self.tokens_nbytes + self.seq_starts_nbytes
        return raw / stored if stored and raw else None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["read_filespec"]
        out["compression_ratio"] = self.compression_ratio
        return out


@dataclasses.dataclass(frozen=True)
class LoaderFigures:
    """What a loader configuration costs on a split (see :func:`loader_figures`)."""

    seq_count: int
    read_block_count: int
    step_count: int
    minipoch_count: int
    rows_used: int
    rows_skipped: int
    buffer_bytes: int
    hosts: int
    streams_per_host: int
    buffer_bytes_per_host: int
    read_amplification: float | None
    #: Share of the split (tokens with packing, sequences without) an epoch never serves.
    dropped_fraction: float = 0.0
    #: The split's tokens as the loader holds them (uint32), to set the buffers against.
    split_bytes: int = 0
    #: When the rounding drops more than 1% of the split: the loader's warning, word for word
    #: (what is dropped, why, and the parameter that fixes it).
    sizing_warning: str | None = None
    #: Expected peak resident memory the loader adds on a host (``docs/tuning.md``): its
    #: buffers, the compressed bytes of the reads in flight, and a fixed part.
    memory_bytes_per_host: int = 0
    #: Shuffle buffers held per stream: 2, more when one step reads several minipochs.
    buffers_per_stream: int = 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """A split that passed :func:`verify_split`, with what was checked."""

    filespec: str
    split: str
    token_count: int
    sequence_count: int
    max_token_id: int
    observed_max_token_id: int | None
    token_reads: int
    seq_starts_reads: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
