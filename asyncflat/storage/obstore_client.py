"""obstore (a Rust object-store client) as the loader's reader of ``s3://`` and ``gs://`` URLs.

Opt in with ``storage_options={"client": "obstore", ...}``. s3fs and gcsfs do each request's
work (signing, headers, parsing) in Python on the engine's thread, holding the GIL the trainer
wants; obstore does it in Rust, off the GIL, imports in milliseconds instead of 0.3-0.5 s, and
spends a quarter of s3fs's CPU per byte (``bench/clients.py``; docs/cloud.md, "Which client").

The rest of ``storage_options`` is spelled as for s3fs/gcsfs and translated here (a key with no
obstore equivalent is a :class:`~asyncflat.errors.ConfigError` naming it). obstore's own retry
loop is off: asyncflat's retries, per-request bounds and error classification apply as with
fsspec (:mod:`asyncflat.storage.retry` reads obstore's errors too).
"""

from __future__ import annotations

import datetime
import re
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from asyncflat.config import CLIENT_OPTION, client_of
from asyncflat.errors import ConfigError, error_text, redact
from asyncflat.storage.pins import Version, VersionMismatch

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from zarr.abc.store import ByteRequest, Store

_S3_KEYS = {
    "endpoint_url": "endpoint",
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
}
_GCS_KEYS = {"endpoint_url": "base_url"}


def without_client(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` for an fsspec filesystem: asyncflat's client choice (checked)
    removed. Writing, listing and conversion go through fsspec whichever client reads, so one
    options dict serves the converter and the loader alike."""
    client_of(storage_options)
    options = dict(storage_options or {})
    options.pop(CLIENT_OPTION, None)
    return options


#: S3 and GCS bucket names: letters, digits, dots, hyphens, underscores (S3's legacy buckets may
#: hold capitals), 3-222 characters.
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,220}[A-Za-z0-9]")


def _text_option(options: dict[str, Any], key: str) -> Any:
    value = options.pop(key)
    if not isinstance(value, str):
        raise ConfigError(
            f"storage_options[{key!r}] must be a string with client 'obstore', "
            f"got {type(value).__name__}"
        )
    if key == "endpoint_url":
        parts = urllib.parse.urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # obstore would panic on its first request, naming neither the option nor the value.
            raise ConfigError(
                f"storage_options['endpoint_url'] must be an http:// or https:// URL with a "
                f"host, got {redact(value)!r}"
            )
    return value


def _translate(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """obstore keyword arguments for s3fs/gcsfs-style ``options`` (consumed as they are read)."""
    config: dict[str, Any] = {}
    if protocol == "s3":
        for key, target in _S3_KEYS.items():
            if key in options:
                config[target] = _text_option(options, key)
        anon = options.pop("anon", False)
        if not isinstance(anon, bool):
            raise ConfigError(
                f"storage_options['anon'] must be True or False, got {type(anon).__name__} {anon!r}"
            )
        if anon:
            config["skip_signature"] = True
        region = (options.pop("client_kwargs", None) or {}).get("region_name")
        if region is not None and not isinstance(region, str):
            raise ConfigError(
                "storage_options['client_kwargs']['region_name'] must be a string, got "
                f"{type(region).__name__}"
            )
        config["region"] = region or "us-east-1"
        if "endpoint" in config:  # a custom endpoint (MinIO, moto, a proxy): path-style URLs
            config["virtual_hosted_style_request"] = False
    else:
        for key, target in _GCS_KEYS.items():
            if key in options:
                config[target] = _text_option(options, key)
        token = options.pop("token", None)
        options.pop("project", None)  # reading objects needs none
        if token == "anon":
            config["skip_signature"] = True
        elif isinstance(token, str):
            config["service_account_path"] = token
        elif token is not None:
            raise ConfigError(
                "storage_options['token']: with client 'obstore' a path to a service-account "
                "JSON file or 'anon' (for other credentials, use client 'fsspec')"
            )
    return config


def make_obstore_store(
    filespec: str,
    storage_options: Mapping[str, Any] | None,
    *,
    timeout_s: float | None = None,
    max_connections: int | None = None,
) -> Store:
    """A read-only zarr ``ObjectStore`` over obstore for ``filespec`` (``s3://`` or ``gs://``)."""
    try:
        from obstore.store import GCSStore, S3Store
        from zarr.storage import ObjectStore
    except ImportError as exc:
        raise ConfigError(
            f"storage_options[{CLIENT_OPTION!r}]='obstore' needs obstore "
            f"(pip install obstore): {exc}"
        ) from None
    protocol, _, rest = filespec.partition("://")
    protocol = {"s3a": "s3", "gcs": "gs"}.get(protocol, protocol)
    if protocol not in ("s3", "gs"):
        raise ConfigError(
            f"{filespec}: storage_options[{CLIENT_OPTION!r}]='obstore' reads s3:// and gs:// "
            f"URLs, not {protocol}://"
        )
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        # obstore would panic on its first request (a space, say) instead of naming it.
        raise ConfigError(
            f"{redact(filespec)}: {bucket!r} is not a bucket name (letters, digits, dots, "
            "hyphens and underscores, 3-222 characters)"
        )
    options = without_client(storage_options)
    config = _translate(protocol, options)
    if options:
        raise ConfigError(
            f"storage_options {sorted(options)} have no obstore equivalent (client 'obstore' "
            "takes endpoint_url, key, secret, token, anon, client_kwargs.region_name for S3; "
            "endpoint_url, token, project for GCS); use client 'fsspec' for them"
        )
    endpoint = str(config.get("endpoint") or config.get("base_url") or "")
    client_options: dict[str, Any] = {"allow_http": endpoint.startswith("http://")}
    if timeout_s is not None:
        client_options["timeout"] = datetime.timedelta(seconds=timeout_s)
        client_options["connect_timeout"] = datetime.timedelta(seconds=timeout_s)
    if max_connections is not None:
        client_options["pool_max_idle_per_host"] = str(max_connections)
    # One attempt each: asyncflat's retry loop decides (and its deadline bounds the whole).
    retry = {"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=1)}
    store_class: Any = S3Store if protocol == "s3" else GCSStore
    try:
        raw = store_class(
            bucket,
            prefix=prefix.strip("/") or None,
            client_options=client_options,
            retry_config=retry,
            **config,
        )
    except Exception as exc:  # noqa: BLE001 - obstore's configuration errors
        raise ConfigError(
            f"{redact(filespec)}: obstore refused these storage_options: {error_text(exc)}"
        ) from None
    return ObjectStore(raw, read_only=True)


def obstore_reader(
    store: Store,
) -> Callable[[str, ByteRequest | None, Version | None], Awaitable[Any]] | None:
    """The conditional read of a zarr ``ObjectStore`` over obstore (None for any other store):
    ``obstore.get_async`` with ``if_match`` set to the pinned ETag (or ``version`` to the
    pinned version, when the store sends no ETag), the range in the same options; the ETag and
    version come back in the result's ``meta``. A refused precondition (obstore's
    ``PreconditionError``, a 412) raises :class:`~asyncflat.storage.pins.VersionMismatch`."""
    try:
        from zarr.storage import ObjectStore
    except ImportError:  # pragma: no cover - zarr without obstore support
        return None
    if not isinstance(store, ObjectStore):
        return None
    raw = store.store

    async def read(
        key: str, byte_range: ByteRequest | None, pinned: Version | None
    ) -> tuple[Any, Version | None] | None:
        import obstore

        options: dict[str, Any] = {}
        span = _obstore_range(byte_range)
        if span is not None:
            options["range"] = span
        if pinned is not None:
            options["if_match" if pinned.kind == "ETag" else "version"] = pinned.value
        try:
            result = await obstore.get_async(raw, key, options=options)  # type: ignore[arg-type]
            data = await result.bytes_async()
        except obstore.exceptions.PreconditionError as exc:
            raise VersionMismatch(error_text(exc)) from exc
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        return data, _obstore_version(result.meta)

    return read


def _obstore_range(byte_range: ByteRequest | None) -> Any:
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    if isinstance(byte_range, RangeByteRequest):
        return (byte_range.start, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return {"offset": byte_range.offset}
    if isinstance(byte_range, SuffixByteRequest):
        return {"suffix": byte_range.suffix}
    return None


def _obstore_version(meta: Mapping[str, Any]) -> Version | None:
    """The version obstore's ``ObjectMeta`` names: the ETag (with the version, S3's version id
    or GCS's generation, said alongside), else the version alone."""
    etag, version = meta.get("e_tag"), meta.get("version")
    if etag:
        return Version("ETag", str(etag), f"version {version}" if version else "")
    return Version("version", str(version)) if version else None
