"""Fault injection for zarr stores: latency, transient and permanent errors, corrupt bytes.

:class:`FaultyStore` wraps any zarr store and misbehaves on purpose, the way object stores do
in production, so tests and benchmarks can check that the loader survives faults with nothing
lost and fails clearly when it cannot::

    from asyncflat.testing.faults import FaultyStore

    loader = ShufflingLoader(
        "train", params, batch_params,
        store_wrapper=lambda store: FaultyStore(store, latency_s=0.02, transient_rate=0.2, seed=1),
    )

What each knob injects, per object request (``get``, and each range of ``get_partial_values``):

* ``latency_s`` (+ up to ``latency_jitter_s``): a sleep before the request, like a round trip.
* ``transient_rate``: the request fails with ``transient_error`` (default
  :class:`~asyncflat.errors.TransientStorageError`; ``ConnectionResetError`` also works), which
  the store layer retries. ``max_transient_per_request`` caps how many times in a row one
  request (same key and byte range) is failed, so a test can stay below the retry budget.
* ``permanent_keys``: keys matching any of these globs always fail with ``permanent_error``
  (default ``PermissionError``, like an HTTP 403): not retried, the load needing them raises.
* ``corrupt_rate``: the request returns damaged bytes. ``corrupt_mode="truncate"`` (default)
  drops the tail of the object, which every codec detects. ``"flip"`` inverts one byte, which a
  codec without a checksum (Blosc) may decode into wrong values without noticing: use it to
  study that, not to expect an error. Metadata documents are never corrupted.

``fault_keys`` (a glob, or several) limits latency, transient faults and corruption to matching
keys; ``permanent_keys`` apply regardless.

Decisions are a pure function of ``(seed, key, byte range, attempt number)``, not of the order
in which concurrent requests happen to arrive, so a faulty run repeats exactly. A store and the
copies zarr makes of it (``with_read_only``) share their settings and :attr:`FaultyStore.counts`;
:meth:`FaultyStore.configure` changes them for all (for example to heal a permanent fault).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import fnmatch
import hashlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype

from asyncflat.errors import ConfigError, TransientStorageError
from asyncflat.storage.guarded import PerKeyWrapperStore, describe_range, is_metadata

__all__ = ["FaultCounts", "FaultyStore"]

log = logging.getLogger(__name__)

_CORRUPT_MODES = ("truncate", "flip")

Globs = str | Iterable[str]


@dataclasses.dataclass
class FaultCounts:
    """What a :class:`FaultyStore` (and its copies) did so far."""

    requests: int = 0  #: object requests seen (each range of a partial read counts once)
    delayed: int = 0  #: requests given injected latency
    transient: int = 0  #: transient errors raised
    permanent: int = 0  #: permanent errors raised
    corrupted: int = 0  #: responses returned damaged


@dataclasses.dataclass
class _Settings:
    latency_s: float
    latency_jitter_s: float
    transient_rate: float
    transient_error: Callable[[str], BaseException]
    max_transient_per_request: int | None
    permanent_keys: tuple[str, ...]
    permanent_error: Callable[[str], BaseException]
    corrupt_rate: float
    corrupt_mode: str
    fault_keys: tuple[str, ...]
    seed: int


class _Shared:
    """Settings, counters and per-request attempt numbers shared by a store and its copies."""

    def __init__(self, settings: _Settings) -> None:
        self.settings = settings
        self.counts = FaultCounts()
        self.attempts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.transient_run: collections.Counter[tuple[str, str]] = collections.Counter()


def _globs(name: str, value: Globs) -> tuple[str, ...]:
    patterns = (value,) if isinstance(value, str) else tuple(value)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigError(f"FaultyStore.{name} must hold glob strings, got {pattern!r}")
    return patterns


def _number(name: str, value: Any, *, upper: float | None = None) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value >= 0
        or (upper is not None and value > upper)
    ):
        bound = f"in [0, {upper}]" if upper is not None else ">= 0"
        raise ConfigError(f"FaultyStore.{name} must be a number {bound}, got {value!r}")
    return float(value)


def _validated(changes: dict[str, Any], base: _Settings | None) -> _Settings:
    values = dataclasses.asdict(base) if base is not None else {}
    unknown = set(changes) - {f.name for f in dataclasses.fields(_Settings)}
    if unknown:
        raise ConfigError(f"FaultyStore: unknown setting(s) {sorted(unknown)}")
    values.update(changes)
    values["latency_s"] = _number("latency_s", values["latency_s"])
    values["latency_jitter_s"] = _number("latency_jitter_s", values["latency_jitter_s"])
    values["transient_rate"] = _number("transient_rate", values["transient_rate"], upper=1.0)
    values["corrupt_rate"] = _number("corrupt_rate", values["corrupt_rate"], upper=1.0)
    cap = values["max_transient_per_request"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ConfigError(
            f"FaultyStore.max_transient_per_request must be None or an int >= 0, got {cap!r}"
        )
    if values["corrupt_mode"] not in _CORRUPT_MODES:
        raise ConfigError(
            f"FaultyStore.corrupt_mode must be one of {_CORRUPT_MODES}, got {values['corrupt_mode']!r}"
        )
    for name in ("transient_error", "permanent_error"):
        if not callable(values[name]):
            raise ConfigError(
                f"FaultyStore.{name} must be an exception class or factory, got {values[name]!r}"
            )
    values["permanent_keys"] = _globs("permanent_keys", values["permanent_keys"])
    values["fault_keys"] = _globs("fault_keys", values["fault_keys"])
    if isinstance(values["seed"], bool) or not isinstance(values["seed"], int):
        raise ConfigError(f"FaultyStore.seed must be an int, got {values['seed']!r}")
    return _Settings(**values)


class FaultyStore(PerKeyWrapperStore):
    """A zarr store wrapper that injects latency, transient/permanent errors and corruption.

    See the module docstring for what each argument does. Reads only: writes, listing and
    the rest are passed through untouched.
    """

    def __init__(
        self,
        store: Store,
        *,
        latency_s: float = 0.0,
        latency_jitter_s: float = 0.0,
        transient_rate: float = 0.0,
        transient_error: Callable[[str], BaseException] = TransientStorageError,
        max_transient_per_request: int | None = None,
        permanent_keys: Globs = (),
        permanent_error: Callable[[str], BaseException] = PermissionError,
        corrupt_rate: float = 0.0,
        corrupt_mode: str = "truncate",
        fault_keys: Globs = "*",
        seed: int = 0,
        _shared: _Shared | None = None,
    ) -> None:
        super().__init__(store)
        if _shared is None:
            _shared = _Shared(
                _validated(
                    dict(
                        latency_s=latency_s,
                        latency_jitter_s=latency_jitter_s,
                        transient_rate=transient_rate,
                        transient_error=transient_error,
                        max_transient_per_request=max_transient_per_request,
                        permanent_keys=permanent_keys,
                        permanent_error=permanent_error,
                        corrupt_rate=corrupt_rate,
                        corrupt_mode=corrupt_mode,
                        fault_keys=fault_keys,
                        seed=seed,
                    ),
                    None,
                )
            )
        self._shared = _shared

    def _with_store(self, store: Store) -> FaultyStore:
        return FaultyStore(store, _shared=self._shared)

    @property
    def counts(self) -> FaultCounts:
        """Faults injected so far by this store and every copy of it."""
        return self._shared.counts

    def configure(self, **changes: Any) -> None:
        """Change settings (same names as the constructor) for this store and its copies."""
        self._shared.settings = _validated(changes, self._shared.settings)

    def __repr__(self) -> str:
        return f"FaultyStore({self._store!r})"

    # -- reads --------------------------------------------------------------------------------

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        shared, settings = self._shared, self._shared.settings
        counts = shared.counts
        counts.requests += 1
        where = f"{key} ({describe_range(byte_range)})"
        request = (key, where)
        attempt = shared.attempts[request]
        shared.attempts[request] += 1

        if any(fnmatch.fnmatchcase(key, p) for p in settings.permanent_keys):
            counts.permanent += 1
            raise settings.permanent_error(f"injected permanent fault: {where}")
        if not any(fnmatch.fnmatchcase(key, p) for p in settings.fault_keys):
            return await self._store.get(key, prototype, byte_range)

        if settings.latency_s or settings.latency_jitter_s:
            counts.delayed += 1
            jitter = settings.latency_jitter_s * self._uniform("latency", key, where, attempt)
            await asyncio.sleep(settings.latency_s + jitter)

        if (
            settings.transient_rate
            and self._uniform("transient", key, where, attempt) < settings.transient_rate
        ):
            cap = settings.max_transient_per_request
            if cap is None or shared.transient_run[request] < cap:
                shared.transient_run[request] += 1
                counts.transient += 1
                raise settings.transient_error(f"injected transient fault: {where}")
        shared.transient_run.pop(request, None)

        buffer = await self._store.get(key, prototype, byte_range)
        if (
            buffer is not None
            and settings.corrupt_rate
            and not is_metadata(key)
            and len(buffer) > 0
            and self._uniform("corrupt", key, where, attempt) < settings.corrupt_rate
        ):
            counts.corrupted += 1
            buffer = self._corrupt(buffer, prototype, settings.corrupt_mode, key, where, attempt)
        return buffer

    # -- helpers ------------------------------------------------------------------------------

    def _uniform(self, what: str, key: str, where: str, attempt: int) -> float:
        """A number in [0, 1) fixed by (seed, what, request, attempt): order-independent."""
        text = f"{self._shared.settings.seed}|{what}|{where}|{attempt}".encode()
        digest = hashlib.blake2b(text, digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2.0**64

    def _corrupt(
        self,
        buffer: Buffer,
        prototype: BufferPrototype,
        mode: str,
        key: str,
        where: str,
        attempt: int,
    ) -> Buffer:
        data = bytearray(buffer.to_bytes())
        if mode == "truncate":
            keep = int(len(data) * self._uniform("cut", key, where, attempt))
            data = data[:keep]
        else:
            data[int(len(data) * self._uniform("byte", key, where, attempt))] ^= 0xFF
        log.debug("corrupted %s (%s)", where, mode)
        return prototype.buffer.from_bytes(bytes(data))
