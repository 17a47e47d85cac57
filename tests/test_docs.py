"""The documentation's runnable code blocks run, and its references resolve.

A fenced block preceded by the line ``<!-- run -->`` in ``README.md`` or ``docs/*.md`` is
executed: all such blocks of one file in order, in one fresh directory, Python blocks in one
shared namespace (in a subprocess, so a page's jax set-up is its own), bash blocks with ``bash
-euo pipefail`` and ``asyncflat`` on the PATH meaning this checkout's ``python -m asyncflat``.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MARK = "<!-- run -->"
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.S | re.M)


def runnable_blocks(path: Path) -> list[tuple[str, str, int]]:
    """``(language, code, line)`` of each block marked runnable, in order."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.strip() == MARK:
            blocks.append((match.group(1), match.group(2), text.count("\n", 0, match.start()) + 1))
    return blocks


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


RUNNABLE = [p for p in documents() if runnable_blocks(p)]


def test_the_quickstart_is_runnable() -> None:
    assert REPO / "docs" / "quickstart.md" in RUNNABLE
    languages = [lang for lang, _, _ in runnable_blocks(REPO / "docs" / "quickstart.md")]
    assert "bash" in languages and "python" in languages


_DRIVER = """
import sys
namespace = {"__name__": "__main__"}
for path in sys.argv[1:]:
    source = open(path, encoding="utf-8").read()
    exec(compile(source, path, "exec"), namespace)
"""


@pytest.mark.slow
@pytest.mark.parametrize("doc", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_documented_blocks_run(doc: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    shims = tmp_path / "bin"
    shims.mkdir()
    shim = shims / "asyncflat"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m asyncflat "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    python = shims / "python"
    python.symlink_to(sys.executable)
    # As a user runs them: one CPU device, not the 8 the test session simulates.
    env = {
        **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
        "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "ASYNCFLAT_NO_PROGRESS": "1",
    }
    # Consecutive Python blocks run together in one process (one namespace); a bash block
    # between them runs after the Python blocks before it.
    pending: list[Path] = []

    def flush() -> None:
        if pending:
            proc = subprocess.run(
                [sys.executable, "-c", _DRIVER, *map(str, pending)],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert proc.returncode == 0, f"{doc.name}: python blocks failed\n{proc.stderr[-4000:]}"
            pending.clear()

    blocks = runnable_blocks(doc)
    python_blocks = [b for b in blocks if b[0] == "python"]
    for i, (language, code, line) in enumerate(blocks):
        if language == "python":
            script = tmp_path / f"block{i:02d}_line{line}.py"
            script.write_text(code, encoding="utf-8")
            pending.append(script)
            continue
        assert language in ("bash", "sh", "console"), f"{doc.name}:{line}: {language}"
        flush()
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, f"{doc.name}:{line} failed\n{proc.stdout}\n{proc.stderr}"
    flush()
    assert python_blocks or blocks


def test_no_document_refers_to_files_users_do_not_have() -> None:
    """No "DESIGN §n", DESIGN.md or ../shared in the docs, the README or the package."""
    forbidden = re.compile(r"DESIGN(\.md| ?§)|§\s*\d|\.\./shared|/work/shared")
    offenders = []
    paths = [*documents(), *sorted((REPO / "asyncflat").rglob("*.py"))]
    paths += sorted((REPO / "bench").glob("*.py")) + sorted((REPO / "examples").glob("*.py"))
    for path in paths:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if forbidden.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_readme_starts_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    fence = lines.index("```bash")
    assert lines[fence + 1].startswith("pip install -e . && asyncflat demo")
    assert lines[fence + 2].startswith('pip install -e ".[all]" && python -m pytest -q')
    assert fence <= 3


def test_license_and_changelog() -> None:
    license_text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert 'license = { text = "Apache-2.0" }' in (REPO / "pyproject.toml").read_text()
    import asyncflat

    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## {asyncflat.__version__}" in changelog or "## Unreleased" in changelog
