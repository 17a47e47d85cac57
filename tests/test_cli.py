"""Tests of the asyncflat command line and of asyncflat.inspection (describe, loader figures, verify)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import random_sequences
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflat import (
    FlatTokensParams,
    ShufflePlan,
    ShufflingLoader,
    TokenBatchParams,
    write_flat_tokens,
)
from asyncflat.cli import main
from asyncflat.errors import CorruptChunkError, DatasetFormatError
from asyncflat.inspection import describe_split, loader_figures, verify_split
from asyncflat.plan.coverage import coverage

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    seqs = random_sequences(1, 1500, max_len=200, vocab=5000)
    path = tmp_path_factory.mktemp("cli") / "ds.zarr"
    write_flat_tokens(path, {"train": seqs, "validation": seqs[:40]}, chunk_tokens=4096)
    return path, seqs


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- the command line -------------------------------------------------------------------------


def test_python_m_asyncflat_help() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflat", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "inspect", "convert", "bench"):
        assert command in proc.stdout


@pytest.mark.parametrize(
    "command, option",
    [
        ("demo", "--no-prefetch"),
        ("inspect", "--verify"),
        ("convert", "--tokenizer"),
        ("bench", "--list"),
    ],
)
def test_each_command_has_help(
    capsys: pytest.CaptureFixture[str], command: str, option: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert option in capsys.readouterr().out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", "0"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main([])
    capsys.readouterr()


def test_demo_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = [
        "--tokens",
        "300000",
        "--len",
        "64",
        "--batch",
        "8",
        "--sequences-per-block",
        "16",
        "--read-blocks-per-buffer",
        "4",
        "--step-ms",
        "0.5",
        "--no-progress",
        "--path",
        str(tmp_path / "demo.zarr"),
    ]
    rc, out, _ = run(capsys, "demo", *common, "--json")
    assert rc == 0
    result = json.loads(out)
    plan = ShufflePlan.create(
        FlatTokensParams(str(tmp_path / "demo.zarr"), 1, 4, 16, 0, True),
        TokenBatchParams(len=64, batch=8),
        token_count=zarr.open_group(str(tmp_path / "demo.zarr"))["train"]["encoded_tokens"].shape[
            0
        ],
        sequence_count=0,
    )
    assert result["steps"] == plan.step_count
    assert result["minipoch_boundaries_crossed"] == plan.minipoch_count - 1 >= 3
    assert result["fills"] == plan.minipoch_count
    assert result["fills_prefetch"] == plan.minipoch_count - 1
    assert result["tokens_per_s"] > 0 and result["load_max_s"] >= result["load_median_s"] > 0
    assert result["read_amplification"] == pytest.approx(1.0)  # chunks written to match blocks

    # The dataset at --path is reused; without prefetch every fill is on demand. Text output.
    rc, out, _ = run(capsys, "demo", *common, "--no-prefetch", "--steps", "40")
    assert rc == 0
    assert "40 steps of 8 x 64 tokens" in out and "prefetch off" in out
    assert "M tokens/s" in out and "0 prefetch" in out and "load() latency" in out


def test_inspect_text_and_json(
    dataset: tuple[Path, list[np.ndarray]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, seqs = dataset
    rc, out, _ = run(
        capsys,
        "inspect",
        str(path),
        "--len",
        "128",
        "--batch",
        "8",
        "--sequences-per-block",
        "8",
        "--read-blocks-per-buffer",
        "4",
        "--no-progress",
    )
    assert rc == 0
    tokens = sum(len(s) for s in seqs)
    assert f"train: {tokens:,} tokens, {len(seqs):,} sequences" in out
    assert "zarr format 3" in out and "chunks of 4,096 tokens" in out and "blosc(lz4" in out
    assert "sequence lengths: min" in out and "read amplification" in out and "minipochs" in out

    rc, out, _ = run(
        capsys,
        "inspect",
        str(path),
        "--split",
        "train",
        "--len",
        "128",
        "--batch",
        "8",
        "--sequences-per-block",
        "8",
        "--read-blocks-per-buffer",
        "4",
        "--streams",
        "2",
        "--hosts",
        "2",
        "--json",
        "--no-progress",
        "--verify",
    )
    assert rc == 0
    report = json.loads(out)["splits"]["train"]
    summary, loader = report["summary"], report["loader"]
    lengths = np.array([len(s) for s in seqs])
    assert summary["token_count"] == tokens and summary["sequence_count"] == len(seqs)
    assert summary["max_token_id"] == max(int(s.max()) for s in seqs)
    assert summary["lengths"]["min"] == lengths.min() and summary["lengths"]["max"] == lengths.max()
    assert summary["lengths"]["median"] == int(np.quantile(lengths, 0.5, method="inverted_cdf"))
    assert summary["lengths"]["p90"] == int(np.quantile(lengths, 0.9, method="inverted_cdf"))
    assert sum(summary["lengths"]["log2_histogram"]) == len(seqs)
    assert summary["compression_ratio"] > 1
    plan = ShufflePlan.create(
        FlatTokensParams(str(path), 2, 4, 8, 0, True),
        TokenBatchParams(len=128, batch=8),
        token_count=tokens,
        sequence_count=len(seqs),
    )
    assert (
        loader["step_count"] == plan.step_count and loader["minipoch_count"] == plan.minipoch_count
    )
    assert loader["streams_per_host"] == 1
    assert loader["buffer_bytes_per_host"] == 2 * plan.buffer_bytes
    # buffers + compressed reads in flight (here 4 whole chunks, less than uint32 in size) +
    # the fixed part
    from asyncflat.inspection.figures import FIXED_MEMORY_BYTES

    in_flight = loader["memory_bytes_per_host"] - 2 * plan.buffer_bytes - FIXED_MEMORY_BYTES
    assert 0 < in_flight < 4 * summary["chunk_tokens"] * 4
    assert report["verify"]["token_count"] == tokens


def test_inspect_says_whether_checksums_are_present(
    dataset: tuple[Path, list[np.ndarray]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers.seqax_v2 import write_seqax_v2

    path, seqs = dataset  # written with the writer's defaults: checksummed
    rc, out, _ = run(capsys, "inspect", str(path), "--split", "train", "--no-progress")
    assert rc == 0
    assert (
        "checksums: crc32c on every chunk of encoded_tokens and seq_starts, verified on every read"
        in out
    )
    rc, out, _ = run(capsys, "inspect", str(path), "--split", "train", "--json", "--no-progress")
    summary = json.loads(out)["splits"]["train"]["summary"]
    assert summary["token_checksums"] is True and summary["seq_starts_checksums"] is True

    seqax = tmp_path / "seqax.zarr"
    write_seqax_v2(seqax, {"train": seqs[:50], "validation": []})
    rc, out, _ = run(capsys, "inspect", str(seqax), "--split", "train", "--no-progress")
    assert rc == 0
    assert "checksums: none (a damaged chunk may decode into wrong tokens unnoticed)" in out


def test_inspect_reports_parameters_too_large(
    dataset: tuple[Path, list[np.ndarray]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = dataset
    rc, out, _ = run(
        capsys,
        "inspect",
        str(path),
        "--split",
        "validation",
        "--len",
        "2048",
        "--batch",
        "8",
        "--no-progress",
    )
    assert rc == 0 and "loader: the split has" in out


def test_inspect_missing_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "inspect", str(tmp_path / "nope"), "--no-progress")
    assert rc == 1 and "asyncflat inspect: error:" in err


# -- read amplification -----------------------------------------------------------------------


def test_read_amplification_packed_figures(dataset: tuple[Path, list[np.ndarray]]) -> None:
    path, _ = dataset
    summary = describe_split(str(path), "train", scan_lengths=False)
    batch = TokenBatchParams(len=128, batch=8)
    aligned = loader_figures(summary, FlatTokensParams(str(path), 1, 4, 32, 0, True), batch)
    assert aligned.read_amplification == pytest.approx(1.0, abs=0.02)  # 32*128 = one chunk
    quarter = loader_figures(summary, FlatTokensParams(str(path), 1, 1, 8, 0, True), batch)
    assert quarter.read_amplification == pytest.approx(4.0, rel=0.02)  # one block per fill
    unpacked = loader_figures(summary, FlatTokensParams(str(path), 1, 4, 8, 0, False), batch)
    assert unpacked.read_amplification > 1


def test_read_amplification_summed_a_minipoch_at_a_time_is_the_same(
    dataset: tuple[Path, list[np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflat.inspection import figures

    path, _ = dataset
    summary = describe_split(str(path), "train", scan_lengths=False)
    batch = TokenBatchParams(len=128, batch=8)
    params = FlatTokensParams(str(path), 2, 3, 4, 5, True)  # blocks share chunks across fills
    whole = loader_figures(summary, params, batch).read_amplification
    monkeypatch.setattr(figures, "FIGURES_BLOCKS_AT_ONCE", 1)  # one minipoch per run
    assert loader_figures(summary, params, batch).read_amplification == whole


def test_the_figures_of_a_split_the_loader_opens_are_not_refused(
    dataset: tuple[Path, list[np.ndarray]],
) -> None:
    """10^13 tokens in 512-sequence blocks of 2048 (9.5M read blocks): the loader opens it,
    and so must inspect (its figures used to need 160 bytes a block: 1.5 GB). The packed
    figures need only the split's sizes, so a small split's summary is scaled up."""
    import dataclasses

    path, _ = dataset
    small = describe_split(str(path), "train", scan_lengths=False)
    tokens = 10**13
    summary = dataclasses.replace(
        small, token_count=tokens, sequence_count=tokens // 2048, chunk_tokens=1 << 22
    )
    params = FlatTokensParams(str(path), 1, 16, 512, 0, True)
    figures = loader_figures(summary, params, TokenBatchParams(len=2048, batch=16))
    assert figures.read_amplification == pytest.approx(4.0, rel=0.01)  # 1M-token blocks, 4M chunks


# -- verify: each corruption is caught, with its index ----------------------------------------


def corrupt_copy(tmp_path: Path, fmt: int) -> Path:
    seqs = random_sequences(2, 400, max_len=60, vocab=300)
    path = tmp_path / f"ds{fmt}.zarr"
    write_flat_tokens(path, {"train": seqs}, zarr_format=fmt, chunk_tokens=512)
    return path


def array(path: Path, name: str) -> zarr.Array:
    return zarr.open_array(str(path / "train" / name), mode="r+")


@pytest.mark.parametrize("fmt", [2, 3])
def test_verify_passes_and_cli_exit_codes(
    tmp_path: Path, fmt: int, capsys: pytest.CaptureFixture[str]
) -> None:
    path = corrupt_copy(tmp_path, fmt)
    report = verify_split(str(path), "train")
    assert report.observed_max_token_id == report.max_token_id
    assert run(capsys, "inspect", str(path), "--verify", "--no-progress")[0] == 0
    array(path, "encoded_tokens")[5] = np.uint32(2 * 10_000)
    rc, _, err = run(capsys, "inspect", str(path), "--verify", "--no-progress", "--no-lengths")
    assert rc == 1 and "encoded_tokens[5]: token id 10000 > max_token_id" in err


@pytest.mark.parametrize("fmt", [2, 3])
def test_verify_seq_starts_not_increasing(tmp_path: Path, fmt: int) -> None:
    path = corrupt_copy(tmp_path, fmt)
    starts = array(path, "seq_starts")
    starts[37] = starts[35]
    with pytest.raises(DatasetFormatError, match=r"not strictly increasing at index 37"):
        verify_split(str(path), "train")


def test_verify_last_entry_mismatch(tmp_path: Path) -> None:
    path = corrupt_copy(tmp_path, 3)
    starts = array(path, "seq_starts")
    starts[starts.shape[0] - 1] = starts[starts.shape[0] - 1] - 1
    with pytest.raises(DatasetFormatError, match=r"seq_starts\[-1\] == len\(encoded_tokens\)"):
        verify_split(str(path), "train")


def test_verify_start_bits(tmp_path: Path) -> None:
    path = corrupt_copy(tmp_path, 3)
    tokens = array(path, "encoded_tokens")
    starts = array(path, "seq_starts")[:]
    inside = int(starts[10]) + 1  # a token that does not start a sequence
    assert inside < starts[11]
    tokens[inside] = tokens[inside] | 1
    with pytest.raises(DatasetFormatError, match=rf"encoded_tokens\[{inside}\]: start bit set"):
        verify_split(str(path), "train")
    tokens[inside] = tokens[inside] & ~np.uint32(1)
    first = int(starts[200])
    tokens[first] = tokens[first] & ~np.uint32(1)
    match = rf"encoded_tokens\[{first}\]: sequence 200 starts there"
    with pytest.raises(DatasetFormatError, match=match):
        verify_split(str(path), "train")


@pytest.mark.parametrize("fmt", [2, 3])
def test_verify_corrupt_and_missing_chunks(tmp_path: Path, fmt: int) -> None:
    path = corrupt_copy(tmp_path, fmt)
    chunk = path / "train" / "encoded_tokens" / ("3" if fmt == 2 else "c/3")
    original = chunk.read_bytes()
    chunk.write_bytes(np.random.default_rng(0).bytes(len(original)))
    with pytest.raises(CorruptChunkError, match=r"encoded_tokens: chunk 3 \(elements 1536:2048\)"):
        verify_split(str(path), "train")
    chunk.unlink()
    with pytest.raises(CorruptChunkError, match="missing"):
        verify_split(str(path), "train")
    chunk.write_bytes(original)
    verify_split(str(path), "train")
    starts_chunk = path / "train" / "seq_starts" / ("0" if fmt == 2 else "c/0")
    starts_chunk.write_bytes(starts_chunk.read_bytes()[:20])
    with pytest.raises(DatasetFormatError):  # first/last checks or the chunk itself
        verify_split(str(path), "train")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=80),
    kind=st.sampled_from(["id", "bit", "starts", "none"]),
    where=st.floats(0, 1, exclude_max=True),
)
def test_verify_finds_first_violation_across_windows(
    tmp_path_factory: pytest.TempPathFactory,
    lengths: list[int],
    kind: str,
    where: float,
) -> None:
    # Tiny windows and chunks, so every check crosses window and chunk boundaries.
    windows = {"token_window": 16, "starts_window": 8}
    rng = np.random.default_rng(len(lengths))
    seqs = [rng.integers(0, 50, n) for n in lengths]
    path = tmp_path_factory.mktemp("prop") / "ds.zarr"
    write_flat_tokens(path, {"train": seqs}, chunk_tokens=8)
    tokens, starts = array(path, "encoded_tokens"), array(path, "seq_starts")
    n = tokens.shape[0]
    k = int(where * n)
    if kind == "id":
        tokens[k] = (tokens[k] & 1) | (2 * 1000)
        match = rf"encoded_tokens\[{k}\]: token id 1000"
    elif kind == "bit":
        tokens[k] = tokens[k] ^ 1
        match = rf"encoded_tokens\[{k}\]"
    elif kind == "starts" and len(lengths) > 1:
        i = 1 + int(where * (len(lengths) - 1))
        starts[i] = starts[i - 1]
        match = rf"index {i}"
    else:
        report = verify_split(str(path), "train", **windows)
        assert report.token_count == n and report.token_reads == -(-n // 16)
        return
    with pytest.raises(DatasetFormatError, match=match):
        verify_split(str(path), "train", **windows)


# -- bench ------------------------------------------------------------------------------------


def test_bench_runs_scripts_and_prints_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "fast.py").write_text(
        '"""A fast benchmark."""\nprint("warming up")\nprint(\'{"figure": 1.5}\')\n'
    )
    (bench / "broken.py").write_text('"""Fails."""\nimport sys\nsys.exit(3)\n')
    (bench / "_helper.py").write_text("")
    rc, out, _ = run(capsys, "bench", "--bench-dir", str(bench), "--list")
    assert rc == 0 and "fast" in out and "A fast benchmark." in out and "_helper" not in out
    rc, out, err = run(capsys, "bench", "--bench-dir", str(bench), "fast")
    assert rc == 0
    assert json.loads(out) == {"figure": 1.5} and "warming up" in err
    rc, _, err = run(capsys, "bench", "--bench-dir", str(bench), "broken")
    assert rc == 1 and "broken (exit status 3)" in err
    rc, _, err = run(capsys, "bench", "--bench-dir", str(bench), "nope")
    assert rc == 1 and "unknown benchmark" in err
    rc, _, err = run(capsys, "bench", "--bench-dir", str(tmp_path / "missing"), "--list")
    assert rc == 1 and "not a directory" in err


def test_bench_finds_the_checkout(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "bench", "--list")
    assert rc == 0
    assert {p.stem for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_")} <= {
        line.split()[0] for line in out.splitlines() if line.strip()
    }


# -- conventions: --version, global options, environment, exit status, pipes ----------------


def _cli(*argv: str, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: int = 180):
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "asyncflat", *argv],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import asyncflat

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"asyncflat {asyncflat.__version__}"


@pytest.fixture
def restore_logging():
    loggers = [logging.getLogger(), logging.getLogger("asyncflat")]
    levels = [lg.level for lg in loggers]
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


@pytest.mark.parametrize(
    ("argv", "asyncflat_level"),
    [
        (["-v", "bench", "--list"], logging.INFO),
        (["bench", "--list", "-v"], logging.INFO),
        (["bench", "-v", "--list", "--verbose"], logging.DEBUG),
        (["-v", "bench", "--list", "-v"], logging.DEBUG),
        (["bench", "--list", "-q"], logging.ERROR),
        (["-q", "bench", "--list"], logging.ERROR),
        (["bench", "--list"], logging.WARNING),
    ],
)
def test_global_options_before_and_after_the_command(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    restore_logging: None,
    argv: list[str],
    asyncflat_level: int,
) -> None:
    (tmp_path / "one.py").write_text('"""One."""\n')
    rc, out, _ = run(capsys, *argv, "--bench-dir", str(tmp_path))
    assert rc == 0 and out.startswith("one")
    assert logging.getLogger("asyncflat").level == asyncflat_level
    # Other libraries (jax, absl, urllib3...) stay at warnings whatever -v says.
    assert logging.getLogger().level == max(asyncflat_level, logging.WARNING)


def test_verbose_shows_asyncflat_info_but_not_jax_info(tmp_path: Path) -> None:
    demo = ["demo", "--tokens", "60000", "--len", "64", "--batch", "8"]
    demo += ["--sequences-per-block", "16", "--read-blocks-per-buffer", "4", "--steps", "20"]
    demo += ["--step-ms", "0", "--no-progress", "--path", str(tmp_path / "d.zarr")]
    proc = _cli(*demo, "-v", env={"JAX_LOG_COMPILES": "1"})
    assert proc.returncode == 0, proc.stderr
    info = [line for line in proc.stderr.splitlines() if " INFO " in line]
    assert any(" INFO asyncflat" in line for line in info), proc.stderr
    assert not [line for line in info if " INFO asyncflat" not in line], proc.stderr
    # Without -v, asyncflat's info lines are not shown either.
    proc = _cli(*demo)
    assert proc.returncode == 0 and " INFO " not in proc.stderr, proc.stderr


def test_environment_defaults(
    dataset: tuple[Path, list[np.ndarray]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    restore_logging: None,
    tmp_path: Path,
) -> None:
    path, _ = dataset
    (tmp_path / "one.py").write_text('"""One."""\n')
    monkeypatch.setenv("ASYNCFLAT_LOG_LEVEL", "debug")
    assert run(capsys, "bench", "--list", "--bench-dir", str(tmp_path))[0] == 0
    assert logging.getLogger("asyncflat").level == logging.DEBUG
    # -q on the command line wins over the environment.
    assert run(capsys, "bench", "--list", "-q", "--bench-dir", str(tmp_path))[0] == 0
    assert logging.getLogger("asyncflat").level == logging.ERROR
    monkeypatch.setenv("ASYNCFLAT_LOG_LEVEL", "loud")
    rc, _, err = run(capsys, "bench", "--list", "--bench-dir", str(tmp_path))
    assert rc == 1 and "ASYNCFLAT_LOG_LEVEL='LOUD'" in err and "DEBUG" in err
    monkeypatch.delenv("ASYNCFLAT_LOG_LEVEL")

    # Progress bars: shown by default on inspect's scan, gone with ASYNCFLAT_NO_PROGRESS=1.
    rc, _, err = run(capsys, "inspect", str(path), "--split", "train")
    assert rc == 0 and ("it/s" in err or "%|" in err)
    monkeypatch.setenv("ASYNCFLAT_NO_PROGRESS", "1")
    rc, _, err = run(capsys, "inspect", str(path), "--split", "train")
    assert rc == 0 and "%|" not in err and "it/s" not in err


@pytest.mark.parametrize("given", [["--len", "128"], ["--batch", "8"]])
def test_len_without_batch_is_a_usage_error(
    dataset: tuple[Path, list[np.ndarray]], capsys: pytest.CaptureFixture[str], given: list[str]
) -> None:
    path, _ = dataset
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(path), *given])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "--len and --batch go together" in err


def test_exit_statuses_documented_and_real(
    dataset: tuple[Path, list[np.ndarray]], tmp_path: Path
) -> None:
    doc = (REPO / "docs" / "cli.md").read_text()
    for status in ("0", "1", "2", "130", "141"):
        assert f"`{status}`" in doc
    assert _cli("inspect", str(dataset[0]), "--split", "train", "--no-lengths").returncode == 0
    failed = _cli("inspect", str(tmp_path / "missing"), "--no-progress")
    assert failed.returncode == 1 and "asyncflat inspect: error:" in failed.stderr
    assert "Traceback" not in failed.stderr
    usage = _cli("inspect", str(dataset[0]), "--len", "64")
    assert usage.returncode == 2 and "usage:" in usage.stderr
    assert _cli("nope").returncode == 2


def test_bench_passes_arguments_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "echo.py").write_text(
        '"""Echo."""\nimport json, sys\nprint(json.dumps({"argv": sys.argv[1:]}))\n'
    )
    (tmp_path / "other.py").write_text('"""Other."""\nprint(\'{"other": 1}\')\n')
    from asyncflat.cli import build_parser

    parsed = build_parser().parse_args(["bench", "cloud", "--tokens-mib", "8"])
    assert (parsed.name, parsed.args) == ("cloud", ["--tokens-mib", "8"])
    rc, out, _ = run(capsys, "bench", "--bench-dir", str(tmp_path), "echo", "--tokens-mib", "8")
    assert rc == 0 and json.loads(out) == {"argv": ["--tokens-mib", "8"]}
    # Global options before NAME are asyncflat's; everything after NAME is the script's.
    rc, out, _ = run(capsys, "bench", "-q", "--bench-dir", str(tmp_path), "echo", "-v", "x")
    assert rc == 0 and json.loads(out) == {"argv": ["-v", "x"]}
    rc, out, _ = run(capsys, "bench", "--bench-dir", str(tmp_path), "echo,other")
    assert rc == 0 and [json.loads(line) for line in out.splitlines()] == [
        {"argv": []},
        {"other": 1},
    ]


def test_bench_list_into_a_closed_pipe_has_no_traceback(tmp_path: Path) -> None:
    # A first docstring line longer than a pipe's buffer, so the write must fail.
    (tmp_path / "long.py").write_text('"""' + "x" * 300_000 + '"""\n')
    for i in range(5):
        (tmp_path / f"b{i}.py").write_text(f'"""Benchmark {i}."""\n')
    with subprocess.Popen(
        [sys.executable, "-m", "asyncflat", "bench", "--list", "--bench-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.read(10)  # like `head -c 10`: read a little, then go away
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_bench_never_runs_the_current_directorys_scripts(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "evil.py").write_text(
        f'"""Evil."""\nopen({str(marker)!r}, "w").close()\n'
    )
    listed = _cli("bench", "--list", cwd=tmp_path)
    assert listed.returncode == 0 and "evil" not in listed.stdout and "stall" in listed.stdout
    ran = _cli("bench", "evil", cwd=tmp_path)
    assert ran.returncode == 1 and "unknown benchmark(s) evil" in ran.stderr
    assert not marker.exists()


def test_bench_of_an_installed_package_needs_bench_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncflat.cli.bench as cli

    # A wheel install: site-packages/asyncflat/cli.py next to somebody else's bench/.
    site = tmp_path / "site-packages"
    (site / "asyncflat").mkdir(parents=True)
    (site / "bench").mkdir()
    (site / "bench" / "other.py").write_text('"""Not ours."""\n')
    monkeypatch.setattr(cli, "__file__", str(site / "asyncflat" / "cli.py"))
    rc, out, err = run(capsys, "bench", "--list")
    assert rc == 1 and "--bench-dir" in err and "other" not in out
    # The same tree with asyncflat's pyproject.toml is a source checkout: its bench/ is ours.
    (site / "pyproject.toml").write_text('[project]\nname = "asyncflat"\n')
    rc, out, _ = run(capsys, "bench", "--list")
    assert rc == 0 and out.startswith("other")


# -- inspect: sizing made visible ------------------------------------------------------------


def test_inspect_warns_when_rounding_drops_more_than_one_percent(
    dataset: tuple[Path, list[np.ndarray]],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, seqs = dataset
    tokens = sum(len(s) for s in seqs)
    argv = ["inspect", str(path), "--split", "train", "--len", "128", "--batch", "8"]
    argv += ["--read-blocks-per-buffer", "4", "--no-progress", "--no-lengths"]
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        rc, out, _ = run(capsys, *argv, "--sequences-per-block", "200")
    assert rc == 0
    plan = ShufflePlan.create(
        FlatTokensParams(str(path), 1, 4, 200, 0, True),
        TokenBatchParams(len=128, batch=8),
        token_count=tokens,
        sequence_count=len(seqs),
    )
    dropped = 1 - plan.step_count * 8 * 128 / tokens
    assert dropped > 0.01
    assert f"dropped by rounding: {dropped:.1%} of the split's tokens" in out
    assert f"warning: {path}/train: " in out and f"({dropped:.1%}) are never served" in out
    suggested = int(out.split("sequences_per_read_block=")[-1].split()[0])
    better = ShufflePlan.create(
        FlatTokensParams(str(path), 1, 4, suggested, 0, True),
        TokenBatchParams(len=128, batch=8),
        token_count=tokens,
        sequence_count=len(seqs),
    )
    assert coverage(better).dropped_fraction <= 0.01
    assert f"for a split of {tokens * 4 / 1024:.1f} KiB" in out
    assert [
        r for r in caplog.records if r.levelno == logging.WARNING and "never served" in r.message
    ]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        rc, out, _ = run(capsys, *argv, "--sequences-per-block", str(suggested), "--json")
    figures = json.loads(out)["splits"]["train"]["loader"]
    assert rc == 0 and figures["sizing_warning"] is None
    assert figures["dropped_fraction"] == pytest.approx(coverage(better).dropped_fraction)
    assert figures["split_bytes"] == 4 * tokens
    assert not [r for r in caplog.records if "never served" in r.message]


def test_inspect_and_the_loader_give_the_same_drop_warning(
    dataset: tuple[Path, list[np.ndarray]],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One rule, one sentence: what inspect shows (and logs) is what the loader logs when built
    # over the same split with the same parameters.
    path, _ = dataset
    argv = ["inspect", str(path), "--split", "train", "--len", "128", "--batch", "8"]
    argv += ["--read-blocks-per-buffer", "4", "--sequences-per-block", "200", "--no-lengths"]
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        rc, out, _ = run(capsys, *argv, "--no-progress", "--json")
    shown = json.loads(out)["splits"]["train"]["loader"]["sizing_warning"]
    assert rc == 0 and shown and "never served" in shown
    inspect_logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    caplog.clear()
    params = FlatTokensParams(str(path), 1, 4, 200, 0, True)
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        with ShufflingLoader("train", params, TokenBatchParams(len=128, batch=8)):
            pass
    loader_logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert inspect_logged == loader_logged == [shown]


# -- demo --plot, the deprecated module name ------------------------------------------------


def test_demo_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "run.png"
    rc, out, _ = run(
        capsys,
        "demo",
        "--tokens",
        "200000",
        "--len",
        "64",
        "--batch",
        "8",
        "--sequences-per-block",
        "16",
        "--read-blocks-per-buffer",
        "4",
        "--step-ms",
        "0",
        "--no-progress",
        "--json",
        "--plot",
        str(png),
    )
    assert rc == 0 and json.loads(out)["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_boundary_worst() -> None:
    from asyncflat.cli.stall_figure import boundary_worst

    lat = [9.0, 1, 2, 7, 1, 1, 3, 1]
    np.testing.assert_array_equal(boundary_worst(lat, [3, 6, 99]), [7, 3])
    np.testing.assert_array_equal(boundary_worst(lat, [0, 1]), [9 * 0 + 7])
