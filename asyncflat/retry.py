"""Retrying transient storage failures with jittered exponential backoff, up to a deadline.

Only the store layer retries: asyncflat turns off the filesystems' own retry loops where it can
(see ``source.py``), so attempts never multiply (gcsfs x aiobotocore x ours).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .config import RetryPolicy
from .errors import StorageError, TransientStorageError

__all__ = ["is_transient", "retrying"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
_TRANSIENT_ERRNO = frozenset(
    {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
     errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH}
)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an fsspec backend attached to ``exc``, if any (gcsfs, aiohttp, botocore)."""
    for attr in ("code", "status", "status_code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether a failed read is worth retrying: throttling, 5xx, timeouts, resets."""
    if isinstance(exc, TransientStorageError):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, StorageError)):
        return False
    status = _http_status(exc)
    if status is not None:
        return status in _TRANSIENT_HTTP
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO:
        return True
    # aiohttp's and botocore's connection errors do not all derive from the builtins above.
    name = type(exc).__name__
    return any(part in name for part in ("ServerDisconnected", "ClientOSError", "ClientPayloadError",
                                         "ConnectionClosed", "EndpointConnectionError",
                                         "ReadTimeout", "ConnectTimeout"))


async def retrying(
    attempt: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    describe: Callable[[], str],
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Await ``attempt()`` until it succeeds, a permanent error occurs, or the budget runs out.

    Permanent errors propagate unchanged. When attempts or the deadline run out, the last
    transient error is raised as TransientStorageError naming the object and the attempts made.
    """
    start = time.monotonic()
    backoff = policy.initial_backoff_s
    for number in range(1, policy.max_attempts + 1):
        try:
            return await attempt()
        except Exception as exc:
            if not is_transient(exc):
                raise
            elapsed = time.monotonic() - start
            # Full jitter (AWS architecture blog): spreads retries of many concurrent readers.
            sleep = random.uniform(0, backoff)
            if number == policy.max_attempts or elapsed + sleep > policy.deadline_s:
                raise TransientStorageError(
                    f"{describe()}: still failing after {number} attempts over {elapsed:.1f} s: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if on_retry is not None:
                on_retry(exc)
            log.debug("retrying %s after %s (attempt %d)", describe(), exc, number)
            await asyncio.sleep(sleep)
            backoff = min(policy.max_backoff_s, backoff * 2)
    raise AssertionError("unreachable")  # pragma: no cover
