"""More than one pass over a split: :func:`iter_epochs`.

A :class:`~asyncflat.loader.shuffling.ShufflingLoader` serves one *epoch*: ``step_count`` steps, after
which ``iter()`` stops. ``ShufflingLoader(..., epoch=e)`` serves pass ``e``: epoch 0 is seqax's
order exactly, epoch ``e > 0`` the same construction seeded with ``seed + e * 2**64``
(:func:`asyncflat.plan.shuffle.epoch_seed`), a different order that is just as deterministic. A batch is
a pure function of ``(epoch, step)``, so a run resumes from those two numbers and nothing else.

:func:`iter_epochs` chains the passes. While the last minipoch of epoch ``e`` is being served it
builds the loader of epoch ``e + 1`` in a background thread and loads that epoch's first step, so
the epoch boundary costs no more than a minipoch boundary. For that overlap, up to two more
shuffle buffers per stream are held (the next epoch's first two).

Given a :class:`~asyncflat.loader.mixture.MixtureParams`, the epochs are those of a
:class:`~asyncflat.loader.mixture.loader.MixtureLoader`: epoch ``e`` is the mixture's steps
``[e * step_count, (e + 1) * step_count)``, each source carrying on where epoch ``e - 1`` left
it (docs/epochs.md). A mixture has no one minipoch: its next epoch's loader is built from the
last sixteenth of its steps (at least the last step) on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import threading
from collections.abc import Generator, Iterator
from typing import Any, TypeVar

from jax.sharding import Sharding

from asyncflat._typecheck import checked
from asyncflat.config import EngineOptions, FlatTokensParams, TokenBatchParams, step_argument
from asyncflat.errors import AsyncflatError, ConfigError, LoaderClosedError
from asyncflat.loader.mixture.config import MixtureParams
from asyncflat.loader.mixture.loader import MixtureLoader
from asyncflat.loader.shared.batch import TokenBatch
from asyncflat.loader.shared.iterator import BatchIterator
from asyncflat.loader.shared.open import sizing_log
from asyncflat.loader.shuffling import ShufflingLoader

__all__ = ["EpochIterator", "iter_epochs"]

log = logging.getLogger(__name__)

#: what :func:`iter_epochs` serves from
Loader = ShufflingLoader | MixtureLoader
_T = TypeVar("_T")


def build_ahead_from(loader: Loader) -> int:
    """The step of ``loader`` from which the next epoch's loader is built: its last served
    minipoch's first step (a mixture: the last sixteenth of its steps)."""
    if isinstance(loader, MixtureLoader):
        return loader.step_count - max(1, loader.step_count // 16)
    return loader.plan.last_minipoch_step


@checked
def iter_epochs(
    split: str,
    params: FlatTokensParams | MixtureParams,
    token_batch_params: TokenBatchParams,
    sharding: Sharding | None = None,
    *,
    start_epoch: int = 0,
    start_step: int = 0,
    epochs: int | None = None,
    options: EngineOptions | None = None,
) -> EpochIterator:
    """``(epoch, step, batch)`` from ``(start_epoch, start_step)`` on, epoch after epoch.

    ``step`` restarts at 0 in every epoch (it is the loader's step, in ``[0, step_count)``);
    ``epochs`` is the number of the epoch to stop *before* (``None``: never stop). To resume,
    pass the epoch and the step after the last one trained on; ``start_step == step_count`` is
    allowed and means "the start of the next epoch". Use it as a context manager (or call
    ``close()``, or let it be collected) to stop the loaders; ``.loader`` is the loader of the
    epoch being served (for ``stats()``). A :class:`MixtureParams` chains the epochs of a
    :class:`~asyncflat.loader.mixture.loader.MixtureLoader` (see the module's docstring).
    """
    start_epoch = step_argument(start_epoch, "iter_epochs: start_epoch")
    start_step = step_argument(start_step, "iter_epochs: start_step")
    if epochs is not None:
        epochs = step_argument(epochs, "iter_epochs: epochs")
    if start_epoch < 0:
        raise ConfigError(f"iter_epochs: start_epoch must be >= 0, got {start_epoch}")
    if start_step < 0:
        raise ConfigError(f"iter_epochs: start_step must be >= 0, got {start_step}")
    if epochs is not None and epochs < 0:
        raise ConfigError(f"iter_epochs: epochs must be >= 0 or None, got {epochs}")

    return EpochIterator(
        split,
        params,
        token_batch_params,
        sharding,
        start_epoch=start_epoch,
        start_step=start_step,
        epochs=epochs,
        options=EngineOptions() if options is None else options,
    )


class EpochIterator(Iterator[tuple[int, int, TokenBatch]]):
    """What :func:`iter_epochs` returns: an iterator of ``(epoch, step, batch)`` that owns the
    loaders it runs; ``loader`` is the current epoch's (None before the first ``next()`` and
    after the end)."""

    def __init__(
        self,
        split: str,
        params: FlatTokensParams | MixtureParams,
        token_batch_params: TokenBatchParams,
        sharding: Sharding | None,
        *,
        start_epoch: int,
        start_step: int,
        epochs: int | None,
        options: EngineOptions,
    ) -> None:
        # The generator holds this holder, not the iterator: a dropped iterator is finalized
        # at once by the thread that drops it (a cycle through ``self`` waited for the cycle
        # collector, whose run on one of the loaders' own threads could deadlock its close).
        self._current: list[Loader | None] = [None]
        self._lock = threading.Lock()
        self._closing = False
        #: the error every next() raises once a KeyboardInterrupt ended the generator
        self._broken: AsyncflatError | None = None
        self._delivered: tuple[int, int] | None = None  # the last (epoch, step) returned
        make = _Epochs(split, params, token_batch_params, sharding, options)
        self._gen = _warning_once(_epochs(self._current, make, start_epoch, start_step, epochs))

    @property
    def loader(self) -> Loader | None:
        """The loader of the epoch being served (None before the first ``next()`` and after
        the end)."""
        return self._current[0]

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> tuple[int, int, TokenBatch]:
        with self._lock:  # one next() at a time; close() from another thread sees it runs
            if self._broken is not None:
                raise self._broken
            try:
                item = next(self._gen)
            except KeyboardInterrupt:
                # Outside the generator's guarded waits (building a loader, closing one): it
                # ended. Say so from now on rather than stop as if the run were over.
                resume = self._delivered
                self._broken = AsyncflatError(
                    "this iter_epochs was ended by a KeyboardInterrupt outside its waits; "
                    + ("start a new one" if resume is None else
                       f"resume with start_epoch={resume[0]}, start_step={resume[1] + 1}")
                )  # fmt: skip
                raise
            if self._closing:  # close() came from another thread meanwhile
                self._gen.close()
                raise LoaderClosedError("the epoch iterator was closed")
            if isinstance(item, _Interrupted):
                exc = item.exc
                del item  # nothing here may keep the exception (and its frames) alive
                try:
                    raise exc
                finally:
                    del exc
            self._delivered = item[0], item[1]
            return item

    def close(self) -> None:
        """Stop the loaders (the current one and one being built ahead). Idempotent. From
        another thread while ``next()`` runs, it closes the current loader and that ``next()``
        raises :class:`~asyncflat.errors.LoaderClosedError` (as soon as it waits on that
        loader, else when it would return) and closes the rest."""
        if self._lock.acquire(blocking=False):
            try:
                self._gen.close()
            finally:
                self._lock.release()
            return
        self._closing = True
        loader = self._current[0]
        if loader is not None:
            loader.close()

    def __enter__(self) -> EpochIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    #: the logger as the class holds it (module globals may be None at interpreter shutdown)
    _log = log

    def __del__(self) -> None:
        gen = getattr(self, "_gen", None)
        if gen is not None:
            try:
                gen.close()
            except Exception:  # noqa: BLE001 - a finalizer must never raise
                try:
                    self._log.debug("closing a collected epoch iterator failed", exc_info=True)
                except Exception:  # noqa: BLE001 - logging torn down at shutdown
                    pass


class _OncePerCondition(logging.Filter):
    """Lets each distinct sizing warning (:data:`~asyncflat.loader.shared.open.sizing_log`:
    rows never served, a mixture source starved) through once while an :func:`iter_epochs`
    runs: every epoch's loader is built from the same sizes and weights, and logged them again
    at each epoch. Process-wide while it runs: a loader of the same sizes built meanwhile has
    had its warning logged."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()
        self._lock = threading.Lock()  # epochs are built on a background thread

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        message = record.getMessage()
        with self._lock:
            if message in self._seen:
                return False
            self._seen.add(message)
        return True

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        sizing_log.addFilter(self)
        try:
            yield
        finally:
            sizing_log.removeFilter(self)


class _Interrupted:
    """What the generator yields when Ctrl-C interrupts one of its waits: ``__next__`` raises
    the ``KeyboardInterrupt`` and the generator stays where it was, so the next ``next()``
    returns the same step (an exception raised through a generator would end it)."""

    def __init__(self, exc: KeyboardInterrupt) -> None:
        self.exc = exc


def _warning_once(generator: Generator[_T, None, None]) -> Generator[_T, None, None]:
    """``generator``'s items, each sizing warning logged once for all of them."""
    with _OncePerCondition().installed():
        yield from generator


@dataclasses.dataclass(frozen=True)
class _Epochs:
    """How :func:`iter_epochs` makes the loader of an epoch."""

    split: str
    params: FlatTokensParams | MixtureParams
    token_batch_params: TokenBatchParams
    sharding: Sharding | None
    options: EngineOptions

    def loader(self, epoch: int) -> Loader:
        # (ShufflingLoader(...) of a MixtureParams is a MixtureLoader)
        loader: Loader = ShufflingLoader(
            self.split, self.params, self.token_batch_params, self.sharding,
            options=self.options, epoch=epoch,
        )  # fmt: skip
        return loader

    def started(self, epoch: int) -> tuple[Loader, BatchIterator, TokenBatch]:
        """The epoch's loader, its iterator and its first batch: minipoch 0 is filled now, not
        at the boundary, and the iterator goes on from there (a ``load(0)`` then ``iter(1)``
        built step 1 twice: once ahead of the load, once in the iterator)."""
        loader = self.loader(epoch)
        try:
            iterator = loader.iter(0)
            try:
                _, batch = next(iterator)
            except BaseException:
                iterator.close()
                raise
            return loader, iterator, batch
        except BaseException:
            loader.close()
            raise


def _next_step(iterator: BatchIterator) -> Generator[_Interrupted, None, Any]:
    """``next(iterator)`` (None at its end); a Ctrl-C meanwhile is yielded, and the same step
    asked again (the iterator stays at its step)."""
    while True:
        box = []  # the interrupt is not kept in this frame while the generator is suspended
        try:
            return next(iterator)
        except StopIteration:
            return None
        except KeyboardInterrupt as exc:
            box.append(_Interrupted(exc))
        yield box.pop()


def _result(future: concurrent.futures.Future[Any]) -> Generator[_Interrupted, None, Any]:
    """``future.result()``; a Ctrl-C meanwhile is yielded, and the wait taken up again."""
    while True:
        box = []  # as in _next_step
        try:
            return future.result()
        except KeyboardInterrupt as exc:
            if future.done():  # the build itself raised it: not an interrupted wait
                raise
            box.append(_Interrupted(exc))
        yield box.pop()


def _epochs(
    current: list[Loader | None],
    make: _Epochs,
    start_epoch: int,
    start_step: int,
    epochs: int | None,
) -> Generator[tuple[int, int, TokenBatch] | _Interrupted, None, None]:
    if epochs is not None and start_epoch >= epochs:
        return
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncflat-next-epoch")
    loader = current[0] = make.loader(start_epoch)
    #: the current epoch's iterator and first batch when its loader was built ahead
    started: tuple[BatchIterator, TokenBatch] | None = None
    upcoming: concurrent.futures.Future[tuple[Loader, BatchIterator, TokenBatch]] | None = None
    step = start_step
    try:
        if step > loader.step_count:
            raise ConfigError(
                f"iter_epochs: start_step {step} is past the epoch's {loader.step_count} steps"
            )
        for epoch in itertools.count(start_epoch):
            if epochs is not None and epoch >= epochs:
                return
            last = epochs is not None and epoch + 1 >= epochs
            # The next epoch starts building once this one serves its last minipoch.
            build_from = build_ahead_from(loader)
            iterator = loader.iter(step) if started is None else started[0]
            with iterator:
                if started is not None:
                    first, started = started[1], None
                    yield epoch, 0, first
                    del first  # not kept for the whole epoch
                while (item := (yield from _next_step(iterator))) is not None:
                    step, batch = item
                    if upcoming is None and not last and step >= build_from:
                        log.debug("building the loader of epoch %d ahead", epoch + 1)
                        upcoming = pool.submit(make.started, epoch + 1)
                    yield epoch, step, batch
                    del item, batch
            if last:
                return
            if upcoming is None:  # resumed past build_from, or an empty remainder
                upcoming = pool.submit(make.started, epoch + 1)
            next_loader, next_iterator, next_first = yield from _result(upcoming)
            # Closed on the pool (a thread join, up to seconds): a Ctrl-C there would end this
            # generator, and ``current`` shows the new loader, never a closing one.
            pool.submit(loader.close)
            loader = current[0] = next_loader
            started = (next_iterator, next_first)
            del next_loader, next_iterator, next_first  # ``started`` alone holds them
            upcoming = None
            step = 0
    finally:
        current[0] = None
        # Each step runs whatever interrupts another (a Ctrl-C in a close's join); last in,
        # first run: the loader, an epoch's iterator not entered yet (an error before it was),
        # the next epoch's loader (closed once built, never waited for here), the pool.
        with contextlib.ExitStack() as wind_down:
            wind_down.callback(_shut_down, pool)
            if upcoming is not None:
                wind_down.callback(upcoming.add_done_callback, _close_built)
            if started is not None:
                wind_down.callback(started[0].close)
            wind_down.callback(loader.close)


def _shut_down(pool: concurrent.futures.ThreadPoolExecutor) -> None:
    try:
        pool.shutdown(wait=True)
    except KeyboardInterrupt:
        pool.shutdown(wait=False)  # its thread ends once what it builds is closed
        raise


def _close_built(upcoming: concurrent.futures.Future[tuple[Loader, BatchIterator, Any]]) -> None:
    """Close the next epoch's loader and iterator built for a generator that has ended (on the
    pool's thread as the build ends, or at once if it has)."""
    try:
        next_loader, next_iterator, _ = upcoming.result()
    except BaseException:  # its error is not the ended generator's to raise
        log.debug("the next epoch's loader failed while closing", exc_info=True)
        return
    try:
        try:
            next_iterator.close()
        finally:
            next_loader.close()
    except Exception:  # as above: a done-callback's error would be logged as an ERROR
        log.debug("closing the next epoch's loader failed", exc_info=True)
