"""Retries alone: what is transient, backoff to a budget, permanent errors unchanged."""

from __future__ import annotations

import asyncio
import errno

import pytest

from asyncflat import RetryPolicy, StorageError, TransientStorageError
from asyncflat.storage.retry import is_throttle, is_transient, retrying


class HttpError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


@pytest.mark.parametrize(
    ("exc", "transient", "throttle"),
    [
        (HttpError(503), True, True),
        (HttpError(429), True, True),
        (HttpError(500), True, False),
        (HttpError(403), False, False),
        (ConnectionResetError(), True, False),
        (OSError(errno.ETIMEDOUT, "timed out"), True, False),
        (FileNotFoundError("gone"), False, False),
        (PermissionError("no"), False, False),
        (StorageError("bad"), False, False),
        (TransientStorageError("flaky"), True, False),
        (ValueError("other"), False, False),
    ],
)
def test_classification(exc: BaseException, transient: bool, throttle: bool) -> None:
    assert is_transient(exc) is transient
    assert is_throttle(exc) is throttle


def test_a_status_in_the_cause_chain_counts() -> None:
    wrapped = OSError("s3fs said busy")
    wrapped.__cause__ = HttpError(503)
    assert is_transient(wrapped) and is_throttle(wrapped)


POLICY = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.002)


def test_transient_failures_are_retried_until_success() -> None:
    calls: list[int] = []
    retried: list[BaseException] = []

    async def attempt() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    result = asyncio.run(retrying(attempt, POLICY, describe=lambda: "obj", on_retry=retried.append))
    assert result == "ok" and len(calls) == 3 and len(retried) == 2


def test_the_budget_runs_out_with_a_named_error() -> None:
    async def attempt() -> str:
        raise HttpError(503)

    with pytest.raises(TransientStorageError, match=r"mem://x/c/0: still failing after 4 attempts"):
        asyncio.run(retrying(attempt, POLICY, describe=lambda: "mem://x/c/0"))


def test_a_permanent_error_propagates_at_once() -> None:
    calls: list[int] = []

    async def attempt() -> str:
        calls.append(1)
        raise PermissionError("403")

    with pytest.raises(PermissionError):
        asyncio.run(retrying(attempt, POLICY, describe=lambda: "obj"))
    assert len(calls) == 1
