"""The writer when things go wrong: a full disk, bad sequences, and what importing it costs."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr.storage._local as zarr_local

from asyncflat.errors import AsyncflatError, ConfigError, LoaderClosedError, StorageError
from asyncflat.writer.flat_tokens import FlatTokensWriter, write_flat_tokens

REPO = str(Path(__file__).resolve().parents[1])


# ---------------------------------------------------------------------------------------------
# A full disk
# ---------------------------------------------------------------------------------------------


def test_disk_full_is_a_storage_error_and_in_flight_writes_end_before_cleanup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One chunk write fails with ENOSPC while others of the same zarr call are still running
    (slowly); when the error reaches the caller, those writes must have ended and the staging
    directory must be gone for good (a late write would recreate it)."""
    real_put = zarr_local._put
    late_writes: list[str] = []
    started = threading.Event()

    def put(path: Path, value: Any, exclusive: bool = False) -> int:
        if path.parent.name == "c" and path.name == "3":
            started.wait(5)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        if path.parent.name == "c":
            started.set()
            time.sleep(0.3)  # still in flight when the failure is raised
            late_writes.append(path.name)
        return real_put(path, value, exclusive)

    monkeypatch.setattr(zarr_local, "_put", put)
    tokens = np.random.default_rng(0).integers(0, 1000, 64 * 8)
    with pytest.raises(StorageError) as info:
        with FlatTokensWriter(tmp_path / "d", chunk_tokens=64) as writer:
            writer.append("train", [tokens])
    message = str(info.value)
    assert "No space left on device" in message
    assert f"{tmp_path / 'd'}/train/encoded_tokens/c/3" in message  # names the object
    assert isinstance(info.value, AsyncflatError) and isinstance(info.value, OSError)
    assert late_writes, "the slow writes should have been in flight"
    assert list(tmp_path.iterdir()) == []
    time.sleep(0.5)  # nothing still running may bring the staging directory back
    assert list(tmp_path.iterdir()) == []


def test_an_append_that_failed_part_written_leaves_nothing_to_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append whose second chunk write fails (the disk full for a moment) has written its
    first chunk already: what it wrote cannot be taken back, so the writer is aborted. Were it
    kept open, a caller that retries the append once space is freed would commit tokens and
    ``seq_starts`` that disagree, a dataset that opens as valid with a sequence read wrong."""
    real_put = zarr_local._put
    failed: list[str] = []

    def put(path: Path, value: Any, exclusive: bool = False) -> int:
        if path.parent.name == "c" and path.name == "1" and not failed:
            failed.append(path.name)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_put(path, value, exclusive)

    monkeypatch.setattr(zarr_local, "_put", put)
    first, second = np.arange(1, 11), np.arange(100, 200)  # 10 tokens held, then 100
    writer = FlatTokensWriter(tmp_path / "d", chunk_tokens=16)
    writer.append("train", [first])
    with pytest.raises(StorageError, match="No space left on device"):
        writer.append("train", [second])  # chunk 0 written, chunk 1 fails
    assert failed
    with pytest.raises(LoaderClosedError, match="an append failed"):
        writer.append("train", [second])  # space freed: the same append again
    with pytest.raises(LoaderClosedError, match="an append failed"):
        writer.close()
    assert list(tmp_path.iterdir()) == []  # nothing committed, nothing left staged


TINY_DISK_SCRIPT = """
import os, sys, time
import numpy as np
from asyncflat.writer.flat_tokens import write_flat_tokens
from asyncflat.errors import StorageError
root = sys.argv[1]
rng = np.random.default_rng(0)
seqs = [rng.integers(0, 2**31 - 1, 4096) for _ in range(256)]  # 4 MiB, incompressible
try:
    write_flat_tokens(os.path.join(root, "d"), {"train": seqs}, chunk_tokens=4096)
except StorageError as exc:
    print("ERROR", exc)
time.sleep(0.5)
print("LEFT", sorted(os.listdir(root)))
st = os.statvfs(root)
print("USED", (st.f_blocks - st.f_bfree) * st.f_frsize)
"""


def test_a_real_full_tmpfs(tmp_path: Path) -> None:
    """The same on a real 1 MiB tmpfs (root only: a private mount namespace with ``unshare``)."""
    unshare = shutil.which("unshare")
    mount = tmp_path / "tiny"
    mount.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(TINY_DISK_SCRIPT)
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("mounting a tmpfs needs root and unshare; the monkeypatched test covers this")
    shell = f"mount -t tmpfs -o size=1m tmpfs {mount} && exec {sys.executable} {script} {mount}"
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run(
        [unshare, "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120, env=env
    )
    if "mount:" in result.stderr and result.returncode:
        pytest.skip(f"no tmpfs mount here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert "No space left on device" in lines["ERROR"]
    assert f"{mount}/d" in lines["ERROR"]
    assert lines["LEFT"] == "[]"
    assert int(lines["USED"]) == 0  # the space is given back


# ---------------------------------------------------------------------------------------------
# Sequences that are not sequences of integers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sequences", "match"),
    [
        (None, r"sequences must be an iterable of 1-D integer sequences, got None"),
        (7, r"got 7"),
        ("abc", r"got 'abc'"),
        ([[1, 2], None], r"sequence 1 must be a 1-D sequence of token ids, got None"),
        ([[1, [2, 3]]], r"sequence 0 is not a 1-D sequence of integers: \[1, \[2, 3\]\]"),
        ([[1, 2.5]], r"sequence 0: token ids must be integers, got 2.5"),
        ([[1, None]], r"sequence 0: token ids must be integers, got None"),
        ([["7"]], r"sequence 0: token ids must be integers, got '7'"),
        ([[True, False]], r"sequence 0: token ids must be integers, got True"),
        (
            np.array([[1.5, 2.0]]),
            r"token ids must be integers, got dtype float64 \(first value 1.5",
        ),
    ],
)
def test_bad_sequences_are_config_errors_quoting_the_value(
    tmp_path: Path, sequences: Any, match: str
) -> None:
    with FlatTokensWriter(tmp_path / "d") as writer:
        with pytest.raises(ConfigError, match=match):
            writer.append("train", sequences)
        writer.append("train", [[3]])  # the writer is still usable
    with pytest.raises(ConfigError, match=match):
        write_flat_tokens(tmp_path / "e", {"train": sequences})
    assert not (tmp_path / "e").exists()


def test_write_flat_tokens_needs_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"splits must map split name to sequences, got \[\[1\]\]"
    ):
        write_flat_tokens(tmp_path / "d", [[1]])  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Importing the writer
# ---------------------------------------------------------------------------------------------


def test_importing_the_writer_does_not_import_jax() -> None:
    code = textwrap.dedent(
        """
        import sys
        import asyncflat.writer.flat_tokens, asyncflat.writer.convert
        assert "jax" not in sys.modules, sorted(m for m in sys.modules if m.startswith("jax"))
        import asyncflat
        assert "jax" not in sys.modules
        asyncflat.ShufflingLoader  # the loader's names still resolve, importing jax then
        assert "jax" in sys.modules
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
