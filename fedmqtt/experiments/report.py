"""`fedmqtt report`: the seeds' tables (mean ± std over seeds per site and on average) and rank-sum tests."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from fedmqtt.errors import ConfigError
from fedmqtt.means import direction_of, mean_defined

GRID_FILE = "grid.json"  # written by run_grid in the grid's out_dir
POINT_FILE = "grid_point.json"  # written by run_grid beside each run's report.json: its labels and config
MEAN = "mean"  # the site-average column
ALPHA = 0.05  # seed 000: rank-sum test at p < 0.05
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

    def test(self, which: Which) -> SiteMetrics | None:
        return self.final_test if which == "final" else self.best_test

    def value(self, which: Which, site: str, metric: str) -> float | None:
        """A site's test value, or for `MEAN` the unweighted mean over the sites where it is defined."""
        test = self.test(which)
        if test is None:
            return None
        if site == MEAN:
            return mean_defined(_clean(test.get(s, {}).get(metric)) for s in self.sites)
        return _clean(test.get(site, {}).get(metric))


def _clean(value: Any) -> float | None:
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
                     best_round=best_round.get("round"), curve=tuple(curve), **labels)


def _selection(config: dict[str, Any]) -> str:
    """How the run chose its sites: "all", "fraction 0.1", "recruited", "recruited, fraction 0.1"."""
    selection, fraction = str(config.get("selection", "all")), config.get("fraction")
    if selection == "all" or fraction is None:
        return selection
    return f"fraction {fraction:g}" if selection == "fraction" else f"{selection}, fraction {fraction:g}"


def _split(entry: dict[str, Any], split: str) -> dict[str, float | None]:
    """A per-site report entry's metrics on `split`; a missing site ({"missing": why}) has none."""
    return {k: _clean(v) for k, v in entry.get("metrics", {}).get(split, {}).items()}


def metric_names(records: Sequence[RunRecord]) -> list[str]:
    """Every test metric any record has (for a helpful error on a mistyped --metric)."""
    return sorted({m for r in records for site in r.final_test.values() for m in site})


def group_by(items: Iterable[T], key: Callable[[T], K]) -> dict[K, list[T]]:
    """Groups in order of first appearance (a grid's order, or the order of the paths given)."""
    out: dict[K, list[T]] = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return out


@dataclass(frozen=True)
class Cell:
    """Mean and sample std (ddof=1; None below 2 values) over the seeds where the value is defined."""

    mean: float | None
    std: float | None
    n: int  # seeds with a defined value
    runs: int  # seeds in the row
    best: bool = False


@dataclass(frozen=True)
class SummaryRow:
    algorithm: str
    norm: str
    cells: dict[str, Cell]


@dataclass(frozen=True)
class SummaryTable:
    """One partition: rows per (algorithm, norm), columns the partition's sites then `MEAN`."""

    metric: str
    which: Which
    partition: str
    columns: tuple[str, ...]
    rows: tuple[SummaryRow, ...]
    show_norm: bool
    missing_best: bool  # which="best" but some report has no best-round test metrics


def make_cell(values: Sequence[float | None]) -> Cell:
    defined = [v for v in values if v is not None]
    mean = statistics.fmean(defined) if defined else None
    std = statistics.stdev(defined) if len(defined) >= 2 else None
    return Cell(mean=mean, std=std, n=len(defined), runs=len(values))


def summary_table(records: Sequence[RunRecord], metric: str, *, which: Which = "final") -> list[SummaryTable]:
    """One table per partition: per (algorithm, norm) and column, mean ± std over seeds of the test metric.

    Site columns hold each seed's value at that site; the `MEAN` column each seed's unweighted mean over the
    sites where the metric is defined, then mean ± std of those over seeds. Undefined values are left out
    (a cell with none is n/a). Per column the best mean is marked (max, or min for loss-type metrics).
    """
    tables = []
    for partition, recs in group_by(records, lambda r: r.partition).items():
        columns = (*sorted({s for r in recs for s in r.sites}), MEAN)
        name = algorithm_label(recs, with_norm=False)
        rows = [SummaryRow(alg, norm, {c: make_cell([r.value(which, c, metric) for r in grp]) for c in columns})
                for (alg, norm), grp in group_by(recs, lambda r: (name(r), r.norm)).items()]
        tables.append(SummaryTable(metric=metric, which=which, partition=partition, columns=columns,
                                   rows=_mark_best(rows, columns, metric), show_norm=len({r.norm for r in recs}) > 1,
                                   missing_best=which == "best" and any(r.best_test is None for r in recs)))
    return tables


def _mark_best(rows: list[SummaryRow], columns: Sequence[str], metric: str) -> tuple[SummaryRow, ...]:
    """Mark the best mean per column (every tied row), where at least two rows differ."""
    pick = max if direction_of(metric) == "max" else min
    best: dict[str, float] = {}
    for col in columns:
        means = [m for r in rows if (m := r.cells[col].mean) is not None]
        if len(set(means)) >= 2:  # one value, or all tied: nothing stands out
            best[col] = pick(means)
    return tuple(replace(r, cells={c: replace(cell, best=c in best and cell.mean == best[c])
                                   for c, cell in r.cells.items()}) for r in rows)


MAX_SITE_COLUMNS = 12  # wider tables are summarised over sites on screen; the per-site table goes to a file


def compact(table: SummaryTable) -> SummaryTable:
    """`table` as it stays readable with many sites: per row the lowest, median and highest of the site
    columns' means, then the MEAN column (best marked again). Unchanged up to MAX_SITE_COLUMNS sites."""
    sites = [c for c in table.columns if c != MEAN]
    if len(sites) <= MAX_SITE_COLUMNS:
        return table
    names = (f"min of {len(sites)} sites", "median site", "max site")
    rows = []
    for row in table.rows:
        means = sorted(m for s in sites if (m := row.cells[s].mean) is not None)
        runs = row.cells[MEAN].runs
        picks = (means[0], statistics.median(means), means[-1]) if means else (None, None, None)
        cells = {name: Cell(mean=v, std=None, n=runs if v is not None else 0, runs=runs) for name, v in zip(names, picks)}
        rows.append(replace(row, cells={**cells, MEAN: replace(row.cells[MEAN], best=False)}))
    columns = (*names, MEAN)
    return replace(table, columns=columns, rows=_mark_best(rows, columns, table.metric))


@dataclass(frozen=True)
class WilcoxonTable:
    """Two-sided rank-sum p-values between every pair of algorithms (of one partition)."""

    metric: str
    which: Which
    partition: str
    names: tuple[str, ...]
    n: dict[str, int]  # sample size per algorithm
    p: dict[tuple[str, str], float | None]  # both orders; None when a sample has fewer than 2 values


def wilcoxon_table(records: Sequence[RunRecord], metric: str, *, which: Which = "final") -> list[WilcoxonTable]:
    """`scipy.stats.ranksums(a, b).pvalue` for every pair of algorithms, per partition.

    The sample of an algorithm (with its norm, "alg/norm", when the partition has several norms) is
    every defined per-site test value of `metric` over its seeds x the partition's sites: one value per
    (seed, site), the site-average is not in it, undefined (None) values are left out. Rank-sum is
    unpaired and uses the normal approximation (seed 000 reports it at p < 0.05). With fewer than two
    values in either sample the p-value is None (scipy would warn and return NaN).
    """
    from scipy.stats import ranksums

    out = []
    for partition, recs in group_by(records, lambda r: r.partition).items():
        groups = group_by(recs, algorithm_label(recs))
        samples = {name: [v for r in grp for s in r.sites if (v := r.value(which, s, metric)) is not None]
                   for name, grp in groups.items()}
        names = tuple(samples)
        p: dict[tuple[str, str], float | None] = {}
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                ok = len(samples[a]) >= 2 and len(samples[b]) >= 2
                p[(a, b)] = p[(b, a)] = float(ranksums(samples[a], samples[b]).pvalue) if ok else None
        out.append(WilcoxonTable(metric=metric, which=which, partition=partition, names=names,
                                 n={k: len(v) for k, v in samples.items()}, p=p))
    return out


def algorithm_label(records: Sequence[RunRecord], *, with_norm: bool = True) -> Callable[[RunRecord], str]:
    """A record's algorithm, as "algorithm/norm" when `records` hold several norms, and with its client
    selection ("fedavg [recruited]") when they hold several selections."""
    norms = with_norm and len({r.norm for r in records}) > 1
    selections = len({r.selection for r in records}) > 1

    def label(r: RunRecord) -> str:
        return r.algorithm + (f"/{r.norm}" if norms else "") + (f" [{r.selection}]" if selections else "")
    return label


def format_cell(cell: Cell) -> str:
    """"0.812 ± 0.013", "0.812" (one seed), "n/a"; "(n=2)" when some seeds are undefined."""
    if cell.mean is None:
        return "n/a"
    text = f"{cell.mean:.3f}" if cell.std is None else f"{cell.mean:.3f} ± {cell.std:.3f}"
    return text + (f" (n={cell.n})" if cell.n < cell.runs else "")


def _summary_rows(table: SummaryTable, mark: Callable[[str], str]) -> list[list[str]]:
    head = ["algorithm", *(["norm"] if table.show_norm else []), "seeds", *table.columns]
    rows = [head]
    for row in table.rows:
        cells = [mark(format_cell(c)) if c.best else format_cell(c) for c in row.cells.values()]
        seeds = str(max(c.runs for c in row.cells.values()))
        rows.append([row.algorithm, *([row.norm] if table.show_norm else []), seeds, *cells])
    return rows


def _p_rows(table: WilcoxonTable) -> list[list[str]]:
    def fmt(a: str, b: str) -> str:
        if a == b:
            return "-"
        p = table.p[(a, b)]
        return "n/a" if p is None else f"{p:.3g}" + ("*" if p < ALPHA else "")

    return [["algorithm", "n", *table.names],
            *([a, str(table.n[a]), *(fmt(a, b) for b in table.names)] for a in table.names)]


def _title(metric: str, which: Which, partition: str) -> str:
    model = "final model" if which == "final" else "best-validation-round model"
    return f"test {metric}, {model}" + (f", partition {partition}" if partition else "")


def _notes(metric: str, tables: Sequence[SummaryTable]) -> list[str]:
    best = "highest" if direction_of(metric) == "max" else "lowest"
    notes = [(f"mean ± sample std (ddof=1) over seeds; {MEAN} = per-run unweighted mean over the sites where "
              f"defined, then over seeds; (n=k): only k seeds defined; best per column marked ({best} mean)."),
             ("rank-sum p: scipy.stats.ranksums, two-sided, samples = per-site test values over seeds x sites; "
              f"* p < {ALPHA}.")]
    if any(t.missing_best for t in tables):
        notes.append("some reports hold no best-round test metrics (report['best']): those runs are n/a.")
    return notes


def render_text(tables: Sequence[SummaryTable], tests: Sequence[WilcoxonTable]) -> str:
    """Plain text: aligned tables, best cells suffixed with "*"."""
    out: list[str] = []
    for table, test in zip(tables, tests):
        out += [_title(table.metric, table.which, table.partition), align(_summary_rows(table, lambda s: s + " *")),
                ""]
        if len(test.names) >= 2:  # one algorithm: nothing to compare
            out += ["rank-sum p-values", align(_p_rows(test)), ""]
    return "\n".join(out + (_notes(tables[0].metric, tables) if tables else []))


def render_markdown(tables: Sequence[SummaryTable], tests: Sequence[WilcoxonTable], *,
                    title: str = "fedmqtt experiment report", plots: Sequence[Path] = ()) -> str:
    """Markdown: one section per partition, best cells in bold, then the plots (paths relative to the file)."""
    md = [f"# {title}", ""]
    for table, test in zip(tables, tests):
        md += [f"## {_title(table.metric, table.which, table.partition)}", "",
               *_md(_summary_rows(table, lambda s: f"**{s}**")), ""]
        if len(test.names) >= 2:
            md += ["Wilcoxon rank-sum p-values:", "", *_md(_p_rows(test)), ""]
    md += [f"- {n}" for n in (_notes(tables[0].metric, tables) if tables else [])]
    md += ["", *(f"![{p.stem}]({p.name})" for p in plots)] if plots else []
    return "\n".join(md).rstrip("\n") + "\n"


def _md(rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
            *("| " + " | ".join(r) + " |" for r in rows[1:])]


def align(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


# --- Recruitment comparisons on one held-out test union (docs/algorithms.md 15) ---------------------------

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
            if site in found and found[site] != spec:
                raise ConfigError(f"site {site}: the runs were configured with different data for it")
            found[site] = spec
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class UnionRow:
    """One run's final model (or the constant baseline) on every site's test split."""

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
    over patients and the per-site mean side by side. Regression runs with a constant-predictor baseline
    in their report add its row (the pooled training mean predicted for every patient)."""
    import numpy as np

    from fedmqtt.metrics import task_metrics
    from fedmqtt.training.holdout import load_test_splits, predict_test_splits

    splits = load_test_splits(sites)
    names = tuple(splits)
    patients = sum(len(s.y) for s in splits.values())

    def score(preds: dict[str, np.ndarray]) -> dict[str, Any]:
        per_site = {s: _clean(task_metrics(splits[s].task, splits[s].y, preds[s])[0].get(metric))
                    for s in names}
        task = splits[names[0]].task
        pooled = task_metrics(task, np.concatenate([splits[s].y for s in names]),
                              np.concatenate([preds[s] for s in names]))[0].get(metric)
        cell = make_cell(list(per_site.values()))
        return {"pooled": _clean(pooled), "site_mean": replace(cell, runs=len(names), std=None),
                "per_site": per_site}

    rows: list[UnionRow] = []
    baseline_level: float | None = None
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
            preds = predict_test_splits(config["model"], weights, splits)
        except (KeyError, ValueError) as exc:
            rows.append(UnionRow(name, trained, None, Cell(None, None, 0, len(names)),
                                 f"not evaluated: {exc}"))
            continue
        rows.append(UnionRow(name, trained, **score(preds)))
        if baseline_level is None and isinstance(report.get("baseline"), dict):
            baseline_level = report["baseline"].get("level")
    if baseline_level is not None:
        constant = {s: np.full(len(splits[s].y), float(baseline_level)) for s in names}
        rows.append(UnionRow("constant (pooled training mean)", "-",
                             note=f"predicts {baseline_level:.4g} for everyone", **score(constant)))
    return UnionTable(metric=metric, sites=names, patients=patients, rows=tuple(rows))


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
    return "\n".join([f"## {_union_title(table)}", "", *_md(_union_rows(table)), "", f"- {UNION_NOTE}", ""])
