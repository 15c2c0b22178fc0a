"""Finished runs as records: read from run folders, grid folders or folders of runs, and grouped for tables."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fedmqtt.errors import ConfigError
from fedmqtt.means import mean_defined

if TYPE_CHECKING:
    import numpy as np

GRID_FILE = "grid.json"  # written by run_grid in the grid's out_dir
POINT_FILE = "grid_point.json"  # written by run_grid beside each run's report.json: its labels and config
MEAN = "mean"  # the site-average column
Which = Literal["final", "best"]
SiteMetrics = dict[str, dict[str, float | None]]  # site -> metric -> value (None: undefined)
K = TypeVar("K")
T = TypeVar("T")


@dataclass(frozen=True)
class RunRecord:
    """One run: its labels and metrics.

    `final_test`: test metrics of the final model. `best_test`: test metrics of the best-validation-round
    model (docs/algorithms.md 17.1), read from `report["best"]["per_site"]` (the layout of `final.per_site`)
    when the report has it, else None. `curve`: (aggregations completed, site -> validation metrics),
    from `rounds[r].per_site` (the model received at round r has seen r - 1) and the final evaluation.
    `references`: the baselines of a simulated run's report (`references`).
    """

    path: Path
    algorithm: str
    norm: str
    seed: int
    partition: str
    sites: tuple[str, ...]
    final_test: SiteMetrics
    best_test: SiteMetrics | None
    best_round: int | None
    curve: tuple[tuple[int, SiteMetrics], ...]
    selection: str = "all"  # all | fraction | recruited: a recruited run is not another seed of an all-sites run
    # The report's baselines as per-site test metrics (`references`): the tables' reference rows.
    references: dict[str, SiteMetrics] = field(default_factory=dict)

    def test(self, which: Which) -> SiteMetrics | None:
        return self.final_test if which == "final" else self.best_test

    def value(self, which: Which, site: str, metric: str) -> float | None:
        """A site's test value, or for `MEAN` the unweighted mean over the sites where it is defined."""
        test = self.test(which)
        if test is None:
            return None
        if site == MEAN:
            return mean_defined(finite_or_none(test.get(s, {}).get(metric)) for s in self.sites)
        return finite_or_none(test.get(site, {}).get(metric))


def finite_or_none(value: Any) -> float | None:
    """A metric as a float, or None where the report holds no number (missing, null, NaN, infinite)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def load_runs(paths: Iterable[Path]) -> list[RunRecord]:
    """Records of run folders (with report.json, or ps/report.json as `fedmqtt demo` keeps it), grid
    folders (grid.json: its finished points, in grid order) or folders of run folders.

    Raises:
        ConfigError: a path holds no run.
    """
    dirs: list[Path] = []
    for path in map(Path, paths):
        found = _run_dirs(path)
        if not found:
            raise ConfigError(f"{path}: no report.json, grid.json or run folders with a report.json")
        dirs += [d for d in found if d not in dirs]
    return [load_run(d) for d in dirs]


def _run_dirs(path: Path) -> list[Path]:
    if path.is_file() and path.name == "report.json":
        return [path.parent]
    for run in (path, path / "ps"):
        if (run / "report.json").is_file():
            return [run]
    if (path / GRID_FILE).is_file():
        points = json.loads((path / GRID_FILE).read_text())["points"]
        return [path / p["run"] for p in points if (path / p["run"] / "report.json").is_file()]
    if path.is_dir():
        return sorted(d for d in path.iterdir() if (d / "report.json").is_file())
    return []


def load_run(run_dir: Path) -> RunRecord:
    """One run folder; labels from grid_point.json, else from the report (partition unknown: "")."""
    report = json.loads((run_dir / "report.json").read_text())
    config = report.get("config", {})
    norm = config.get("model", {}).get("args", {}).get("norm", "none")
    labels: dict[str, Any] = {"algorithm": report.get("algorithm", "?"), "norm": str(norm),
                              "seed": int(config.get("seed", 0)), "partition": "",
                              "selection": _selection(config)}
    if (run_dir / POINT_FILE).is_file():
        point = json.loads((run_dir / POINT_FILE).read_text())
        labels.update({k: point[k] for k in labels if k in point})
    per_site = report["final"]["per_site"]
    sites = tuple(sorted(per_site))
    best = next((report[k]["per_site"] for k in ("best", "best_round")
                 if isinstance(report.get(k), dict) and isinstance(report[k].get("per_site"), dict)), None)
    last = max((int(r["round"]) for r in report.get("rounds", [])), default=0)
    curve = [(int(r["round"]) - 1, {s: dict(m) for s, m in r["per_site"].items()}) for r in report.get("rounds", [])]
    curve.append((last, {s: _split(per_site[s], "val") for s in sites}))
    best_round = report.get("best_round") or {}
    return RunRecord(path=run_dir, sites=sites, final_test={s: _split(per_site[s], "test") for s in sites},
                     best_test=None if best is None else {s: _split(best.get(s, {}), "test") for s in sites},
                     best_round=best_round.get("round"), curve=tuple(curve), references=references(report),
                     **labels)


BEST_CONSTANT = "best constant"
POOLED_REFERENCE = "pooled reference"
SITE_ALONE = "site alone"
OLD_CONSTANT = "constant (pooled training mean)"  # the single `baseline` of older regression reports


def references(report: dict[str, Any]) -> dict[str, SiteMetrics]:
    """Per-site test metrics of the baselines a simulated run's report holds (fedmqtt.baseline_report):
    BEST_CONSTANT (per metric the constant optimal for it, so one row serves any metric), POOLED_REFERENCE
    when fitted, SITE_ALONE; an older regression report's single `baseline` as OLD_CONSTANT."""
    section = report.get("baselines")
    if not isinstance(section, dict):
        old = report.get("baseline")
        if isinstance(old, dict) and isinstance(old.get("per_site"), dict):
            return {OLD_CONSTANT: {s: _split(e, "test") for s, e in old["per_site"].items()}}
        return {}
    out: dict[str, SiteMetrics] = {}
    best: SiteMetrics = {}
    for constant in section.get("constants", []):
        for site, entry in constant.get("per_site", {}).items():
            test = _split(entry, "test")
            best.setdefault(site, {}).update({m: test.get(m) for m in constant.get("metrics", [])})
    if best:
        out[BEST_CONSTANT] = best
    reference = section.get("pooled_reference") or {}
    if reference.get("fitted"):
        out[POOLED_REFERENCE] = {s: _split(e, "test") for s, e in reference.get("per_site", {}).items()}
    if isinstance(section.get("site_alone"), dict):
        out[SITE_ALONE] = {s: _split(e, "test") for s, e in section["site_alone"].get("per_site", {}).items()}
    return out


def _selection(config: dict[str, Any]) -> str:
    """How the run chose its sites: "all", "fraction 0.1", "recruited", "recruited, fraction 0.1"."""
    selection, fraction = str(config.get("selection", "all")), config.get("fraction")
    if selection == "all" or fraction is None:
        return selection
    return f"fraction {fraction:g}" if selection == "fraction" else f"{selection}, fraction {fraction:g}"


def _split(entry: dict[str, Any], split: str) -> dict[str, float | None]:
    """A per-site report entry's metrics on `split`; a missing site ({"missing": why}) has none."""
    return {k: finite_or_none(v) for k, v in entry.get("metrics", {}).get(split, {}).items()}


def metric_names(records: Sequence[RunRecord]) -> list[str]:
    """Every test metric any record has (for a helpful error on a mistyped --metric)."""
    return sorted({m for r in records for site in r.final_test.values() for m in site})


def group_by(items: Iterable[T], key: Callable[[T], K]) -> dict[K, list[T]]:
    """Groups in order of first appearance (a grid's order, or the order of the paths given)."""
    out: dict[K, list[T]] = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return out


def site_seed_matrix(records: Sequence[RunRecord], sites: Sequence[str], seeds: Sequence[int], which: Which,
                     metric: str) -> np.ndarray:
    """A method's test values as a sites x seeds matrix (NaN where undefined or not run); two runs of one
    seed (the same run listed twice, say) are averaged."""
    import numpy as np

    out = np.full((len(sites), len(seeds)), np.nan)
    for j, seed in enumerate(seeds):
        runs = [r for r in records if r.seed == seed]
        for i, site in enumerate(sites):
            values = [v for r in runs if (v := r.value(which, site, metric)) is not None]
            if values:
                out[i, j] = sum(values) / len(values)
    return out


def algorithm_label(records: Sequence[RunRecord], *, with_norm: bool = True) -> Callable[[RunRecord], str]:
    """A record's algorithm, as "algorithm/norm" when `records` hold several norms, and with its client
    selection ("fedavg [recruited]") when they hold several selections."""
    norms = with_norm and len({r.norm for r in records}) > 1
    selections = len({r.selection for r in records}) > 1

    def label(r: RunRecord) -> str:
        return r.algorithm + (f"/{r.norm}" if norms else "") + (f" [{r.selection}]" if selections else "")
    return label
