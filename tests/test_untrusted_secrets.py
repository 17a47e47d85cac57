"""Credentials never leak: a run with a secret in the URL and in storage_options is grepped.

A dataset is served over HTTP on 127.0.0.1 and read as ``http://reader:SECRET@127.0.0.1:PORT/...``
(fsspec's HTTP filesystem sends the userinfo as basic auth), with another secret in a header in
``storage_options``. Every exception message (and its chain), every log record at DEBUG (ours and
the libraries' under us) and all output of ``python -m asyncflat inspect`` must be free of both.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import importlib
import logging
import os
import subprocess
import sys
import threading
import traceback
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import asyncflat
from asyncflat.errors import AsyncflatError, redact
from asyncflat.inspection import describe_split, verify_split

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parent.parent
SECRET = "s3cr3t-PASSWORD-9f1c"
HEADER_SECRET = "Bearer tok-HEADER-77ab"
OPTIONS = {"headers": {"X-Api-Key": HEADER_SECRET}}


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[int]:
    handler = functools.partial(_Quiet, directory=str(directory))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[str]:
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 50, size=int(n)) for n in rng.integers(4, 24, size=40)]
    asyncflat.write_flat_tokens(
        tmp_path / "d.zarr", {"train": seqs, "validation": seqs[:12]}, zarr_format=2
    )
    with serve(tmp_path) as port:
        yield f"http://reader:{SECRET}@127.0.0.1:{port}"


def chain_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def assert_clean(text: str, what: str) -> None:
    assert SECRET not in text, f"{what} shows the URL password:\n{text[-3000:]}"
    assert "tok-HEADER" not in text, f"{what} shows the header secret:\n{text[-3000:]}"


def test_redact_removes_userinfo_and_query_secrets() -> None:
    assert (
        redact(f"see http://reader:{SECRET}@h:1/x.zarr/a") == "see http://reader:***@h:1/x.zarr/a"
    )
    assert redact("s3://AKIA:abc/def@bucket/k") == "s3://AKIA:***@bucket/k"
    assert redact("https://ghp_token@host/x") == "https://***@host/x"
    assert redact("gs://b/x?token=abc&alt=media") == "gs://b/x?token=***&alt=media"
    assert redact("/plain/path and gs://bucket/key") == "/plain/path and gs://bucket/key"


def test_no_secret_in_results_errors_or_logs(served: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"{served}/d.zarr"
    summary = describe_split(url, "train", storage_options=OPTIONS)
    assert summary.token_count > 0 and summary.lengths is not None
    assert_clean(repr(summary) + str(summary.to_dict()), "the summary")
    assert summary.filespec.startswith("http://reader:***@127.0.0.1:")
    report = verify_split(url, "train", storage_options=OPTIONS)
    assert_clean(repr(report), "the verify report")

    failures = []
    for bad in (f"{served}/missing.zarr", f"{served}/d.zarr/train", f"{served}/d.zarr"):
        for call in (
            lambda u=bad: describe_split(u, "validation" if u.endswith("d.zarr") else "train"),
            lambda u=bad: verify_split(u, "train", storage_options=OPTIONS),
        ):
            try:
                call()
            except AsyncflatError as exc:
                failures.append(exc)
    # Damaged store over HTTP: the chunk refusal names the object, without the password.
    assert len(failures) >= 4, failures
    for exc in failures:
        assert_clean(chain_text(exc), "an exception")
        assert "***@127.0.0.1" in str(exc) or "127.0.0.1" not in str(exc), str(exc)
    records = [r.getMessage() for r in caplog.records]
    assert any("127.0.0.1" in m for m in records) or records, "expected some DEBUG records"
    for message in records:
        assert_clean(message, "a log record")


@pytest.mark.slow
def test_no_secret_in_cli_output(served: str) -> None:
    env = dict(os.environ, ASYNCFLAT_NO_PROGRESS="1")
    for args in (
        ["inspect", f"{served}/d.zarr", "--verify", "-vv"],
        ["inspect", f"{served}/d.zarr", "--json"],
        ["inspect", f"{served}/nothing-here.zarr", "-vv"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "asyncflat", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert_clean(proc.stdout + proc.stderr, f"asyncflat {' '.join(args[:1])} output")
        if "nothing-here" in args[1]:
            assert proc.returncode == 1 and "reader:***@" in proc.stderr, proc.stderr
        else:
            assert proc.returncode == 0, proc.stderr
            assert "reader:***@127.0.0.1" in proc.stdout, proc.stdout


# -- errors while making the filesystem ---------------------------------------------------------


TOKEN = "ya29.tok-OPTION-5e2d/x"


class _EchoingFileSystem:
    """A third-party filesystem whose constructor repeats its arguments in its errors (as
    gcsfs does with a string token, in the URL of a ``requests.ConnectionError``)."""

    protocol = "echofs"
    async_impl = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        if kwargs.get("fail") == "type":
            raise TypeError(f"__init__() got an unexpected keyword argument 'fail' ({kwargs})")
        raise ConnectionError(
            f"HTTPSConnectionPool: Max retries exceeded with url: /tokeninfo?access_token="
            f"{urllib.parse.quote(str(kwargs.get('token')), safe='')} (token {kwargs['token']!r})"
        )

    @classmethod
    def _get_kwargs_from_urls(cls, path: str) -> dict[str, object]:
        return {}

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return path.split("://", 1)[-1]


def open_source(url: str, options: dict[str, object]) -> BaseException:
    from asyncflat.source.zarr_source import ZarrTokenSource

    async def main() -> None:
        await ZarrTokenSource.open(url, "train", storage_options=options)

    with pytest.raises(AsyncflatError) as info:
        asyncio.run(main())
    return info.value


@pytest.mark.parametrize(
    "mode,expected",
    [("network", "StorageError"), ("type", "ConfigError")],
)
def test_filesystem_constructor_errors_are_wrapped_without_secrets(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mode: str, expected: str
) -> None:
    caplog.set_level(logging.DEBUG)
    registry = importlib.import_module("fsspec.registry")
    monkeypatch.setitem(registry._registry, "echofs", _EchoingFileSystem)
    url = f"echofs://reader:{SECRET}@bucket/d.zarr"
    exc = open_source(url, {"token": TOKEN, "fail": mode})
    assert expected in [c.__name__ for c in type(exc).__mro__], repr(exc)
    message = str(exc)
    assert message.startswith("echofs://reader:***@bucket/d.zarr: cannot open this URL"), message
    text = chain_text(exc) + "\n".join(r.getMessage() for r in caplog.records)
    assert_clean(text, "the error")
    for shown in (TOKEN, urllib.parse.quote(TOKEN, safe=""), "tok-OPTION"):
        assert shown not in text, text


def test_a_bad_option_to_a_real_filesystem_is_a_config_error_without_secrets() -> None:
    # gcsfs validates ``access`` in its constructor (anonymous: no credential exchange, no network).
    url = f"gs://reader:{SECRET}@bucket/d.zarr"
    exc = open_source(url, {"token": "anon", "access": f"bogus-{TOKEN}"})
    assert isinstance(exc, asyncflat.ConfigError), repr(exc)
    assert "gs://reader:***@bucket/d.zarr" in str(exc) and "access must be one of" in str(exc)
    assert_clean(chain_text(exc), "the error")
    assert "tok-OPTION" not in chain_text(exc)


def test_an_unknown_protocol_with_credentials_is_a_config_error_without_them() -> None:
    exc = open_source(f"nosuchfs://reader:{SECRET}@host/d.zarr", {"token": TOKEN})
    assert isinstance(exc, asyncflat.ConfigError), repr(exc)
    assert "nosuchfs://reader:***@host/d.zarr: unknown URL protocol" in str(exc), str(exc)
    assert_clean(chain_text(exc), "the error")


@pytest.mark.parametrize("error", [ConnectionError, PermissionError])
def test_a_read_error_that_repeats_an_option_value_is_scrubbed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, error: type[Exception]
) -> None:
    """A transient failure (retried, logged, then a TransientStorageError quoting it) or a
    permanent one, raised by the filesystem after open with a storage_options value in it."""
    caplog.set_level(logging.DEBUG)
    from zarr.storage import WrapperStore

    from asyncflat.source.zarr_source import ZarrTokenSource

    rng = np.random.default_rng(2)
    asyncflat.write_flat_tokens(
        tmp_path / "d.zarr", {"train": [rng.integers(0, 50, size=30) for _ in range(20)]}
    )

    class Failing(WrapperStore):  # type: ignore[type-arg]
        armed = False

        async def get(self, key: str, *args: object, **kwargs: object) -> object:
            if Failing.armed and "encoded_tokens/c" in key:
                raise error(f"GET /{key}?access_token={TOKEN} refused for token {TOKEN}")
            return await self._store.get(key, *args, **kwargs)  # type: ignore[arg-type]

    async def main() -> None:
        source = await ZarrTokenSource.open(
            str(tmp_path / "d.zarr"),
            "train",
            storage_options={"token": TOKEN},
            retry=asyncflat.RetryPolicy(max_attempts=2, initial_backoff_s=0.001),
            store_wrapper=Failing,
        )
        Failing.armed = True
        try:
            await source.read_tokens(0, 10)
        finally:
            await source.aclose()

    with pytest.raises(AsyncflatError) as info:
        asyncio.run(main())
    text = chain_text(info.value)
    assert "encoded_tokens" in str(info.value) and "refused for token ***" in str(info.value)
    assert "tok-OPTION" not in text, text
    records = [r.getMessage() for r in caplog.records]
    if error is ConnectionError:  # retried: the retry is logged, with the error's text
        assert any("retrying" in m and "refused for token ***" in m for m in records), records
    for message in records:
        assert "tok-OPTION" not in message, message


# -- credentials a library shows without their URL's scheme -------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        'Invalid bucket name "carol:pw3SECRET@bkt": Bucket name must match',
        "info: /alice:pw3SECRET@bucket/w.zarr/zarr.json",
        "{'Bucket': 'carol:pw3SECRET@bkt', 'Key': 'x.zarr/zarr.json'}",
    ],
)
def test_userinfo_without_its_scheme_is_redacted(text: str) -> None:
    clean = redact(text)
    assert "pw3SECRET" not in clean and ":***@" in clean, clean


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        # what a traceback (or an error reporter) shows: the cause, or an unsuppressed context
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def test_an_s3_url_with_a_password_never_shows_it(caplog: pytest.LogCaptureFixture) -> None:
    """botocore rejects ``carol:pw@bkt`` as a bucket name and quotes it, without ``s3://``."""
    pytest.importorskip("s3fs")
    caplog.set_level(logging.DEBUG)
    params = asyncflat.FlatTokensParams(
        "s3://carol:pw3SECRET@bkt/x.zarr", 1, 4, 16, 0, True,
        storage_options={"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"},
    )  # fmt: skip
    with pytest.raises(AsyncflatError) as info:
        asyncflat.ShufflingLoader("train", params, asyncflat.TokenBatchParams(len=16, batch=8))
    for exc in _chain(info.value):
        assert "pw3SECRET" not in str(exc), str(exc)
    assert "pw3SECRET" not in "".join(traceback.format_exception(info.value))
    leaks = [r.getMessage() for r in caplog.records if "pw3SECRET" in r.getMessage()]
    assert not leaks, leaks[:3]


def test_writing_to_a_url_with_a_password_logs_none_of_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url = "memory://alice:pw3SECRET@bucket/w.zarr"
    asyncflat.write_flat_tokens(url, {"train": [np.arange(1, 30, dtype=np.uint32)] * 50})
    params = asyncflat.FlatTokensParams(url, 1, 2, 8, 0, True)
    batch = asyncflat.TokenBatchParams(len=16, batch=8)
    with asyncflat.ShufflingLoader("train", params, batch) as loader:
        loader.load(0)
    assert caplog.records, "fsspec's DEBUG records are what this test reads"
    leaks = [r.getMessage() for r in caplog.records if "pw3SECRET" in r.getMessage()]
    assert not leaks, leaks[:3]
