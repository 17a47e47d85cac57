"""Writing flat-tokens datasets to local disk or an object store, crash-safely, in bounded memory.

:class:`FlatTokensWriter` appends ragged sequences to the ``train`` and ``validation`` splits,
buffering at most one stored object (a chunk, or a shard) of tokens per split and writing whole
objects as they fill, so a dataset larger than memory can be written from a stream.

Nothing that opens as a dataset appears at the target until the writer commits. Locally, all
data goes into a staging directory beside it (``<path>.partial-<random>``) which ``close()``
renames into place in one ``os.rename``; on an object store (any fsspec URL) the metadata objects
are written last (see :mod:`asyncflat.writer.output`). A writer that is killed, or whose ``with`` block
raises, therefore leaves either the previous dataset or nothing at the target; never a
half-written store that would open as valid. (A killed local writer may leave its
``*.partial-*`` directory behind; it is safe to delete. A killed object-store writer leaves
chunk objects without metadata under the URL; ``overwrite=True`` replaces them.)

Choosing ``chunk_tokens``: a reader decodes whole chunks, so make a chunk the size of the
loader's read block, ``sequences_per_read_block * len`` tokens for packed data (512 * 2048 =
1,048,576 = the default). Then a block read decodes exactly the tokens it uses; with seqax's
4,194,304-token chunks and 1M-token blocks every block read decompresses 4x what it needs. On an
object store where per-request latency dominates, keep chunks at the block size and group them
into larger objects with ``shard_tokens`` (zarr format 3).
"""

from __future__ import annotations

import logging
import operator
import os
import reprlib
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import numpy as np
import zarr
from numcodecs import Blosc, Delta
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.array_spec import ArrayConfig

from asyncflat.errors import ConfigError, LoaderClosedError
from asyncflat.format.codec import SPLITS, encode_sequences
from asyncflat.writer.options import chunk_tokens_arg, positive_int
from asyncflat.writer.output import OutputExistsError, open_output

__all__ = ["FlatTokensWriter", "OutputExistsError", "write_flat_tokens"]

logger = logging.getLogger(__name__)

#: Entries per chunk of ``seq_starts`` (seqax's layout; 512 KiB of uint64 before compression).
SEQ_STARTS_CHUNK = 65536

# Chunks equal to the fill value are still written: readers that fetch objects directly (not
# through zarr) must find every object, and an all-zero token chunk is legitimate data.
_ARRAY_CONFIG = ArrayConfig(order="C", write_empty_chunks=True)

#: Bytes per Blosc block of an ``encoded_tokens`` chunk (decoded): the unit a row read decodes.
#: A load that arrives before its blocks (a resume, start-up) reads its rows one by one, and each
#: costs the Blosc blocks that hold it: at 32 KiB a 2048-token row is one or two blocks (64 KiB at
#: most) where Blosc's own choice (512 KiB for lz4 at clevel 5) made it 512 KiB-1 MiB, read and
#: decompressed for 8 KiB. Measured on text-like tokens, the compression ratio (2.02) and the
#: speed of decoding a whole chunk are the same at 32 KiB as at Blosc's choice.
BLOSC_BLOCK_BYTES = 1 << 15

#: Tokens per ``append`` call that ``write_flat_tokens`` batches a lazy iterable into.
_BATCH_TOKENS = 1 << 22


def create_split_arrays(
    group: zarr.Group,
    shape: tuple[int, int] = (0, 0),
    *,
    zarr_format: int,
    chunk_tokens: int,
    shard_tokens: int | None,
    checksum: bool | None = None,
    blosc_block_bytes: int | None = None,
) -> tuple[zarr.Array, zarr.Array]:
    """Create one split's ``encoded_tokens`` and ``seq_starts`` arrays in ``group``.

    ``shape`` is (tokens, seq_starts entries). Shared with the distributed converter so both
    write the same array metadata and codecs, hence the same chunk bytes. ``checksum`` (format 3;
    None: on in format 3, off in format 2) appends zarr's crc32c to every chunk of both arrays.
    ``blosc_block_bytes`` is the Blosc
    block size of ``encoded_tokens`` (0: Blosc's own choice, as seqax's tools write; None: the
    format's default, :data:`BLOSC_BLOCK_BYTES` in format 3, 0 in format 2).
    """
    if blosc_block_bytes is None:
        blosc_block_bytes = BLOSC_BLOCK_BYTES if zarr_format == 3 else 0
    if checksum is None:
        checksum = zarr_format == 3
    if zarr_format == 2:
        # seqax's exact layout, so seqax (zarr 2.x) can read what we write.
        compressor = Blosc(cname="lz4", clevel=5, shuffle=Blosc.BITSHUFFLE)
        tokens = group.create_array(
            "encoded_tokens",
            shape=(shape[0],),
            chunks=(chunk_tokens,),
            dtype="<u4",
            fill_value=None,
            compressors=Blosc(
                cname="lz4", clevel=5, shuffle=Blosc.BITSHUFFLE, blocksize=blosc_block_bytes
            ),
            filters=None,
            config=_ARRAY_CONFIG,
        )
        starts = group.create_array(
            "seq_starts",
            shape=(shape[1],),
            chunks=(SEQ_STARTS_CHUNK,),
            dtype="<u8",
            fill_value=0,
            compressors=compressor,
            filters=[Delta(dtype="<i8", astype="<i8")],
            config=_ARRAY_CONFIG,
        )
    else:
        codec = BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle")
        tokens_codec = BloscCodec(
            cname="lz4", clevel=5, shuffle="bitshuffle", blocksize=blosc_block_bytes
        )
        # zarr's crc32c after Blosc (which has no checksum): a damaged chunk is an error, not
        # wrong tokens. Inside a shard each inner chunk carries its own.
        crc = [Crc32cCodec()] if checksum else []
        tokens = group.create_array(
            "encoded_tokens",
            shape=(shape[0],),
            chunks=(chunk_tokens,),
            shards=(shard_tokens,) if shard_tokens else None,
            dtype="uint32",
            fill_value=0,
            compressors=[tokens_codec, *crc],
            config=_ARRAY_CONFIG,
        )
        starts = group.create_array(
            "seq_starts",
            shape=(shape[1],),
            chunks=(SEQ_STARTS_CHUNK,),
            dtype="uint64",
            fill_value=0,
            compressors=[codec, *crc],
            config=_ARRAY_CONFIG,
        )
    return tokens, starts


class _SplitWriter:
    """Buffers one split's tokens and offsets and writes them out in whole stored objects."""

    def __init__(
        self,
        group: zarr.Group,
        split: str,
        *,
        zarr_format: int,
        chunk_tokens: int,
        shard_tokens: int | None,
        checksum: bool | None = None,
        blosc_block_bytes: int | None = None,
    ) -> None:
        self.split = split
        self.group = group
        self.tokens, self.starts = create_split_arrays(
            group,
            zarr_format=zarr_format,
            chunk_tokens=chunk_tokens,
            shard_tokens=shard_tokens,
            checksum=checksum,
            blosc_block_bytes=blosc_block_bytes,
        )
        # A whole shard is the unit of writing when sharded: writing part of one would make zarr
        # read, modify and rewrite it.
        self.token_buf = _Buffer(self.tokens, shard_tokens or chunk_tokens, np.uint32)
        self.start_buf = _Buffer(self.starts, SEQ_STARTS_CHUNK, np.uint64)
        self.start_buf.extend(np.zeros(1, np.uint64))
        self.token_count = 0
        self.sequence_count = 0
        self.max_token_id = 0

    def append(self, encoded: np.ndarray, lengths: np.ndarray) -> None:
        if lengths.size == 0:
            return
        self.max_token_id = max(self.max_token_id, int(encoded.max() >> 1))
        ends = np.cumsum(lengths, dtype=np.uint64)
        ends += np.uint64(self.token_count)
        self.token_buf.extend(encoded)
        self.start_buf.extend(ends)
        self.token_count += int(encoded.size)
        self.sequence_count += int(lengths.size)

    def finish(self) -> None:
        self.token_buf.flush()
        self.start_buf.flush()
        self.group.attrs["max_token_id"] = self.max_token_id


class _Buffer:
    """An append-only view of a 1-D zarr array that writes only whole objects until the end."""

    def __init__(self, array: zarr.Array, unit: int, dtype: type) -> None:
        self.array = array
        self.unit = unit
        self.buf: np.ndarray = np.empty(unit, dtype)
        self.fill = 0
        self.written = 0

    def extend(self, data: np.ndarray) -> None:
        while data.size:
            if self.fill == 0 and data.size >= self.unit:
                # Aligned and at least one whole object: write straight from the caller's array.
                n = data.size - data.size % self.unit
                self._write(data[:n])
                data = data[n:]
                continue
            take = min(self.unit - self.fill, data.size)
            self.buf[self.fill : self.fill + take] = data[:take]
            self.fill += take
            data = data[take:]
            if self.fill == self.unit:
                self.flush()

    def flush(self) -> None:
        if self.fill:
            self._write(self.buf[: self.fill])
            self.fill = 0

    def _write(self, data: np.ndarray) -> None:
        start, end = self.written, self.written + data.size
        self.array.resize((end,))  # growing only rewrites metadata, never touches chunks
        self.array[start:end] = data
        self.written = end


class FlatTokensWriter:
    """Write a new flat-tokens dataset at ``path``; use as a context manager.

    ``append(split, sequences)`` adds ragged token-id sequences to ``"train"`` or
    ``"validation"``. Leaving the ``with`` block cleanly (or calling :meth:`close`) writes the
    remaining partial chunks and the ``max_token_id`` attributes and commits the dataset
    atomically; an exception inside the block (or :meth:`abort`) discards everything. A split
    that was never appended to is written empty (0 tokens, ``seq_starts == [0]``,
    ``max_token_id == 0``), so the dataset always has both splits.

    Arguments:
      * ``path``: a local path (missing parent directories are created) or any fsspec URL
        (``gs://``, ``s3://``, ``memory://``; ``file://`` is local). On an object store, which
        has no rename, the metadata objects are written last: a reader finds no dataset until
        the commit, then the complete one.
      * ``zarr_format``: 3 (default; Blosc lz4 bitshuffle) or 2 (seqax's exact layout: Blosc lz4
        clevel 5 bitshuffle, ``fill_value`` null, a ``Delta('<i8')`` filter on ``seq_starts``),
        for stores seqax's own zarr-2 tooling must read.
      * ``chunk_tokens``: tokens per chunk of ``encoded_tokens``, the reader's decode unit; match
        the loader's read block (see the module docstring). seqax used 4,194,304.
      * ``shard_tokens``: format 3 only, a multiple of ``chunk_tokens``; groups chunks into one
        stored object each (fewer, larger objects for object stores). Memory then holds a shard.
      * ``checksum``: on by default in format 3 (False turns it off): each chunk of both
        arrays ends with zarr's ``crc32c`` of its bytes (Blosc has none), which the loader
        verifies on every read, so a flipped bit on disk is a ``CorruptChunkError`` naming the
        chunk object, not wrong tokens. Format 2 has none (True is refused): seqax's exact
        layout has no room for one (see docs/format.md). The cost is measured by
        ``bench/fill.py`` (docs/performance.md): the checksum is computed off the GIL, with
        no thread hop of its own (in the job that reads or decodes the chunk).
      * ``overwrite``: replace an existing flat-tokens store (or an empty directory) at
        ``path``; anything else there is refused, naming what was found. Without it an existing
        path is an :class:`OutputExistsError` (a :class:`ConfigError`; raised at construction,
        and locally again at commit if one appeared since). Locally the old dataset is moved
        aside, the new one renamed into place, then the old removed, so a crash never leaves a
        mixture; on an object store the old dataset is removed (root metadata first) before
        anything new is written.
      * ``storage_options``: passed to fsspec for a URL (credentials, ``endpoint_url``, ...).
      * ``blosc_block_bytes``: the Blosc block size of ``encoded_tokens`` chunks, a multiple of
        4; 0 leaves it to Blosc, as seqax's own tools do. Default: 32 KiB in format 3, so a
        resumed loader reads and decodes a few KiB per row, not half a MiB; 0 in format 2
        (seqax's exact metadata).

    A failed write (a full disk, a lost connection) is a :class:`StorageError` naming the
    object; every write in flight has ended before the partial output is removed.
    Memory stays at about one stored object per split plus the batch passed to ``append``.
    A writer is not thread-safe.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        zarr_format: int = 3,
        chunk_tokens: int = 1 << 20,
        shard_tokens: int | None = None,
        overwrite: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        checksum: bool | None = None,
        blosc_block_bytes: int | None = None,
    ) -> None:
        chunk_tokens, shard_tokens, blosc_block_bytes, checksum = _check_arguments(
            path,
            zarr_format=zarr_format,
            chunk_tokens=chunk_tokens,
            shard_tokens=shard_tokens,
            overwrite=overwrite,
            storage_options=storage_options,
            checksum=checksum,
            blosc_block_bytes=blosc_block_bytes,
        )
        self._output = open_output(
            path,
            overwrite=overwrite,
            storage_options=dict(storage_options) if storage_options else None,
        )
        self.path = self._output.display
        self.overwrite = overwrite
        self._closed = False
        self._failed: str | None = None  # why an append aborted the writer
        try:
            root = zarr.open_group(
                self._output.store, mode="w", zarr_format=2 if zarr_format == 2 else 3
            )
            self._splits = {
                split: _SplitWriter(
                    root.create_group(split),
                    split,
                    zarr_format=zarr_format,
                    chunk_tokens=chunk_tokens,
                    shard_tokens=shard_tokens,
                    checksum=checksum,
                    blosc_block_bytes=blosc_block_bytes,
                )
                for split in SPLITS
            }
        except BaseException:
            self.abort()
            raise
        logger.debug("writing flat-tokens dataset %s", self.path)

    def append(self, split: str, sequences: Iterable[Any]) -> None:
        """Encode and append ``sequences`` (1-D non-negative int sequences, ids < 2**31)."""
        self._check_open()
        writer = self._splits.get(split)
        if writer is None:
            raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
        encoded, lengths = encode_sequences(_as_arrays(sequences))
        try:
            writer.append(encoded, lengths)
        except BaseException as exc:
            # Some of its chunks may be written, which cannot be taken back: were the writer
            # kept, tokens and seq_starts would disagree in what it commits.
            self._failed = f"an append failed ({type(exc).__name__}: {exc})"
            self.abort()
            raise

    def close(self) -> None:
        """Flush every split and commit the dataset at ``path`` atomically (idempotent).
        Raises :class:`~asyncflat.errors.LoaderClosedError` once an append failed."""
        if self._failed is not None:
            self._check_open()
        if self._closed:
            return
        try:
            for writer in self._splits.values():
                writer.finish()
            self._output.commit()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        for writer in self._splits.values():
            logger.info(
                "wrote %s/%s: %d sequences, %d tokens, max_token_id %d",
                self.path,
                writer.split,
                writer.sequence_count,
                writer.token_count,
                writer.max_token_id,
            )

    def abort(self) -> None:
        """Discard everything written so far; ``path`` is left as it was (idempotent).

        Every write still in flight ends before the partial output is removed.
        """
        self._closed = True
        self._output.abort()

    def __enter__(self) -> FlatTokensWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self._failed is not None:
            raise LoaderClosedError(
                f"FlatTokensWriter for {self.path} was aborted, nothing committed: {self._failed}"
            )
        if self._closed:
            raise LoaderClosedError(f"FlatTokensWriter for {self.path} is closed")


def write_flat_tokens(
    path: str | os.PathLike[str], splits: Mapping[str, Iterable[Any]], **writer_kwargs: Any
) -> None:
    """Write a whole dataset in one call: ``splits`` maps split name to its sequences.

    ``path`` and the keyword arguments are those of :class:`FlatTokensWriter`. The sequences
    may be a lazy iterable (a generator over a corpus): they are appended in batches of about
    ``_BATCH_TOKENS`` tokens, so memory stays bounded whatever the corpus size.
    """
    if not isinstance(splits, Mapping):
        raise ConfigError(
            f"write_flat_tokens: splits must map split name to sequences, got {reprlib.repr(splits)}"
        )
    with FlatTokensWriter(path, **writer_kwargs) as writer:
        for split, sequences in splits.items():
            if isinstance(sequences, np.ndarray):
                writer.append(split, sequences)
                continue
            batch: list[np.ndarray] = []
            batch_tokens = 0
            for i, seq in enumerate(_iterate(sequences)):
                arr = _as_array(i, seq)
                batch.append(arr)
                batch_tokens += arr.size
                if batch_tokens >= _BATCH_TOKENS:
                    writer.append(split, batch)
                    batch, batch_tokens = [], 0
            writer.append(split, batch)


def _iterate(sequences: Any) -> Iterator[Any]:
    if isinstance(sequences, (str, bytes)) or sequences is None:
        raise ConfigError(
            f"sequences must be an iterable of 1-D integer sequences, got {reprlib.repr(sequences)}"
        )
    try:
        return iter(sequences)
    except TypeError:
        raise ConfigError(
            f"sequences must be an iterable of 1-D integer sequences, got {reprlib.repr(sequences)}"
        ) from None


def _as_array(i: int, seq: Any) -> np.ndarray:
    """Sequence ``i`` as a numpy array, or a ConfigError quoting it (ragged, None, not numbers)."""
    if seq is None or isinstance(seq, (str, bytes)):
        raise ConfigError(f"sequence {i} must be a 1-D sequence of token ids, got {seq!r}")
    try:
        arr = np.asarray(seq)
    except (ValueError, TypeError) as exc:  # ragged nesting, unconvertible objects
        raise ConfigError(
            f"sequence {i} is not a 1-D sequence of integers: {reprlib.repr(seq)} ({exc})"
        ) from None
    if arr.ndim == 1 and arr.size and arr.dtype.kind not in "iu":
        values = arr.tolist() if isinstance(seq, np.ndarray) else list(seq)
        bad = next((v for v in values if not _is_int(v)), values[0])
        raise ConfigError(
            f"sequence {i}: token ids must be integers, got {bad!r} (dtype {arr.dtype}) in "
            f"{reprlib.repr(seq)}"
        )
    return arr


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _as_arrays(sequences: Any) -> Any:
    """``sequences`` checked element by element (a 2-D integer array passes through whole)."""
    if isinstance(sequences, np.ndarray) and sequences.ndim == 2:
        if sequences.dtype.kind not in "iu":
            bad = sequences.reshape(-1)[:1].tolist()
            raise ConfigError(
                f"sequences: token ids must be integers, got dtype {sequences.dtype} "
                f"(first value {bad[0] if bad else None!r})"
            )
        return sequences
    return [_as_array(i, seq) for i, seq in enumerate(_iterate(sequences))]


def _check_arguments(
    path: Any,
    *,
    zarr_format: Any,
    chunk_tokens: Any,
    shard_tokens: Any,
    overwrite: Any,
    storage_options: Any,
    checksum: Any,
    blosc_block_bytes: Any,
) -> tuple[int, int | None, int | None, bool]:
    """The writer's arguments checked (ConfigError naming the bad one), integers normalised:
    (chunk_tokens, shard_tokens, blosc_block_bytes, checksum)."""
    chunk_tokens = chunk_tokens_arg("FlatTokensWriter.chunk_tokens", chunk_tokens)
    if blosc_block_bytes is not None:  # None: the format's default (create_split_arrays)
        given = blosc_block_bytes
        try:
            valid = not isinstance(given, bool)
            blosc_block_bytes = operator.index(given)  # numpy integers too
        except TypeError:
            valid = False
        if not valid or not 0 <= blosc_block_bytes <= 1 << 30 or blosc_block_bytes % 4:
            raise ConfigError(
                "FlatTokensWriter.blosc_block_bytes must be 0 (Blosc's choice) or a multiple "
                f"of 4 up to 2**30, got {given!r}"
            )
    if checksum is None:
        checksum = zarr_format == 3  # format 2: seqax's exact layout, which has no checksum
    if not isinstance(checksum, bool) or (checksum and zarr_format != 3):
        raise ConfigError(
            "FlatTokensWriter.checksum must be a bool, and True only with zarr_format=3 "
            f"(format 2 keeps seqax's exact layout), got {checksum!r} with "
            f"zarr_format={zarr_format!r}"
        )
    if isinstance(zarr_format, bool) or zarr_format not in (2, 3):
        raise ConfigError(f"FlatTokensWriter.zarr_format must be 2 or 3, got {zarr_format!r}")
    if shard_tokens is not None:
        shard_tokens = positive_int("FlatTokensWriter.shard_tokens", shard_tokens)
        if zarr_format != 3:
            raise ConfigError(
                "FlatTokensWriter.shard_tokens needs zarr_format=3 (format 2 has no sharding), "
                f"got zarr_format={zarr_format}"
            )
        if shard_tokens % chunk_tokens:
            raise ConfigError(
                f"FlatTokensWriter.shard_tokens ({shard_tokens}) must be a multiple of "
                f"chunk_tokens ({chunk_tokens})"
            )
    if not isinstance(overwrite, bool):
        raise ConfigError(f"FlatTokensWriter.overwrite must be a bool, got {overwrite!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(
            f"FlatTokensWriter.path must be a str or os.PathLike, got {reprlib.repr(path)}"
        )
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ConfigError(
            "FlatTokensWriter.storage_options must be a mapping, "
            f"got {type(storage_options).__name__}"
        )
    return chunk_tokens, shard_tokens, blosc_block_bytes, checksum
