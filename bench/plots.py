"""Plots the benchmarks share (matplotlib is a bench-only dependency: imported when used)."""

from __future__ import annotations

from pathlib import Path


def grouped_bars(
    path: Path,
    groups: list[str],
    series: dict[str, list[float]],
    ylabel: str,
    title: str,
    log: bool = False,
) -> None:
    """One bar per series in each group, side by side; ``series[name][i]`` is group ``i``'s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8.0, 2.2 * len(groups) + 2.0), 4))
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar([j + offset for j in range(len(groups))], values, width, label=name)
    ax.set_xticks(list(range(len(groups))), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")  # off the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
