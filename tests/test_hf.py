"""Tests of asyncflat.integrations.hf: converting local Hugging Face datasets and the streaming loader."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from test_convert import assert_dataset, expected_splits, make_tokenizer_json

from asyncflat import HuggingFaceDataParams, TokenBatchParams, get_loader
from asyncflat.cli import main
from asyncflat.errors import ConfigError, StepOutOfRangeError
from asyncflat.integrations.hf import HuggingFaceDataLoader, convert_hf_dataset
from asyncflat.writer.convert import ConvertOptions

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def documents(seed: int, count: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(1, 30))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hf")
    train, validation = documents(0, 120), documents(1, 30)
    data = root / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(
        "".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(train))
    )
    (data / "validation.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in validation)
    )
    tokenizer = make_tokenizer_json(root, train)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    return {
        "root": root,
        "data": data,
        "train": train,
        "validation": validation,
        "tokenizer": str(tokenizer),
        "encode": lambda t: tok.encode(t, add_special_tokens=False).ids,
    }


# -- conversion -------------------------------------------------------------------------------


def test_convert_data_file_directory_keeps_its_splits(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "out.zarr"
    report = convert_hf_dataset(
        corpus["data"], out, options=ConvertOptions(tokenizer=corpus["tokenizer"])
    )
    encode = corpus["encode"]
    assert_dataset(
        out,
        {
            "train": [encode(d) for d in corpus["train"]],
            "validation": [encode(d) for d in corpus["validation"]],
        },
    )
    assert report.documents == len(corpus["train"]) + len(corpus["validation"])


def test_convert_save_to_disk_and_single_file(corpus: dict, tmp_path: Path) -> None:
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": corpus["train"]}).save_to_disk(str(saved))
    out = tmp_path / "saved.zarr"
    convert_hf_dataset(
        saved, out, options=ConvertOptions(tokenizer=corpus["tokenizer"], validation_fraction=0.25)
    )
    expected = expected_splits(corpus["train"], corpus["encode"], 0.25)
    assert_dataset(out, expected)

    out2 = tmp_path / "file.zarr"  # one data file: a train split, split by the same rule
    convert_hf_dataset(
        corpus["data"] / "train.jsonl",
        out2,
        options=ConvertOptions(tokenizer=corpus["tokenizer"], validation_fraction=0.25),
    )
    assert_dataset(out2, expected)


def test_convert_hf_via_cli(
    corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.zarr"
    rc = main(
        [
            "convert",
            "--hf-dataset",
            str(corpus["data"]),
            "-o",
            str(out),
            "--tokenizer",
            "bytes",
            "--workers",
            "1",
            "--no-progress",
            "--json",
        ]
    )
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["sequences"] == {"train": 120, "validation": 30}
    assert_dataset(
        out,
        {
            "train": [[b + 1 for b in d.encode()] for d in corpus["train"]],
            "validation": [[b + 1 for b in d.encode()] for d in corpus["validation"]],
        },
    )


def test_convert_hf_errors(corpus: dict, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="never downloads"):
        convert_hf_dataset(tmp_path / "not-here", tmp_path / "o")
    with pytest.raises(ConfigError, match="no column 'body'"):
        convert_hf_dataset(corpus["data"], tmp_path / "o", text_field="body")
    assert not (tmp_path / "o").exists()


# -- the streaming loader ---------------------------------------------------------------------


def reference_collate(
    sequences: list[list[int]], batch: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """seqax's HuggingFaceDataLoader.collate, transcribed."""
    flat_batch = np.zeros(batch * seq_len, np.uint32)
    flat_is_start = np.zeros(batch * seq_len, np.bool_)
    start = 0
    for seq in sequences:
        end = min(start + len(seq), len(flat_batch))
        flat_is_start[start] = True
        flat_batch[start:end] = seq[: end - start]
        start += len(seq)
        if start >= len(flat_batch):
            break
    return flat_batch.reshape(batch, seq_len), flat_is_start.reshape(batch, seq_len)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_matches_reference_collate(corpus: dict, num_workers: int) -> None:
    per_batch, batch, seq_len = 6, 8, 16  # some batches overflow (cut), some are padded
    params = HuggingFaceDataParams(
        path=str(corpus["data"]),
        tokenizer=corpus["tokenizer"],
        num_workers=num_workers,
        sequences_packed_per_batch=per_batch,
    )
    loader = get_loader("train", params, TokenBatchParams(len=seq_len, batch=batch))
    assert isinstance(loader, HuggingFaceDataLoader)
    with loader:
        assert loader.max_token_id == len(WORDS) + 1  # [PAD], [UNK] and the words
        encoded = [corpus["encode"](d) for d in corpus["train"]]
        steps = len(encoded) // per_batch  # the last partial group is dropped
        for step in range(steps):
            out = loader.load(step)
            group = encoded[step * per_batch : (step + 1) * per_batch]
            targets, is_start = reference_collate(group, batch, seq_len)
            np.testing.assert_array_equal(np.asarray(out.targets), targets)
            np.testing.assert_array_equal(np.asarray(out.is_seq_start), is_start)
            assert out.targets.dtype == np.uint32 and out.is_seq_start.dtype == np.bool_
            assert out.targets.sharding.is_equivalent_to(loader.sharding, 2)
        with pytest.raises(StepOutOfRangeError, match="ran out after"):
            loader.load(steps)
        with pytest.raises(StepOutOfRangeError, match="cannot go back"):
            loader.load(0)


def test_loader_skips_forward_and_validation_split(corpus: dict) -> None:
    params = HuggingFaceDataParams(
        path=str(corpus["data"]), tokenizer="bytes", num_workers=0, sequences_packed_per_batch=2
    )
    mesh_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    batch = TokenBatchParams(len=32, batch=2)
    with HuggingFaceDataLoader("validation", params, batch, mesh_sharding) as loader:
        out = loader.load(3)  # reads and discards steps 0..2
        docs = [[b + 1 for b in d.encode()] for d in corpus["validation"][6:8]]
        targets, _ = reference_collate(docs, 2, 32)
        np.testing.assert_array_equal(np.asarray(out.targets), targets)


def test_loader_config_errors(corpus: dict, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    path = tmp_path / "no-zero.json"  # id 0 is an ordinary word
    Tokenizer(models.WordLevel({"alpha": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    batch = TokenBatchParams(len=16, batch=8)
    with pytest.raises(ConfigError, match="id 0 must be a special token"):
        params = HuggingFaceDataParams(str(corpus["data"]), str(path), 0, 2)
        HuggingFaceDataLoader("train", params, batch)
    with pytest.raises(ConfigError, match="no split 'test'"):
        HuggingFaceDataLoader(
            "test", HuggingFaceDataParams(str(corpus["data"]), "bytes", 0, 2), batch
        )
    with pytest.raises(ConfigError, match="never downloads"):
        HuggingFaceDataLoader(
            "train", HuggingFaceDataParams("some/hub-dataset", "bytes", 0, 2), batch
        )


def test_loader_takes_only_integer_steps_and_builds_the_users_batch_type(corpus: dict) -> None:
    from typing import NamedTuple

    from asyncflat import ArgumentTypeError

    class Batch(NamedTuple):
        targets: jax.Array
        is_seq_start: jax.Array

    params = HuggingFaceDataParams(
        path=str(corpus["data"]), tokenizer="bytes", num_workers=0, sequences_packed_per_batch=2
    )
    batch = TokenBatchParams(len=32, batch=8)
    with get_loader("validation", params, batch, batch_type=Batch) as loader:
        for bad in (True, 1.0, "1", None, np.array(1)):
            with pytest.raises(ArgumentTypeError, match="step must be a Python or numpy integer"):
                loader.load(bad)
        out = loader.load(np.uint64(1))  # reads and discards step 0
        assert type(out) is Batch
        docs = [[b + 1 for b in d.encode()] for d in corpus["validation"][2:4]]
        targets, is_start = reference_collate(docs, 8, 32)
        np.testing.assert_array_equal(np.asarray(out.targets), targets)
        np.testing.assert_array_equal(np.asarray(out.is_seq_start), is_start)


def test_a_malformed_data_file_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A data file streamed by datasets fails while it is read, not when it is opened."""
    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n{"text": bad}\n')
    with pytest.raises(ConfigError, match=r"c.jsonl \[train\]: cannot read"):
        convert_hf_dataset(tmp_path / "c.jsonl", tmp_path / "o", options=ConvertOptions(workers=1))
    assert main(["convert", "--hf-dataset", str(tmp_path / "c.jsonl"), "-o", str(tmp_path / "o"),
                 "--no-progress", "--workers", "1"]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncflat convert: error: ") and "Traceback" not in err
    assert not (tmp_path / "o").exists()
