"""The stall figure: the worst ``load()`` after each minipoch boundary, one series per run.

A shuffling loader without prefetch stops for a whole buffer fill at every boundary; asyncflat's
should not. Plotting every step's latency hides that story in a cloud of points, so this draws
one marker per boundary (the worst ``load()`` from that boundary up to the next one) for each
run, on a log scale, with each run's median ``load()`` as a line and the configuration and
machine in a caption. Step 0 (compilation and the first fill, paid once by any loader) is left
out of the markers and quoted in the caption.

Used by ``bench/stall.py`` (``docs/stall.png``) and by ``asyncflat demo --plot FILE``.
matplotlib is needed (the ``dev`` extra, or ``pip install matplotlib``).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["boundary_worst", "machine_description", "plot_boundary_latency"]


def boundary_worst(
    latencies: Sequence[float] | np.ndarray, boundaries: Sequence[int]
) -> np.ndarray:
    """Worst latency from each boundary (a step index) up to the next boundary (or the end).

    Boundaries at or past the end of ``latencies`` are left out.
    """
    lat = np.asarray(latencies, dtype=np.float64)
    starts = [b for b in boundaries if 0 < b < len(lat)]
    ends = [*starts[1:], len(lat)]
    return np.array([lat[a:b].max() for a, b in zip(starts, ends)], dtype=np.float64)


def machine_description() -> str:
    """``"<cpu model>, N cores, <os>"`` for a caption (the CPU model when the OS says it)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def plot_boundary_latency(
    path: str | os.PathLike[str],
    runs: Mapping[str, Sequence[float] | np.ndarray],
    boundaries: Sequence[int],
    *,
    caption: str,
    title: str = "Worst load() after each minipoch boundary",
) -> None:
    """Write the figure to ``path`` (format from its suffix: ``.png``, ``.svg``, ``.pdf``).

    ``runs`` maps a label to per-step ``load()`` latencies in seconds (step 0 first);
    ``boundaries`` are the first steps of minipochs 1, 2, ... (the same for every run).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    colors = ["tab:blue", "tab:red", "tab:green", "tab:purple"]
    markers = ["o", "s", "^", "D"]
    fig, ax = plt.subplots(figsize=(9, 5.2))
    cold = []
    for i, (label, latencies) in enumerate(runs.items()):
        lat = np.asarray(latencies, dtype=np.float64)
        worst = boundary_worst(lat, boundaries) * 1e3
        x = np.arange(1, len(worst) + 1)
        color = colors[i % len(colors)]
        median = float(np.median(lat[1:] if len(lat) > 1 else lat)) * 1e3
        ax.plot(
            x,
            worst,
            marker=markers[i % len(markers)],
            ms=7,
            lw=1,
            color=color,
            label=f"{label}; median load() {median:.2g} ms (dotted)",
        )
        ax.axhline(median, color=color, lw=1, ls=":", alpha=0.8)
        if len(worst) <= 12:  # few boundaries: the figures themselves, next to the markers
            for xi, yi in zip(x, worst):
                ax.annotate(
                    f"{yi:.3g} ms",
                    (xi, yi),
                    textcoords="offset points",
                    xytext=(6, -3),
                    color=color,
                    fontsize=8,
                )
        if len(lat):
            cold.append(f"{label.split(' (')[0]} {lat[0] * 1e3:,.0f} ms")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
    ax.set_xlabel("minipoch boundary")
    ax.set_ylabel("worst load() until the next boundary [ms, log]")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, which="both", axis="y", alpha=0.3)
    # Above the axes, so it never hides a marker; the title above it.
    ax.legend(
        loc="lower left", bbox_to_anchor=(0, 1.01), frameon=False, fontsize=9, borderaxespad=0
    )
    fig.suptitle(title, x=0.01, ha="left", fontsize=12)
    note = caption
    if cold:
        note += f"\nStep 0 (compilation and first fill, paid once; not plotted): {', '.join(cold)}."
    fig.text(0.01, 0.01, note, fontsize=8, va="bottom", ha="left", wrap=True)
    fig.tight_layout(rect=(0, 0.1, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
