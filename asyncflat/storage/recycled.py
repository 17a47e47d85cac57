"""Memory for object reads, used again once nothing refers to what was read into it.

A fresh allocation of megabytes is a new anonymous mapping, first-written one 4 KiB page fault
at a time by the read that fills it. Under the sandboxed kernel of a TPU host (gVisor) those
faults do not run in parallel: 64 chunk objects of 2 MB took 161-164 ms to read into fresh
memory on 6 or on 12 threads, and 12-14 ms into memory written before (on two cores here,
53-61 against 19-23 ms). A loader reads a chunk object per read block of every fill, and a
frame lives only until its decode (and two more in the reader's cache), so a few slabs serve
every read.

A slab goes back to its pool when the last array using it is gone, however it was sliced or
viewed: each read gets a fresh ctypes view of its slab, every numpy array made from that read
keeps the view alive, and a :func:`weakref.finalize` on the view returns the slab.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import weakref

import numpy as np

__all__ = ["RecycledBytes", "release_all", "shared"]

#: Free slabs kept for later reads: at most ``KEPT_MAX`` (the reads a fill has in flight, plus
#: the reader's cache), and at most ``KEPT_BYTES`` of them (none of slabs larger than that).
KEPT_MAX = 12
KEPT_BYTES = 64 << 20
#: Smaller reads come from the heap (glibc maps only larger allocations): no slab for them.
SMALL = 128 << 10


class RecycledBytes:
    """uint8 arrays of up to ``slab_bytes`` each, taken from slabs used before when one is free.

    Thread-safe: reads take slabs on the CPU pool's threads, and a slab returns on whichever
    thread drops its last array (a deque's append and pop are atomic; no lock a finalizer
    could find already held by its own thread).
    """

    def __init__(self, slab_bytes: int, kept_bytes: int = KEPT_BYTES) -> None:
        if slab_bytes <= 0:
            raise ValueError(f"slab_bytes must be > 0, got {slab_bytes}")
        self.slab_bytes = slab_bytes
        # one ctypes type for every view (a type per size cost ~10 us of the GIL to make)
        self._slab_type = ctypes.c_uint8 * slab_bytes
        self._bound = min(KEPT_MAX, kept_bytes // slab_bytes)
        #: free slabs kept at most (the rest are freed); none once every reader has left
        self.keep = self._bound
        self._readers = 0
        self._free: collections.deque[np.ndarray] = collections.deque()
        #: arrays handed out from a new slab, and from a slab used before
        self.fresh = 0
        self.reused = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` (contents undefined). Smaller than ``SMALL``
        or larger than a slab: an ordinary allocation, never kept."""
        if not SMALL <= nbytes <= self.slab_bytes or not self.keep:
            return np.empty(nbytes, np.uint8)
        try:
            slab = self._free.pop()
            self.reused += 1
        except IndexError:
            slab = np.empty(self.slab_bytes, np.uint8)
            self.fresh += 1
        view = self._slab_type.from_buffer(slab)  # type: ignore[arg-type]  # numpy buffers
        weakref.finalize(view, self._give_back, slab).atexit = False
        return np.frombuffer(view, np.uint8, count=nbytes)  # type: ignore[call-overload]

    def _give_back(self, slab: np.ndarray) -> None:
        self._free.append(slab)
        while len(self._free) > self.keep:  # two threads may both have appended
            try:
                self._free.popleft()
            except IndexError:
                break

    def release(self) -> None:
        """Free the slabs kept now (at a fill's end: those still in use return later)."""
        self._free.clear()

    def leave(self) -> None:
        """A reader of :func:`shared`'s is closed: when it was the last, keep no slab, nor any
        still in use when it returns (a closed loader its caller still refers to holds none)."""
        with _shared_lock:
            self._readers -= 1
            if self._readers <= 0:
                self._readers, self.keep = 0, 0
        self._free.clear()

    @property
    def free(self) -> int:
        """Free slabs kept now."""
        return len(self._free)


_shared: weakref.WeakValueDictionary[int, RecycledBytes] = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def shared(slab_bytes: int) -> RecycledBytes:
    """The process's pool of ``slab_bytes`` slabs for one more reader (which calls
    :meth:`~RecycledBytes.leave` when it closes), made when none is alive: the readers of every
    loader with chunks of one size share it, so its bound holds for the process (for each size),
    and a mixture's sources and passes and the epochs of ``iter_epochs`` use one another's
    slabs. It lives as long as a reader or a slab in use refers to it."""
    with _shared_lock:
        pool = _shared.get(slab_bytes)
        if pool is None:
            pool = _shared[slab_bytes] = RecycledBytes(slab_bytes)
        pool._readers += 1
        pool.keep = pool._bound
        return pool


def release_all() -> None:
    """Free the slabs every pool keeps now (the engine calls it after each fill: a pool's free
    slabs go back to the system even where other fills, of this loader or another, read into
    it; they take fresh slabs for their next reads)."""
    with _shared_lock:
        pools = list(_shared.values())
    for pool in pools:
        pool.release()


def _reset_after_fork() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # a fork while another thread held it must not deadlock


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
