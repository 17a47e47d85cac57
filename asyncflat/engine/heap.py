"""Freed memory handed back to the system after each fill: the read slabs kept free, then
glibc's heap (``malloc_trim``).

A fill's transient allocations (compressed chunk objects read by the store's threads, a few MiB
each) come from glibc's heap once its adaptive mmap threshold has grown past their size, and the
heap keeps what they leave free, per arena (one per reading thread): at a 256 MiB buffer ~40 MiB
of resident memory that no live object holds. ``malloc_trim(0)`` returns those free pages; it is
called in a worker thread once per finished fill (once per minipoch and stream), so the event
loop never waits on it. Elsewhere (musl, macOS, Windows) there is no heap to trim.

The slabs a local store's reads go into (:mod:`asyncflat.storage.recycled`) are kept free during
a fill, whose reads use them one after another, and freed with the heap at its end: kept across
fills they added ~10 MiB to the peak RSS of a 64 MiB buffer (2.57x the buffer against 2.41x),
and a later fill is read while the trainer runs, where their page faults cost it nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import sys
from collections.abc import Callable

from asyncflat.storage.recycled import release_all

__all__ = ["available", "trim_count", "trim_later"]

log = logging.getLogger(__name__)


@functools.cache
def _resolve() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


_trims = 0  # finished trims, for tests and diagnostics (a plain int: += under the GIL is enough
# for a count read after the fact; trims of one process run on its loops' pools)


def available() -> bool:
    """Whether this process has glibc's ``malloc_trim`` (else :func:`trim_later` only frees the
    read slabs kept)."""
    return _resolve() is not None


def trim_count() -> int:
    """How many trims have finished in this process."""
    return _trims


def _trim(function: Callable[[int], int] | None) -> None:
    global _trims
    release_all()
    if function is not None:
        function(0)
        _trims += 1


def trim_later(loop: asyncio.AbstractEventLoop) -> None:
    """Hand the free read slabs and the heap's free pages back to the system, in ``loop``'s
    default executor."""
    function = _resolve()
    try:
        future = loop.run_in_executor(None, _trim, function)
    except RuntimeError:
        # The pool is shut down (the loader is closing, or the interpreter exits while a fill
        # finishes): nothing to hand back for, and the fill's unit must not fail over it.
        log.debug("trim skipped: the executor is shut down")
        return
    future.add_done_callback(_quiet)


def _quiet(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("trim failed", exc_info=future.exception())
