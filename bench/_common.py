"""Shared pieces of the benchmarks: the reference setup's dataset (2^28 tokens), timers, JSON output.

Datasets are cached under ``$ASYNCFLAT_BENCH_DIR`` (default: ``/tmp/asyncflat-bench``) so a
second run does not rewrite a gigabyte. Layouts:

* ``seqax``: zarr format 2 exactly as seqax's tools write it (4,194,304-token chunks, Blosc lz4
  bitshuffle), the setup the reference figures were measured on;
* ``aligned``: asyncflat's default, format 3 with chunks equal to a 1M-token read block.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

# This checkout's asyncflat, even when another one (or none) is installed: every benchmark that
# imports this module runs the code beside it.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

REFERENCE_TOKENS = 1 << 28
SEQAX_CHUNK = 4_194_304
BLOCK_TOKENS = 1 << 20


def bench_dir() -> Path:
    path = Path(os.environ.get("ASYNCFLAT_BENCH_DIR", "/tmp/asyncflat-bench"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def synthetic_sequences(tokens: int, seed: int = 0, vocab: int = 50_000):
    """Zipf-distributed ids (text-like, ~2x compressible), sequence lengths ~ geometric(1/900)."""
    rng = np.random.default_rng(seed)
    step = 1 << 24
    for lo in range(0, tokens, step):
        n = min(step, tokens - lo)
        ids = (rng.zipf(1.15, n) - 1) % vocab
        lengths = rng.geometric(1 / 900, size=n // 100 + 16)
        ends = np.cumsum(lengths)
        ends = ends[ends < n]
        yield np.split(ids.astype(np.uint32), ends)


def ensure_dataset(layout: str, tokens: int = REFERENCE_TOKENS) -> str:
    """Write (once) and return the path of a ``layout`` dataset with about ``tokens`` tokens."""
    from asyncflat import FlatTokensWriter

    # the writer's format version in the name: a store written by an older default (Blosc's own
    # block size before 32 KiB blocks) is not reused
    # (w3: format 3 with crc32c checksums, the writer's default since issue 37)
    path = bench_dir() / f"{layout}-{tokens}-w3.zarr"
    if path.exists():
        return str(path)
    kwargs = {
        "seqax": dict(zarr_format=2, chunk_tokens=SEQAX_CHUNK),
        "aligned": dict(zarr_format=3, chunk_tokens=BLOCK_TOKENS),
    }[layout]
    t0 = time.perf_counter()
    with FlatTokensWriter(path, **kwargs) as writer:
        for sequences in synthetic_sequences(tokens):
            writer.append("train", sequences)
        writer.append("validation", next(synthetic_sequences(1 << 16, seed=1)))
    print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return str(path)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak RSS: ``VmHWM``. (``ru_maxrss`` carries over ``exec``: a benchmark
    child started by a bigger parent would read the parent's peak as its own.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: best effort


def reset_peak_rss() -> bool:
    """Start ``VmHWM`` again from the current RSS (Linux >= 4.0), so a peak read later is the
    peak since now, not a transient of the start-up (an LLVM compile, an import). False if the
    kernel does not allow it (then the peak also covers what came before)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def emit(figures: dict) -> None:
    """Print the one JSON line of a benchmark (stdout); everything else goes to stderr."""
    print(json.dumps(figures, sort_keys=False), flush=True)


def out_dir() -> Path:
    path = Path(__file__).resolve().parent / "out"
    path.mkdir(exist_ok=True)
    return path


def bytecode_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child process that loads this checkout's modules
    from cached bytecode, as an installed package's are: this VM sets PYTHONDONTWRITEBYTECODE,
    under which every fresh process compiles asyncflat's ~100 modules from source (~40 ms here,
    far more on a slow host), a cost no installed package pays. The cache (under
    :func:`bench_dir`) is filled here, before any timed run."""
    import compileall

    out = dict(os.environ if env is None else env)
    out.pop("PYTHONDONTWRITEBYTECODE", None)
    prefix = str(bench_dir() / "pycache")
    out["PYTHONPYCACHEPREFIX"] = prefix
    previous = sys.pycache_prefix
    sys.pycache_prefix = prefix
    try:
        root = Path(__file__).resolve().parent.parent
        for folder in ("asyncflat", "bench"):
            compileall.compile_dir(root / folder, quiet=1)
    finally:
        sys.pycache_prefix = previous
    return out


def plot_cold_start(
    path: str,
    waits: dict[str, list[float]],
    boundaries: list[int],
    resumed: dict[str, list[float]],
    *,
    title: str,
    caption: str,
) -> None:
    """Per-step ``load()`` time of each loader (log scale): from construction over two
    minipochs (boundaries marked), and from a resume in a fresh process to its minipoch's end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncflat.cli.stall_figure import machine_description

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), width_ratios=(3, 2), sharey=True)
    styles = {
        "asyncflat": ("tab:blue", "o"),
        "asyncflat-iter": ("tab:cyan", "v"),
        "reference": ("tab:red", "s"),
        "seqax": ("tab:red", "s"),
    }
    for name in waits:
        color, marker = styles.get(name, ("tab:green", "^"))
        label = "reference (seqax-style, synchronous)" if name in ("reference", "seqax") else name
        for axis, run in ((ax, waits[name]), (bx, resumed[name])):
            ms = [w * 1e3 for w in run]
            axis.plot(range(len(ms)), ms, color=color, marker=marker, ms=2.5, lw=0.8, label=label)
    for i, step in enumerate(boundaries):
        ax.axvline(
            step, color="gray", ls="--", lw=0.8, label="minipoch boundary" if not i else None
        )
    ax.set_yscale("log")
    ax.set_xlabel("step (from construction)")
    ax.set_ylabel("load() [ms, log]")
    ax.set_title("from construction", fontsize=10)
    bx.set_xlabel("loads after a resume mid-minipoch (fresh process)")
    bx.set_title("after a resume, to the minipoch's end", fontsize=10)
    for axis in (ax, bx):
        axis.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.text(0.01, 0.01, f"{caption}\n{machine_description()}", fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
