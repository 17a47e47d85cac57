"""Retrying transient storage failures with jittered exponential backoff, up to a deadline.

Only the store layer retries: asyncflat turns off the filesystems' own retry loops where it can
(see ``source.py``), so attempts never multiply (gcsfs x aiobotocore x ours).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from asyncflat.config import RetryPolicy
from asyncflat.errors import ObjectReplacedError, StorageError, TransientStorageError, error_text

__all__ = [
    "is_precondition_failure",
    "is_range_past_end",
    "is_throttle",
    "is_transient",
    "retrying",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

_TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Statuses by which a store says "slow down": the concurrency limit backs off on these.
_THROTTLE_HTTP = frozenset({429, 503})
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestThrottled",
    }
)
_TRANSIENT_ERRNO = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EAGAIN,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)
# Connection-level failures of aiohttp, botocore and requests (gcsfs raises requests' ProxyError
# for a 502) that do not all derive from the builtin ConnectionError/TimeoutError.
_TRANSIENT_NAMES = (
    "ServerDisconnected",
    "ClientOSError",
    "ClientPayloadError",
    "ConnectionClosed",
    "EndpointConnectionError",
    "ReadTimeout",
    "ConnectTimeout",
    "ProxyError",
    "ChunkedEncodingError",
    "ResponseStreamingError",
    "IncompleteRead",
)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and its explicit causes (``raise ... from``), outermost first.

    s3fs translates botocore's ClientError into a plain OSError (EBUSY for a 503) and keeps the
    ClientError, with its HTTP status, as ``__cause__``.
    """
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 8 and all(current is not c for c in chain):
        chain.append(current)
        current = current.__cause__
    return chain


#: obstore reports an HTTP failure as text ("... Server returned non-2xx status code: 503 ...")
_OBSTORE_STATUS = re.compile(r"status(?: code)?:? (\d{3})\b")


def _obstore_status(exc: BaseException) -> int | None:
    if not type(exc).__module__.startswith("obstore"):
        return None
    found = _OBSTORE_STATUS.search(str(exc))
    return int(found.group(1)) if found else None


def _own_status(exc: BaseException) -> int | None:
    status = _obstore_status(exc)
    if status is not None:
        return status
    # aiohttp's .status before .code: its ClientResponseError.code is a deprecated alias that warns.
    for attr in ("status", "status_code", "code"):  # aiohttp .status, gcsfs HttpError.code
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status an fsspec backend attached to ``exc`` or its causes, if any."""
    for link in _causes(exc):
        status = _own_status(link)
        if status is not None:
            return status
    return None


def _error_code(exc: BaseException) -> str | None:
    """The service's error code (botocore ClientError: ``SlowDown``...) in ``exc``'s causes."""
    for link in _causes(exc):
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if isinstance(code, str):
                return code
    return None


def is_throttle(exc: BaseException) -> bool:
    """Whether the store asked us to slow down (HTTP 429 or 503, S3 ``SlowDown``)."""
    return _http_status(exc) in _THROTTLE_HTTP or _error_code(exc) in _THROTTLE_CODES


def is_precondition_failure(exc: BaseException) -> bool:
    """Whether the store refused a conditional read (HTTP 412 Precondition Failed, S3's
    ``PreconditionFailed``, obstore's ``PreconditionError``): the object changed since the
    version the read was conditional on. Permanent: a retry would be refused again, or worse,
    served the new version."""
    if _http_status(exc) == 412 or _error_code(exc) == "PreconditionFailed":
        return True
    return any(
        isinstance(link, ObjectReplacedError)
        or (
            type(link).__name__ == "PreconditionError"
            and type(link).__module__.startswith("obstore")
        )
        for link in _causes(exc)
    )


#: words for a range past an object's end: S3's and s3fs's 416 ("not satisfiable"), and
#: object_store's own check of a range against the object's size (its ``StartTooLarge``)
_PAST_END_TEXTS = ("not satisfiable", "Wanted range starting at")
#: object_store's words for a range response it cannot use (a whole object for a range, a
#: ``Content-Range`` it cannot parse): every retry gets the same answer
_BAD_RANGE_RESPONSE_TEXTS = ("non-partial response", "Content-Range header", "CONTENT_RANGE header")


def is_range_past_end(exc: BaseException) -> bool:
    """Whether the store refused a ranged read as past the object's end (HTTP 416 Range Not
    Satisfiable; s3fs says "not satisfiable", object_store "Wanted range starting at"): the
    object is shorter than the range, which ``PinnedStore`` reads as empty (a truncated object),
    as zarr's ``FsspecStore`` does."""
    return _http_status(exc) == 416 or any(
        text in str(link) for link in _causes(exc) for text in _PAST_END_TEXTS
    )


def is_transient(exc: BaseException) -> bool:
    """Whether a failed read is worth retrying: throttling, 5xx, timeouts, resets.

    Missing objects (404 -> FileNotFoundError), refusals (403 -> PermissionError or gcsfs's
    ``OSError("Forbidden: ...")``) and other 4xx are permanent.
    """
    if isinstance(exc, TransientStorageError):
        return True
    if is_precondition_failure(exc):  # the object changed: a retry must not read it again
        return False
    if isinstance(exc, (FileNotFoundError, PermissionError, StorageError)):
        return False
    status = _http_status(exc)
    if status is not None:
        return status in _TRANSIENT_HTTP
    if _error_code(exc) in _THROTTLE_CODES:
        return True
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO:
        return True
    name = type(exc).__name__
    if type(exc).__module__.startswith("obstore"):
        # Its specific errors (not found, permission denied, unauthenticated, precondition,
        # a bad path or configuration) are permanent; without an HTTP status (see above), a
        # GenericError is the request failing on the way (connect, reset, timeout), except a
        # range response it cannot use (a whole object for a range: a server that ignores
        # ranges, or S3 on a range of an empty object), which every retry repeats.
        return name == "GenericError" and not any(
            text in str(exc) for text in _BAD_RANGE_RESPONSE_TEXTS
        )
    return any(part in name for part in _TRANSIENT_NAMES)


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
    The deadline also cuts off an attempt in progress: a store that accepts a request and never
    answers costs ``policy.deadline_s``, not forever. (Each attempt's own bound,
    ``policy.attempt_timeout_s``, is applied around the filesystem call by
    :func:`~asyncflat.storage.filesystems.bounded`, so that waiting for a request slot does
    not count against it.)
    """
    start = time.monotonic()
    backoff = policy.initial_backoff_s
    for number in range(1, policy.max_attempts + 1):
        remaining = policy.deadline_s - (time.monotonic() - start)
        try:
            async with asyncio.timeout(max(remaining, 0.0)) as budget:
                return await attempt()
        except Exception as exc:
            elapsed = time.monotonic() - start
            if budget.expired():
                raise TransientStorageError(
                    f"{describe()}: no answer within the retry deadline "
                    f"(RetryPolicy.deadline_s={policy.deadline_s:g}): attempt {number} cut off "
                    f"after {elapsed:.1f} s"
                ) from exc
            if not is_transient(exc):
                raise
            # Full jitter (AWS architecture blog): spreads retries of many concurrent readers.
            sleep = random.uniform(0, backoff)
            if number == policy.max_attempts or elapsed + sleep > policy.deadline_s:
                raise TransientStorageError(
                    f"{describe()}: still failing after {number} attempts over {elapsed:.1f} s: "
                    f"{type(exc).__name__}: {error_text(exc)}"
                ) from exc
            if on_retry is not None:
                on_retry(exc)
            log.debug("retrying %s after %s (attempt %d)", describe(), exc, number)
            await asyncio.sleep(sleep)
            backoff = min(policy.max_backoff_s, backoff * 2)
    raise AssertionError("unreachable")  # pragma: no cover
