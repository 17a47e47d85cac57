"""Write datasets in seqax's exact zarr-format-2 layout, with plain zarr and numpy only.

This is an oracle independent of :mod:`asyncflat.writer.flat_tokens`: it encodes with its own few lines of
numpy, so a bug in asyncflat's encoder cannot hide in a round trip. The layout matches what
seqax's tools (zarr 2.x) wrote: Blosc lz4 clevel 5 bitshuffle, 4,194,304-token chunks with
``fill_value`` null, ``seq_starts`` in 65,536-entry chunks with a ``Delta('<i8')`` filter.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import zarr
from numcodecs import Blosc, Delta

SEQAX_TOKEN_CHUNK = 4_194_304
SEQAX_SEQ_STARTS_CHUNK = 65_536


def seqax_compressor() -> Blosc:
    return Blosc(cname="lz4", clevel=5, shuffle=Blosc.BITSHUFFLE)


def write_seqax_v2(
    path: str | os.PathLike[str],
    splits: Mapping[str, list[np.ndarray]],
    max_token_id: int | Mapping[str, int] | None = None,
) -> None:
    """Write exactly the splits given (pass both for a complete dataset).

    ``max_token_id``: None computes each split's largest id (0 when empty); an int applies to
    every split; a mapping gives it per split (so tests can write deliberately wrong values).
    """
    root = zarr.open_group(str(path), mode="w", zarr_format=2)
    for split, seqs in splits.items():
        seqs = [np.asarray(s, dtype=np.uint32) for s in seqs]
        lengths = np.array([len(s) for s in seqs], dtype=np.uint64)
        seq_starts = np.concatenate([np.zeros(1, np.uint64), np.cumsum(lengths, dtype=np.uint64)])
        ids = np.concatenate(seqs) if seqs else np.zeros(0, np.uint32)
        encoded = ids * np.uint32(2)
        encoded[seq_starts[:-1].astype(np.intp)] += np.uint32(1)

        group = root.create_group(split)
        tokens = group.create_array(
            "encoded_tokens",
            shape=encoded.shape,
            chunks=(SEQAX_TOKEN_CHUNK,),
            dtype="<u4",
            fill_value=None,
            compressors=seqax_compressor(),
            filters=None,
        )
        starts = group.create_array(
            "seq_starts",
            shape=seq_starts.shape,
            chunks=(SEQAX_SEQ_STARTS_CHUNK,),
            dtype="<u8",
            fill_value=0,
            compressors=seqax_compressor(),
            filters=[Delta(dtype="<i8", astype="<i8")],
        )
        if encoded.size:
            tokens[:] = encoded
        starts[:] = seq_starts
        if max_token_id is None:
            value = int(ids.max()) if ids.size else 0
        elif isinstance(max_token_id, Mapping):
            value = max_token_id[split]
        else:
            value = max_token_id
        group.attrs["max_token_id"] = value
