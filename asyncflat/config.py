"""Configuration: frozen dataclasses, validated when they are built.

``FlatTokensParams`` and ``TokenBatchParams`` keep the reference loader's field names, order and
meaning, so existing configs construct unchanged. Everything asyncflat adds has a default and
comes after them. A bad value fails here, at construction, with the field and value in the
message, not minutes later inside a background fill.

May import: ``errors``.
"""

# No ``from __future__ import annotations``: ``dataclasses.fields(cls)[i].type`` must be the real
# type, since tools that build configs from dicts (seqax's ``make_dataclass_from_dict``, hydra
# structured configs, draccus) call or inspect it. For the same reason optional fields are spelled
# ``Optional[...]``/``Union[...]`` (a ``typing`` construct they understand), not ``X | None``.

import dataclasses
import numbers
import operator
import os
from collections.abc import Mapping
from typing import Any, Optional, TypeGuard, Union

import numpy as np

from asyncflat.errors import ArgumentTypeError, ConfigError, redact

__all__ = [
    "EngineOptions",
    "FlatTokensParams",
    "HuggingFaceDataParams",
    "RetryPolicy",
    "TokenBatchParams",
    "available_cpus",
    "default_decode_threads",
]


#: storage_options key (asyncflat's, never passed to a filesystem): which client reads.
CLIENT_OPTION = "client"
CLIENTS = ("fsspec", "obstore")


def client_of(storage_options: Mapping[str, Any] | None) -> str:
    """The client ``storage_options`` asks for (``fsspec`` unless it says otherwise)."""
    client = (storage_options or {}).get(CLIENT_OPTION, "fsspec")
    if client not in CLIENTS:
        raise ConfigError(
            f"storage_options[{CLIENT_OPTION!r}] must be one of {', '.join(CLIENTS)}, "
            f"got {client!r}"
        )
    return str(client)


def _int_field(owner: object, name: str, *, minimum: int, maximum: int | None = None) -> None:
    """Normalise ``owner.name`` to a Python int in [minimum, maximum], or raise ConfigError
    naming it."""
    value = getattr(owner, name)
    if isinstance(value, bool):
        raise ConfigError(f"{type(owner).__name__}.{name} must be an integer, got bool {value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ConfigError(
            f"{type(owner).__name__}.{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    if as_int < minimum:
        raise ConfigError(f"{type(owner).__name__}.{name} must be >= {minimum}, got {as_int}")
    if maximum is not None and as_int > maximum:
        raise ConfigError(f"{type(owner).__name__}.{name} must be <= {maximum:,}, got {as_int:,}")
    object.__setattr__(owner, name, as_int)


def step_argument(value: object, name: str = "step") -> int:
    """``value`` as a Python int if it is a Python or numpy integer (not a bool), else raise.

    The range is the plan's to check; this only refuses values that are not step numbers at all
    (``True``, ``3.0``, ``"3"``, ``None``, arrays) before they reach numpy indexing.
    """
    if type(value) is int:  # the common case, first
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(
            f"{name} must be a Python or numpy integer, got {type(value).__name__} {value!r}"
        )
    return int(value)


#: the most ``EngineOptions.max_concurrent_reads`` and ``decode_threads``
MAX_WORKERS = 1024

#: reads in flight by default on a store on this machine, and the fewest behind a network
DEFAULT_READS = 16
#: the most reads in flight by default behind a network
REMOTE_READS_MAX = 64
#: behind a network, the decoded bytes of the chunks read at once by default: a same-region
#: bucket's bandwidth times its latency (150 MB/s x 25 ms). A read waits out the latency
#: whatever its size, so small chunks need more of them in flight for the same bytes/s.
REMOTE_BYTES_IN_FLIGHT = 4 << 20

#: ``EngineOptions.fill_on_open``'s values
FILL_ON_OPEN = ("local", "always", "never")


def default_reads(*, token_chunk: int, remote: bool) -> int:
    """Reads in flight where ``EngineOptions.max_concurrent_reads`` is None, for a store whose
    chunks hold ``token_chunk`` tokens: see :meth:`EngineOptions.reads_in_flight`."""
    if not remote:
        return DEFAULT_READS
    wanted = -(-REMOTE_BYTES_IN_FLIGHT // max(1, 4 * token_chunk))  # uint32 tokens
    return min(REMOTE_READS_MAX, max(DEFAULT_READS, wanted))


def is_real_number(value: object) -> TypeGuard[numbers.Real]:
    """Whether ``value`` is a real number a float field takes: Python's and numpy's (an
    ``np.float32`` or ``np.int64`` read off an array) alike, never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _bool_field(owner: object, name: str) -> None:
    value = getattr(owner, name)
    if not isinstance(value, bool):
        raise ConfigError(
            f"{type(owner).__name__}.{name} must be a bool, got {type(value).__name__} {value!r}"
        )


def _float_field(owner: object, name: str, *, minimum: float, optional: bool = False) -> None:
    value = getattr(owner, name)
    if value is None and optional:
        return
    if not is_real_number(value):
        raise ConfigError(
            f"{type(owner).__name__}.{name} must be a number, got {type(value).__name__} {value!r}"
        )
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range
        number = float("inf")
    if not number >= minimum:  # also rejects NaN
        raise ConfigError(f"{type(owner).__name__}.{name} must be >= {minimum}, got {value!r}")
    object.__setattr__(owner, name, number)


@dataclasses.dataclass(frozen=True)
class TokenBatchParams:
    """The shape of a token batch: ``batch`` rows of ``len`` tokens."""

    len: int
    batch: int

    def __post_init__(self) -> None:
        _int_field(self, "len", minimum=1)
        _int_field(self, "batch", minimum=1)


def redact_url(url: str) -> str:
    """``url`` with its secrets replaced by ``***`` (``user:***@``, a bare ``***@`` token,
    credential query parameters): :func:`asyncflat.errors.redact`."""
    return redact(url)


def _redacted(options: Mapping[str, Any] | None) -> str:
    if options is None:
        return "None"
    return "{" + ", ".join(f"{key!r}: '***'" for key in options) + "}"


@dataclasses.dataclass(frozen=True, repr=False)
class FlatTokensParams:
    """Where a flat-tokens dataset lives and how it is shuffled (the reference's fields).

    A *stream* owns one independent shuffle buffer; batch rows are split evenly over streams, so
    ``batch`` must be a multiple of ``streams``. A *read block* is ``sequences_per_read_block``
    consecutive sequences (rows); a *shuffle buffer* holds ``read_blocks_per_shuffle_buffer``
    randomly chosen blocks per stream; a *minipoch* is one refill of every stream's buffer.

    ``filespec`` is a local path (``str`` or ``os.PathLike``, stored as an absolute ``str``:
    resolved against the working directory when the params are built, so a later ``os.chdir()``
    changes nothing) or a URL such as ``gs://bucket/data.zarr``. ``storage_options`` (asyncflat's addition, keyword, after the
    reference's fields) is passed to the fsspec filesystem for a URL; it usually holds
    credentials, so ``repr()`` shows its keys only. Its ``"client"`` key (asyncflat's) chooses
    who reads ``s3://`` and ``gs://`` URLs: ``"fsspec"`` (the default) or ``"obstore"`` (a Rust
    client; docs/cloud.md).
    """

    filespec: Union[str, os.PathLike[str]]  # noqa: UP007 (a typing construct, see the module top)
    streams: int
    read_blocks_per_shuffle_buffer: int
    sequences_per_read_block: int
    seed: int
    sequence_packing: bool
    storage_options: Optional[dict[str, Any]] = dataclasses.field(  # noqa: UP045
        default=None, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        filespec = self.filespec
        if isinstance(filespec, os.PathLike):
            filespec = os.fspath(filespec)
        if not isinstance(filespec, str) or not filespec:
            raise ConfigError(
                "FlatTokensParams.filespec must be a non-empty path (str or os.PathLike) or URL "
                f"string, got {type(filespec).__name__} {redact_url(str(filespec))!r}"
            )
        if "://" not in filespec:
            # A local path is resolved now: a relative one read after os.chdir() would name
            # another file (or none), and fills and row reads open their files long after.
            filespec = os.path.abspath(filespec)
        object.__setattr__(self, "filespec", filespec)
        _int_field(self, "streams", minimum=1)
        _int_field(self, "read_blocks_per_shuffle_buffer", minimum=1)
        _int_field(self, "sequences_per_read_block", minimum=1)
        # Philox takes a non-negative seed; the per-buffer seeds are seed + 1 + m*streams + stream.
        _int_field(self, "seed", minimum=0)
        _bool_field(self, "sequence_packing")
        if self.storage_options is not None:
            if not isinstance(self.storage_options, Mapping):
                raise ConfigError(
                    "FlatTokensParams.storage_options must be a mapping of fsspec options or None, "
                    f"got {type(self.storage_options).__name__}"
                )
            client_of(self.storage_options)  # a misspelt client fails here, not at first read
            # A private copy: the frozen config must not change when the caller's dict does.
            object.__setattr__(self, "storage_options", dict(self.storage_options))

    def __repr__(self) -> str:
        fields = [
            f"filespec={redact_url(str(self.filespec))!r}",
            *(
                f"{name}={getattr(self, name)!r}"
                for name in (
                    "streams",
                    "read_blocks_per_shuffle_buffer",
                    "sequences_per_read_block",
                    "seed",
                    "sequence_packing",
                )
            ),
            f"storage_options={_redacted(self.storage_options)}",
        ]
        return f"FlatTokensParams({', '.join(fields)})"


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Retries of transient storage failures: jittered exponential backoff up to a deadline.

    Every storage operation is bounded in time: each attempt (one request to the filesystem,
    connecting and reading the whole body included) is cut off after ``attempt_timeout_s`` and
    retried like any other transient failure, and ``deadline_s`` cuts off the attempt in
    progress when it runs out, so one object read never takes longer than ``deadline_s``
    (plus scheduling slack) however silent the store is. Opening a dataset is bounded by
    ``deadline_s`` as a whole. The filesystems' own socket timeouts (gcsfs ``requests_timeout``,
    botocore ``connect_timeout``/``read_timeout``) default to ``attempt_timeout_s`` too.
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    deadline_s: float = 60.0
    attempt_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _int_field(self, "max_attempts", minimum=1)
        _float_field(self, "initial_backoff_s", minimum=0.0)
        _float_field(self, "max_backoff_s", minimum=0.0)
        _float_field(self, "deadline_s", minimum=0.0)
        _float_field(self, "attempt_timeout_s", minimum=0.0)
        if not self.attempt_timeout_s > 0:
            raise ConfigError(
                f"RetryPolicy.attempt_timeout_s must be > 0, got {self.attempt_timeout_s!r}"
            )


def default_decode_threads() -> int:
    """Half the CPUs this process may run on (:func:`available_cpus`), at least 2
    and at most 8, read when the options are made: a first fill (which a
    cold start waits for) decodes on all of them, and a prefetch on all but one, at a lower
    priority than the trainer's threads. Two on a 2-core machine; six on a 13-core TPU host,
    where two threads made a 256 MiB first fill take 0.28 s."""
    return min(8, max(2, available_cpus() // 2))


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity, and a cgroup's quota below it."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 2
    return min(cpus, _cgroup_cpus() or cpus)


def _cgroup_cpus() -> int | None:
    """The CPUs a cgroup v2 quota grants this process (a container's limit, which
    ``sched_getaffinity`` does not see), or None when there is none."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, -(-int(quota) // int(period)))
    except (ValueError, ZeroDivisionError):
        return None


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How the background engine runs; none of this changes which data a step gets.

    * ``prefetch``: fill minipoch m+1 while m serves. ``False`` reproduces the reference's
      synchronous behaviour (a load at a boundary waits for the whole buffer), for comparisons.
    * ``max_concurrent_reads``: reads in flight over all streams and fills (a sliding window;
      at most :data:`MAX_WORKERS`, as ``decode_threads``). None (default): sized from the
      store (:meth:`reads_in_flight`): 16 on this machine; behind a network as many as keep
      :data:`REMOTE_BYTES_IN_FLIGHT` of chunks in flight, 16 to 64 (32 for seqax's 128 KiB
      chunks, 16 for the writer's 4 MiB ones).
    * ``decode_threads``: threads that decompress chunks and pad rows, off the event loop
      (default: :func:`default_decode_threads`, half the CPUs, 2 to 8).
    * ``load_timeout_s``: ``load()`` raises LoadTimeoutError after this long (None: no limit).
    * ``max_inflight_bytes``: decoded bytes of reads in flight (None: an eighth of a shuffle
      buffer, or four chunks if that is more; for a remote store, ``max_concurrent_reads``
      chunks, since only a full read window hides latency). Bounds memory beyond the buffers.
    * ``max_buffer_bytes``: refuse, at construction, a configuration whose shuffle buffers on this
      host would need more memory than this (None: no budget).
    * ``prefetch_to_device``: how many upcoming steps ``iter()`` keeps built as jax arrays.
    * ``load_ahead``: after a loader's first ``load(step)``, and after two consecutive ones,
      keep the next ``prefetch_to_device`` steps built on a background thread too (as
      ``iter()`` does; a jump stops it, and so does an ``iter()``); the
      ``load()`` of the next step then takes its batch instead of building it. False: every
      ``load()`` builds its batch itself.
    * ``fill_on_open``: where step 0's buffers start filling when the loader opens, before
      the first ``load()`` asks, so that a trainer's model set-up and compile hide the first
      fill: ``"local"`` (default) on a store on this machine's file system, ``"always"`` on
      any store, ``"never"``: the first fill starts with the first load. A first load
      elsewhere (a resume) cancels what is not done of it before its own reads are queued;
      reads already in flight finish, which behind a network is a round of requests
      competing with the resume's (and a checkpoint's restore may share that bucket): hence
      ``"local"``. Where step 0's buffers fill on opening, they are also faulted in then
      (their pages written once on the CPU pool), and so are the buffers the first
      prefetches take (where a minipoch 1 serves rows; on the loop's one background thread,
      beside step 0's fills), whose first writes would otherwise land in the trainer's
      first steps. Only with ``prefetch``.
    * ``engine_niceness``: how much lower than the trainer's the scheduling priority of the
      engine's threads is (Linux ``nice``; 0 keeps it equal). Fills then take only the CPU the
      trainer leaves, and a load that waits for data leaves the trainer idle anyway.
    """

    prefetch: bool = True
    max_concurrent_reads: Optional[int] = None  # noqa: UP045
    decode_threads: int = dataclasses.field(default_factory=default_decode_threads)
    load_timeout_s: Optional[float] = None  # noqa: UP045 (a typing construct, see the module top)
    max_buffer_bytes: Optional[int] = None  # noqa: UP045
    max_inflight_bytes: Optional[int] = None  # noqa: UP045
    prefetch_to_device: int = 1
    load_ahead: bool = True
    fill_on_open: str = "local"
    engine_niceness: int = 10
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        _bool_field(self, "prefetch")
        # One task (reads) and one thread (decodes) each: a bound far above any useful value,
        # so that a typo is an error, not a loader that starts 10**5 tasks.
        if self.max_concurrent_reads is not None:
            _int_field(self, "max_concurrent_reads", minimum=1, maximum=MAX_WORKERS)
        _int_field(self, "decode_threads", minimum=1, maximum=MAX_WORKERS)
        _float_field(self, "load_timeout_s", minimum=0.0, optional=True)
        if self.max_buffer_bytes is not None:
            _int_field(self, "max_buffer_bytes", minimum=1)
        if self.max_inflight_bytes is not None:
            _int_field(self, "max_inflight_bytes", minimum=1)
        _int_field(self, "prefetch_to_device", minimum=0)
        _bool_field(self, "load_ahead")
        if self.fill_on_open not in FILL_ON_OPEN:
            raise ConfigError(
                f"EngineOptions.fill_on_open must be one of {', '.join(map(repr, FILL_ON_OPEN))}, "
                f"got {self.fill_on_open!r}"
            )
        _int_field(self, "engine_niceness", minimum=0)
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError(
                f"EngineOptions.retry must be a RetryPolicy, got {type(self.retry).__name__}"
            )

    def reads_in_flight(self, *, token_chunk: int, remote: bool) -> int:
        """``max_concurrent_reads``, or where it is None the default for a store whose chunks
        hold ``token_chunk`` tokens: behind a network (``remote``) enough reads to keep
        :data:`REMOTE_BYTES_IN_FLIGHT` in flight, from :data:`DEFAULT_READS` to
        :data:`REMOTE_READS_MAX`; on this machine :data:`DEFAULT_READS`."""
        if self.max_concurrent_reads is not None:
            return self.max_concurrent_reads
        return default_reads(token_chunk=token_chunk, remote=remote)


@dataclasses.dataclass(frozen=True)
class HuggingFaceDataParams:
    """The reference's Hugging Face streaming config, accepted by ``get_loader`` for parity."""

    path: str
    tokenizer: str
    num_workers: int
    sequences_packed_per_batch: int
    name: Optional[str] = None  # noqa: UP045 (a typing construct, see the module top)

    def __post_init__(self) -> None:
        _int_field(self, "num_workers", minimum=0)
        _int_field(self, "sequences_packed_per_batch", minimum=1)
