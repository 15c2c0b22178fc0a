"""Recruitment comparisons on one held-out test union (docs/algorithms.md 15): every run's final model scored
on every site's test split, trained on or not, so that runs on a subset of the sites compare with the others."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedmqtt.baselines import RANKING_METRICS, Constant
from fedmqtt.data.base import TaskInfo
from fedmqtt.errors import ConfigError, DataError
from fedmqtt.experiments.runs import POINT_FILE, RunRecord, finite_or_none
from fedmqtt.experiments.tables import Cell, align, make_cell, markdown_rows

FINAL_MODEL = "final_model.safetensors"  # written by the PS (ps_daemon.runner) in the run folder


def trained_on_subset(run_dir: Path) -> bool:
    """The run trained on recruited sites only, or some site has no final metrics: its own per-site test
    table then covers fewer sites than an all-sites run's, so their means are not comparable."""
    report = json.loads((run_dir / "report.json").read_text())
    missing = any("missing" in e for e in report["final"]["per_site"].values())
    return bool(report.get("recruitment")) or missing


def held_out_sites(records: Sequence[RunRecord], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every site's data spec (fedmqtt.data.spec.DataSpec) the runs were configured with: from each
    run's grid_point.json (a grid), its report's `site_data` (a simulation or central run), or a report
    config that carries the sites' data,
    plus `extra` (a simulation config's sites, `fedmqtt report --test-sites`).

    Raises:
        ConfigError: two runs describe the same site with different data.
    """
    from fedmqtt.data.spec import DataSpec

    found: dict[str, Any] = {}
    sources = [dict(extra or {})]
    for rec in records:
        for path, pick in ((rec.path / POINT_FILE, lambda d: d.get("config", {}).get("sites")),
                           (rec.path / "report.json", lambda d: d.get("site_data")),  # a simulation's
                           (rec.path / "report.json", lambda d: d.get("config", {}).get("sites"))):
            sites = pick(json.loads(path.read_text())) if path.is_file() else None
            if isinstance(sites, dict):  # a PS config's `sites` is a list of names: no data there
                sources.append(sites)
                break
    for sites in sources:
        for site, raw in sites.items():
            spec = raw if isinstance(raw, DataSpec) else DataSpec.model_validate(raw)
            if site in found and not same_site_data(site, found[site], spec):
                raise ConfigError(f"site {site}: the runs were configured with different data for it")
            found.setdefault(site, spec)
    return dict(sorted(found.items()))


def run_test_splits(run: Path, sites: dict[str, Any], splits: dict[str, Any],
                    cache: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The test splits as `run`'s sites read them: standardised with the federation's statistics where the run
    used them (its feature_statistics.json, fedmqtt.federation_stats), else `splits` (each site's own).
    `cache` keeps the splits per statistics (the file's values, not its message id or time), so runs of one
    federation share them."""
    from fedmqtt.data.spec import DataSpec
    from fedmqtt.federation_stats import STATISTICS_FILE
    from fedmqtt.training.holdout import load_test_splits

    path = run / STATISTICS_FILE
    if not path.is_file():
        return splits
    doc = json.loads(path.read_text())  # read_statistics checks it fully when the splits are loaded
    key = json.dumps({k: doc.get(k) for k in ("columns", "low", "high", "fill", "mean", "std")})
    if key not in cache:
        cache[key] = load_test_splits({site: DataSpec.model_validate(spec).model_copy(update={"statistics": path})
                                       for site, spec in sites.items()})
    return cache[key]


def same_site_data(site: str, a: Any, b: Any) -> bool:
    """Whether two DataSpecs give `site` the same items: equal, or differing only in the partition manifest
    when both manifests come from the same pooled data and give the site the same items and labels (a
    grid writes one manifest per seed, so every seed of a natural split has its own identical copy)."""
    from fedmqtt.data.partitioners import read_partition_manifest

    if a == b:
        return True
    if a.partition is None or b.partition is None or a.model_copy(update={"partition": b.partition}) != b:
        return False
    first, second = read_partition_manifest(a.partition), read_partition_manifest(b.partition)
    try:
        one, other = first.site_part(site), second.site_part(site)
    except DataError:
        return False
    return first.source == second.source and (one.indices, one.annotated) == (other.indices, other.annotated)


@dataclass(frozen=True)
class UnionRow:
    """One run's final model (or a metric-optimal constant) on every site's test split."""

    label: str
    trained_on: str  # "6 of 6", "2 of 6 (recruited)"
    pooled: float | None  # the metric over all test patients at once
    site_mean: Cell  # unweighted mean over the sites where the metric is defined (n = such sites)
    note: str = ""
    per_site: dict[str, float | None] | None = None  # None: not evaluated


@dataclass(frozen=True)
class UnionTable:
    metric: str
    sites: tuple[str, ...]
    patients: int
    rows: tuple[UnionRow, ...]


def union_table(records: Sequence[RunRecord], metric: str, sites: dict[str, Any]) -> UnionTable:
    """Each run's final model on the union of `sites`' test splits, recruited or not: the metric pooled
    over patients and the per-site mean side by side. Then a row per metric-optimal constant of the first
    report that has them (`report_constants`), predicted for every patient."""
    import numpy as np

    from fedmqtt.metrics import task_metrics
    from fedmqtt.training.holdout import load_test_splits, predict_test_splits

    splits = load_test_splits(sites)
    names = tuple(splits)
    patients = sum(len(s.y) for s in splits.values())
    federated: dict[str, dict[str, Any]] = {}  # per federation statistics file: the test splits read with it

    def score(preds: dict[str, np.ndarray]) -> dict[str, Any]:
        per_site = {s: finite_or_none(task_metrics(splits[s].task, splits[s].y, preds[s])[0].get(metric))
                    for s in names}
        task = splits[names[0]].task
        pooled = task_metrics(task, np.concatenate([splits[s].y for s in names]),
                              np.concatenate([preds[s] for s in names]))[0].get(metric)
        cell = make_cell(list(per_site.values()))
        return {"pooled": finite_or_none(pooled), "site_mean": replace(cell, runs=len(names), std=None),
                "per_site": per_site}

    rows: list[UnionRow] = []
    constants: list[UnionConstant] = []
    for rec in records:
        report = json.loads((rec.path / "report.json").read_text())
        config = report.get("config", {})
        trained = _trained_on(report, len(names))
        name = (rec.path.parent if rec.path.name == "ps" else rec.path).name  # the run folder, as named
        weights = rec.path / FINAL_MODEL
        if not weights.is_file():
            rows.append(UnionRow(name, trained, None, Cell(None, None, 0, len(names)), f"no {FINAL_MODEL}"))
            continue
        try:
            preds = predict_test_splits(config["model"], weights, run_test_splits(rec.path, sites, splits, federated))
        except (KeyError, ValueError) as exc:
            rows.append(UnionRow(name, trained, None, Cell(None, None, 0, len(names)),
                                 f"not evaluated: {exc}"))
            continue
        rows.append(UnionRow(name, trained, **score(preds)))
        constants = constants or report_constants(report, splits[names[0]].task)
    for c in constants:
        note = c.constant.describe() + ("; any constant scores 0.5 here" if metric in RANKING_METRICS else "")
        rows.append(UnionRow(c.label, "-", note=note,
                             **score({s: c.constant.predict(len(splits[s].y)) for s in names})))
    return UnionTable(metric=metric, sites=names, patients=patients, rows=tuple(rows))


@dataclass(frozen=True)
class UnionConstant:
    label: str
    constant: Constant


def report_constants(report: dict[str, Any], task: TaskInfo) -> list[UnionConstant]:
    """The metric-optimal constants a simulation's report holds (`baselines`, fitted on the pooled training
    rows), or for an older regression report its single `baseline` (the pooled training mean)."""
    import numpy as np

    section = report.get("baselines")
    if isinstance(section, dict) and section.get("constants"):
        return [UnionConstant(f"constant for {c['name']}", Constant(tuple(c["metrics"]), c["name"], c["formula"],
                                                                    np.asarray(c["value"]), task.kind))
                for c in section["constants"]]
    old = report.get("baseline")
    if isinstance(old, dict) and old.get("level") is not None:
        mean = Constant(("mse",), "MSE", "the pooled training mean", np.asarray(float(old["level"])), task.kind)
        return [UnionConstant("constant (pooled training mean)", mean)]
    return []


def _trained_on(report: dict[str, Any], n_sites: int) -> str:
    recruitment = report.get("recruitment") or {}
    config = report.get("config", {})
    fraction = config.get("fraction")
    per_round = f", {fraction:g} of them per round" if fraction is not None else ""
    if recruitment.get("recruited") is not None:
        return f"{len(recruitment['recruited'])} of {n_sites} (recruited){per_round}"
    return f"{len(report['final']['per_site'])} of {n_sites}{per_round}"


def _union_rows(table: UnionTable) -> list[list[str]]:
    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    head = ["run", "trained on", f"pooled {table.metric}", f"per-site mean {table.metric}", "sites defined",
            "note"]
    return [head, *([r.label, r.trained_on, fmt(r.pooled), fmt(r.site_mean.mean),
                     f"{r.site_mean.n} of {len(table.sites)}", r.note] for r in table.rows)]


def _union_title(table: UnionTable) -> str:
    return (f"test {table.metric} on one held-out union: every site's test split ({len(table.sites)} sites, "
            f"{table.patients} patients), trained on or not")


UNION_NOTE = ("pooled = the metric over every test patient at once (each site weighs by its test size); "
              "per-site mean = unweighted mean of each site's value. Each run's shared final model "
              f"({FINAL_MODEL}); site-local layers of personalised algorithms stay at the sites, not in it.")


def render_union_text(table: UnionTable) -> str:
    return "\n".join([_union_title(table), align(_union_rows(table)), UNION_NOTE])


def render_union_markdown(table: UnionTable) -> str:
    return "\n".join([f"## {_union_title(table)}", "", *markdown_rows(_union_rows(table)), "", f"- {UNION_NOTE}", ""])
