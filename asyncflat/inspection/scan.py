"""Reading a split for inspection, the helpers :mod:`.describe`, :mod:`.figures` and
:mod:`.verify` share: a loop of their own (:func:`run`), the split's arrays and its guarded source
(:func:`open_arrays`, :func:`open_source`), reads that name the chunk that does not decode
(:func:`read_checked`), and the windowed, checked scan of ``seq_starts``
(:func:`seq_start_windows`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from asyncflat.engine.loop import LoopThread
from asyncflat.errors import (
    AsyncflatError,
    CorruptChunkError,
    DatasetFormatError,
    carries_secret,
    install_log_redaction,
    option_secrets,
    scrubbed,
)
from asyncflat.format.split import SplitArrays, open_split
from asyncflat.source.zarr_source import ZarrTokenSource
from asyncflat.storage.filesystems import close_store, construction_error, make_store
from asyncflat.storage.guarded import guard_store

__all__ = [
    "STARTS_WINDOW",
    "TOKEN_WINDOW",
    "open_arrays",
    "open_source",
    "read_checked",
    "run",
    "seq_start_windows",
]

#: The default tokens / seq_starts entries read per request while scanning (rounded to whole
#: chunks): 16 MiB of tokens and 8 MiB of offsets, so a scan's memory stays bounded. The scans
#: take other sizes as arguments (tiny windows make every check cross window boundaries).
TOKEN_WINDOW = 1 << 22
STARTS_WINDOW = 1 << 20


def run(coro: Any, filespec: str, storage_options: Mapping[str, Any] | None) -> Any:
    """Run ``coro`` on a loop of its own; errors leave with any URL secret and any value of
    ``storage_options`` removed."""
    secrets = option_secrets(storage_options)
    install_log_redaction(secrets)
    runner = LoopThread(name="asyncflat-inspect", cpu_threads=2)
    try:
        return runner.run(coro)
    except AsyncflatError as exc:
        if not carries_secret(exc, secrets):
            raise
        raise scrubbed(exc, filespec, secrets) from None
    finally:
        runner.close()


async def open_arrays(
    filespec: str, split: str, storage_options: Mapping[str, Any] | None
) -> tuple[SplitArrays, Any]:
    """The split's arrays (through a guarded store) and the raw store, to close after."""
    try:
        store = make_store(filespec, storage_options)
    except Exception as exc:  # noqa: BLE001 - a filesystem constructor, credential exchange
        secrets = option_secrets(storage_options)
        raise construction_error(exc, filespec, secrets) from (
            None if carries_secret(exc, secrets) else exc
        )
    try:
        guarded = guard_store(store, filespec, allow_missing=True)
        return await open_split(guarded, split, name=filespec), store
    except BaseException:
        await close_store(store)
        raise


async def open_source(
    filespec: str, split: str, storage_options: Mapping[str, Any] | None
) -> ZarrTokenSource:
    """The split's guarded token source (a missing chunk is an error, not zeros); a failure to
    build the filesystem leaves without the URL's secrets."""
    try:
        return await ZarrTokenSource.open(filespec, split, storage_options=storage_options)
    except AsyncflatError:
        raise
    except Exception as exc:  # noqa: BLE001 - a filesystem constructor, credential exchange
        raise scrubbed(exc, filespec) from (None if carries_secret(exc) else exc)


async def read_checked(
    source: ZarrTokenSource, array: str, start: int, stop: int, chunk: int
) -> np.ndarray:
    """Read ``array[start:stop]``; if it fails to decode, find and name the exact chunk."""
    read = source.read_tokens if array == "encoded_tokens" else source.read_seq_starts
    try:
        return await read(start, stop)
    except CorruptChunkError as exc:
        first_error: Exception = exc
    for lo in range(start, stop, chunk):  # narrow the failure down to one chunk
        try:
            await read(lo, min(lo + chunk, stop))
        except CorruptChunkError as exc:
            raise CorruptChunkError(
                f"{source.name}/{array}: chunk {lo // chunk} (elements {lo}:{min(lo + chunk, stop)}) "
                f"does not decode: {exc}"
            ) from exc
    raise first_error


async def seq_start_windows(
    source: ZarrTokenSource,
    chunk: int,
    progress: bool,
    stop: int | None = None,
    *,
    window: int = STARTS_WINDOW,
) -> AsyncGenerator[tuple[int, np.ndarray], None]:
    """Yield consecutive windows ``(base, seq_starts[base : base + len(window)])`` (uint64) of the
    first ``stop`` entries (all by default), checking that the entries strictly increase, within
    and across windows, and naming the first index where they do not. ``window`` entries are read
    at a time, rounded down to whole chunks of ``chunk`` entries (one chunk at least)."""
    entries = source.sequence_count + 1 if stop is None else stop
    window = max(chunk, window // chunk * chunk)
    previous: int | None = None
    with tqdm(
        total=entries, unit=" offsets", desc="seq_starts", disable=not progress, leave=False
    ) as bar:
        for base in range(0, entries, window):
            data = await read_checked(
                source, "seq_starts", base, min(base + window, entries), chunk
            )
            data = data.astype(np.uint64, copy=False)
            ok = data[1:] > data[:-1]
            bad = None if ok.all() else base + 1 + int(np.argmin(ok))
            if previous is not None and int(data[0]) <= previous:
                bad = base
            if bad is not None:
                before = previous if bad == base else int(data[bad - base - 1])
                raise DatasetFormatError(
                    f"{source.name}/seq_starts: not strictly increasing at index {bad}: "
                    f"seq_starts[{bad}] = {int(data[bad - base])} <= seq_starts[{bad - 1}] = "
                    f"{before} (every sequence needs at least one token)"
                )
            bar.update(len(data))
            yield base, data
            previous = int(data[-1])
