"""`fedmqtt grid`: run an experiment grid (algorithms x norms x seeds x partitions) in simulation."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from fedmqtt.tracking.spec import TRACK_HELP

if TYPE_CHECKING:
    from fedmqtt.experiments.grid import GridPoint, GridSpec

app = typer.Typer(help="Experiment grids.")


class Engine(str, Enum):
    """Values of --engine (fedmqtt.experiments.engines)."""

    auto = "auto"
    serial = "serial"
    dask = "dask"


GRID_EPILOG = (
    "Grid TOML: a `base` table holds simulation keys (as `fedmqtt simulate FILE`: rounds, model, train, sites...); "
    "the axes are algorithms (names, or tables with name, label, hyper, train, config, norms), norms "
    "(values of base.model.args.norm), seeds, and partitions (\"natural\" = the base sites, or tables with "
    "name, spec = a partition spec as `fedmqtt partition` takes it, data = the pooled dataset).\n\n"
    "Examples:\n\n"
    "  fedmqtt grid grid.toml --out runs/grid   (two runs at a time on a local Dask cluster, if installed)\n\n"
    "  fedmqtt grid grid.toml --out runs/grid --engine serial   (one run after another in this process)\n\n"
    "  fedmqtt grid grid.toml --out runs/grid --engine dask --workers 4   (a local Dask cluster)\n\n"
    "  fedmqtt grid grid.toml --out /shared/grid --engine dask --cluster tcp://head:8786   (docs/grids.md)\n\n"
    "  fedmqtt grid grid.toml --out runs/grid --list\n\n"
    "  fedmqtt grid grid.toml --out runs/grid --only fedavg-bn-s0-natural --export   (configs for MQTT)\n\n"
    "  fedmqtt report runs/grid --metric auroc --out runs/grid/report\n"
)
@app.command("grid", epilog=GRID_EPILOG)
def grid_command(
    spec: Path = typer.Argument(..., help="Grid TOML (a `base` table plus the axes; see below)."),
    out: Path = typer.Option(..., "--out", help="One folder per run (DIR/<run>/report.json), partition "
                             "manifests in DIR/partitions, and DIR/grid.json (points, status, wall time)."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Skip runs whose report.json exists "
                                "and whose config is unchanged (default), or run everything again."),
    only: list[str] = typer.Option([], "--only", help="Run only this point (repeat); names as --list shows."),
    list_points: bool = typer.Option(False, "--list", help="Print the points and skipped combinations; run "
                                     "nothing."),
    export: bool = typer.Option(False, "--export", help="Run nothing; write DIR/configs/<run>/ with "
                                "simulation.toml, ps.toml and sites/<id>.toml to run points over MQTT."),
    fed_dir: Path = typer.Option(Path("fed"), "--fed-dir", help="With --export: the federation folder of "
                                 "`fedmqtt broker init` whose credentials the configs name."),
    engine: Engine = typer.Option(Engine.auto, "--engine", help="Where the runs go: serial (one after "
                                  "another in this process), dask (a Dask cluster), or auto: a local Dask cluster "
                                  "of two single-threaded workers (one per CPU if fewer) when there are two runs "
                                  "or more and Dask is installed, else serial. The same results bit for bit."),
    cluster: str | None = typer.Option(None, "--cluster", metavar="ADDRESS", help="With --engine dask: the "
                                       "scheduler of a running cluster, e.g. tcp://head:8786 (default: start a "
                                       "local cluster on this machine). --out must be a path every worker sees."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="With --engine dask or auto and no "
                                       "--cluster: worker processes of the local cluster (default: dask the CPU "
                                       "count, auto two; at most one per run)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the grid's progress bar "
                                  "(runs in a grid never draw their own); --no-progress: no bar at all."),
    track: list[str] = typer.Option([], "--track", metavar="BACKEND[:WHERE]", help=TRACK_HELP + " One tracked "
                                    "run per point, named by it; default places are under --out; the MLflow "
                                    "experiment is the grid file's name."),
) -> None:
    """Run every point of an experiment grid (algorithms x norms x seeds x partitions) as a simulation.

    Run names read ALGORITHM-NORM-sSEED-PARTITION, e.g. fedavg-bn-s0-label_skew_0.1. Combinations an
    algorithm cannot use (adafed without BatchNorm...) are skipped and listed. Then `fedmqtt report OUT`.
    """
    from fedmqtt.errors import FedMqttError
    from fedmqtt.experiments import grid as g
    from fedmqtt.experiments.engines import make_engine
    from fedmqtt.tracking import parse_tracks

    try:
        specs = parse_tracks(track)  # a missing package stops here, before any point runs
        grid = g.load_grid(spec)
        points = [p for p in g.expand(grid) if not only or p.name in only]
        runner = make_engine(engine.value, address=cluster, workers=workers, points=len(points))
        if list_points or export:
            _list_or_export(grid, points, out, export=export, fed_dir=fed_dir)
            return
        entries = g.run_grid(grid, out, resume=resume, progress=progress, only=only or None,
                             engine=runner, track=specs, experiment=spec.stem)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    counts = {s: sum(e["status"] == s for e in entries) for s in ("done", "cached", "failed")}
    typer.echo(f"{len(entries)} runs: {counts['done']} run, {counts['cached']} cached, {counts['failed']} "
               f"failed; {out / 'grid.json'}")
    for entry in (e for e in entries if e["status"] == "failed"):
        typer.echo(f"failed {entry['run']}: {entry['error']}", err=True)
    if counts["failed"]:
        raise typer.Exit(code=1)


def _list_or_export(grid: GridSpec, points: list[GridPoint], out: Path, *, export: bool, fed_dir: Path) -> None:
    from fedmqtt.experiments import grid as g
    from fedmqtt.experiments.export import export_point

    for point in points:
        line = point.name
        if export:
            line += f" -> {export_point(point, out, fed_dir=fed_dir)}"
        typer.echo(line)
    for skip in g.skipped_combinations(grid):
        typer.echo(f"skipped {skip['algorithm']} with norm {skip['norm']}: {skip['reason']}")
    typer.echo(f"{len(points)} points")
