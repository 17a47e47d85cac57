"""Retries alone: what is transient, backoff to a budget, permanent errors unchanged."""

from __future__ import annotations

import asyncio
import errno

import pytest

from asyncflat import RetryPolicy, StorageError, TransientStorageError
from asyncflat.errors import ObjectReplacedError
from asyncflat.storage.retry import is_precondition_failure, is_throttle, is_transient, retrying


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


def test_the_deadline_cuts_off_an_attempt_in_progress() -> None:
    """An attempt that never returns (a silent server) ends at the deadline, named."""
    policy = RetryPolicy(max_attempts=5, deadline_s=0.3, attempt_timeout_s=10)

    async def silent() -> None:
        await asyncio.Event().wait()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(
            TransientStorageError, match=r"obj: no answer within the retry deadline"
        ):
            await retrying(silent, policy, describe=lambda: "obj")
        return loop.time() - t0

    assert asyncio.run(main()) < 1.5


def test_each_request_is_bounded_and_then_retried() -> None:
    """BoundedStore turns a request that never answers into a TimeoutError (transient), so the
    retry loop tries again; a later attempt that answers succeeds."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.storage import MemoryStore

    from asyncflat.storage.filesystems import BoundedStore

    class Stalls(MemoryStore):
        calls = 0

        async def get(self, key, prototype, byte_range=None):  # type: ignore[no-untyped-def]
            Stalls.calls += 1
            if Stalls.calls == 1:
                await asyncio.Event().wait()  # the first request is swallowed
            return await super().get(key, prototype, byte_range)

    async def main() -> bytes:
        inner = Stalls()
        await inner.set("k", default_buffer_prototype().buffer.from_bytes(b"abc"))
        store = BoundedStore(inner, 0.1)
        policy = RetryPolicy(
            max_attempts=3, initial_backoff_s=0, deadline_s=5, attempt_timeout_s=0.1
        )
        buffer = await retrying(
            lambda: store.get("k", default_buffer_prototype()), policy, describe=lambda: "k"
        )
        assert buffer is not None
        return buffer.to_bytes()

    assert asyncio.run(main()) == b"abc"
    assert Stalls.calls == 2


def test_a_timeout_the_client_raises_itself_keeps_its_own_message() -> None:
    """Only BoundedStore's own bound is reported as "no answer within attempt_timeout_s": a
    TimeoutError the client raises at once (its connect timer, say) propagates as it is."""
    from zarr.core.buffer import default_buffer_prototype
    from zarr.storage import MemoryStore

    from asyncflat.storage.filesystems import BoundedStore

    class HandshakeTimesOut(MemoryStore):
        async def get(self, key, prototype, byte_range=None):  # type: ignore[no-untyped-def]
            raise TimeoutError("TLS handshake timed out (the client's own 5 s timer)")

    async def main() -> None:
        store = BoundedStore(HandshakeTimesOut(), 30)
        with pytest.raises(TimeoutError, match="TLS handshake timed out"):
            await store.get("k", default_buffer_prototype())

    asyncio.run(main())


def test_attempt_timeout_must_be_positive() -> None:
    from asyncflat import ConfigError

    with pytest.raises(ConfigError, match=r"RetryPolicy\.attempt_timeout_s must be > 0"):
        RetryPolicy(attempt_timeout_s=0)
    assert RetryPolicy().attempt_timeout_s < RetryPolicy().deadline_s


def _precondition_failures() -> list[BaseException]:
    """412s as each client raises them: s3fs (botocore's ClientError translated), obstore, and
    asyncflat's own refusal; one also arrives inside an error that is otherwise transient."""
    import obstore.exceptions
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    s3 = translate_boto_error(
        ClientError(
            {
                "Error": {"Code": "PreconditionFailed", "Message": "At least one failed"},
                "ResponseMetadata": {"HTTPStatusCode": 412},
            },
            "GetObject",
        )
    )
    hidden = ConnectionResetError("reset")
    hidden.__cause__ = HttpError(412)
    return [
        s3,
        obstore.exceptions.PreconditionError("Precondition: status code: 412"),
        ObjectReplacedError("gs://b/o: object replaced"),
        hidden,
    ]


def test_a_precondition_failure_is_never_retried() -> None:
    for exc in _precondition_failures():
        assert is_precondition_failure(exc) and not is_transient(exc), exc
        calls: list[int] = []

        async def attempt(exc: BaseException = exc, calls: list[int] = calls) -> None:
            calls.append(1)
            raise exc

        with pytest.raises(type(exc)):
            asyncio.run(retrying(attempt, POLICY, describe=lambda: "obj"))
        assert calls == [1], exc
    assert not is_precondition_failure(HttpError(503))
    assert not is_precondition_failure(FileNotFoundError("gone"))
