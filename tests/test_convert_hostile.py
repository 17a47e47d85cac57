"""Convert on hostile or broken input: huge documents, failing tokenizers, symlinks out of the
corpus, outputs that are not datasets, full disks. Each ends in one error line and exit 1 (or a
warning), with nothing left behind and no process left running."""

from __future__ import annotations

import errno
import gzip
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
import zarr.storage._local as zarr_local

from asyncflat.cli import main
from asyncflat.errors import ConfigError
from asyncflat.text.corpus import iter_documents, iter_range_documents
from asyncflat.text.pool import tokenized_batches
from asyncflat.text.tokenizer import TokenizerError, load_tokenizer
from asyncflat.writer.convert import ConvertOptions, convert_files, convert_texts

REPO = str(Path(__file__).resolve().parents[1])


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m asyncflat ARGS`` in a fresh process, with its peak memory on the last line."""
    code = (
        "import resource, sys\n"
        "from asyncflat.cli import main\n"
        "try:\n"
        "    rc = main(sys.argv[1:])\n"
        "finally:\n"
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the pytest parent.
        "    kib = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "    print(f'MAXRSS {kib}', file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO, "RUST_BACKTRACE": "0"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("asyncflat convert:")]


def max_rss_mib(stderr: str) -> float:
    return int(stderr.rsplit("MAXRSS ", 1)[1].split()[0]) / 1024


# -- documents over the size limit ------------------------------------------------------------


def test_a_gzip_bomb_line_is_never_read_whole(tmp_path: Path) -> None:
    """512 MiB of one line in a ~0.5 MiB gzip: refused at the 16 MiB default, in little memory."""
    bomb = tmp_path / "corpus" / "bomb.txt.gz"
    bomb.parent.mkdir()
    block = b"a" * (1 << 20)
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        f.write(b"a normal first line\n")
        for _ in range(512):
            f.write(block)
    assert bomb.stat().st_size < 4 << 20
    out = tmp_path / "out.zarr"
    result = run_cli("convert", str(bomb.parent), "-o", str(out), "--workers", "1", "--no-progress")
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    assert "bomb.txt.gz:2: document of at least" in line
    assert "--max-document-bytes" in line
    assert "Traceback" not in result.stderr
    assert max_rss_mib(result.stderr) < 600, result.stderr  # not 512 MiB of str and its copies
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


@pytest.mark.parametrize(
    ("name", "content", "where"),
    [
        ("a.txt", "ok\n" + "x" * 11 + "\nok\n", "a.txt:2"),
        ("a.txt", "ok\n" + "é" * 6 + "\n", "a.txt:2"),  # 6 characters, 12 bytes
        ("a.jsonl", '{"text": "ok"}\n{"text": "' + "y" * 20 + '"}\n', "a.jsonl:2"),
    ],
)
def test_documents_over_the_limit_name_file_and_line(
    tmp_path: Path, name: str, content: str, where: str
) -> None:
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"{where}: document of at least \d+ bytes is over"):
        list(iter_documents([tmp_path / name], max_document_bytes=10))
    with pytest.raises(ConfigError, match=where):
        convert_files(
            [tmp_path / name], tmp_path / "out", options=ConvertOptions(max_document_bytes=10)
        )
    assert not (tmp_path / "out").exists()


def test_documents_at_the_limit_pass(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x" * 10 + "\r\n" + "é" * 5 + "\n", encoding="utf-8")
    assert list(iter_documents([tmp_path / "a.txt"], max_document_bytes=10)) == ["x" * 10, "é" * 5]
    (tmp_path / "b.txt").write_text("x" * 11)
    with pytest.raises(ConfigError, match=r"b.txt: document of at least 11 bytes"):
        list(iter_documents([tmp_path / "b.txt"], txt_mode="file", max_document_bytes=10))


def test_limit_applies_to_parquet_and_in_memory_texts(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["ok", "z" * 50]}), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match=r"a.parquet row 1: document of at least 50 bytes"):
        convert_files(
            [tmp_path / "a.parquet"],
            tmp_path / "out",
            options=ConvertOptions(max_document_bytes=10),
        )
    with pytest.raises(ConfigError, match=r"document 2: document of at least 30 bytes"):
        convert_texts(
            ["a", "b", "c" * 30], tmp_path / "out", options=ConvertOptions(max_document_bytes=10)
        )
    with pytest.raises(ConfigError, match=r"max_document_bytes must be an integer >= 1, got 0"):
        convert_texts(["a"], tmp_path / "out", options=ConvertOptions(max_document_bytes=0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet"]


# -- tokenizers that fail ---------------------------------------------------------------------


def panicking_tokenizer(path: Path) -> Path:
    """A tokenizer.json whose pre-tokenizer regex backtracks: onig gives up, tokenizers panics."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "a": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex("(a|a)*$"), behavior="isolated")
    file = path / "tokenizer.json"
    tok.save(str(file))
    return file


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_panicking_tokenizer_is_one_error_line(tmp_path: Path, workers: str) -> None:
    tokenizer = panicking_tokenizer(tmp_path)
    docs = ["a b a"] * 2000 + ["a" * 3000 + "b"] + ["a"] * 2000
    (tmp_path / "in.txt").write_text("\n".join(docs) + "\n")
    out = tmp_path / "out.zarr"
    start = time.monotonic()
    result = run_cli(
        "convert",
        str(tmp_path / "in.txt"),
        "-o",
        str(out),
        "--tokenizer",
        str(tokenizer),
        "--workers",
        workers,
        "--chunk-tokens",
        "64",
        "--no-progress",
        timeout=120,
    )
    assert time.monotonic() - start < 100
    assert result.returncode == 1, result.stderr
    (line,) = error_lines(result.stderr)
    assert "asyncflat convert: error: tokenizer" in line
    assert "failed on documents" in line and "PanicException" in line
    assert "retry-limit-in-match" in line
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "tokenizer.json"]


def test_tokenizer_error_in_process_names_the_documents(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(panicking_tokenizer(tmp_path)))
    batches = [["a"], ["a" * 3000 + "b", "a"]]
    with pytest.raises(TokenizerError, match=r"failed on documents 1\.\.2: PanicException"):
        list(tokenized_batches(tokenizer, batches, workers=1))


def test_a_dead_worker_fails_the_conversion_instead_of_hanging() -> None:
    tokenizer = load_tokenizer("bytes")
    batches = (["document"] * 10 for _ in range(10_000))
    gen = tokenized_batches(tokenizer, batches, workers=2)
    next(gen)  # the pool is running
    (victim, *_) = multiprocessing.active_children()
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    start = time.monotonic()
    with pytest.raises(TokenizerError, match=r"a tokenizer worker process .* died"):
        for _ in gen:
            pass
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []  # every worker was stopped


_JAMMED_POOL = """
import os, struct, sys, time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
from asyncflat.text.pool import stop_pool

pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
assert pool.submit(abs, -1).result() == 1
manager = pool._executor_manager_thread
# What a worker killed while sending a 1 MiB result leaves in the pipe: a header and 10 bytes.
os.write(pool._result_queue._writer.fileno(), struct.pack("!i", 1 << 20) + b"x" * 10)
time.sleep(0.5)  # the manager thread is now blocked reading the rest
stop_pool(pool, kill=True)
print("manager alive:", manager.is_alive(), flush=True)
"""


def test_a_worker_killed_mid_result_jams_neither_the_pool_nor_the_exit() -> None:
    # CPython's pool reader would wait forever for the rest of the message, and the interpreter's
    # exit joins that reader: without the release, this process never exits.
    result = subprocess.run(
        [sys.executable, "-c", _JAMMED_POOL], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "manager alive: False" in result.stdout


def test_workers_are_killed_when_the_writer_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_put = zarr_local._put
    calls = 0

    def put(path: Path, value: object, exclusive: bool = False) -> int:
        nonlocal calls
        calls += 1
        if path.parent.name == "c" and calls > 5:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_put(path, value, exclusive)  # type: ignore[arg-type]

    monkeypatch.setattr(zarr_local, "_put", put)
    docs = [f"document {i} " * 20 for i in range(20_000)]
    out = tmp_path / "out.zarr"
    assert main(["convert", "-o", str(out), "--workers", "2", "--chunk-tokens", "4096",
                 "--no-progress", *write_inputs(tmp_path, docs)]) == 1  # fmt: skip
    assert multiprocessing.active_children() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_workers_outlive_the_thread_that_started_them() -> None:
    """Linux's parent-death signal fires when the starting *thread* ends, not the process."""
    tokenizer = load_tokenizer("bytes")
    gen = tokenized_batches(tokenizer, ([f"doc {i}"] * 10 for i in range(500)), workers=2)
    got = []
    starter = threading.Thread(target=lambda: got.extend(next(gen) for _ in range(8)))
    starter.start()
    starter.join()
    time.sleep(0.5)  # time for a wrongly delivered SIGKILL to land
    got.extend(gen)
    assert len(got) == 500
    assert multiprocessing.active_children() == []


def session_processes(sid: int) -> dict[int, str]:
    """``{pid: command line}`` of every live process in session ``sid`` (Linux ``/proc``)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        state, _ppid, _pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
        if int(session) == sid and state != "Z":
            found[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="lists processes via /proc")
def test_no_child_of_convert_outlives_a_sigkilled_parent(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup: the workers, and what multiprocessing started, must notice."""
    (tmp_path / "in.txt").write_text(("document number %d " * 10 + "\n") * 300_000)
    out = tmp_path / "out.zarr"
    env = {**os.environ, "PYTHONPATH": REPO}
    args = ["convert", str(tmp_path / "in.txt"), "-o", str(out), "--workers", "2", "--no-progress"]
    parent = subprocess.Popen(
        [sys.executable, "-m", "asyncflat", *args],
        env=env,
        start_new_session=True,  # its session is the parent and everything it starts
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # two workers, and chunks being written
            workers = [c for c in session_processes(parent.pid).values() if "spawn_main" in c]
            if len(workers) == 2 and list(tmp_path.glob("out.zarr.partial-*/train/*/c/*")):
                break
            assert parent.poll() is None, "convert ended before it could be killed"
            time.sleep(0.02)
        else:
            pytest.fail(f"no two workers mid-write: {session_processes(parent.pid)}")
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while session_processes(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session_processes(parent.pid) == {}
    finally:
        parent.kill()
        parent.wait()
        for pid in session_processes(parent.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def write_inputs(tmp_path: Path, docs: list[str]) -> list[str]:
    (tmp_path / "in.txt").write_text("\n".join(docs) + "\n")
    return [str(tmp_path / "in.txt")]


# -- symlinks out of the corpus ---------------------------------------------------------------


def test_symlinks_out_of_the_input_directory_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("api key 1234\n")
    (tmp_path / "outside" / "more.txt").write_text("private notes\n")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("public text\n")
    (corpus / "inner.txt").write_text("inner\n")
    (corpus / "leak.txt").symlink_to(secret)
    (corpus / "leakdir").symlink_to(tmp_path / "outside", target_is_directory=True)
    (corpus / "alias.txt").symlink_to(corpus / "inner.txt")  # inside the corpus: read
    with caplog.at_level(logging.WARNING, logger="asyncflat"):
        docs = list(iter_documents([corpus]))
    assert docs == ["public text", "inner", "inner"]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "skipping" in warned and "leak.txt" in warned and "leakdir" in warned
    followed = list(iter_documents([corpus], follow_symlinks=True))
    assert sorted(followed) == [
        "api key 1234",  # leak.txt
        "api key 1234",  # leakdir/secret.txt
        "inner",
        "inner",
        "private notes",  # leakdir/more.txt
        "public text",
    ]

    out = tmp_path / "out.zarr"
    assert main(["convert", str(corpus), "-o", str(out), "--no-progress",
                 "--validation-fraction", "0", "--workers", "1"]) == 0  # fmt: skip
    stored = zarr.open_group(str(out), mode="r")["train"]["encoded_tokens"][:]
    text = bytes(((stored >> 1) - 1).astype(np.uint8)).decode()
    assert "api key" not in text and "public text" in text


# -- outputs ------------------------------------------------------------------------------------


def test_overwrite_refuses_a_project_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    project = tmp_path / "project"
    project.mkdir()
    (project / "main.py").write_text("print('mine')\n")
    rc = main(["convert", str(tmp_path / "in.txt"), "-o", str(project), "--overwrite",
               "--no-progress", "--workers", "1"])  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncflat convert: error:") and "\n" not in err
    assert "not a flat-tokens store (it holds main.py)" in err
    assert (project / "main.py").read_text() == "print('mine')\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "project"]


def test_existing_output_error_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    args = ["convert", str(tmp_path / "in.txt"), "-o", str(tmp_path / "o"), "--no-progress",
            "--workers", "1"]  # fmt: skip
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "already exists (pass --overwrite to replace it)" in err
    assert "overwrite=True" not in err
    assert main([*args, "--overwrite"]) == 0


def test_disk_full_and_other_os_errors_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full(path: Path, value: object, exclusive: bool = False) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(zarr_local, "_put", full)
    (tmp_path / "in.txt").write_text("hello\n" * 10)
    out = tmp_path / "out.zarr"
    assert main(["convert", str(tmp_path / "in.txt"), "-o", str(out), "--no-progress",
                 "--workers", "1"]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncflat convert: error: cannot write") and "\n" not in err
    assert "No space left on device" in err and str(out) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]

    import asyncflat.writer.convert

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "Input/output error", "/dev/sdz")

    monkeypatch.setattr(asyncflat.writer.convert, "convert_files", broken)
    assert main(["convert", str(tmp_path / "in.txt"), "-o", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "asyncflat convert: error: Input/output error /dev/sdz"


def test_corrupt_gzip_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = gzip.compress(b"hello\n" * 1000)
    (tmp_path / "a.txt.gz").write_bytes(data[: len(data) // 2])
    (tmp_path / "b.jsonl.gz").write_bytes(b"not gzip at all")
    for name in ("a.txt.gz", "b.jsonl.gz"):
        assert main(["convert", str(tmp_path / name), "-o", str(tmp_path / "o"), "--no-progress",
                     "--workers", "1"]) == 1  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"asyncflat convert: error: {tmp_path / name}: not a valid gzip")
        assert "\n" not in err


def test_workers_zero_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    with pytest.raises(SystemExit) as info:
        main(["convert", str(tmp_path / "in.txt"), "-o", str(tmp_path / "o"), "--workers", "0"])
    assert info.value.code == 2


def test_cli_converts_into_a_bucket(s3_server: object, tmp_path: Path) -> None:
    """End to end from the CLI into moto's S3, read back equal to a local conversion."""
    from test_writer_remote import read_split

    options = s3_server.storage_options()  # type: ignore[attr-defined]
    docs = [f"document {i} " * (i % 7 + 1) for i in range(500)]
    common = ["--no-progress", "--workers", "1", "--chunk-tokens", "512", "--validation-fraction",
              "0.1", *write_inputs(tmp_path, docs)]  # fmt: skip
    url = "s3://asyncflat-test/cli-convert.zarr"
    assert main(["convert", "-o", url, "--storage-options", json.dumps(options), *common]) == 0
    assert main(["convert", "-o", str(tmp_path / "local.zarr"), *common]) == 0
    for split in ("train", "validation"):
        got, want = (
            read_split(url, options, split),
            read_split(str(tmp_path / "local.zarr"), None, split),
        )
        np.testing.assert_array_equal(got["encoded_tokens"], want["encoded_tokens"])
        np.testing.assert_array_equal(got["seq_starts"], want["seq_starts"])


def test_a_symlink_to_a_directory_of_the_corpus_does_not_hide_it(tmp_path: Path) -> None:
    """A symlink inside the corpus to one of its directories is not walked (without
    follow_symlinks), and the directory itself is read whatever order the walk meets them in."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):  # enough pairs that the filesystem lists some links before their targets
        (corpus / f"real{i:02d}").mkdir()
        (corpus / f"real{i:02d}" / "d.txt").write_text(f"doc {i:02d}\n")
        (corpus / f"link{i:02d}").symlink_to(f"real{i:02d}", target_is_directory=True)
    expected = [f"doc {i:02d}" for i in range(20)]
    assert list(iter_documents([corpus])) == expected
    followed = list(iter_documents([corpus], follow_symlinks=True))
    assert followed == expected


@pytest.mark.parametrize(
    "record",
    ['{"text": "b", "n": ' + "1" * 5000 + "}", "[" * 100_000 + "]" * 100_000],
    ids=["huge-integer", "deep-nesting"],
)
def test_a_hostile_json_record_names_its_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record: str
) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n' + record + "\n")
    with pytest.raises(ConfigError, match=r"a.jsonl:2: JSON record not readable"):
        list(iter_documents([tmp_path / "a.jsonl"]))
    assert main(["convert", str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "o"), "--no-progress",
                 "--workers", "1"]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"asyncflat convert: error: {tmp_path / 'a.jsonl'}:2: ") and "\n" not in err
    )


def test_a_corrupt_deflate_stream_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A gzip header, then a deflate block of the reserved type: zlib.error, not BadGzipFile."""
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"hello\n")[:10] + b"\xff" * 16)
    with pytest.raises(ConfigError, match=r"a.txt.gz: not a valid gzip file"):
        list(iter_documents([tmp_path / "a.txt.gz"]))
    assert main(["convert", str(tmp_path / "a.txt.gz"), "-o", str(tmp_path / "o"), "--no-progress",
                 "--workers", "1"]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"asyncflat convert: error: {tmp_path / 'a.txt.gz'}: not a valid gzip")


def test_a_damaged_parquet_file_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": [f"document {i}" for i in range(100)]})
    pq.write_table(table, tmp_path / "ok.parquet", compression="none", use_dictionary=False)
    good = (tmp_path / "ok.parquet").read_bytes()
    strings = good.index(b"document 50")  # plain-encoded page: bytes that decode to no UTF-8
    damaged = {
        "empty.parquet": b"",
        "truncated.parquet": good[: len(good) // 2] + good[-8:],
        "garbage.parquet": b"PAR1" + b"\0" * 100 + b"PAR1",
        "utf8.parquet": good[:strings] + b"\xff" + good[strings + 1 :],
    }
    for name, data in damaged.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=rf"{name}: not a readable parquet file"):
            list(iter_documents([tmp_path / name]))
        assert main(["convert", str(tmp_path / name), "-o", str(tmp_path / "o"), "--no-progress",
                     "--workers", "1"]) == 1  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"asyncflat convert: error: {tmp_path / name}"), err
        assert "\n" not in err


@pytest.mark.parametrize("name", ["a.txt", "a.txt.gz", "a.jsonl"])
def test_invalid_utf8_names_its_line(tmp_path: Path, name: str) -> None:
    """Far into the file (past the text decoder's first blocks), after CRLF and lone-CR lines."""
    line = '{"text": "ok"}' if name == "a.jsonl" else "ok"
    head = ((line + "\r\n") * 3000).encode()
    data = head + ((line + "\r") * 2000 + (line + "\n") * 1000 + line[:-2]).encode()
    bad = data + b"\xff" + line[-2:].encode() + b"\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(bad) if name.endswith(".gz") else bad)
    where = rf"{name}:6001: not valid UTF-8 text: invalid start byte"
    with pytest.raises(ConfigError, match=where):
        list(iter_documents([path]))
    if not name.endswith(".gz"):  # a byte range of the file names the line from its start
        with pytest.raises(ConfigError, match=where):
            list(iter_range_documents(path, len(head), len(bad)))


def test_a_huge_max_document_bytes_is_refused_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match=r"max_document_bytes must be at most 2\*\*40"):
        ConvertOptions(max_document_bytes=1 << 70)
    with pytest.raises(ConfigError, match=r"max_document_bytes must be at most 2\*\*40"):
        list(iter_documents([tmp_path / "in.txt"], max_document_bytes=1 << 70))
    assert main(["convert", str(tmp_path / "in.txt"), "-o", str(tmp_path / "o"), "--no-progress",
                 "--workers", "1", "--max-document-bytes", str(1 << 70)]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncflat convert: error: ConvertOptions.max_document_bytes must be")
    assert ConvertOptions(max_document_bytes=1 << 40).max_document_bytes == 1 << 40


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl", "a.txt.gz"])
def test_a_byte_order_mark_at_a_files_start_is_no_text(tmp_path: Path, name: str) -> None:
    """Editors on Windows start UTF-8 files with U+FEFF: it became 3 bytes of the first document
    of a .txt (tokens of its own), and a .jsonl was refused ("Unexpected UTF-8 BOM")."""
    import gzip

    lines = ['{"text": "a"}', '{"text": "b\ufeff"}'] if name == "a.jsonl" else ["a", "b\ufeff"]
    data = ("\ufeff" + "\n".join(lines) + "\n").encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert list(iter_documents([path])) == ["a", "b\ufeff"]  # only the file's first one goes
    if not name.endswith(".gz"):  # a range from the start drops it too; one after it has none
        split = data.index(b"\n") + 1
        ranges = [(0, split), (split, len(data))]
        assert [d for r in ranges for d in iter_range_documents(path, *r)] == ["a", "b\ufeff"]


def test_a_generous_bound_reads_a_whole_file_document_in_pieces(tmp_path: Path) -> None:
    """``txt_mode="file"`` read a document with one ``read(max_document_bytes + 1)``, which
    allocated the whole bound up front: a MemoryError for any bound past the machine's memory."""
    path = tmp_path / "a.txt"
    path.write_text("é" * 600_000 + "\nend")  # more than a MiB read of characters: in pieces
    (document,) = iter_documents([path], txt_mode="file", max_document_bytes=1 << 40)
    assert document == "é" * 600_000 + "\nend"
    with pytest.raises(ConfigError, match="over max_document_bytes"):
        list(iter_documents([path], txt_mode="file", max_document_bytes=1_000_000))


def test_a_lone_surrogate_in_a_json_record_names_its_line(tmp_path: Path) -> None:
    """``"\\ud800"`` parses to half a UTF-16 pair, which no tokenizer can encode: it failed in the
    tokenizer, naming documents but not the file or line. A whole pair is a character."""
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "ok \\ud83d\\ude00"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(ConfigError, match=r"a\.jsonl:2: field 'text' holds a lone surrogate"):
        list(iter_documents([path]))
    path.write_text('{"text": "ok \\ud83d\\ude00"}\n')
    assert list(iter_documents([path])) == ["ok \U0001f600"]


def test_a_file_named_twice_is_read_twice_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("x\n")
    with caplog.at_level("WARNING", logger="asyncflat.text.corpus"):
        assert list(iter_documents([corpus, corpus / "a.txt"])) == ["x", "x"]
    (warning,) = [r.getMessage() for r in caplog.records if "read twice" in r.getMessage()]
    assert str(corpus / "a.txt") in warning


def test_invalid_utf8_in_a_truncated_gz_is_still_one_error_line(tmp_path: Path) -> None:
    """Naming the line of invalid UTF-8 re-reads the file: a .gz cut short after the bad byte
    raised a bare EOFError there (the text reader had stopped at the bad byte first)."""
    import gzip

    data = gzip.compress(b'{"text":"a"}\n{"text":"\xff"}\n' + b'{"text":"b"}\n' * 20000)
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"a\.jsonl\.gz: not a valid gzip file"):
        list(iter_documents([path]))
