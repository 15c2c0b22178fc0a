"""The seeds' tables: mean ± std over seeds per site and on average, rank-sum p-values, as text and Markdown."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fedmqtt.experiments.runs import MEAN, RunRecord, Which, algorithm_label, group_by
from fedmqtt.means import direction_of

ALPHA = 0.05  # seed 000: rank-sum test at p < 0.05
MAX_SITE_COLUMNS = 12  # wider tables are summarised over sites on screen; the per-site table goes to a file


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
        rows = [SummaryRow(alg, norm, {c: make_cell([r.value(which, c, metric) for r in grp]) for c in columns})
                for (alg, norm), grp in _by_algorithm_and_norm(recs).items()]
        tables.append(SummaryTable(metric=metric, which=which, partition=partition, columns=columns,
                                   rows=_mark_best(rows, columns, metric), show_norm=len({r.norm for r in recs}) > 1,
                                   missing_best=which == "best" and any(r.best_test is None for r in recs)))
    return tables


def _by_algorithm_and_norm(records: Sequence[RunRecord]) -> dict[tuple[str, str], list[RunRecord]]:
    """The rows of one partition's table: the norm has a column of its own, so the label leaves it out."""
    name = algorithm_label(records, with_norm=False)
    return group_by(records, lambda r: (name(r), r.norm))


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
        cells = {name: Cell(mean=v, std=None, n=runs if v is not None else 0, runs=runs)
                 for name, v in zip(names, picks, strict=True)}
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
    for table, test in zip(tables, tests, strict=True):
        out += [_title(table.metric, table.which, table.partition), align(_summary_rows(table, lambda s: s + " *")),
                ""]
        if len(test.names) >= 2:  # one algorithm: nothing to compare
            out += ["rank-sum p-values", align(_p_rows(test)), ""]
    return "\n".join(out + (_notes(tables[0].metric, tables) if tables else []))


def render_markdown(tables: Sequence[SummaryTable], tests: Sequence[WilcoxonTable], *,
                    title: str = "fedmqtt experiment report", plots: Sequence[Path] = ()) -> str:
    """Markdown: one section per partition, best cells in bold, then the plots (paths relative to the file)."""
    md = [f"# {title}", ""]
    for table, test in zip(tables, tests, strict=True):
        md += [f"## {_title(table.metric, table.which, table.partition)}", "",
               *markdown_rows(_summary_rows(table, lambda s: f"**{s}**")), ""]
        if len(test.names) >= 2:
            md += ["Wilcoxon rank-sum p-values:", "", *markdown_rows(_p_rows(test)), ""]
    md += [f"- {n}" for n in (_notes(tables[0].metric, tables) if tables else [])]
    md += ["", *(f"![{p.stem}]({p.name})" for p in plots)] if plots else []
    return "\n".join(md).rstrip("\n") + "\n"


def markdown_rows(rows: list[list[str]]) -> list[str]:
    """A header row and body rows as the lines of a Markdown table."""
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
            *("| " + " | ".join(r) + " |" for r in rows[1:])]


def align(rows: list[list[str]]) -> str:
    """A header row and body rows as plain text: columns padded to their widest cell, a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
