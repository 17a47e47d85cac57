"""Tests of asyncflat.writer.convert: inputs, tokenizers, deterministic splits, parallelism, crash safety."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import zarr

from asyncflat.cli import main
from asyncflat.errors import ConfigError
from asyncflat.format.codec import decode
from asyncflat.inspection import verify_split
from asyncflat.text.corpus import iter_documents
from asyncflat.text.tokenizer import BytesTokenizer, load_tokenizer
from asyncflat.writer.convert import (
    ConvertOptions,
    convert_files,
    convert_texts,
    validation_mask,
)

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln — ünïcödé ✓",
    "",
    "short",
    "a much longer document " * 40,
    "日本語のテキスト",
    "tabs\tand  spaces",
] + [f"document number {i} with some words" for i in range(300)]


def read_split(path: Path, split: str) -> list[list[int]]:
    """The sequences of a split, checking the start bits agree with seq_starts."""
    group = zarr.open_group(str(path), mode="r")[split]
    targets, is_start = decode(group["encoded_tokens"][:])
    starts = group["seq_starts"][:].astype(np.int64)
    np.testing.assert_array_equal(np.flatnonzero(is_start), starts[:-1])
    return [targets[starts[i] : starts[i + 1]].tolist() for i in range(len(starts) - 1)]


def expected_splits(
    docs: list[str], encode, fraction: float, seed: int = 0
) -> dict[str, list[list[int]]]:
    is_val = validation_mask(np.arange(len(docs)), fraction, seed)
    out: dict[str, list[list[int]]] = {"train": [], "validation": []}
    for doc, val in zip(docs, is_val):
        ids = list(encode(doc))
        if ids:
            out["validation" if val else "train"].append(ids)
    return out


def bytes_ids(text: str) -> list[int]:
    return [b + 1 for b in text.encode("utf-8")]


def assert_dataset(path: Path, expected: dict[str, list[list[int]]]) -> None:
    for split, seqs in expected.items():
        assert read_split(path, split) == seqs, split
        verify_split(str(path), split)


# -- split assignment -------------------------------------------------------------------------


def test_validation_mask_is_deterministic_and_proportional() -> None:
    idx = np.arange(200_000)
    mask = validation_mask(idx, 0.1, seed=3)
    assert abs(mask.mean() - 0.1) < 0.005
    np.testing.assert_array_equal(
        mask[:1000], validation_mask(idx[:1000], 0.1, seed=3)
    )  # prefix-stable
    assert not np.array_equal(mask, validation_mask(idx, 0.1, seed=4))
    assert not validation_mask(idx, 0.0, 0).any()
    assert validation_mask(idx, 1.0, 0).all()
    with pytest.raises(ConfigError, match="validation_fraction"):
        validation_mask(idx, 1.5, 0)


# -- inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["txt", "txt.gz", "txt-file", "jsonl", "jsonl.gz", "parquet", "dir"]
)
def test_convert_each_input_type_bytes(tmp_path: Path, kind: str) -> None:
    docs = [d for d in DOCS if "\n" not in d]
    inputs: list[Path]
    txt_mode = "line"
    if kind in ("txt", "txt.gz"):
        inputs = [tmp_path / f"in.{kind}"]
        data = "".join(d + "\n" for d in docs)
        if kind == "txt.gz":
            with gzip.open(inputs[0], "wt", encoding="utf-8") as f:
                f.write(data)
        else:
            inputs[0].write_text(data, encoding="utf-8")
    elif kind == "txt-file":
        txt_mode = "file"
        docs = ["first file\nwith two lines", "second file", "third\n\nfile\n"]
        inputs = []
        for i, doc in enumerate(docs):
            inputs.append(tmp_path / f"doc{i}.txt")
            inputs[-1].write_text(doc, encoding="utf-8")
    elif kind in ("jsonl", "jsonl.gz"):
        inputs = [tmp_path / f"in.{kind}"]
        data = "".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs))
        if kind == "jsonl.gz":
            with gzip.open(inputs[0], "wt", encoding="utf-8") as f:
                f.write(data)
        else:
            inputs[0].write_text(data, encoding="utf-8")
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        inputs = [tmp_path / "in.parquet"]
        table = pa.table({"body": docs, "n": list(range(len(docs)))})
        pq.write_table(table, inputs[0], row_group_size=50)
    else:  # a directory: its files in sorted order, whatever their types
        (tmp_path / "d").mkdir()
        half = len(docs) // 2
        (tmp_path / "d" / "a.txt").write_text(
            "".join(d + "\n" for d in docs[:half]), encoding="utf-8"
        )
        (tmp_path / "d" / "b.jsonl").write_text(
            "".join(json.dumps({"body": d}) + "\n" for d in docs[half:]), encoding="utf-8"
        )
        (tmp_path / "d" / "ignored.md").write_text("not an input")
        inputs = [tmp_path / "d"]
    text_field = "body"
    assert list(iter_documents(inputs, text_field=text_field, txt_mode=txt_mode)) == docs
    out = tmp_path / "out.zarr"
    report = convert_files(
        inputs,
        out,
        text_field=text_field,
        txt_mode=txt_mode,
        options=ConvertOptions(validation_fraction=0.2, chunk_tokens=64),
    )
    expected = expected_splits(docs, bytes_ids, 0.2)
    assert_dataset(out, expected)
    assert report.documents == len(docs)
    assert report.sequences == {s: len(v) for s, v in expected.items()}
    assert report.empty_documents == sum(1 for d in docs if not d)
    group = zarr.open_group(str(out), mode="r")
    assert group["train"].attrs["max_token_id"] == max(max(s) for s in expected["train"])


def test_bytes_tokenizer_matches_seqax_bytes_utf8() -> None:
    (ids,) = BytesTokenizer().encode_batch(["é!"])
    assert ids.tolist() == [0xC3 + 1, 0xA9 + 1, ord("!") + 1]  # id = byte + 1, 0 never used


# -- tokenizers -------------------------------------------------------------------------------


def make_tokenizer_json(path: Path, corpus: list[str]) -> Path:
    """A tiny WordLevel tokenizer with [PAD] = id 0 (special) and [UNK] = 1, saved as JSON."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    file = path / "tokenizer.json"
    tok.save(str(file))
    return file


def test_convert_with_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    file = make_tokenizer_json(tmp_path, DOCS[:100])
    tok = Tokenizer.from_file(str(file))
    assert tok.token_to_id("[PAD]") == 0
    docs = DOCS + ["words never seen before zzz"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for spec in (str(file), str(tmp_path)):  # the file, or the directory holding it
        out = tmp_path / f"out-{len(spec)}.zarr"
        convert_files(
            [tmp_path / "in.jsonl"],
            out,
            options=ConvertOptions(tokenizer=spec, validation_fraction=0.3),
        )
        encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
        assert_dataset(out, expected_splits(docs, encode, 0.3))
    assert load_tokenizer(str(file)).zero_reserved


def test_unknown_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="never downloads tokenizers"):
        load_tokenizer("gpt2")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path))


def test_tiktoken_without_cached_files_fails_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(ConfigError, match="not in tiktoken's cache"):
        load_tokenizer("tiktoken:cl100k_base")
    with pytest.raises(ConfigError, match="tiktoken:no_such_encoding") as unknown:
        load_tokenizer("tiktoken:no_such_encoding")
    # one line naming the encodings it knows, not tiktoken's three
    assert "\n" not in str(unknown.value) and "cl100k_base" in str(unknown.value)


def test_a_known_tiktoken_encoding_that_fails_to_load_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoding tiktoken knows whose ranks do not load (a plugin's corrupt ranks file) is
    reported with tiktoken's reason, not as an encoding tiktoken has not."""
    import tiktoken
    import tiktoken.load
    import tiktoken.registry

    ranks = tmp_path / "broken.tiktoken"
    ranks.write_text("not base64 at all\n")

    def broken() -> dict[str, object]:
        bpe = tiktoken.load.load_tiktoken_bpe(str(ranks))  # a local path: no download
        return {"name": "broken", "pat_str": r"\S+", "mergeable_ranks": bpe, "special_tokens": {}}

    tiktoken.list_encoding_names()  # the registry is filled on first use
    monkeypatch.setitem(tiktoken.registry.ENCODING_CONSTRUCTORS, "broken_ranks", broken)
    with pytest.raises(ConfigError, match="tiktoken:broken_ranks") as failed:
        load_tokenizer("tiktoken:broken_ranks")
    assert "Error parsing line" in str(failed.value)
    assert "has no encoding" not in str(failed.value)


# -- parallelism, crash safety, CLI -----------------------------------------------------------


def test_worker_processes_give_identical_output(tmp_path: Path) -> None:
    docs = [f"doc {i} " + "x" * (i % 37) for i in range(3000)]  # several batches per worker
    convert_texts(docs, tmp_path / "one.zarr", options=ConvertOptions(workers=1, chunk_tokens=4096))
    convert_texts(docs, tmp_path / "two.zarr", options=ConvertOptions(workers=2, chunk_tokens=4096))
    for split in ("train", "validation"):
        assert read_split(tmp_path / "one.zarr", split) == read_split(tmp_path / "two.zarr", split)
    assert_dataset(tmp_path / "two.zarr", expected_splits(docs, bytes_ids, 0.01))


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"doc {i} " * 50}) for i in range(5000)]
    lines.insert(4000, json.dumps({"title": "no text field"}))  # after several appended batches
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.zarr"
    with pytest.raises(ConfigError, match=r"in.jsonl:4001: no field 'text'"):
        convert_files([tmp_path / "in.jsonl"], out, options=ConvertOptions(chunk_tokens=1024))
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no staging left behind

    def exploding():
        yield from ("fine document",) * 2000
        raise RuntimeError("the input stream broke")

    with pytest.raises(RuntimeError, match="stream broke"):
        convert_texts(exploding(), out, options=ConvertOptions(chunk_tokens=1024))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_existing_output_needs_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out.zarr"
    convert_texts(["one", "two"], out)
    with pytest.raises(ConfigError, match="already exists"):
        convert_texts(["three"], out)
    convert_texts(["three"], out, options=ConvertOptions(overwrite=True, validation_fraction=0.0))
    assert read_split(out, "train") == [bytes_ids("three")]


def test_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        convert_files([tmp_path / "missing.txt"], tmp_path / "o")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unsupported file type"):
        convert_files([tmp_path / "x.csv"], tmp_path / "o")
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ConfigError, match="expected a string"):
        convert_files([tmp_path / "bad.jsonl"], tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_cli_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "in.txt").write_text("".join(d + "\n" for d in DOCS), encoding="utf-8")
    out = tmp_path / "out.zarr"
    rc = main(
        [
            "convert",
            str(tmp_path / "in.txt"),
            "-o",
            str(out),
            "--workers",
            "1",
            "--validation-fraction",
            "0.1",
            "--format",
            "2",
            "--chunk-tokens",
            "256",
            "--no-progress",
            "--json",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    expected = expected_splits(DOCS, bytes_ids, 0.1)
    assert report["sequences"] == {s: len(v) for s, v in expected.items()}
    assert_dataset(out, expected)
    assert zarr.open_group(str(out), mode="r")["train"]["encoded_tokens"].metadata.zarr_format == 2

    rc = main(["convert", str(tmp_path / "in.txt"), "-o", str(out), "--no-progress"])
    assert rc == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", "-o", str(tmp_path / "x"), "--no-progress"]) == 1
    assert "either input files" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


# -- what a user meets ------------------------------------------------------------------------


def test_jsonl_missing_field_lists_the_fields_present(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"title": "t", "body": "b"}\n')
    with pytest.raises(ConfigError, match=r"no field 'text' .*\(fields: 'title', 'body'\)"):
        convert_files([tmp_path / "in.jsonl"], tmp_path / "o")
    (tmp_path / "in.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match=r"in.jsonl:1: expected a JSON object .* got a list"):
        convert_files([tmp_path / "in.jsonl"], tmp_path / "o")


def test_empty_and_tiny_splits_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    docs = [f"document {i}" for i in range(151)]
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        report = convert_texts(
            docs, tmp_path / "a", options=ConvertOptions(validation_fraction=0.0, chunk_tokens=64)
        )
    assert report.sequences["validation"] == 0
    (record,) = [r for r in caplog.records if "validation" in r.getMessage()]
    assert "'validation'" in record.getMessage() and "is empty" in record.getMessage()
    assert "151 documents" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        report = convert_texts(
            docs, tmp_path / "b", options=ConvertOptions(validation_fraction=0.02, chunk_tokens=64)
        )
    assert 0 < report.sequences["validation"] < 16
    messages = [r.getMessage() for r in caplog.records]
    assert any("'validation'" in m and "is tiny" in m for m in messages), messages
    assert not any("'train'" in m for m in messages), messages  # train is big enough
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        convert_texts(
            docs * 20,
            tmp_path / "c",
            options=ConvertOptions(validation_fraction=0.3, chunk_tokens=64),
        )
    assert caplog.records == []


def test_progress_bar_has_a_total(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text("".join(f"line {i}\n" for i in range(5000)))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5000))
    size = (tmp_path / "a.txt").stat().st_size + (tmp_path / "b.jsonl.gz").stat().st_size
    convert_files([tmp_path], tmp_path / "o.zarr", options=ConvertOptions(progress=True))
    err = capsys.readouterr().err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "100%" in final, err  # a percentage is shown only against a total
    assert f"{size / 1000:.1f}k" in final or f"{size / 1000:.0f}k" in final, final


# -- tiktoken from a local file -----------------------------------------------------------------


def write_tiktoken_file(path: Path) -> dict[bytes, int]:
    """Ranks for every byte plus a few merges, in tiktoken's base64 format."""
    import base64

    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"he", b"ll", b"hell", b"hello", b" w", b"or"):
        ranks[merge] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def test_tiktoken_from_a_local_file(tmp_path: Path) -> None:
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    file = tmp_path / "r50k_base.tiktoken"
    ranks = write_tiktoken_file(file)
    reference = tiktoken.Encoding(
        name="ref", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={}
    )
    text = "hello world, hello"
    for spec in (str(file), f"tiktoken:r50k_base={file}"):
        tok = load_tokenizer(spec)
        assert tok.vocab_size == len(ranks)
        (ids,) = tok.encode_batch([text])
        assert ids.tolist() == reference.encode_ordinary(text)
        assert ids.tolist()[0] == ranks[b"hello"]
    out = tmp_path / "out.zarr"
    convert_texts(
        [text, "hello"],
        out,
        options=ConvertOptions(tokenizer=str(file), validation_fraction=0.0, workers=2),
    )
    assert read_split(out, "train") == [reference.encode_ordinary(t) for t in (text, "hello")]

    other = tmp_path / "mine.tiktoken"
    other.write_bytes(file.read_bytes())
    with pytest.raises(ConfigError, match=r"'mine' names no tiktoken encoding"):
        load_tokenizer(str(other))
    (tmp_path / "cl100k_base.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(ConfigError, match=r"cannot read tiktoken ranks file"):
        load_tokenizer(str(tmp_path / "cl100k_base.tiktoken"))
