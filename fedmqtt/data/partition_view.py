"""How a partition reads to a person: bin names with their edges, and per-site label counts as a plot."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np

from fedmqtt.recruitment import LOS_EDGES


def los_bin_edges() -> list[str]:
    """Each length-of-stay bin of `label_histogram` (regression) with its edges in days: b0 < 1, ..."""
    edges = [f"{e:g}" for e in LOS_EDGES]
    inner = [f"[{lo}, {hi})" for lo, hi in pairwise(edges)]
    return [f"< {edges[0]}", *inner, f">= {edges[-1]}"]


def bin_legend(task_kind: str, label_names: Sequence[str], keys: Sequence[str]) -> str | None:
    """One line naming what each histogram key means (class name, label, or LoS bin with its edges)."""
    if task_kind == "regression":
        ranges = los_bin_edges()
        return "bins (length of stay, days): " + ", ".join(
            f"{k}: {ranges[int(k)]}" for k in keys if int(k) < len(ranges))
    named = [(k, label_names[int(k)]) for k in keys if int(k) < len(label_names)]
    legend = [f"{k}={name}" for k, name in named if name != k]
    return ("labels: " + ", ".join(legend)) if legend else None


def plot_partition(names: list[str], hists: list[dict[str, int]], path: Path, *, title: str = "",
                   task_kind: str | None = None) -> None:
    """Per-site label counts as a bubble plot (area proportional to the count, the count written beside).

    With `task_kind = "regression"` the y axis names each length-of-stay bin by its edges in days.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(hists[0]) if hists else []
    counts = np.asarray([[h.get(k, 0) for k in keys] for h in hists], dtype=np.float64)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(names) + 2), max(3.0, 0.35 * len(keys) + 1.5)))
    if counts.size and counts.max() > 0:
        xs, ys = np.meshgrid(np.arange(len(names)), np.arange(len(keys)), indexing="ij")
        sizes = 900.0 * counts / counts.max()
        ax.scatter(xs.ravel(), ys.ravel(), s=sizes.ravel(), color="tab:red", alpha=0.6)
        for (i, j), c in np.ndenumerate(counts):
            if c:  # the label sits just right of the bubble (radius in points = sqrt(area) / 2)
                ax.annotate(f"{int(c)}", (i, j), xytext=(np.sqrt(sizes[i, j]) / 2 + 2, 0),
                            textcoords="offset points", fontsize=7, va="center")
    many = len(names) > 8
    ax.set_xticks(range(len(names)), names, rotation=45 if many else 0, ha="right" if many else "center")
    regression = task_kind == "regression"
    ax.set_yticks(range(len(keys)), los_bin_edges()[: len(keys)] if regression else keys)
    ax.set_xlim(-0.7, len(names) - 0.3)
    ax.set_ylim(-0.7, len(keys) - 0.3)
    ax.set_xlabel("site")
    ax.set_ylabel("length of stay (days)" if regression else "label (class, label index or LoS bin)")
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
