"""Distributed conversion (asyncflat.writer.distributed): equal to the single-machine converter, byte for
byte, in this process and on a local two-worker Ray cluster; resumable; input errors fail fast."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers.servers import MOTO_ENV

from asyncflat.errors import ConfigError
from asyncflat.text.tokenizer import BytesTokenizer
from asyncflat.writer.convert import ConvertOptions, convert_files
from asyncflat.writer.distributed import convert_distributed
from asyncflat.writer.distributed.plan import make_plan

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "v3": dict(zarr_format=3, chunk_tokens=4096),
    "v3_sharded": dict(zarr_format=3, chunk_tokens=2048, shard_tokens=8192),
    "v2": dict(zarr_format=2, chunk_tokens=4096),
}
SPLIT: dict[str, Any] = dict(validation_fraction=0.2, seed=3)
WORDS = ["alpha", "béta", "γάμμα", "дельта", "🙂", "", "x" * 40, "tab\there", "日本語"]


def _doc(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 25)))


def make_corpus(root: Path, scale: int = 1) -> Path:
    """txt (with CRLF and empty lines), jsonl.gz, jsonl, multi-row-group parquet (with nulls)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "a.txt", "w", encoding="utf-8", newline="") as f:
        for i in range(600 * scale):
            f.write(_doc(rng) + ("\r\n" if i % 7 == 0 else "\n"))
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for i in range(300 * scale):
            f.write(json.dumps({"text": _doc(rng)}) + "\n" + ("\n" if i % 50 == 0 else ""))
    with open(root / "c.jsonl", "w", encoding="utf-8") as f:
        for i in range(400 * scale):
            f.write(json.dumps({"text": _doc(rng), "id": i}, ensure_ascii=i % 2 == 0) + "\n")
    texts = [_doc(rng) if i % 40 else None for i in range(500 * scale)]
    pq.write_table(pa.table({"text": texts}), root / "d.parquet", row_group_size=150 * scale)
    (root / "e.txt").write_text("")  # an empty file: no documents
    return root


def tree(path: Path) -> dict[str, bytes]:
    """Every object of a local store, by relative path."""
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def assert_same_store(got: Path, want: Path) -> None:
    a, b = tree(got), tree(want)
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    for split in ("train", "validation"):
        g, w = (
            zarr.open_group(str(got / split), mode="r"),
            zarr.open_group(str(want / split), mode="r"),
        )
        assert dict(g.attrs) == dict(w.attrs)
        for name in ("encoded_tokens", "seq_starts"):
            np.testing.assert_array_equal(g[name][:], w[name][:])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "in")


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The single-machine converter's output for each layout."""
    root = tmp_path_factory.mktemp("reference")
    out = {}
    for name, layout in LAYOUTS.items():
        out[name] = root / f"{name}.zarr"
        convert_files([corpus], out[name], options=ConvertOptions(**SPLIT, **layout))
    return out


# -- planning ---------------------------------------------------------------------------------


def test_plan_units_are_bounded_and_line_aligned(corpus: Path) -> None:
    plan = make_plan(
        [corpus], tokenizer="bytes", text_field="text", txt_mode="line", unit_bytes=4000
    )
    by_file: dict[str, list[Any]] = {}
    for unit in plan.units:
        by_file.setdefault(Path(unit.path).name, []).append(unit)
    assert [u.index for u in plan.units] == list(range(len(plan.units)))
    assert list(by_file) == ["a.txt", "b.jsonl.gz", "c.jsonl", "d.parquet"]  # e.txt: no unit
    assert len(by_file["b.jsonl.gz"]) == 1  # gzip: one unit
    assert [u.start for u in by_file["d.parquet"]] == [0, 1, 2, 3]  # one per row group
    assert [u.first_row for u in by_file["d.parquet"]] == [0, 150, 300, 450]
    for name in ("a.txt", "c.jsonl"):
        data = (corpus / name).read_bytes()
        units = by_file[name]
        assert len(units) > 3
        assert units[0].start == 0 and units[-1].end == len(data)
        for prev, unit in itertools.pairwise(units):
            assert prev.end == unit.start and data[unit.start - 1 : unit.start] == b"\n"
        # a unit ends at the first newline after unit_bytes: at most one line longer
        assert max(u.end - u.start for u in units) < 4000 + 2000


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("unit_bytes", [3000, 1 << 20])
def test_in_process_runner_equals_single_machine(
    corpus: Path, reference: dict[str, Path], tmp_path: Path, layout: str, unit_bytes: int
) -> None:
    out = tmp_path / "out.zarr"
    report = convert_distributed(
        [corpus],
        out,
        options=ConvertOptions(**SPLIT, **LAYOUTS[layout]),
        runner="local",
        unit_bytes=unit_bytes,
        write_run_tokens=10000,  # several write tasks per split, not aligned to anything
    )
    assert_same_store(out, reference[layout])
    want = convert_files(
        [corpus], tmp_path / "again.zarr", options=ConvertOptions(**SPLIT, **LAYOUTS[layout])
    )
    for field in ("documents", "empty_documents", "sequences", "tokens", "max_token_id"):
        assert getattr(report, field) == getattr(want, field)
    assert report.documents > 1500 and report.empty_documents > 10
    assert not (tmp_path / "out.zarr.pieces").exists()  # pieces removed after the commit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.zarr", "out.zarr"]


# -- the commit protocol: the single-machine writer's, through both converters ------------------


def convert_with(kind: str, inputs: list[Path], out: Path, options: ConvertOptions) -> Any:
    if kind == "files":
        return convert_files(inputs, out, options=options)
    return convert_distributed(inputs, out, options=options, runner="local", unit_bytes=5000)


@pytest.mark.parametrize("kind", ["files", "distributed"])
def test_overwrite_never_replaces_a_directory_that_is_not_a_dataset(
    kind: str, corpus: Path, tmp_path: Path
) -> None:
    project = tmp_path / "my_project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text("print('my training script')\n")
    (project / "notes.txt").write_text("keep me")
    before = tree(project)
    with pytest.raises(ConfigError) as info:
        convert_with(kind, [corpus], project, ConvertOptions(overwrite=True))
    assert type(info.value) is ConfigError
    assert str(info.value) == (
        f"{project} exists and is not a flat-tokens store (it holds notes.txt, src); overwrite "
        "only replaces a flat-tokens store or an empty directory: remove it yourself or choose "
        "another output path"
    )
    assert tree(project) == before  # every file, and its contents
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_project"]  # no staging, no pieces


@pytest.mark.parametrize("kind", ["files", "distributed"])
def test_an_existing_dataset_is_refused_then_replaced(
    kind: str, corpus: Path, reference: dict[str, Path], tmp_path: Path
) -> None:
    from asyncflat.writer.flat_tokens import write_flat_tokens
    from asyncflat.writer.output import OutputExistsError

    out = tmp_path / "out.zarr"
    write_flat_tokens(out, {"train": [[1, 2, 3]], "validation": [[4]]})
    before = tree(out)
    with pytest.raises(OutputExistsError) as info:
        convert_with(kind, [corpus], out, ConvertOptions(**SPLIT, **LAYOUTS["v3"]))
    assert str(info.value) == f"{out} already exists (pass overwrite=True to replace it)"
    assert tree(out) == before
    replace = ConvertOptions(overwrite=True, **SPLIT, **LAYOUTS["v3"])
    convert_with(kind, [corpus], out, replace)
    assert_same_store(out, reference["v3"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.zarr"]


def test_convert_options_name_the_bad_field() -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {"validation_fraction": 1.5},
            r"ConvertOptions.validation_fraction must be in \[0, 1\], got 1.5",
        ),
        ({"validation_fraction": float("nan")}, r"validation_fraction .*got nan"),
        ({"workers": -1}, r"ConvertOptions.workers must be an integer >= 0, got -1"),
        ({"zarr_format": 4}, r"ConvertOptions.zarr_format must be 2 or 3, got 4"),
        ({"chunk_tokens": 0}, r"ConvertOptions.chunk_tokens must be >= 1, got 0"),
        ({"chunk_tokens": "1M"}, r"ConvertOptions.chunk_tokens must be an integer, got '1M'"),
        # a Blosc chunk holds under 2 GiB: refused now, not after the corpus is tokenized
        ({"chunk_tokens": 1 << 29}, r"ConvertOptions.chunk_tokens must be at most 536870907"),
        ({"shard_tokens": 1000, "chunk_tokens": 300}, r"shard_tokens \(1000\) needs .* multiple"),
        ({"shard_tokens": 1024, "chunk_tokens": 512, "zarr_format": 2}, r"needs zarr_format=3"),
        ({"overwrite": "yes"}, r"ConvertOptions.overwrite must be a bool, got 'yes'"),
        ({"storage_options": [1]}, r"ConvertOptions.storage_options must be a mapping"),
        ({"max_document_bytes": 0}, r"ConvertOptions.max_document_bytes must be an integer >= 1"),
        ({"tokenizer": 3}, r"ConvertOptions.tokenizer must be a spec string or a Tokenizer, got 3"),
    ]
    for fields, message in bad:
        with pytest.raises(ConfigError, match=message):
            ConvertOptions(**fields)
    options = ConvertOptions(chunk_tokens=512, shard_tokens=2048, storage_options={"a": 1})
    assert options.storage_dict == {"a": 1} and ConvertOptions().storage_dict is None


def test_changed_tokenizer_is_refused_on_resume(corpus: Path, tmp_path: Path) -> None:
    from test_convert import make_tokenizer_json

    tok = make_tokenizer_json(tmp_path, [_doc(random.Random(i)) for i in range(50)])
    out, work = tmp_path / "out.zarr", tmp_path / "work"
    run: dict[str, Any] = dict(runner="local", work_dir=str(work), unit_bytes=3000)
    tokenized = ConvertOptions(tokenizer=str(tok), **SPLIT)
    replacing = ConvertOptions(tokenizer=str(tok), overwrite=True, **SPLIT)
    first = convert_distributed([corpus], out, options=tokenized, keep_pieces=True, **run)
    assert first.units_resumed == 0 and (work / "plan.json").exists()
    again = convert_distributed([corpus], out, options=replacing, keep_pieces=True, **run)
    assert again.units_resumed == again.units > 3  # every piece reused
    (work / "mine.txt").write_text("a file of the user's")
    with pytest.raises(ConfigError, match=r"different conversion \(changed since: tokenizer\)"):
        convert_distributed([corpus], tmp_path / "o2.zarr", options=ConvertOptions(**SPLIT), **run)
    tok.write_text(tok.read_text().replace('"alpha"', '"ALPHA"'))  # same path, new contents
    with pytest.raises(ConfigError, match=r"changed since: tokenizer\)"):
        convert_distributed([corpus], tmp_path / "o3.zarr", options=tokenized, **run)
    assert not (tmp_path / "o2.zarr").exists() and not (tmp_path / "o3.zarr").exists()
    (work / "plan.json").unlink()  # start afresh in the same directory
    convert_distributed([corpus], out, options=replacing, **run)
    assert sorted(p.name for p in work.iterdir()) == ["mine.txt"]  # only our own files removed


def test_progress_is_logged(corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="asyncflat.writer.distributed"):
        report = convert_distributed(
            [corpus], tmp_path / "o.zarr", runner="local", unit_bytes=20000
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenized")]
    total = sum(report.tokens.values())
    assert lines[-1].startswith(f"tokenized {report.units}/{report.units} units (0 resumed), ")
    tokens = int(lines[-1].split(", ")[1].removesuffix(" tokens"))
    assert tokens == total
    assert "tokens/s, ETA 0 s" in lines[-1]


def test_wrong_argument_types_are_clear(corpus: Path, tmp_path: Path) -> None:
    from asyncflat.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match="unit_bytes"):
        convert_distributed([corpus], tmp_path / "o.zarr", runner="local", unit_bytes="64M")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="runner must be 'ray', 'local' or a TaskRunner"):
        convert_distributed([corpus], tmp_path / "o.zarr", runner="dask")
    with pytest.raises(ConfigError, match=r"needs ConvertOptions\.tokenizer as a spec string"):
        convert_distributed(
            [corpus], tmp_path / "o.zarr", options=ConvertOptions(tokenizer=BytesTokenizer())
        )
    with pytest.raises(ArgumentTypeError, match=r'argument "options" \(dict\)'):
        convert_distributed([corpus], tmp_path / "o.zarr", options={"seed": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="options must be a ConvertOptions, got dict"):
        convert_files([corpus], tmp_path / "o.zarr", options={"seed": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unit_bytes must be an integer >= 1"):
        convert_distributed([corpus], tmp_path / "o.zarr", runner="local", unit_bytes=0)
    assert list(tmp_path.iterdir()) == []


def test_bad_json_names_file_and_line_of_a_later_range(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"document {i}"}) for i in range(400)]
    lines[321] = '{"text": "truncated'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:322: invalid JSON"):
        convert_distributed([path], tmp_path / "o.zarr", runner="local", unit_bytes=1000)
    lines[321] = json.dumps({"body": "no text field"})
    path.write_text("\n".join(lines) + "\n")
    # The first run's pieces are of another input now: refused, and the message says why.
    with pytest.raises(ConfigError, match=r"different conversion \(changed since: inputs\)"):
        convert_distributed([path], tmp_path / "o.zarr", runner="local", unit_bytes=1000)
    with pytest.raises(ConfigError, match=rf"{path}:322: no field 'text'"):
        convert_distributed([path], tmp_path / "o2.zarr", runner="local", unit_bytes=1000)
    assert not (tmp_path / "o.zarr").exists() and not (tmp_path / "o2.zarr").exists()


def test_memory_url_output_commits_root_metadata_last(
    corpus: Path, reference: dict[str, Path]
) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    url = "memory://asyncflat-dist-test/out.zarr"
    try:
        convert_distributed(
            [corpus],
            url,
            options=ConvertOptions(**SPLIT, **LAYOUTS["v3_sharded"]),
            runner="local",
            unit_bytes=5000,
        )
        want = tree(reference["v3_sharded"])
        got = {
            k.removeprefix("/asyncflat-dist-test/out.zarr/"): fs.cat_file(k)
            for k in fs.find("/asyncflat-dist-test/out.zarr")
        }
        assert got == want
        assert not fs.exists("/asyncflat-dist-test/out.zarr.pieces")
    finally:
        fs.rm("/asyncflat-dist-test", recursive=True)


def test_failed_write_pass_leaves_no_output_and_keeps_pieces(
    corpus: Path, reference: dict[str, Path], tmp_path: Path
) -> None:
    from asyncflat.writer.distributed import InProcessRunner
    from asyncflat.writer.distributed.write import run_write_job

    class DiskFullOnSecondWrite(InProcessRunner):
        def map(self, fn: Any, jobs: Any) -> Iterator[tuple[int, Any]]:
            for i, result in super().map(fn, jobs):
                if fn is run_write_job and i == 1:
                    raise OSError("disk full")
                yield i, result

    out = tmp_path / "out.zarr"
    run: dict[str, Any] = dict(
        options=ConvertOptions(**SPLIT, **LAYOUTS["v3"]), unit_bytes=3000, write_run_tokens=10000
    )
    with pytest.raises(OSError, match="disk full"):
        convert_distributed([corpus], out, runner=DiskFullOnSecondWrite(), **run)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.zarr.pieces"]
    report = convert_distributed([corpus], out, runner="local", **run)
    assert report.units_resumed == report.units
    assert_same_store(out, reference["v3"])


def test_local_tiktoken_file(corpus: Path, tmp_path: Path) -> None:
    import base64

    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    from asyncflat.text.tokenizer import load_tokenizer

    ranks = {bytes([i]): i for i in range(256)}
    for merged in (b"th", b"the", b" t", b" the", b"al", b"alpha", "é".encode()):
        ranks[merged] = len(ranks)
    path = tmp_path / "r50k_base.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    tok = load_tokenizer(str(path))
    want = tiktoken.Encoding(
        "r50k_base",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
    )
    texts = ["the alpha béta", "", "then <|endoftext|> the"]
    assert [t.tolist() for t in tok.encode_batch(texts)] == [want.encode_ordinary(t) for t in texts]
    assert tok.encode_batch(["the"])[0].tolist() == [ranks[b"the"]]
    out, ref = tmp_path / "out.zarr", tmp_path / "ref.zarr"
    options = ConvertOptions(tokenizer=str(path), **SPLIT)
    convert_files([corpus], ref, options=options)
    convert_distributed([corpus], out, options=options, runner="local", unit_bytes=5000)
    assert_same_store(out, ref)
    bad = tmp_path / "mine.tiktoken"
    bad.write_bytes(path.read_bytes())
    with pytest.raises(ConfigError, match=r"names no tiktoken encoding"):
        load_tokenizer(str(bad))


# -- on a Ray cluster ---------------------------------------------------------------------------


#: The workers' environment: this checkout first, and for writing to moto's S3 the fixture's fake
#: credentials with EC2 metadata probing off (the workers start before the S3 fixture sets them,
#: and a botocore without them asks 169.254.169.254, slowly, for credentials and region).
WORKER_ENV = {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", **MOTO_ENV}


def import_ray(patch: pytest.MonkeyPatch) -> Any:
    """Ray, first imported with its 'cluster' mode off: Ray reads the setting when first
    imported, and a cluster started later in the process (the fixture below) then advertises
    and binds the loopback address only, not the machine's."""
    patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    return pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster with 2 worker CPUs on 127.0.0.1, started once (only this module uses
    it) and stopped after the module, so its ~10 processes do not linger under later tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray = import_ray(patch)
        with warnings.catch_warnings():
            # Ray starts its processes with subprocess's preexec_fn, which runs jax's at-fork
            # hook; the child execs at once, so jax's deadlock warning does not apply.
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
            context = ray.init(
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": WORKER_ENV},
            )
        try:
            address = context.address_info["address"]
            assert address.startswith("127.0.0.1:"), address
            yield address
        finally:
            ray.shutdown()


def test_ray_equals_single_machine(
    ray_cluster: str, corpus: Path, reference: dict[str, Path], tmp_path: Path
) -> None:
    for layout in ("v3", "v3_sharded"):
        out = tmp_path / f"{layout}.zarr"
        report = convert_distributed(
            [corpus],
            out,
            options=ConvertOptions(**SPLIT, **LAYOUTS[layout]),
            runner="ray",
            unit_bytes=3000,
            write_run_tokens=10000,
        )
        assert report.parallelism == 2 and report.units > 10
        assert_same_store(out, reference[layout])


def test_ray_input_error_fails_fast_naming_line(
    ray_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    def no_cancel(*args: Any, **kwargs: Any) -> None:
        # A cancel racing a completing task aborts this (the driver's) process in Ray 2.x.
        raise AssertionError("ray.cancel called: it can abort the driver process")

    monkeypatch.setattr(ray, "cancel", no_cancel)
    lines = [json.dumps({"text": f"document {i}"}) for i in range(400)]
    lines[250] = "not json"
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"{path}:251: invalid JSON"):
        convert_distributed([path], tmp_path / "o.zarr", runner="ray", unit_bytes=1000)
    assert time.perf_counter() - t0 < 30
    assert not (tmp_path / "o.zarr").exists()


def _tokenize_workers() -> list[int]:
    """Pids of this process's Ray workers executing tokenize_unit right now (Ray names the
    process after it; the cluster ``ray.init`` started is this process's descendant, another
    test process's is not)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::tokenize_unit") and _descends_from_us(
                        int(entry.name)
                    ):
                        pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _descends_from_us(pid: int) -> bool:
    while pid > 1:
        with open(f"/proc/{pid}/stat", "rb") as f:
            pid = int(f.read().rsplit(b")", 1)[1].split()[1])  # the parent's pid
        if pid == os.getpid():
            return True
    return False


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A corpus of ~40 units, a word-level tokenizer, and the single-machine output for both."""
    from test_convert import make_tokenizer_json

    root = tmp_path_factory.mktemp("big")
    corpus = make_corpus(root / "in", scale=8)
    tok = make_tokenizer_json(root, [" ".join(WORDS)])
    ref = root / "ref.zarr"
    options = ConvertOptions(tokenizer=str(tok), **SPLIT, **LAYOUTS["v3_sharded"])
    convert_files([corpus], ref, options=options)
    return corpus, tok, ref


#: A driver in a process of its own: argv is corpus, output, Ray address, ConvertOptions as JSON.
#: It must never cancel or kill a task: either racing a task's completion aborts the driver
#: (Ray's task manager check, see docs/reliability.md), so here either one fails the run.
DRIVER = (
    "import sys, json, ray\n"
    "def forbidden(*args, **kwargs):\n"
    "    raise SystemExit('the driver called ray.cancel or ray.kill')\n"
    "ray.cancel = ray.kill = forbidden\n"
    "from asyncflat.writer.convert import ConvertOptions\n"
    "from asyncflat.writer.distributed import convert_distributed\n"
    "convert_distributed([sys.argv[1]], sys.argv[2], runner='ray', ray_address=sys.argv[3], "
    "options=ConvertOptions(**json.loads(sys.argv[4])), **{run!r})\n"
)


def _kill_one_tokenize_worker(stop: threading.Event, killed: list[int]) -> None:
    while not stop.is_set() and not killed:
        for pid in _tokenize_workers():
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            break


def test_ray_worker_killed_mid_task_is_retried(
    ray_cluster: str, big_corpus: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A tokenize worker SIGKILLed mid-task: Ray retries the task and the dataset is the
    single-machine one. The driver runs in a process of its own (a Ray abort there would fail
    this test, not the whole session) and cancels nothing: a cancel racing a task's completion
    was what aborted it (Ray's "Tried to complete task that was not pending"), so no retry of
    the run is allowed for it any more."""
    corpus, tok, ref = big_corpus
    options = dict(tokenizer=str(tok), **SPLIT, **LAYOUTS["v3_sharded"])
    script = DRIVER.format(run=dict(unit_bytes=2000))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "out.zarr"
    killed: list[int] = []
    stop = threading.Event()
    thread = threading.Thread(target=_kill_one_tokenize_worker, args=(stop, killed), daemon=True)
    thread.start()
    try:
        result = subprocess.run(
            [sys.executable, "-c", script, str(corpus), str(out), ray_cluster,
             json.dumps(options)],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    finally:
        stop.set()
        thread.join()
    assert result.returncode == 0, result.stderr[-3000:]
    assert killed, "no tokenize task was seen running"
    assert_same_store(out, ref)


def test_ray_driver_killed_then_rerun_resumes(
    ray_cluster: str, big_corpus: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    corpus, tok, ref = big_corpus
    out, work = tmp_path / "out.zarr", tmp_path / "work"
    options = dict(tokenizer=str(tok), **SPLIT, **LAYOUTS["v3_sharded"])
    run = dict(work_dir=str(work), unit_bytes=2000)
    script = DRIVER.format(run=run)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    driver = subprocess.Popen(
        [sys.executable, "-c", script, str(corpus), str(out), ray_cluster, json.dumps(options)],
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 90
        while len(list(work.glob("pieces/*.json"))) < 4:
            assert driver.poll() is None, "the driver finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        driver.kill()
        driver.wait()
    done_before = {p.name: p.stat().st_mtime_ns for p in work.glob("pieces/*.json")}
    assert not out.exists()
    report = convert_distributed(
        [corpus], out, options=ConvertOptions(**options), runner="ray", **run
    )
    assert len(done_before) >= 4
    assert report.units_resumed >= len(done_before) and report.units_resumed < report.units
    assert_same_store(out, ref)
    assert not work.exists()


# -- into a bucket: the GCS emulator and moto's S3, written by the Ray workers ----------------------


@pytest.mark.cloud
# The GCS emulator: test_cli_ray_into_bucket_then_train_from_it, the same checks from the CLI.
@pytest.mark.parametrize("backend", ["s3"])
def test_ray_into_bucket_equals_local(
    ray_cluster: str,
    corpus: Path,
    reference: dict[str, Path],
    request: pytest.FixtureRequest,
    backend: str,
) -> None:
    import fsspec

    from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams

    server = request.getfixturevalue("gcs_emulator" if backend == "gcs" else "s3_server")
    options = server.storage_options()
    protocol = "gs" if backend == "gcs" else "s3"
    url = f"{protocol}://asyncflat-test/dist/out.zarr"
    report = convert_distributed(
        [corpus],
        url,
        options=ConvertOptions(storage_options=options, **SPLIT, **LAYOUTS["v3_sharded"]),
        runner="ray",
        unit_bytes=5000,
        write_run_tokens=20000,
    )
    assert report.output == url
    fs = fsspec.filesystem(protocol, **options)
    prefix = "asyncflat-test/dist/out.zarr"
    fs.invalidate_cache()
    got = {k.removeprefix(prefix + "/"): fs.cat_file(k) for k in fs.find(prefix)}
    assert got == tree(reference["v3_sharded"])
    assert not fs.find("asyncflat-test/dist/out.zarr.pieces")  # pieces removed

    batch = TokenBatchParams(len=32, batch=8)

    def params(path: str, opts: dict[str, Any] | None) -> FlatTokensParams:
        return FlatTokensParams(path, 2, 3, 8, 5, True, storage_options=opts)

    with (
        ShufflingLoader("train", params(url, options), batch) as remote,
        ShufflingLoader("train", params(str(reference["v3_sharded"]), None), batch) as here,
    ):
        assert remote.step_count == here.step_count and remote.max_token_id == here.max_token_id
        for step in [*range(8), remote.step_count - 1]:
            got, want = remote.load(step), here.load(step)
            np.testing.assert_array_equal(np.asarray(got.targets), np.asarray(want.targets))
            np.testing.assert_array_equal(
                np.asarray(got.is_seq_start), np.asarray(want.is_seq_start)
            )
    with pytest.raises(ConfigError, match="already exists"):
        convert_distributed(
            [corpus], url, options=ConvertOptions(storage_options=options), runner="local"
        )


def test_cli_engine_ray(
    ray_cluster: str,
    corpus: Path,
    reference: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from asyncflat.cli import main

    out = tmp_path / "cli.zarr"
    args = ["convert", str(corpus), "-o", str(out), "--engine", "ray"]
    args += ["--ray-address", ray_cluster, "--validation-fraction", "0.2", "--seed", "3"]
    args += ["--chunk-tokens", "2048", "--shard-tokens", "8192", "--json", "--no-progress"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["units"] >= 4 and report["parallelism"] == 2
    assert_same_store(out, reference["v3_sharded"])
    assert main(["convert", str(corpus), "-o", str(tmp_path / "x"), "--ray-address", "auto"]) != 0
    assert "--ray-address and --work-dir need --engine ray" in capsys.readouterr().err


# -- the single-machine reading rules, on every engine --------------------------------------------


def oversized_inputs(root: Path) -> dict[str, Path]:
    """Inputs each holding one document of 1,200 UTF-8 bytes (600 characters) late in the file,
    past several 1,000-byte units; the txt has CRLF and lone-CR line endings before it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    big = "é" * 600
    endings = ["\n", "\r\n", "\r"]
    txt = root / "a.txt"
    txt.write_bytes(
        "".join((big if i == 130 else f"line {i}") + endings[i % 3] for i in range(200)).encode()
    )
    lines = [json.dumps({"text": big if i == 90 else f"document {i}"}) for i in range(120)]
    (root / "b.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(root / "c.txt.gz", "wt", encoding="utf-8") as f:
        f.write("short\n" * 30 + big + "\nafter\n")
    texts = [big if i == 70 else f"row {i}" for i in range(100)]
    pq.write_table(pa.table({"text": texts}), root / "d.parquet", row_group_size=25)
    return {p.suffix: p for p in sorted(root.iterdir())}


def test_oversized_document_fails_alike_on_both_engines(tmp_path: Path) -> None:
    """``max_document_bytes`` is enforced by the same reader on both engines: the same error,
    naming the same line (or row) of the file, from a unit in the middle of it."""
    inputs = oversized_inputs(tmp_path / "in")
    assert len(inputs) == 4
    run: dict[str, Any] = dict(runner="local", unit_bytes=300)
    bound = ConvertOptions(max_document_bytes=1000)
    for path in inputs.values():
        with pytest.raises(ConfigError) as single:
            convert_files([path], tmp_path / "single.zarr", options=bound)
        with pytest.raises(ConfigError) as dist:
            convert_distributed(
                [path],
                tmp_path / "d.zarr",
                options=bound,
                work_dir=str(tmp_path / f"pieces{path.suffix}"),
                **run,
            )
        assert str(dist.value) == str(single.value)
        assert "of at least 1,200 bytes is over max_document_bytes (1,000" in str(dist.value)
        where = {".txt": ":131:", ".jsonl": ":91:", ".gz": ":31:", ".parquet": " row 70:"}
        assert f"{path}{where[path.suffix]}" in str(dist.value)
    assert not (tmp_path / "single.zarr").exists() and not (tmp_path / "d.zarr").exists()
    # A piece tokenized under one bound is not reused under another (it is in the fingerprint).
    work = str(tmp_path / "pieces.txt")
    with pytest.raises(ConfigError, match=r"changed since: max_document_bytes\)"):
        convert_distributed([inputs[".txt"]], tmp_path / "d.zarr", work_dir=work, **run)
    # A bound that fits accepts them, and the outputs are equal.
    fits = ConvertOptions(max_document_bytes=1200)
    convert_files(list(inputs.values()), tmp_path / "single.zarr", options=fits)
    convert_distributed(list(inputs.values()), tmp_path / "d.zarr", options=fits, **run)
    assert_same_store(tmp_path / "d.zarr", tmp_path / "single.zarr")


def test_byte_ranges_read_as_the_whole_file(tmp_path: Path) -> None:
    """Any line-aligned cut of a file gives the whole file's documents; a line's number in an
    error counts universal newlines (\\n, \\r\\n, lone \\r) from the file's start, also when a
    \\r\\n straddles the line counter's 1 MiB read blocks."""
    from asyncflat.text.corpus import iter_file_documents, iter_range_documents

    txt = tmp_path / "a.txt"
    txt.write_bytes(b"one\r\ntwo\rthree\n\n\xc3\xa9\r\n\r\nlast\n")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_bytes(b'{"text": "a"}\r\n\n{"text": "b\\u00e9"}\n  \n{"text": ""}\n')
    for path in (txt, jsonl):
        data = path.read_bytes()
        whole = list(iter_file_documents(path))
        cuts = [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]
        for cut in [0, *cuts]:
            got = [*iter_range_documents(path, 0, cut), *iter_range_documents(path, cut, len(data))]
            assert got == whole, (path.name, cut)
    lines = ["x"] * 5 + ["y" * 2000]
    big = tmp_path / "c.txt"
    short = (b"a" * 99 + b"\n") * 10485  # 10,485 lines, then a line whose \r ends the first
    head = short + b"p" * ((1 << 20) - 1 - len(short)) + b"\r\n"  # block; its \n starts the next
    big.write_bytes(head + b"b\rc\n" + "\n".join(lines).encode() + b"\n")
    start = len(head) + 4
    with pytest.raises(ConfigError) as single:
        list(iter_file_documents(big, max_document_bytes=1000))
    with pytest.raises(ConfigError) as ranged:
        list(iter_range_documents(big, start, big.stat().st_size, max_document_bytes=1000))
    assert str(ranged.value) == str(single.value)
    assert f"{big}:{10485 + 1 + 2 + 6}: document" in str(single.value)


def test_symlink_rules_are_the_single_machine_ones(tmp_path: Path) -> None:
    """--follow-symlinks as on one machine (with an empty validation split: its one-entry
    ``seq_starts`` chunk, all fill value, is written as the single-machine writer writes it)."""
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("from outside\n")
    corpus = tmp_path / "in"
    corpus.mkdir()
    (corpus / "a.txt").write_text("inside\n")
    (corpus / "b.txt").symlink_to(outside)
    for follow, docs in ((False, 1), (True, 2)):
        out = tmp_path / f"o{follow}.zarr"
        report = convert_distributed(
            [corpus],
            out,
            options=ConvertOptions(validation_fraction=0.0),
            runner="local",
            follow_symlinks=follow,
        )
        want = convert_files(
            [corpus],
            tmp_path / f"w{follow}.zarr",
            options=ConvertOptions(validation_fraction=0.0),
            follow_symlinks=follow,
        )
        assert report.documents == want.documents == docs
        assert_same_store(out, tmp_path / f"w{follow}.zarr")


def test_ray_and_cli_enforce_max_document_bytes(
    ray_cluster: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncflat.cli import main

    inputs = oversized_inputs(tmp_path / "in")
    path = inputs[".jsonl"]
    bound = ConvertOptions(max_document_bytes=1000)
    with pytest.raises(ConfigError) as single:
        convert_files([path], tmp_path / "single.zarr", options=bound)
    with pytest.raises(ConfigError) as ray:
        convert_distributed(
            [path], tmp_path / "ray.zarr", options=bound, runner="ray", unit_bytes=300
        )
    assert str(ray.value) == str(single.value) and f"{path}:91: document" in str(ray.value)
    # From the command line: the bound reaches the Ray tasks, and both engines say the same.
    errors = []
    for engine in ("local", "ray"):
        args = ["convert", str(inputs[".txt"]), "-o", str(tmp_path / f"cli-{engine}.zarr")]
        args += ["--engine", engine, "--max-document-bytes", "1000", "--no-progress"]
        args += ["--ray-address", ray_cluster] if engine == "ray" else ["--workers", "1"]
        assert main(args) == 1
        errors.append(capsys.readouterr().err.replace(f"{tmp_path}/", ""))
    assert errors[0] == errors[1]
    assert errors[0].startswith(
        "asyncflat convert: error: in/a.txt:131: document of at least 1,200 bytes is over "
        "max_document_bytes (1,000;"
    )
    args = ["convert", str(inputs[".txt"]), "-o", str(tmp_path / "ok.zarr"), "--engine", "ray"]
    args += ["--ray-address", ray_cluster, "--max-document-bytes", "1200", "--no-progress"]
    assert main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cli-ray.zarr.pieces",  # the failed runs' pieces, kept for a rerun
        "in",
        "ok.zarr",
        "ray.zarr.pieces",
    ]


@pytest.mark.cloud
def test_cli_ray_into_bucket_then_train_from_it(
    ray_cluster: str,
    corpus: Path,
    tmp_path: Path,
    gcs_emulator: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """End to end from the command line: convert on Ray into a bucket (the GCS emulator), then
    train from the bucket: every object equals a local single-machine conversion's, and so do
    the loader's batches."""
    import fsspec

    from asyncflat import FlatTokensParams, ShufflingLoader, TokenBatchParams
    from asyncflat.cli import main

    options = gcs_emulator.storage_options()
    url = "gs://asyncflat-test/cli-e2e/corpus.zarr"
    local = tmp_path / "local.zarr"
    common = ["--validation-fraction", "0.2", "--seed", "3", "--chunk-tokens", "2048"]
    common += ["--shard-tokens", "8192", "--json", "--no-progress"]
    assert main(["convert", str(corpus), "-o", str(local), "--workers", "1", *common]) == 0
    here_report = json.loads(capsys.readouterr().out)
    args = ["convert", str(corpus), "-o", url, "--engine", "ray", "--ray-address", ray_cluster]
    args += ["--storage-options", json.dumps(options), *common]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["output"] == url and report["parallelism"] == 2
    for field in ("documents", "sequences", "tokens", "max_token_id"):
        assert report[field] == here_report[field]
    fs = fsspec.filesystem("gs", **options)
    prefix = "asyncflat-test/cli-e2e/corpus.zarr"
    fs.invalidate_cache()
    assert {k.removeprefix(prefix + "/"): fs.cat_file(k) for k in fs.find(prefix)} == tree(local)
    assert not fs.find(prefix + ".pieces")  # pieces removed after the commit

    batch = TokenBatchParams(len=64, batch=8)
    for split in ("train", "validation"):
        with (
            ShufflingLoader(
                split,
                FlatTokensParams(url, 2, 2, 8, 7, True, storage_options=options),
                batch,
            ) as remote,
            ShufflingLoader(split, FlatTokensParams(str(local), 2, 2, 8, 7, True), batch) as here,
        ):
            assert remote.step_count == here.step_count > 5
            for step in [*range(5), remote.step_count - 1]:
                got, want = remote.load(step), here.load(step)
                np.testing.assert_array_equal(np.asarray(got.targets), np.asarray(want.targets))
                np.testing.assert_array_equal(
                    np.asarray(got.is_seq_start), np.asarray(want.is_seq_start)
                )


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_piece_lost_before_the_write_pass_is_named(
    corpus: Path, tmp_path: Path, where: str
) -> None:
    import fsspec

    from asyncflat.writer.distributed import InProcessRunner
    from asyncflat.writer.distributed.layout import split_stats

    work = str(tmp_path / "work") if where == "local" else "memory://asyncflat-lost/work"
    fs, root = fsspec.core.url_to_fs(work)

    class LosesAPiece(InProcessRunner):
        def map(self, fn: Any, jobs: Any) -> Iterator[tuple[int, Any]]:
            if fn is split_stats:
                fs.rm(f"{root}/pieces/00000002.lengths")
            yield from super().map(fn, jobs)

    try:
        with pytest.raises(ConfigError, match=rf"piece {work}/pieces/00000002.lengths is missing"):
            convert_distributed(
                [corpus], tmp_path / "o.zarr", runner=LosesAPiece(), work_dir=work, unit_bytes=5000
            )
    finally:
        if where == "memory":
            fs.rm(root, recursive=True)
    assert not (tmp_path / "o.zarr").exists()


def test_a_pieces_folder_of_the_users_in_work_dir_is_refused_and_never_emptied(
    corpus: Path, tmp_path: Path
) -> None:
    """The pieces go to ``<work_dir>/pieces`` and are removed after the commit. A work_dir of
    the user's that already has a ``pieces/`` folder of their own is refused before any work
    (removing the pieces would have emptied it, recursively); once the run owns the folder,
    removing the pieces leaves anything else there."""
    work = tmp_path / "project"
    (work / "pieces").mkdir(parents=True)
    (work / "pieces" / "my_notes.txt").write_text("precious")
    run: dict[str, Any] = dict(runner="local", options=ConvertOptions(**SPLIT), unit_bytes=3000)
    with pytest.raises(ConfigError, match=r"pieces/ folder holding files no conversion writes"):
        convert_distributed([corpus], tmp_path / "out.zarr", work_dir=str(work), **run)
    assert sorted(p.name for p in (work / "pieces").iterdir()) == ["my_notes.txt"]
    assert not (tmp_path / "out.zarr").exists()
    # refused before the output opens: an overwrite at a URL has not removed the dataset there
    import fsspec

    from asyncflat.writer.flat_tokens import write_flat_tokens

    url = "memory://kept-by-a-refused-work-dir"
    write_flat_tokens(url, {"train": [np.arange(1, 9)], "validation": [np.arange(1, 5)]})
    before = fsspec.filesystem("memory").find(url)
    replacing = ConvertOptions(overwrite=True, **SPLIT)
    with pytest.raises(ConfigError, match=r"pieces/ folder holding files no conversion writes"):
        convert_distributed([corpus], url, work_dir=str(work), runner="local", options=replacing)
    assert before and fsspec.filesystem("memory").find(url) == before
    (work / "pieces" / "my_notes.txt").unlink()
    killed = work / "pieces" / "00000000.tokens.tmp-0123abcd"  # a killed task's local write
    killed.write_bytes(b"\0" * 8)
    (work / "mine.txt").write_text("a file of the user's")
    report = convert_distributed([corpus], tmp_path / "out.zarr", work_dir=str(work), **run)
    assert report.units > 3
    assert sorted(p.name for p in work.iterdir()) == ["mine.txt"]  # pieces/ and plan.json gone


def test_a_runner_that_cannot_start_leaves_the_output_as_it_was(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster that cannot be reached fails the run before any work: nothing is staged
    beside a local output, and a dataset at an object-store URL that ``overwrite`` would
    replace is still there."""
    import fsspec

    from asyncflat.writer.distributed import driver
    from asyncflat.writer.flat_tokens import write_flat_tokens

    class Unreachable:
        def __init__(self, address: str | None, **options: Any) -> None:
            raise ConnectionError(f"could not connect to the Ray cluster at {address}")

    monkeypatch.setattr(driver, "RayRunner", Unreachable)
    run: dict[str, Any] = dict(runner="ray", ray_address="127.0.0.1:1")
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:1"):
        convert_distributed([corpus], tmp_path / "out.zarr", options=ConvertOptions(**SPLIT), **run)
    assert not list(tmp_path.glob("out.zarr*"))
    url = "memory://kept-by-a-failed-start"
    write_flat_tokens(url, {"train": [np.arange(1, 9)], "validation": [np.arange(1, 5)]})
    before = fsspec.filesystem("memory").find(url)
    replacing = ConvertOptions(overwrite=True, **SPLIT)
    with pytest.raises(ConnectionError):
        convert_distributed([corpus], url, options=replacing, **run)
    assert before and fsspec.filesystem("memory").find(url) == before


def test_an_output_that_would_be_refused_is_refused_before_the_cluster_starts(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output that exists without ``overwrite``, or that ``overwrite`` would not replace,
    is refused before the runner starts (reading only), not once a cluster is up: a Ray
    cluster that cannot be reached fails the run with that refusal, not a connection error."""
    import fsspec

    from asyncflat.writer.distributed import driver
    from asyncflat.writer.flat_tokens import write_flat_tokens
    from asyncflat.writer.output import OutputExistsError

    class Unreachable:
        def __init__(self, address: str | None, **options: Any) -> None:
            raise ConnectionError(f"could not connect to the Ray cluster at {address}")

    monkeypatch.setattr(driver, "RayRunner", Unreachable)
    run: dict[str, Any] = dict(runner="ray", ray_address="127.0.0.1:1")
    local = tmp_path / "out.zarr"
    url = "memory://refused-before-the-cluster"
    for where in (local, url):
        write_flat_tokens(where, {"train": [np.arange(1, 9)], "validation": [np.arange(1, 5)]})
        with pytest.raises(OutputExistsError, match="already exists"):
            convert_distributed([corpus], where, options=ConvertOptions(**SPLIT), **run)
    foreign = tmp_path / "project"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    fsspec.filesystem("memory").pipe(f"{url}-foreign/notes.txt", b"keep me")
    replacing = ConvertOptions(overwrite=True, **SPLIT)
    for where in (foreign, f"{url}-foreign"):
        with pytest.raises(ConfigError, match=r"is not a flat-tokens store \(it holds notes.txt"):
            convert_distributed([corpus], where, options=replacing, **run)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert fsspec.filesystem("memory").cat(f"{url}-foreign/notes.txt") == b"keep me"
    # storage_options for a local output: refused by the same rule as when it opens
    with_options = ConvertOptions(storage_options={"anon": True}, **SPLIT)
    with pytest.raises(ConfigError, match="storage_options are for fsspec URLs"):
        convert_distributed([corpus], tmp_path / "fresh.zarr", options=with_options, **run)


def test_removing_pieces_from_a_work_dir_named_like_a_glob_touches_nothing_else() -> None:
    """fsspec's bulk ``rm`` expands glob characters: removing the pieces of a work dir at
    ``memory://runs/exp[12]`` removed those of ``runs/exp1`` and ``runs/exp2`` and kept its
    own."""
    import fsspec

    from asyncflat.writer.distributed.storage import Location

    fs = fsspec.filesystem("memory")
    try:
        for root in ("/runs/exp[12]", "/runs/exp1", "/runs/exp2"):
            fs.pipe_file(f"{root}/pieces/00000000.tokens", b"x")
            fs.pipe_file(f"{root}/plan.json", b"{}")
        work = Location("memory://runs/exp[12]")
        work.remove(*[f"pieces/{name}" for name in work.names("pieces")], "plan.json")
        assert sorted(fs.find("/runs")) == [
            f"/runs/{d}/{f}"
            for d in ("exp1", "exp2")
            for f in ("pieces/00000000.tokens", "plan.json")
        ]
    finally:
        fs.rm("/runs", recursive=True)


@pytest.mark.parametrize("inside", ["", "tmp", "a/b", "through a symlink"])
def test_a_work_dir_inside_the_output_is_refused_before_any_work(
    corpus: Path, tmp_path: Path, inside: str
) -> None:
    """The pieces made the output exist, so the commit, after the whole run, failed with
    "already exists (pass overwrite=True ...)", and every rerun was refused."""
    (tmp_path / "o").mkdir()
    out = tmp_path / "o" / "out.zarr"
    work = str(out / inside) if inside else str(out)
    if inside == "through a symlink":  # another spelling of the same place
        (tmp_path / "alias").symlink_to(tmp_path / "o")
        work = str(tmp_path / "alias" / "out.zarr" / "pieces")
    with pytest.raises(ConfigError, match="is inside the output"):
        convert_distributed([corpus], out, runner="local", work_dir=work)
    assert not out.exists()


@pytest.mark.parametrize("contents", ["my notes\n", '["step 1"]', '{"title": "my plan"}'])
def test_a_plan_json_of_the_users_in_work_dir_is_refused_as_such(
    corpus: Path, tmp_path: Path, contents: str
) -> None:
    """A work dir's plan.json that no conversion wrote: not a JSONDecodeError or an
    AttributeError, nor "pieces of a different conversion ... delete it"."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "plan.json").write_text(contents)
    with pytest.raises(ConfigError, match=r"holds a plan\.json that no conversion wrote"):
        convert_distributed([corpus], tmp_path / "o.zarr", runner="local", work_dir=str(work))
    assert (work / "plan.json").read_text() == contents
    assert not (tmp_path / "o.zarr").exists()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_work_dir_named_like_a_glob_is_resumed_from(
    corpus: Path, tmp_path: Path, where: str
) -> None:
    """fsspec's ``cat`` expands glob characters: the manifests of a work dir ``exp[1]`` were
    looked up under ``exp1``, so a run there failed (FileNotFoundError naming a manifest)."""
    import fsspec

    work = str(tmp_path / "exp[1]") if where == "local" else "memory://asyncflat-glob/exp[1]"
    run: dict[str, Any] = dict(runner="local", work_dir=work, unit_bytes=3000, keep_pieces=True)
    out = tmp_path / "out.zarr"
    try:
        first = convert_distributed([corpus], out, options=ConvertOptions(**SPLIT), **run)
        replacing = ConvertOptions(overwrite=True, **SPLIT)
        again = convert_distributed([corpus], out, options=replacing, **run)
        assert first.units_resumed == 0 and again.units_resumed == again.units > 3
    finally:
        if where == "memory":
            fsspec.filesystem("memory").rm("/asyncflat-glob", recursive=True)


def test_the_cli_refuses_an_output_before_it_starts_a_cluster(
    corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--engine ray`` made its Ray runner (``ray.init``: a local cluster's start, seconds)
    before the conversion checked the output, which it then refused."""
    from asyncflat.cli import main

    ray = import_ray(monkeypatch)

    def no_cluster(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cluster was started before the output was checked")

    monkeypatch.setattr(ray, "init", no_cluster)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["convert", str(corpus), "-o", str(out), "--engine", "ray", "--no-progress"]) != 0
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
