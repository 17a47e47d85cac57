"""The exceptions asyncflat raises.

Every error the library raises on purpose derives from :class:`AsyncflatError`, so a trainer can
catch the library's failures in one place. Where a builtin exception describes the same kind of
failure, the class also derives from it, so code written against the reference loader (which
raised ``AssertionError``/``ValueError``/``IndexError`` ad hoc) keeps working with ``except``
clauses on those builtins::

    AsyncflatError
    ├── ConfigError            (ValueError)   invalid FlatTokensParams / TokenBatchParams / options
    │   └── ArgumentTypeError  (TypeError)    a public entry point got an argument of the wrong type
    ├── DatasetFormatError     (ValueError)   a store that is not a valid flat-tokens split
    │   ├── CorruptChunkError                 chunk bytes that do not decode
    │   └── DatasetTooLargeError (ConfigError) shapes whose plan would exceed its memory budget
    ├── StepOutOfRangeError    (IndexError)   load(step) outside [0, step_count)
    ├── StorageError           (OSError)      a read failed for good (after retries)
    │   ├── TransientStorageError             a read failed in a way worth retrying
    │   └── ObjectReplacedError               a bucket object changed since the loader first read it
    ├── LoadTimeoutError       (TimeoutError) load() waited longer than its timeout
    ├── LoaderClosedError      (RuntimeError) the loader was used after close()
    └── LoopReentryError       (RuntimeError) a blocking call made from the engine's own loop

May import: nothing; every folder imports it.
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "ArgumentTypeError",
    "AsyncflatError",
    "ConfigError",
    "CorruptChunkError",
    "DatasetFormatError",
    "DatasetTooLargeError",
    "LoadTimeoutError",
    "LoaderClosedError",
    "LoopReentryError",
    "ObjectReplacedError",
    "StepOutOfRangeError",
    "StorageError",
    "TransientStorageError",
    "carries_secret",
    "install_log_redaction",
    "option_secrets",
    "redact",
    "scrubbed",
]


class AsyncflatError(Exception):
    """Base class of every error asyncflat raises on purpose."""


class ConfigError(AsyncflatError, ValueError):
    """A parameter (or a combination of parameters) is invalid; the message names the field."""


class ArgumentTypeError(ConfigError, TypeError):
    """A public entry point was called with an argument of the wrong type (checked by typeguard)."""


class DatasetFormatError(AsyncflatError, ValueError):
    """A store is not a valid flat-tokens split; the message names the store, array and expectation."""


class CorruptChunkError(DatasetFormatError):
    """Bytes of a chunk could not be decoded (truncated or corrupt object)."""


class DatasetTooLargeError(DatasetFormatError, ConfigError):
    """The split's shapes, with these parameters, would need more memory for the shuffle plan
    than its budget (refused before allocating; also a :class:`ConfigError`, since other
    parameters can fix it)."""


class StepOutOfRangeError(AsyncflatError, IndexError):
    """A step outside ``[0, step_count)`` was requested."""


class StorageError(AsyncflatError, OSError):
    """Reading from the store failed permanently (or after exhausting retries)."""


class TransientStorageError(StorageError):
    """A read failure that may succeed when retried (throttling, 5xx, timeouts, resets)."""


class ObjectReplacedError(StorageError):
    """An object changed in the store since the loader first read it (its ETag or generation):
    refused, never mixed with the version read before, until the loader is reopened."""


class LoadTimeoutError(AsyncflatError, TimeoutError):
    """``load()`` waited longer than the configured timeout for its data."""


class LoaderClosedError(AsyncflatError, RuntimeError):
    """The loader (or its engine) has been closed and cannot be used again."""


class LoopReentryError(AsyncflatError, RuntimeError):
    """A blocking call was made from the engine's own event-loop thread (it would deadlock)."""


_USERINFO = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)"
    r"(?:(?P<user>[^/@:\s]*):(?P<password>[^@\s]*)|(?P<token>[^/@:\s]+))@"
)
#: ``user:password@host`` with its scheme already stripped, as libraries show a bucket or path
#: they parsed from a URL (``Invalid bucket name "carol:pw@bkt"``, ``/alice:pw@bucket/x``).
_BARE_USERINFO = re.compile(r"(?P<user>[\w.+%~-]+):(?P<password>[^@\s/'\"]+)@(?=[\w.\[-])")
_QUERY_SECRET = re.compile(
    r"(?i)(?P<key>[?&](?:token|access_token|sig|signature|x-amz-signature|x-amz-credential|"
    r"x-amz-security-token|x-goog-signature|x-goog-credential|key|secret|password)=)[^&\s#'\"]+"
)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with the secrets of any URL in it removed: ``scheme://user:***@host`` (a bare
    ``scheme://token@host`` becomes ``scheme://***@host``) and credential-like query parameters
    (``?token=***``). Every message, log line and CLI output that shows a dataset URL uses it.

    ``secrets`` (see :func:`option_secrets`): further strings to replace with ``***`` wherever
    they appear (the values of ``storage_options``)."""

    def userinfo(match: re.Match[str]) -> str:
        user = match.group("user")
        return f"{match.group('scheme')}{user + ':' if user is not None else ''}***@"

    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    text = _BARE_USERINFO.sub(r"\g<user>:***@", _USERINFO.sub(userinfo, text))
    return _QUERY_SECRET.sub(r"\g<key>***", text)


#: Option values shorter than this are not treated as secrets (``True``, ``"us"``, ``3``).
_MIN_SECRET_CHARS = 4


#: ``storage_options`` keys whose values locate data and are no credential: hiding them would
#: garble the very URL an error must name (a bucket named after its project). Any URL userinfo in
#: them is still redacted.
_PUBLIC_OPTION_KEYS = frozenset(
    {"project", "user_project", "endpoint_url", "region", "region_name", "default_location",
     "location", "consistency", "version_aware", "requester_pays",
     "client"}  # asyncflat's own: which client reads (fsspec or obstore)
)  # fmt: skip
#: gcsfs ``token`` modes: keywords naming how to authenticate, not credentials.
_TOKEN_MODES = frozenset({"anon", "google_default", "cache", "cloud", "browser"})


def error_text(exc: BaseException) -> str:
    """``str(exc)`` without obstore's "Debug source:" dump (a Rust ``Debug`` rendering of the
    error chain, ~1,300 characters, that repeats what the first line says)."""
    return str(exc).split("\n\nDebug source:", 1)[0].rstrip()


def option_secrets(options: Any) -> tuple[str, ...]:
    """Every string value in ``storage_options`` (nested mappings and sequences included) that
    could be a credential, as given and URL-quoted (a token ends up in query strings), for
    :func:`redact`. Keys are not secret; every value is treated as one, except those of keys that
    only locate the data (``project``, ``endpoint_url``, ``region_name``...) and gcsfs's token
    modes (``"anon"``, ``"google_default"``...)."""
    found: set[str] = set()

    def walk(value: Any, depth: int) -> None:
        if depth > 8:
            return
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, str):
            if len(value) >= _MIN_SECRET_CHARS and value not in _TOKEN_MODES:
                found.update({value, urllib.parse.quote(value, safe=""), repr(value)[1:-1]})
        elif isinstance(value, Mapping):
            for key, item in value.items():
                if not (isinstance(key, str) and key.lower() in _PUBLIC_OPTION_KEYS):
                    walk(item, depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                walk(item, depth + 1)

    walk(options, 0)
    return tuple(found)


def carries_secret(exc: BaseException, secrets: Iterable[str] = ()) -> bool:
    """Whether ``exc`` or any exception in its chain shows a secret :func:`redact` removes."""
    secrets = tuple(secrets)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if redact(text, secrets) != text:
            return True
        current = current.__cause__ or current.__context__
    return False


def scrubbed(exc: BaseException, where: str, secrets: Iterable[str] = ()) -> BaseException:
    """``exc`` fit to show: asyncflat's own errors with their message redacted, anything else
    (a filesystem's constructor, a credential exchange) as a :class:`StorageError` naming
    ``where``. Raise the result ``from None`` when :func:`carries_secret`: no chained
    traceback may carry the secret."""
    secrets = tuple(secrets)
    if isinstance(exc, AsyncflatError):
        text = str(exc)
        return type(exc)(redact(text, secrets)) if redact(text, secrets) != text else exc
    return StorageError(
        f"{redact(where, secrets)}: {type(exc).__name__}: {redact(error_text(exc), secrets)}"
    )


_LOG_REDACTION: list[bool] = []
#: storage_options values seen by the stores opened so far (replaced whole, never mutated: the
#: factory reads it from any thread).
_LOG_SECRETS: tuple[str, ...] = ()
_LOG_LOCK = threading.Lock()


def install_log_redaction(secrets: Iterable[str] = ()) -> None:
    """Redact URL secrets from every log record made from now on, asyncflat's and those of the
    libraries under it (fsspec, aiohttp, botocore log URLs at DEBUG), and ``secrets`` (the
    :func:`option_secrets` of a store being opened) from then on too.

    A log-record factory is the one place that sees every logger's records before any handler
    formats them; it chains the factory installed before it, and touches only records whose
    message :func:`redact` changes. Installed once, when asyncflat first opens a store.
    """
    global _LOG_SECRETS
    with _LOG_LOCK:
        new = set(secrets) - set(_LOG_SECRETS)
        if new:
            _LOG_SECRETS = (*_LOG_SECRETS, *sorted(new))
        if _LOG_REDACTION:
            return
        _LOG_REDACTION.append(True)
        previous = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logging's to report
            return record
        secrets = _LOG_SECRETS
        if "@" in message or "=" in message or any(s in message for s in secrets):
            clean = redact(message, secrets)
            if clean != message:
                record.msg, record.args = clean, None
        return record

    logging.setLogRecordFactory(factory)
