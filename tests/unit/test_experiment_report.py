"""`fedmqtt report` on synthetic report.json files: seeds' tables, paired comparisons, n/a, plots."""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import wilcoxon
from typer.testing import CliRunner

from fedmqtt.cli import app
from fedmqtt.experiments.paired import paired_table
from fedmqtt.experiments.plots import plot_curves
from fedmqtt.experiments.runs import MEAN, load_runs
from fedmqtt.experiments.tables import format_cell, render_markdown, render_text, summary_table

PNG = b"\x89PNG\r\n\x1a\n"
Values = dict[str, float | None]  # site -> value of one metric


def write_run(root: Path, algorithm: str, seed: int, test: Values, *, metric: str = "auroc",
              norm: str = "none", partition: str = "natural", best: Values | None = None,
              labels: bool = True) -> Path:
    """A run folder as `fedmqtt grid` leaves it: report.json (PS layout) and grid_point.json."""
    run = root / f"{algorithm}-{norm}-s{seed}-{partition}"
    run.mkdir(parents=True)
    rounds = [{"round": r, "per_site": {s: {metric: None if v is None else v - 0.1 * (2 - r)}
                                        for s, v in test.items()}} for r in (1, 2)]

    def per_site(values: Values) -> dict[str, Any]:
        return {s: {"metrics": {"val": {metric: v}, "test": {metric: v}}, "n_samples": {"test": 10},
                    "undefined": {}} for s, v in values.items()}

    report: dict[str, Any] = {
        "algorithm": algorithm, "config": {"seed": seed, "model": {"args": {"norm": norm}}},
        "rounds": rounds, "final": {"per_site": per_site(test)}, "best_round": {"round": 2},
    }
    if best is not None:
        report["best"] = {"round": 2, "per_site": per_site(best)}
    (run / "report.json").write_text(json.dumps(report))
    if labels:
        point = {"run": run.name, "algorithm": algorithm, "norm": norm, "seed": seed, "partition": partition}
        (run / "grid_point.json").write_text(json.dumps(point))
    return run


A = {0: {"a": 0.80, "b": 0.70}, 1: {"a": 0.84, "b": 0.66}, 2: {"a": 0.82, "b": 0.71}}
B = {0: {"a": 0.60, "b": 0.75}, 1: {"a": 0.64, "b": 0.79}, 2: {"a": 0.58, "b": 0.77}}


def two_algorithms(tmp_path: Path, metric: str = "auroc") -> list[Path]:
    runs = [write_run(tmp_path, "fedavg", s, v, metric=metric) for s, v in A.items()]
    return runs + [write_run(tmp_path, "fedprox", s, v, metric=metric) for s, v in B.items()]


def test_table_mean_std_and_best_per_column(tmp_path: Path) -> None:
    """Mean and sample std over seeds per site and of the per-run site-average; the max is marked."""
    # Prepare
    records = load_runs(two_algorithms(tmp_path))
    # Execute
    (table,) = summary_table(records, "auroc")
    # Assert
    assert table.columns == ("a", "b", MEAN) and table.partition == "natural"
    fedavg, fedprox = table.rows
    for row, runs in ((fedavg, A), (fedprox, B)):
        for site in ("a", "b"):
            values = [runs[s][site] for s in runs]
            assert row.cells[site].mean == pytest.approx(statistics.fmean(values))
            assert row.cells[site].std == pytest.approx(statistics.stdev(values))
        averages = [statistics.fmean(runs[s].values()) for s in runs]
        assert row.cells[MEAN].mean == pytest.approx(statistics.fmean(averages))
        assert row.cells[MEAN].std == pytest.approx(statistics.stdev(averages))
    assert fedavg.cells["a"].best and not fedprox.cells["a"].best
    assert fedprox.cells["b"].best and not fedavg.cells["b"].best
    assert fedavg.cells[MEAN].best  # 0.755 vs 0.688


def test_loss_metric_marks_the_minimum(tmp_path: Path) -> None:
    """For loss-type metrics (direction_of = min) the lowest mean is the best."""
    # Prepare
    records = load_runs(two_algorithms(tmp_path, metric="loss"))
    # Execute
    (table,) = summary_table(records, "loss")
    # Assert
    fedavg, fedprox = table.rows
    assert fedprox.cells["a"].best and not fedavg.cells["a"].best
    assert fedavg.cells["b"].best and fedprox.cells[MEAN].best


def test_undefined_values_left_out_and_shown_as_na(tmp_path: Path) -> None:
    """A None is left out of means and counts; a cell with no value reads n/a, and ties mark nothing."""
    # Prepare
    runs = [write_run(tmp_path, "fedavg", 0, {"a": 0.8, "b": None}),
            write_run(tmp_path, "fedavg", 1, {"a": None, "b": None}),
            write_run(tmp_path, "fedavg", 2, {"a": 0.6, "b": None})]
    # Execute
    (table,) = summary_table(load_runs(runs), "auroc")
    text = render_text([table], paired_table(load_runs(runs), "auroc"))
    # Assert
    cells = table.rows[0].cells
    assert (cells["a"].mean, cells["a"].n, cells["a"].runs) == (pytest.approx(0.7), 2, 3)
    assert cells["b"].mean is None and format_cell(cells["b"]) == "n/a"
    assert cells[MEAN].n == 2 and cells[MEAN].mean == pytest.approx(0.7)  # run 1 has no defined site
    assert format_cell(cells["a"]) == "0.700 ± 0.141 (n=2)"
    assert "n/a" in text and not any(c.best for c in cells.values())


def test_paired_p_values_equal_scipy_wilcoxon_on_site_seed_pairs(tmp_path: Path) -> None:
    """Two methods are paired by (site, seed) where both are defined; p = scipy.stats.wilcoxon of the
    differences, then Holm over the table's three comparisons. (Until issue "results are claims" this was an
    unpaired rank-sum over pooled sites and seeds.)"""
    # Prepare
    runs = two_algorithms(tmp_path)
    runs.append(write_run(tmp_path, "base", 0, {"a": None, "b": 0.5}))
    # Execute
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one pair with "base": no scipy warning either
        (test,) = paired_table(load_runs(runs), "auroc")
    # Assert
    assert test.names == ("fedavg", "fedprox", "base")
    first, with_base, _ = test.comparisons
    diffs = [A[seed][site] - B[seed][site] for seed in A for site in ("a", "b")]
    assert (first.a, first.b, first.result.n) == ("fedavg", "fedprox", 6)
    assert first.result.p == pytest.approx(float(wilcoxon(diffs).pvalue))
    assert first.result.median == pytest.approx(statistics.median(diffs))
    assert first.p_holm == pytest.approx(min(1.0, 3 * first.result.p))  # the smallest of three p-values
    assert with_base.result.n == 1 and with_base.result.median == pytest.approx(A[0]["b"] - 0.5)


def test_render_marks_best_bold_in_markdown_and_star_in_text(tmp_path: Path) -> None:
    """Markdown shows the best cell in bold, text with " *"; p < 0.05 carries "*"."""
    # Prepare
    records = load_runs(two_algorithms(tmp_path))
    tables, tests = summary_table(records, "auroc"), paired_table(records, "auroc")
    # Execute
    md = render_markdown(tables, tests, plots=[tmp_path / "rounds_auroc.png"])
    text = render_text(tables, tests)
    # Assert
    assert "**0.820 ± 0.020**" in md and "| fedavg | 3 |" in md
    assert "0.820 ± 0.020 *" in text
    assert "![rounds_auroc](rounds_auroc.png)" in md
    assert "test auroc, final model, partition natural" in text


def test_best_round_metrics_when_the_report_has_them(tmp_path: Path) -> None:
    """--which best reads report["best"]["per_site"]; runs without it are n/a and a note says why."""
    # Prepare
    runs = [write_run(tmp_path, "fedavg", 0, {"a": 0.5}, best={"a": 0.9}),
            write_run(tmp_path, "fedprox", 0, {"a": 0.6})]
    # Execute
    (table,) = summary_table(load_runs(runs), "auroc", which="best")
    # Assert
    assert table.rows[0].cells["a"].mean == pytest.approx(0.9)
    assert table.rows[1].cells["a"].mean is None and table.missing_best
    assert "no best-round test metrics" in render_text([table], paired_table(load_runs(runs), "auroc"))


def test_load_runs_from_grid_dir_and_plain_run_dirs(tmp_path: Path) -> None:
    """A grid folder lists its runs in grid order; a run without grid_point.json is labelled from its report."""
    # Prepare
    grid = tmp_path / "grid"
    runs = two_algorithms(grid)
    points = [{"run": r.name} for r in reversed(runs)]
    (grid / "grid.json").write_text(json.dumps({"points": points}))
    plain = write_run(tmp_path / "other", "scaffold", 7, {"x": 0.5}, norm="bn", labels=False)
    # Execute
    from_grid = load_runs([grid])
    from_plain = load_runs([plain / "report.json"])
    # Assert
    assert [r.path for r in from_grid] == list(reversed(runs))
    (rec,) = from_plain
    assert (rec.algorithm, rec.norm, rec.seed, rec.partition) == ("scaffold", "bn", 7, "")
    assert [x for x, _ in rec.curve] == [0, 1, 2]  # rounds 1-2 (0 and 1 aggregations), then the final model


def test_plots_written_as_png(tmp_path: Path) -> None:
    """Mean-over-sites and per-site curves, one PNG each per partition, even with undefined values."""
    # Prepare
    runs = two_algorithms(tmp_path / "runs")
    runs.append(write_run(tmp_path / "runs", "base", 0, {"a": None, "b": None}, partition="skew"))
    # Execute
    paths = plot_curves(load_runs(runs), "auroc", tmp_path / "out")
    # Assert
    assert [p.name for p in paths] == ["rounds_auroc_natural.png", "sites_auroc_natural.png",
                                       "rounds_auroc_skew.png", "sites_auroc_skew.png"]
    assert all(p.read_bytes()[:8] == PNG for p in paths)


def test_report_cli_prints_tables_and_writes_markdown_and_pngs(tmp_path: Path) -> None:
    """`fedmqtt report RUNS --out DIR` prints the tables and writes report.md and the PNGs."""
    # Prepare
    runs = two_algorithms(tmp_path / "runs")
    # Execute
    result = CliRunner().invoke(app, ["report", str(tmp_path / "runs"), "--metric", "auroc",
                                      "--out", str(tmp_path / "out")])
    # Assert
    assert result.exit_code == 0, result.output
    assert "paired comparisons" in result.output and "seeds: 0, 1, 2" in result.output and len(runs) == 6
    assert (tmp_path / "out" / "report.md").read_text().startswith("# fedmqtt experiment report")
    assert (tmp_path / "out" / "rounds_auroc_natural.png").read_bytes()[:8] == PNG


def test_report_cli_names_the_known_metrics_for_a_typo(tmp_path: Path) -> None:
    """An unknown --metric is one clear line listing the metrics the runs have."""
    # Prepare
    two_algorithms(tmp_path / "runs")
    # Execute
    result = CliRunner().invoke(app, ["report", str(tmp_path / "runs"), "--metric", "aucroc"])
    # Assert
    assert result.exit_code == 2 and "no run has test metric 'aucroc'; they have: auroc" in result.output


def test_many_sites_print_a_summary_over_sites_and_write_every_site_to_a_file(tmp_path: Path) -> None:
    """With more than 12 sites the table shows min / median / max over sites and the mean; every site's column
    goes to report-per-site.md (issue 13: a 186-column table is unreadable)."""
    # Prepare: 21 sites, two algorithms, two seeds
    sites = [f"s{i:02d}" for i in range(21)]
    for seed in (0, 1):
        write_run(tmp_path / "runs", "fedavg", seed, {s: 0.5 + i / 100 for i, s in enumerate(sites)})
        write_run(tmp_path / "runs", "fedprox", seed, {s: 0.6 + i / 100 for i, s in enumerate(sites)})
    # Execute
    done = CliRunner().invoke(app, ["report", str(tmp_path / "runs"), "--metric", "auroc",
                                    "--out", str(tmp_path / "out")])
    # Assert: the screen and report.md are summaries, the per-site file has every site
    assert done.exit_code == 0, done.output
    header = next(line for line in done.output.splitlines() if line.startswith("algorithm"))
    assert header.split() == ["algorithm", "seeds", "min", "of", "21", "sites", "median", "site", "max", "site",
                              "mean", "mean", "95%", "CI"]
    fedprox = next(line for line in done.output.splitlines() if line.startswith("fedprox"))
    assert fedprox.split()[2:6] == ["0.600", "*", "0.700", "*"] and "0.800" in fedprox  # min, median, max
    assert "report-per-site.md" in done.output
    assert "s20" not in (tmp_path / "out" / "report.md").read_text()
    assert all(s in (tmp_path / "out" / "report-per-site.md").read_text() for s in sites)
