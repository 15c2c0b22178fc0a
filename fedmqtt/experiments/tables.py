"""The seeds' tables: mean ± std over seeds per site and on average, the mean's bootstrap interval, the seeds
they rest on, and the paired comparisons (fedmqtt.experiments.paired), as text and Markdown."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fedmqtt.baselines import RANKING_METRICS, RANKING_NOTE
from fedmqtt.experiments.paired import PairedTable, paired_note, paired_rows
from fedmqtt.experiments.runs import (
    BEST_CONSTANT,
    MEAN,
    POOLED_REFERENCE,
    SITE_ALONE,
    RunRecord,
    Which,
    algorithm_label,
    group_by,
    site_seed_matrix,
)
from fedmqtt.experiments.stats import CONFIDENCE, N_RESAMPLES, Interval, mean_interval
from fedmqtt.means import direction_of

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
    seeds: tuple[int, ...] = ()
    interval: Interval | None = None  # bootstrap interval of the MEAN column (fedmqtt.experiments.stats)
    reference: bool = False  # a baseline of the runs' reports, not a method: never marked best, not compared


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
    sites where the metric is defined, then mean ± std of those over seeds, with its bootstrap interval
    (sites resampled, fedmqtt.experiments.stats). Undefined values are left out (a cell with none is n/a).
    Per column the best mean is marked (max, or min for loss-type metrics).
    """
    tables = []
    for partition, recs in group_by(records, lambda r: r.partition).items():
        sites = sorted({s for r in recs for s in r.sites})
        columns = (*sites, MEAN)
        rows = []
        groups = [((alg, norm), grp, False) for (alg, norm), grp in _by_algorithm_and_norm(recs).items()]
        groups += [((label, "-"), grp, True) for label, grp in _reference_runs(recs, metric).items()]
        for (alg, norm), grp, reference in groups:
            seeds = tuple(sorted({r.seed for r in grp}))
            rows.append(SummaryRow(alg, norm, {c: make_cell([r.value(which, c, metric) for r in grp]) for c in columns},
                                   seeds=seeds, reference=reference,
                                   interval=mean_interval(site_seed_matrix(grp, sites, seeds, which, metric))))
        tables.append(SummaryTable(metric=metric, which=which, partition=partition, columns=columns,
                                   rows=_mark_best(rows, columns, metric), show_norm=len({r.norm for r in recs}) > 1,
                                   missing_best=which == "best" and any(r.best_test is None for r in recs)))
    return tables


def _reference_runs(records: Sequence[RunRecord], metric: str) -> dict[str, list[RunRecord]]:
    """Per baseline the runs' reports hold (RunRecord.references), one record per seed (the first run of that
    seed holding it: the data, so the baseline, is the same for every algorithm of a seed) whose test
    metrics are the baseline's; only baselines with a value of `metric` somewhere."""
    out: dict[str, list[RunRecord]] = {}
    for label in dict.fromkeys(k for r in records for k in r.references):
        first = {r.seed: r for r in reversed(records) if label in r.references}
        runs = [replace(first[seed], algorithm=label, norm="-", final_test=first[seed].references[label],
                        best_test=first[seed].references[label]) for seed in sorted(first)]
        if any(r.value("final", s, metric) is not None for r in runs for s in r.sites):
            out[label] = runs
    return out


def _by_algorithm_and_norm(records: Sequence[RunRecord]) -> dict[tuple[str, str], list[RunRecord]]:
    """The rows of one partition's table: the norm has a column of its own, so the label leaves it out."""
    name = algorithm_label(records, with_norm=False)
    return group_by(records, lambda r: (name(r), r.norm))


def _mark_best(rows: list[SummaryRow], columns: Sequence[str], metric: str) -> tuple[SummaryRow, ...]:
    """Mark the best mean per column (every tied row), where at least two rows differ."""
    pick = max if direction_of(metric) == "max" else min
    best: dict[str, float] = {}
    for col in columns:
        means = [m for r in rows if not r.reference and (m := r.cells[col].mean) is not None]
        if len(set(means)) >= 2:  # one value, or all tied: nothing stands out
            best[col] = pick(means)
    return tuple(replace(r, cells={c: replace(cell, best=not r.reference and c in best and cell.mean == best[c])
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


def format_cell(cell: Cell) -> str:
    """"0.812 ± 0.013", "0.812" (one seed), "n/a"; "(n=2)" when some seeds are undefined."""
    if cell.mean is None:
        return "n/a"
    text = f"{cell.mean:.3f}" if cell.std is None else f"{cell.mean:.3f} ± {cell.std:.3f}"
    return text + (f" (n={cell.n})" if cell.n < cell.runs else "")


def _summary_rows(table: SummaryTable, mark: Callable[[str], str]) -> list[list[str]]:
    head = ["algorithm", *(["norm"] if table.show_norm else []), "seeds", *table.columns,
            f"{MEAN} {CONFIDENCE:.0%} CI"]
    rows = [head]
    for row in table.rows:
        cells = [mark(format_cell(c)) if c.best else format_cell(c) for c in row.cells.values()]
        seeds = str(max(c.runs for c in row.cells.values()))
        interval = "n/a" if row.interval is None else f"[{row.interval[0]:.3f}, {row.interval[1]:.3f}]"
        label = f"({row.algorithm})" if row.reference else row.algorithm
        rows.append([label, *([row.norm] if table.show_norm else []), seeds, *cells, interval])
    return rows


def seeds_line(table: SummaryTable) -> str:
    """Which seeds the table rests on; with one seed, that no interval spans seeds."""
    seeds = sorted({s for row in table.rows for s in row.seeds})
    fewer = [f"{row.algorithm}{f'/{row.norm}' if table.show_norm else ''}: {', '.join(map(str, row.seeds))}"
             for row in table.rows if list(row.seeds) != seeds]
    also = f" ({'; '.join(fewer)})" if fewer else ""
    if len(seeds) == 1:
        return (f"one seed ({seeds[0]}){also}: no confidence interval across seeds; intervals resample sites "
                "only")
    return f"seeds: {', '.join(map(str, seeds))}{also}; intervals resample sites, not seeds"


def _title(metric: str, which: Which, partition: str) -> str:
    model = "final model" if which == "final" else "best-validation-round model"
    return f"test {metric}, {model}" + (f", partition {partition}" if partition else "")


def _notes(metric: str, tables: Sequence[SummaryTable]) -> list[str]:
    best = "highest" if direction_of(metric) == "max" else "lowest"
    notes = [(f"mean ± sample std (ddof=1) over seeds; {MEAN} = per-run unweighted mean over the sites where "
              f"defined, then over seeds; (n=k): only k seeds defined; best per column marked ({best} mean)."),
             (f"{MEAN} {CONFIDENCE:.0%} CI: percentile bootstrap (scipy.stats.bootstrap, {N_RESAMPLES} "
              "resamples, seeded) of the mean column, resampling sites with replacement and using each draw "
              "in every seed (a site's values in different seeds are not independent); n/a below two sites."),
             paired_note(metric)]
    if any(r.reference for t in tables for r in t.rows):
        notes.append("rows in parentheses are references from the runs' reports (one run per seed), never marked "
                     "best nor compared: "
                     f"{BEST_CONSTANT} = the constant optimal for {metric}, {POOLED_REFERENCE} = a linear model, "
                     f"both fitted on the pooled training rows; {SITE_ALONE} = each site's own training constant "
                     "(docs/algorithms.md 17.6).")
    if metric in RANKING_METRICS:
        notes.append(f"{RANKING_NOTE}.")
    if any(t.missing_best for t in tables):
        notes.append("some reports hold no best-round test metrics (report['best']): those runs are n/a.")
    return notes


def comparisons_heading(test: PairedTable) -> str:
    """Which family of pairs the table compares, and over how many comparisons Holm's correction ran."""
    return f"{test.family}, Holm over {len(test.comparisons)}"


def render_text(tables: Sequence[SummaryTable], tests: Sequence[PairedTable]) -> str:
    """Plain text: aligned tables, best cells suffixed with "*", the seeds, then the paired comparisons."""
    out: list[str] = []
    for table, test in zip(tables, tests, strict=True):
        out += [_title(table.metric, table.which, table.partition), seeds_line(table),
                align(_summary_rows(table, lambda s: s + " *")), ""]
        if test.comparisons:  # one algorithm: nothing to compare
            out += [f"paired comparisons: {comparisons_heading(test)}", align(paired_rows(test)), ""]
    return "\n".join(out + (_notes(tables[0].metric, tables) if tables else []))


def render_markdown(tables: Sequence[SummaryTable], tests: Sequence[PairedTable], *,
                    title: str = "fedmqtt experiment report", plots: Sequence[Path] = ()) -> str:
    """Markdown: one section per partition, best cells in bold, then the plots (paths relative to the file)."""
    md = [f"# {title}", ""]
    for table, test in zip(tables, tests, strict=True):
        md += [f"## {_title(table.metric, table.which, table.partition)}", "", f"{seeds_line(table)}.", "",
               *markdown_rows(_summary_rows(table, lambda s: f"**{s}**")), ""]
        if test.comparisons:
            md += [f"Paired comparisons: {comparisons_heading(test)}.", "", *markdown_rows(paired_rows(test)), ""]
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
