"""Tokenization in worker processes, in order, that never outlives a failure.

One job: turn an iterable of document batches into (ids, lengths) pairs, in order, with at most
``4 * workers`` batches in flight. A failure anywhere (a tokenizer error, a worker killed by the
OOM killer, the consumer giving up) stops every worker before the generator finishes, and no
thread of the pool is left for the interpreter's exit to wait on. The workers also die with
this process however it ends, SIGKILL included (see :class:`_Lifeline`); multiprocessing's
resource tracker then follows by itself, as it exits when the last holder of its pipe is gone.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Generator, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from asyncflat.text.tokenizer import Tokenizer, TokenizerError, load_tokenizer, tokenize_batch

logger = logging.getLogger(__name__)

# How long stopped workers get to finish the batch in hand before they are killed.
_GRACE_S = 5.0

# prctl(2): ask for a signal when the parent thread ends.
_PR_SET_PDEATHSIG = 1

_worker_tokenizer: Tokenizer | None = None


class _Lifeline:
    """A pipe whose write end only this process holds: EOF in a worker means this process died.

    SIGKILL runs no cleanup, and a spawned worker waiting on the pool's queues never learns that
    its parent is gone (it holds both ends of those pipes itself), so it would live on. Each
    worker watches its copy of the read end in a thread and exits at EOF, which the kernel sends
    when the last write end closes, however this process ends; this works on every platform. On
    Linux a parent-death signal (``PR_SET_PDEATHSIG``) also kills a worker whose tokenizer holds
    the GIL and keeps the watching thread from running. The parent closes the pipe once its
    workers are stopped. A process forked from the parent meanwhile would hold a write end too.
    """

    _writer: Connection | None

    def __init__(self) -> None:
        reader, writer = multiprocessing.Pipe(duplex=False)
        self._reader, self._writer = reader, writer
        self._parent = os.getpid()
        self._main_thread = True

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for each worker by the thread that starts it. The parent-death signal fires
        # when that thread ends, not the process: only the main thread lives as long as we do.
        return {
            "reader": self._reader,
            "parent": os.getpid(),
            "main_thread": threading.current_thread() is threading.main_thread(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._reader, self._writer = state["reader"], None  # the write end stays with the parent
        self._parent, self._main_thread = state["parent"], state["main_thread"]

    def close(self) -> None:
        """In the parent, once no worker runs: the EOF it sends then tells no one."""
        if self._writer is not None:
            self._writer.close()
        self._reader.close()

    def hold(self) -> None:
        """In a worker, before anything slow: die when the parent does, from now on."""
        if self._main_thread:
            _signal_on_parent_death()
        # The parent may have died before the signal was asked for (or before this worker ran).
        if os.getppid() != self._parent:
            os._exit(1)
        threading.Thread(target=self._watch, name="asyncflat-lifeline", daemon=True).start()

    def _watch(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            self._reader.recv_bytes()  # nothing is ever sent: this returns when the parent dies
        os._exit(1)


def _signal_on_parent_death() -> None:
    """Linux: have the kernel SIGKILL this process when its parent thread ends."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sig = ctypes.c_ulong(signal.SIGKILL)
        zero = ctypes.c_ulong(0)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, zero, zero, zero) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError) as e:  # the pipe still watches
        logger.debug("no parent-death signal for a tokenizer worker: %s", e)


def _init_worker(spec: str, lifeline: _Lifeline) -> None:
    global _worker_tokenizer
    lifeline.hold()
    # Each worker is one core's worth of work: keep the tokenizers library's own thread pool
    # from multiplying that by the number of cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    _worker_tokenizer = load_tokenizer(spec)


def _tokenize_in_worker(texts: Sequence[str], first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None, "worker initializer did not run"
    return tokenize_batch(_worker_tokenizer, texts, first)


def tokenized_batches(
    tokenizer: Tokenizer, batches: Iterable[list[str]], workers: int
) -> Generator[tuple[np.ndarray, np.ndarray], None, None]:
    """Tokenize ``batches`` in order: in this process for ``workers <= 1``, else in a pool."""
    first = 0
    if workers <= 1:
        for texts in batches:
            yield tokenize_batch(tokenizer, texts, first)
            first += len(texts)
        return
    # spawn, not fork: the parent may run jax and other threads, which fork would break.
    # concurrent.futures, not multiprocessing.Pool: a worker that dies breaks the pool and
    # fails its futures, where Pool would replace the worker and wait forever for the result.
    # closing() after stop_pool: a worker still in its grace period must not see EOF.
    with contextlib.closing(_Lifeline()) as lifeline:
        pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(tokenizer.spec, lifeline),
        )
        finished = False
        try:
            in_flight: collections.deque[Future[tuple[np.ndarray, np.ndarray]]]
            in_flight = collections.deque()
            for texts in batches:
                in_flight.append(pool.submit(_tokenize_in_worker, texts, first))
                first += len(texts)
                if len(in_flight) >= 4 * workers:
                    yield _result(pool, in_flight.popleft(), tokenizer)
            while in_flight:
                yield _result(pool, in_flight.popleft(), tokenizer)
            finished = True
        except BrokenProcessPool:  # from submit(), once a dead worker has broken the pool
            raise _worker_died(tokenizer) from None
        finally:
            stop_pool(pool, kill=not finished)


def _result(
    pool: ProcessPoolExecutor, future: Future[tuple[np.ndarray, np.ndarray]], tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    # Poll rather than block: a worker killed while it sends a result leaves a partial message
    # that the pool itself never notices (its manager thread blocks reading the rest), so the
    # future would never fail. A worker that has exited while the pool runs has died.
    while True:
        try:
            return future.result(timeout=0.5)
        except BrokenProcessPool:
            raise _worker_died(tokenizer) from None
        except FutureTimeout:
            if any(p.exitcode is not None for p in _processes(pool)):
                raise _worker_died(tokenizer) from None


def _worker_died(tokenizer: Tokenizer) -> TokenizerError:
    return TokenizerError(
        f"a tokenizer worker process ({tokenizer.spec}) died: killed, out of memory, or a "
        "crash inside the tokenizer"
    )


def _processes(pool: ProcessPoolExecutor) -> list[Any]:
    # No public accessor before Python 3.14 (terminate_workers); the processes are what we need.
    return list((getattr(pool, "_processes", None) or {}).values())


def stop_pool(pool: ProcessPoolExecutor, *, kill: bool) -> None:
    """Shut ``pool`` down; with ``kill``, workers still busy after a grace period are killed."""
    if not kill:
        pool.shutdown(wait=True, cancel_futures=True)
        return
    processes = _processes(pool)
    manager: threading.Thread | None = getattr(pool, "_executor_manager_thread", None)
    result_queue = getattr(pool, "_result_queue", None)
    pool.shutdown(wait=False, cancel_futures=True)
    # Let each worker finish the batch in hand and exit by itself: a worker killed while it
    # writes its result is what jams the pool (see _release_manager).
    deadline = time.monotonic() + _GRACE_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.exitcode is None:
            process.kill()
    for process in processes:
        process.join(timeout=10)
    _release_manager(manager, result_queue)
    pool.shutdown(wait=True, cancel_futures=True)


def _release_manager(manager: threading.Thread | None, result_queue: Any) -> None:
    """End the pool's manager thread even when a killed worker left half a message behind.

    CPython's ProcessPoolExecutor reads results in a manager thread; a worker killed in the middle
    of sending one leaves a partial message in the shared result pipe, and the manager blocks in
    ``recv()`` forever. The interpreter's exit joins that thread, so the process would never exit.
    This end of the pipe is still ours: pad the message with zero bytes until ``recv()`` returns.
    What it returns does not unpickle, so the manager marks the pool broken and ends.
    """
    if manager is None:
        return
    manager.join(timeout=1.0)
    writer = getattr(result_queue, "_writer", None)
    if not manager.is_alive() or writer is None:
        return
    logger.debug("a killed tokenizer worker left a partial result; releasing the pool's reader")
    fd = writer.fileno()
    os.set_blocking(fd, False)
    zeros = bytes(1 << 16)
    deadline = time.monotonic() + 30
    while manager.is_alive() and time.monotonic() < deadline:
        try:
            os.write(fd, zeros)
        except (BlockingIOError, BrokenPipeError):
            pass
        manager.join(timeout=0.01)
    if manager.is_alive():
        logger.warning("a tokenizer pool's reader thread did not end; the process may not exit")
