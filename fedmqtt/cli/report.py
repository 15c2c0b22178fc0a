"""`fedmqtt report`: tables, rank-sum p-values and curves from finished runs and grids."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Reports of finished runs and grids.")

REPORT_EPILOG = (
    "Examples:\n\n"
    "  fedmqtt report runs/grid --metric auroc --out runs/grid/report\n\n"
    "  fedmqtt report runs/fedavg runs/fedprox --metric accuracy --which best\n"
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
) -> None:
    """Tabulate runs: mean ± std over seeds per site and on average, rank-sum p-values, curves.

    Per partition: the test metric's table (best per column marked) and Wilcoxon rank-sum p-values
    between algorithms. With --out: report.md and PNGs of the validation metric per round (mean over
    sites, and per site).
    """
    from fedmqtt.errors import FedMqttError
    from fedmqtt.experiments import report as rp

    if which not in ("final", "best"):
        raise typer.BadParameter(f"--which {which!r}: expected final or best")
    try:
        records = rp.load_runs(runs)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    if metric not in (known := rp.metric_names(records)):
        typer.echo(f"error: no run has test metric {metric!r}; they have: {', '.join(known)}", err=True)
        raise typer.Exit(code=2)
    chosen: rp.Which = "best" if which == "best" else "final"
    tables = rp.summary_table(records, metric, which=chosen)
    tests = rp.wilcoxon_table(records, metric, which=chosen)
    typer.echo(rp.render_text(tables, tests))
    if out is not None:
        from fedmqtt.experiments.plots import plot_curves

        plots = plot_curves(records, metric, out)
        (out / "report.md").write_text(rp.render_markdown(tables, tests, plots=plots))
        typer.echo(f"report: {out / 'report.md'}; plots: {', '.join(p.name for p in plots)}")
