"""PNG curves of a validation metric per round: mean over sites, and per site, ± std over seeds shaded."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fedmqtt.experiments.runs import RunRecord, algorithm_label, group_by
from fedmqtt.means import round_score

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Series = tuple[list[int], list[float], list[float]]  # x, mean, std (NaN where nothing is defined)


def seed_band(runs: Sequence[RunRecord], value: Callable[[RunRecord, int], float | None]) -> Series:
    """Per x (aggregations completed), mean and sample std over the runs (seeds) where `value` is defined."""
    xs = sorted({x for r in runs for x, _ in r.curve})
    means, stds = [], []
    for x in xs:
        vals = [v for r in runs if (v := value(r, x)) is not None and math.isfinite(v)]
        means.append(statistics.fmean(vals) if vals else math.nan)
        stds.append(statistics.stdev(vals) if len(vals) >= 2 else 0.0)
    return xs, means, stds


def _at(run: RunRecord, x: int) -> dict[str, dict[str, float | None]] | None:
    return next((sites for rx, sites in run.curve if rx == x), None)


def _site_mean(metric: str) -> Callable[[RunRecord, int], float | None]:
    def value(run: RunRecord, x: int) -> float | None:
        sites = _at(run, x)
        return None if sites is None else round_score(sites, metric)
    return value


def _site_value(metric: str, site: str) -> Callable[[RunRecord, int], float | None]:
    def value(run: RunRecord, x: int) -> float | None:
        found = (_at(run, x) or {}).get(site, {}).get(metric)
        return found if isinstance(found, (int, float)) else None
    return value


def _draw(ax: Axes, runs_by_label: dict[str, list[RunRecord]],
          value_of: Callable[[RunRecord, int], float | None]) -> bool:
    """One line per label with its ± std band; whether anything was drawn."""
    drawn = False
    for label, runs in runs_by_label.items():
        xs, mean, std = seed_band(runs, value_of)
        if all(math.isnan(m) for m in mean):
            continue
        (line,) = ax.plot(xs, mean, marker="o", markersize=3, label=label)
        lo = [m - s for m, s in zip(mean, std, strict=True)]
        hi = [m + s for m, s in zip(mean, std, strict=True)]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        drawn = True
    return drawn


def plot_curves(records: Sequence[RunRecord], metric: str, out_dir: Path) -> list[Path]:
    """Per partition, `rounds_<metric>[_<partition>].png` (mean over sites where defined, one line per
    algorithm) and `sites_<metric>[_<partition>].png` (one panel per site); bands are ± std over seeds.

    x is the number of aggregations the evaluated model has seen: round r's validation metrics belong to
    the model received at round r (r - 1 aggregations), the last point to the final model.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for partition, recs in group_by(records, lambda r: r.partition).items():
        suffix = f"_{partition}" if partition else ""
        labels = group_by(recs, algorithm_label(recs))
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        _finish(ax, _draw(ax, labels, _site_mean(metric)), f"mean over sites{_where(partition)}", metric)
        written.append(_save(fig, out_dir / f"rounds_{metric}{suffix}.png"))
        sites = sorted({s for r in recs for s in r.sites})
        cols = min(3, len(sites))
        rows = math.ceil(len(sites) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
        for k, ax in enumerate(axes.ravel()):
            if k >= len(sites):
                ax.set_visible(False)
                continue
            _finish(ax, _draw(ax, labels, _site_value(metric, sites[k])), sites[k], metric, legend=k == 0)
        written.append(_save(fig, out_dir / f"sites_{metric}{suffix}.png"))
    plt.close("all")
    return written


def _where(partition: str) -> str:
    return f", partition {partition}" if partition else ""


def _finish(ax: Axes, drawn: bool, title: str, metric: str, *, legend: bool = True) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("aggregations completed")
    ax.set_ylabel(f"val {metric}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn and legend:  # an empty legend warns, and pytest turns warnings into errors
        n = len(ax.get_legend_handles_labels()[1])
        # Beside the axes, in columns of at most 20 entries, so a big grid never covers the curves.
        ax.legend(fontsize=6 if n > 10 else 7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  ncol=max(1, -(-n // 20)), frameon=False)
    elif not drawn:
        ax.text(0.5, 0.5, "n/a", ha="center", va="center", transform=ax.transAxes)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight" keeps the outside legend in the image
    return path
