"""A mixture's bad inputs fail early and say which source or flag: sizes out of reach, steps out
of range, a source too small for the batch, unreadable config files, flags that do not apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import random_sequences

import asyncflat
from asyncflat import (
    ConfigError,
    EngineOptions,
    FlatTokensParams,
    LoaderClosedError,
    MixtureParams,
    MixtureSource,
    StepOutOfRangeError,
    TokenBatchParams,
)
from asyncflat.cli import main
from asyncflat.errors import ArgumentTypeError
from asyncflat.loader.mixture.config import MAX_BLOCK_ROWS, MAX_STEPS

BATCH = TokenBatchParams(len=16, batch=8)
OPTIONS = EngineOptions(prefetch_to_device=0)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("mixture_inputs")
    paths = []
    for i, count in enumerate([300, 12]):
        path = str(root / f"source{i}.zarr")
        asyncflat.write_flat_tokens(
            path, {"train": random_sequences(20 + i, count, max_len=40)}, chunk_tokens=1024
        )
        paths.append(path)
    return paths


def flat(path: str) -> FlatTokensParams:
    return FlatTokensParams(path, 1, 2, 4, 0, True)


def test_block_rows_and_steps_beyond_reach_fail_at_construction(stores: list[str]) -> None:
    sources = (MixtureSource(flat(stores[0]), 1.0), MixtureSource(flat(stores[0]), 1.0))
    with pytest.raises(ConfigError, match=r"MixtureParams\.block_rows must be <= "):
        MixtureParams(sources, block_rows=MAX_BLOCK_ROWS + 1)
    with pytest.raises(ConfigError, match=r"MixtureParams\.steps must be <= "):
        MixtureParams(sources, steps=MAX_STEPS + 1)
    assert MixtureParams(sources, block_rows=MAX_BLOCK_ROWS, steps=MAX_STEPS).steps == MAX_STEPS


def test_sources_and_groups_of_a_step_out_of_range_is_a_step_error(stores: list[str]) -> None:
    """``sources`` and ``groups`` check their step as ``load`` does (``groups`` made up a pass
    15873 of a 10-step mixture for step 10**6, took ``True`` for step 1, and answered after
    close)."""
    params = MixtureParams(
        (MixtureSource(flat(stores[0]), 1.0), MixtureSource(flat(stores[0]), 1.0)), block_rows=8
    )
    with asyncflat.ShufflingLoader("train", params, BATCH, options=OPTIONS) as loader:
        assert len(loader.sources(0)) == BATCH.batch

        def key(step: Any) -> list[tuple[int, int, int]]:
            return [(g.source, g.epoch, g.step) for g in loader.groups(step)]

        assert key(np.int64(1)) == key(1)
        for step in (-1, loader.step_count, 2**70):
            with pytest.raises(StepOutOfRangeError):
                loader.sources(step)
            with pytest.raises(StepOutOfRangeError):
                loader.groups(step)
        for wrong in (True, 3.0, "3"):
            with pytest.raises(ArgumentTypeError):
                loader.groups(wrong)  # type: ignore[arg-type]
    with pytest.raises(LoaderClosedError):
        loader.groups(0)


def test_a_seed_beyond_64_bits_and_a_bool_epoch_are_refused(stores: list[str]) -> None:
    """Seed bits from 64 up met the row placement's tag: seed 2**67 placed rows as seed 0
    did. ``epoch=True`` served epoch 1 (the plain loader refuses a bool)."""
    sources = (MixtureSource(flat(stores[0]), 1.0), MixtureSource(flat(stores[0]), 1.0))
    assert MixtureParams(sources, seed=2**64 - 1).seed == 2**64 - 1
    with pytest.raises(ConfigError, match=r"MixtureParams\.seed must be <= "):
        MixtureParams(sources, seed=2**64)
    params = MixtureParams(sources, block_rows=8)
    with pytest.raises(ArgumentTypeError, match="epoch must be a Python or numpy integer"):
        asyncflat.ShufflingLoader("train", params, BATCH, options=OPTIONS, epoch=True)
    for name in ("start_epoch", "start_step", "epochs"):
        with pytest.raises(ArgumentTypeError, match=f"{name} must be"):
            asyncflat.iter_epochs("train", params, BATCH, options=OPTIONS, **{name: True})


@pytest.mark.parametrize(
    ("sources", "stages", "expected"),
    [
        (
            [{"params": "P", "weight": 1}, {"params": "P+bogus", "weight": 1}],
            (),
            r"MixtureParams\.sources\[1\]: MixtureSource\.params has unknown key\(s\) 'bogus'; "
            r"a FlatTokensParams takes filespec, ",
        ),
        ([{"params": "P", "weight": 1, "wieght": 2}], (), r"sources\[0\] has unknown .* 'wieght'"),
        ([{"params": "P"}], (), r"MixtureParams\.sources\[0\] lacks weight, which a Mixture"),
        ([{"params": "P-seed", "weight": 1}], (), r"params lacks seed, which a FlatTokensParams"),
        ([{"params": "P", "weight": -1}], (), r"sources\[0\]: MixtureSource\.weight must be a"),
        (
            [{"params": "P", "weight": 1}],
            [{"steps": 3, "weights": [1]}],
            r"MixtureParams\.stages\[0\] has unknown key\(s\) 'steps'; a MixtureStage takes "
            r"start_step, weights",
        ),
    ],
)
def test_a_nested_mapping_with_a_wrong_key_is_a_config_error_naming_where(
    stores: list[str], sources: list[dict[str, Any]], stages: Any, expected: str
) -> None:
    """A mixture built from plain dicts (hydra, YAML) names the source or stage and the key
    (a raw ``TypeError: __init__() got an unexpected keyword argument`` named neither)."""
    fields = {
        "filespec": stores[0],
        "streams": 1,
        "read_blocks_per_shuffle_buffer": 2,
        "sequences_per_read_block": 4,
        "seed": 0,
        "sequence_packing": True,
    }
    variants = {
        "P": fields,
        "P+bogus": {**fields, "bogus": 1},
        "P-seed": {k: v for k, v in fields.items() if k != "seed"},
    }
    built = [{**s, "params": variants[s["params"]]} for s in sources]
    with pytest.raises(ConfigError, match=expected):
        MixtureParams(built, stages=stages)


def test_a_source_too_small_for_the_batch_is_named(stores: list[str]) -> None:
    params = MixtureParams(
        (MixtureSource(flat(stores[0]), 1.0), MixtureSource(flat(stores[1]), 1.0)), block_rows=8
    )
    with pytest.raises(ConfigError) as info:
        asyncflat.ShufflingLoader("train", params, TokenBatchParams(len=16, batch=64))
    assert "MixtureParams.sources[1]" in str(info.value) and stores[1] in str(info.value)


@pytest.mark.parametrize(
    ("name", "text"),
    [("missing.json", None), ("bad.json", "{"), ("bad.yaml", "sources: [\n"), ("dir", "")],
)
def test_an_unreadable_mixture_config_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str | None
) -> None:
    path = tmp_path / name
    if name == "dir":
        path.mkdir()
    elif text is not None:
        path.write_text(text)
    assert main(["inspect", str(path), "--mixture", "--len", "16", "--batch", "8"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("asyncflat inspect: error: ") and str(path) in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", [["--verify"], ["--streams", "2"], ["--seed", "3"]])
def test_flags_a_mixture_ignores_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(
            ["inspect", str(tmp_path / "m.json"), "--mixture", "--len", "16", "--batch", "8", *flag]
        )
    assert info.value.code == 2
    assert f"{flag[0]} do not apply" in capsys.readouterr().err
