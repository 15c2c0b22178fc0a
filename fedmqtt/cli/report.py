"""`fedmqtt report`: tables with intervals, paired comparisons and curves from finished runs and grids."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

app = typer.Typer(help="Reports of finished runs and grids.")

REPORT_EPILOG = (
    "Examples:\n\n"
    "  fedmqtt report runs/grid --metric auroc --out runs/grid/report\n\n"
    "  fedmqtt report runs/fedavg runs/fedprox --metric accuracy --which best\n\n"
    "  fedmqtt report runs/grid --metric auroc --which best --versus fedpxn --norm-pairs\n\n"
    "  fedmqtt report runs/all runs/recruited --metric mae --held-out\n"
)


@app.command("report", epilog=REPORT_EPILOG)
def report_command(
    runs: list[Path] = typer.Argument(..., help="Run folders (with report.json), grid folders (grid.json) "
                                      "or folders of run folders."),
    metric: str = typer.Option("auroc", "--metric", "-m", help="Test metric to tabulate (auroc, auprc, "
                               "accuracy, balanced_accuracy, loss, mae...); loss-type metrics: lower is best."),
    which: str = typer.Option("final", "--which", help="final: the final model's test metrics; best: the "
                              "best-validation-round model's (docs/algorithms.md 17.1), where the report has them."),
    out: Path | None = typer.Option(None, "--out", help="Write DIR/report.md and the PNG curves here."),
    held_out: bool | None = typer.Option(
        None, "--held-out/--no-held-out", help="Also evaluate every run's final model on every site's test "
        "split (one held-out union, recruited or not): pooled per patient and per-site mean side by side. "
        "Default: on when a run trained on recruited sites only."),
    versus: str | None = typer.Option(
        None, "--versus", metavar="METHOD", help="Compare only METHOD (a table label such as fedpxn/bn, or an "
        "algorithm for each of its norms) against every other method, Holm-corrected over those comparisons "
        "(Hwang et al.'s one-against-all tests). Default: every pair."),
    norm_pairs: bool = typer.Option(
        False, "--norm-pairs", help="Compare the norms of each algorithm against each other (BN - GN, ...); "
        "with --versus, both families, Holm-corrected together."),
    test_sites: Path | None = typer.Option(
        None, "--test-sites", help="Simulation TOML whose sites make the held-out union, for runs that do "
        "not record their sites' data (grids and simulations do)."),
) -> None:
    """Tabulate runs: mean ± std over seeds per site and on average with a 95 % interval, paired tests, curves.

    Per partition: the seeds it rests on, the test metric's table (best per column marked; the site
    average's bootstrap interval, sites resampled) and every pair of algorithms compared on (site, seed)
    pairs (with --versus / --norm-pairs, a chosen family of pairs): Wilcoxon signed-rank p, Holm-corrected
    over the table's comparisons, median difference with its interval and the rank-biserial correlation.
    With --out: report.md and PNGs of the validation metric per round (mean over sites, and per site).
    When a run trained on recruited sites only, its own test table covers only those sites: the
    held-out union table then scores every run on the same patients, beside every metric-optimal
    constant.
    """
    from fedmqtt.errors import FedMqttError
    from fedmqtt.experiments.heldout import render_union_text, trained_on_subset
    from fedmqtt.experiments.privacy import privacy_text
    from fedmqtt.experiments.report import PER_SITE_FILE, seed_report, write_report
    from fedmqtt.experiments.runs import load_runs, metric_names
    from fedmqtt.experiments.tables import MAX_SITE_COLUMNS

    if which not in ("final", "best"):
        raise typer.BadParameter(f"--which {which!r}: expected final or best")
    try:
        records = load_runs(runs)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    if metric not in (known := metric_names(records)):
        typer.echo(f"error: no run has test metric {metric!r}; they have: {', '.join(known)}", err=True)
        raise typer.Exit(code=2)
    try:
        seeds = seed_report(records, metric, which="best" if which == "best" else "final", versus=versus,
                            norm_pairs=norm_pairs)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(seeds.text())
    if seeds.summarised:  # many sites: min / median / max over sites, per-site table in a file
        typer.echo(f"more than {MAX_SITE_COLUMNS} sites: summarised over sites above; "
                   + (f"every site's column is in {PER_SITE_FILE}" if out is not None else
                      f"--out DIR writes every site's column to DIR/{PER_SITE_FILE}"))
    union = None
    if held_out if held_out is not None else any(trained_on_subset(r.path) for r in records):
        union = _union(records, metric, test_sites)
        typer.echo("\n" + render_union_text(union))
    if privacy := privacy_text(records):
        typer.echo("\n" + privacy)
    if out is not None:
        plots = write_report(out, records, metric, seeds, union)
        typer.echo(f"report: {out / 'report.md'}; plots: {', '.join(p.name for p in plots)}")


if TYPE_CHECKING:
    from fedmqtt.experiments.heldout import UnionTable
    from fedmqtt.experiments.runs import RunRecord


def _union(records: list[RunRecord], metric: str, test_sites: Path | None) -> UnionTable:
    """The held-out union table, or exit 2 naming what is missing."""
    from fedmqtt.errors import FedMqttError
    from fedmqtt.experiments.heldout import held_out_sites, union_table

    try:
        extra = None
        if test_sites is not None:
            from fedmqtt.simulation import load_simulation_config

            extra = dict(load_simulation_config(test_sites).sites)
        sites = held_out_sites(records, extra)
        if not sites:
            raise FedMqttError("the runs do not record their sites' data; name them: --test-sites CFG.toml")
        return union_table(records, metric, sites)
    except FedMqttError as exc:
        typer.echo(f"error: held-out union: {exc}", err=True)
        raise typer.Exit(code=2) from None
