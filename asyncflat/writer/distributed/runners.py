"""Task runners run the passes' tasks: in this process, or as Ray core tasks.

A runner only needs :meth:`TaskRunner.map`: run a plain function over a list of picklable jobs
and yield ``(position, result)`` as results arrive, stopping at the first error. The passes know
nothing about Ray, so another runner (Dask, Beam) is a class like :class:`RayRunner`.
(Named runners, not engines: :class:`asyncflat.engine.Engine` is the loader's engine.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from asyncflat.errors import ConfigError

__all__ = ["InProcessRunner", "RayRunner", "TaskRunner"]

log = logging.getLogger(__name__)

J = TypeVar("J")
R = TypeVar("R")


class TaskRunner(Protocol):
    """Runs a pass's tasks (see the module docstring)."""

    #: how many tasks run at once (sizes the tasks in flight)
    parallelism: int

    def map(self, fn: Callable[[J], R], jobs: Sequence[J]) -> Iterator[tuple[int, R]]: ...

    def close(self) -> None: ...


class InProcessRunner:
    """Runs every task here, one after another (tests, and a baseline for the benchmark)."""

    parallelism = 1

    def map(self, fn: Callable[[J], R], jobs: Sequence[J]) -> Iterator[tuple[int, R]]:
        for i, job in enumerate(jobs):
            yield i, fn(job)

    def close(self) -> None:
        pass


#: How long a failed map waits for its tasks in flight before raising anyway.
_DRAIN_TIMEOUT_S = 60.0


class RayRunner:
    """Ray core tasks (``ray.remote``) on an existing cluster (``address``) or a local one.

    A task whose worker dies is retried by Ray (``max_retries``); an exception raised by the
    task itself (a bad input line) is deterministic and is never retried: it is raised here,
    as its own type, once the other tasks in flight (at most two per CPU) have finished. They
    are not ``ray.cancel``-ed: a cancel racing a task's completion aborts the driver process in
    Ray 2.x (its task manager's check "Tried to complete task that was not pending"), which
    would take the caller's process down instead of raising.

    If Ray is already initialised in this process, that connection is used and left open.
    ``max_tasks`` caps the tasks running at once (default: two per CPU of the cluster queued).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        max_retries: int = 3,
        max_tasks: int | None = None,
        init_options: dict[str, Any] | None = None,
    ) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ConfigError(
                "the ray runner needs the ray package: pip install 'asyncflat[distributed]'"
            ) from exc
        self._ray = ray
        self._owned = False
        if not ray.is_initialized():
            options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            options.update(init_options or {})
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(address=address, **options)
            self._owned = True
        self.max_retries = max_retries
        self.parallelism = max(1, int(ray.cluster_resources().get("CPU", 1)))
        if max_tasks is not None:
            self.parallelism = min(self.parallelism, max_tasks)
        self._max_tasks = max_tasks
        self._remote: dict[Callable[..., Any], Any] = {}

    def map(self, fn: Callable[[J], R], jobs: Sequence[J]) -> Iterator[tuple[int, R]]:
        ray = self._ray
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = ray.remote(
                num_cpus=1, max_retries=self.max_retries, retry_exceptions=False
            )(fn)
        # Bounded in flight, so the driver's memory stays small; max_tasks caps concurrency.
        limit = self._max_tasks or 2 * self.parallelism
        pending: dict[Any, int] = {}
        next_job = 0
        try:
            while next_job < len(jobs) or pending:
                while next_job < len(jobs) and len(pending) < limit:
                    pending[remote.remote(jobs[next_job])] = next_job
                    next_job += 1
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    position = pending.pop(ref)
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        cause = exc.cause
                        if isinstance(cause, BaseException):
                            raise cause from None
                        raise
                    yield position, result
        finally:
            if pending:  # let them finish (see the class docstring), bounded in time
                ray.wait(list(pending), num_returns=len(pending), timeout=_DRAIN_TIMEOUT_S)

    def close(self) -> None:
        if self._owned:
            self._ray.shutdown()
            self._owned = False
