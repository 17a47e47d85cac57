"""Public config dataclasses carry real field types, so tools that build configs from dicts work.

seqax builds its Config from the hydra dict by calling ``field.type(value)`` for every field
(``typing.Union``/``Optional`` members tried in turn, dataclasses recursively); hydra structured
configs and draccus read the same ``dataclasses.fields(cls)[i].type``. ``from_dict`` below does
what those tools do; every config class must build through it and survive an ``asdict`` round
trip. Also: secrets in ``storage_options`` never reach ``repr``/``str``, ``filespec`` may be a
``pathlib.Path``, and step arguments accept exactly the integers.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing
from collections.abc import Callable
from typing import Any, Union

import numpy as np
import pytest

import asyncflat
from asyncflat import (
    ArgumentTypeError,
    ConfigError,
    EngineOptions,
    FlatTokensParams,
    HuggingFaceDataParams,
    RetryPolicy,
    TokenBatchParams,
)
from asyncflat.config import step_argument

CONFIG_CLASSES = [
    FlatTokensParams,
    TokenBatchParams,
    EngineOptions,
    RetryPolicy,
    HuggingFaceDataParams,
]

#: One plain dict per class, as hydra/YAML would give it (every field present).
PLAIN = {
    FlatTokensParams: dict(
        filespec="data.zarr",
        streams=2,
        read_blocks_per_shuffle_buffer=4,
        sequences_per_read_block=16,
        seed=0,
        sequence_packing=True,
        storage_options=None,
    ),
    TokenBatchParams: dict(len=64, batch=16),
    EngineOptions: dict(
        prefetch=True,
        max_concurrent_reads=8,
        decode_threads=1,
        load_timeout_s=None,
        max_buffer_bytes=1 << 30,
        max_inflight_bytes=None,
        prefetch_to_device=2,
        load_ahead=True,
        fill_on_open="never",
        engine_niceness=0,
        retry=dict(
            max_attempts=3,
            initial_backoff_s=0.1,
            max_backoff_s=1,
            deadline_s=30,
            attempt_timeout_s=5,
        ),
    ),
    RetryPolicy: dict(
        max_attempts=3, initial_backoff_s=0.1, max_backoff_s=1, deadline_s=30, attempt_timeout_s=5
    ),
    HuggingFaceDataParams: dict(
        path="data", tokenizer="bytes", num_workers=0, sequences_packed_per_batch=4, name=None
    ),
}


def _convert(tp: Any, value: Any) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value)
    if typing.get_origin(tp) is Union:
        members = typing.get_args(tp)
        if value is None:
            if type(None) in members:
                return None
            raise ValueError(f"None for {tp}")
        for member in members:
            if member is type(None):
                continue
            try:
                return _convert(member, value)
            except (TypeError, ValueError):
                continue
        raise ValueError(f"no member of {tp} takes {value!r}")
    return tp(value)  # what seqax's make_dataclass_from_dict does for every other field


def from_dict(cls: Any, data: dict[str, Any]) -> Any:
    return cls(**{f.name: _convert(f.type, data.get(f.name)) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_field_types_are_real_types(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        assert not isinstance(field.type, str), f"{cls.__name__}.{field.name}: {field.type!r}"
        assert field.type == hints[field.name], field.name  # nothing left unresolved


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_built_from_a_plain_dict_and_asdict_round_trips(cls: type) -> None:
    built = from_dict(cls, PLAIN[cls])
    for name, value in PLAIN[cls].items():
        got = getattr(built, name)
        if dataclasses.is_dataclass(got):
            got = dataclasses.asdict(got)
        if cls is FlatTokensParams and name == "filespec":
            value = str(pathlib.Path(value).absolute())  # a local path is resolved when built
        assert got == value, name
    assert from_dict(cls, dataclasses.asdict(built)) == built


def test_scalar_fields_are_called_on_strings_like_a_cli_gives_them() -> None:
    # draccus/argparse-style: every scalar arrives as text; field.type(text) must parse it.
    params = from_dict(TokenBatchParams, {"len": "64", "batch": "16"})
    assert params == TokenBatchParams(len=64, batch=16)
    policy = from_dict(RetryPolicy, {k: str(v) for k, v in PLAIN[RetryPolicy].items()})
    assert policy == RetryPolicy(3, 0.1, 1.0, 30.0, 5.0)


def test_a_bad_value_still_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"TokenBatchParams\.len must be >= 1"):
        from_dict(TokenBatchParams, {"len": 0, "batch": 16})


def test_storage_options_round_trip_and_are_copied() -> None:
    options = {"token": "anon", "project": "p"}
    data = dict(PLAIN[FlatTokensParams], storage_options=options)
    params = from_dict(FlatTokensParams, data)
    assert params.storage_options == options and params.storage_options is not options
    options["token"] = "changed"  # the frozen config does not follow the caller's dict
    assert params.storage_options == {"token": "anon", "project": "p"}
    again = from_dict(FlatTokensParams, dataclasses.asdict(params))
    assert again.storage_options == params.storage_options


def test_repr_and_str_never_show_storage_options_values() -> None:
    secret = "ya29.SECRET-token-value"
    params = FlatTokensParams(
        "gs://alice:hunter2@bucket/data.zarr",
        1,
        2,
        3,
        0,
        True,
        storage_options={"token": secret, "client_kwargs": {"aws_secret_access_key": secret}},
    )
    for text in (repr(params), str(params), f"{params}", repr([params])):
        assert secret not in text and "hunter2" not in text, text
        assert "'token': '***'" in text and "alice:***@bucket" in text
        assert "read_blocks_per_shuffle_buffer=2" in text
    assert "storage_options=None" in repr(FlatTokensParams("d.zarr", 1, 2, 3, 0, True))


def test_filespec_may_be_a_path(tmp_path: pathlib.Path) -> None:
    params = FlatTokensParams(tmp_path / "data.zarr", 1, 2, 3, 0, True)
    assert params.filespec == str(tmp_path / "data.zarr")
    assert params == FlatTokensParams(str(tmp_path / "data.zarr"), 1, 2, 3, 0, True)
    for bad in (b"data.zarr", "", None, 3):
        with pytest.raises(ConfigError, match=r"FlatTokensParams\.filespec"):
            FlatTokensParams(bad, 1, 2, 3, 0, True)


@pytest.mark.parametrize(
    "good", [0, 7, np.int64(7), np.uint64(7), np.int32(7), np.uint8(7)], ids=repr
)
def test_step_argument_takes_python_and_numpy_integers(good: Any) -> None:
    step = step_argument(good)
    assert step == int(good) and type(step) is int


@pytest.mark.parametrize(
    "bad",
    [True, False, np.bool_(True), 3.0, np.float64(3), "3", None, np.array(3), np.array([3]), [3]],
    ids=repr,
)
def test_step_argument_refuses_everything_else(bad: Any) -> None:
    with pytest.raises(ArgumentTypeError, match=r"start_step must be a Python or numpy integer"):
        step_argument(bad, "start_step")
    # the message names the value, and the error is a ConfigError and a TypeError
    with pytest.raises(ConfigError) as info:
        step_argument(bad)
    assert isinstance(info.value, TypeError) and repr(bad) in str(info.value)


def test_every_config_class_is_exported() -> None:
    assert all(cls.__name__ in asyncflat.__all__ for cls in CONFIG_CLASSES)


# -- run-time argument checks of the public entry points -----------------------------------------


def test_checked_entry_points_name_the_argument_for_every_kind_of_annotation(
    tmp_path: pathlib.Path,
) -> None:
    """A class, a union of classes, items of a sequence, a callable and an int, each checked at
    the call (before any work) with a message naming the function and the argument."""
    from asyncflat.writer.distributed import convert_distributed

    batch = TokenBatchParams(len=8, batch=2)
    params = FlatTokensParams(str(tmp_path / "absent.zarr"), 1, 2, 4, seed=0, sequence_packing=True)
    out = str(tmp_path / "out")
    cases: list[tuple[Callable[[], Any], str]] = [
        (
            lambda: asyncflat.get_loader("train", {"len": 8}, batch),  # type: ignore[arg-type]
            r'get_loader\(\): argument "config" \(dict\) is not an instance of',
        ),
        (
            lambda: asyncflat.get_loader("train", params, batch, batch_type="hook"),  # type: ignore[arg-type]
            r'get_loader\(\): argument "batch_type" \(str\)',
        ),
        (
            lambda: convert_distributed(["a.txt"], 3),  # type: ignore[arg-type]
            r'convert_distributed\(\): argument "output" \(int\)',
        ),
        (
            lambda: convert_distributed([1], out),  # type: ignore[list-item]
            r'convert_distributed\(\): item 0 of argument "inputs" \(list\)',
        ),
        (
            lambda: next(asyncflat.iter_epochs("train", params, batch, start_epoch="x")),  # type: ignore[arg-type]
            r'iter_epochs\(\): argument "start_epoch" \(str\)',
        ),
    ]
    for call, match in cases:
        with pytest.raises(ArgumentTypeError, match=match):
            call()
    assert not (tmp_path / "out").exists()  # refused before any work
    with pytest.raises(TypeError):  # a wrong call is the interpreter's own error, unchanged
        asyncflat.get_loader("train")  # type: ignore[call-arg]


def test_importing_and_constructing_entry_points_does_not_import_typeguard() -> None:
    """typeguard (and its unittest.mock) costs ~0.5 s of import and instrumentation: the checks
    of classes and unions of classes need none of it."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys
        import asyncflat, asyncflat.loader.shuffling, asyncflat.loader.epochs
        from asyncflat import ArgumentTypeError, TokenBatchParams, get_loader

        try:
            get_loader("train", {"len": 8}, TokenBatchParams(len=8, batch=2))
        except ArgumentTypeError:
            pass
        else:
            raise AssertionError("no ArgumentTypeError")
        assert "typeguard" not in sys.modules, "typeguard imported"
        """
    )
    root = str(pathlib.Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr


def test_decode_threads_default_to_half_the_cpus_this_process_may_use() -> None:
    import os

    from asyncflat.config import EngineOptions, default_decode_threads

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_decode_threads() == min(8, max(2, (cpus or 2) // 2))
    assert EngineOptions().decode_threads == default_decode_threads()
    assert EngineOptions(decode_threads=5).decode_threads == 5


def test_available_cpus_counts_the_affinity() -> None:
    import os

    from asyncflat.config import available_cpus

    cpus = available_cpus()
    assert 1 <= cpus <= (os.cpu_count() or cpus)
    if hasattr(os, "sched_getaffinity"):
        assert cpus <= len(os.sched_getaffinity(0))


def test_reads_in_flight_default_to_the_bytes_a_network_hides_latency_with() -> None:
    from asyncflat.config import (
        DEFAULT_READS,
        REMOTE_BYTES_IN_FLIGHT,
        REMOTE_READS_MAX,
        EngineOptions,
    )

    options = EngineOptions()
    assert options.max_concurrent_reads is None
    kib = 1024
    # behind a network: 4 MiB of chunks in flight, 16 to 64 reads
    assert REMOTE_BYTES_IN_FLIGHT == 4096 * kib
    assert options.reads_in_flight(token_chunk=32 * kib, remote=True) == 32  # seqax's: 128 KiB
    assert options.reads_in_flight(token_chunk=25 * kib, remote=True) == 41  # rounded up
    assert options.reads_in_flight(token_chunk=1024 * kib, remote=True) == DEFAULT_READS
    assert options.reads_in_flight(token_chunk=256, remote=True) == REMOTE_READS_MAX
    # on this machine reads are CPU, not round trips
    assert options.reads_in_flight(token_chunk=256, remote=False) == DEFAULT_READS
    # a number given is kept, wherever the store is
    mine = EngineOptions(max_concurrent_reads=5)
    assert mine.reads_in_flight(token_chunk=256, remote=True) == 5
    assert mine.reads_in_flight(token_chunk=256, remote=False) == 5
