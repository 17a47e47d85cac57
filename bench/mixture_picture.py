"""Draw ``docs/mixture.png``: the realised proportions of the docs/mixtures.md example over steps.

Runs the worked example of docs/mixtures.md (three small corpora, weights 0.6/0.3/0.1 changing to
0.3/0.3/0.4 at step 50, math running out) in a temporary directory and plots, per step, the
share of the rows each source filled in the step's block (5 steps, 40 rows; exact by
construction), the web share of each single step as a thin line, with the stage
change and the step where math starts its second pass marked. Needs matplotlib.
Usage: ``python bench/mixture_picture.py [OUT.png]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

# This checkout's asyncflat, even when another one is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DOC = Path(__file__).resolve().parent.parent / "docs" / "mixtures.md"


def example_setup() -> str:
    """The first runnable block of docs/mixtures.md (writes the corpora, builds ``mixture``)."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index("<!-- run -->\n```python\n") + len("<!-- run -->\n```python\n")
    return text[start : text.index("```", start)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=str(DOC.parent / "mixture.png"))
    out = Path(parser.parse_args().out)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import asyncflat

    namespace: dict[str, object] = {"__name__": "example"}
    with tempfile.TemporaryDirectory() as work:
        os.chdir(work)
        exec(compile(example_setup(), str(DOC), "exec"), namespace)
        mixture, batch = namespace["mixture"], namespace["batch"]
        with asyncflat.ShufflingLoader("train", mixture, batch) as loader:
            steps = loader.step_count
            counts = np.array([np.bincount(loader.sources(t), minlength=3) for t in range(steps)])
            wrap = next(t for t in range(steps) if any(g.epoch > 0 for g in loader.groups(t)))
    window = 5  # steps per block of 40 rows: each block holds exactly its counts
    share = np.array(
        [counts[t - t % window : t - t % window + window].sum(0) for t in range(steps)]
    )
    share = share / share.sum(1, keepdims=True)
    per_step = counts / counts.sum(1, keepdims=True)
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=110)
    ax.stackplot(np.arange(steps), share.T, labels=["web", "code", "math"], alpha=0.85, step="post")
    ax.plot(np.arange(steps), per_step[:, 0], color="k", lw=0.6, alpha=0.5, label="web, per step")
    ax.axvline(50, color="k", lw=1, ls="--")
    ax.text(50.5, 0.97, "stage: 0.3/0.3/0.4", va="top", fontsize=8)
    ax.axvline(wrap, color="k", lw=1, ls=":")
    ax.text(wrap - 0.5, 0.03, "math: pass 2", ha="right", fontsize=8)
    ax.set_xlim(0, steps - 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_ylabel("share of rows")
    ax.legend(loc="upper left", fontsize=8, ncol=3, framealpha=0.9)
    ax.set_title(
        "Realised proportions of the docs/mixtures.md example (per block of 5 steps)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(out)
    print(out)


if __name__ == "__main__":
    main()
