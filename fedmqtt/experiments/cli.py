"""`fedmqtt grid` (run an experiment grid in simulation) and `fedmqtt report` (seeds' tables, p-values, plots)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from fedmqtt.experiments.grid import GridPoint, GridSpec
    from fedmqtt.simulation import SimulationConfig

app = typer.Typer(help="Experiment grids and their reports.")

GRID_EPILOG = (
    "Grid TOML: a `base` table holds simulation keys (as `fedmqtt simulate FILE`: rounds, model, train, sites...); "
    "the axes are algorithms (names, or tables with name, label, hyper, train, config, norms), norms "
    "(values of base.model.args.norm), seeds, and partitions (\"natural\" = the base sites, or tables with "
    "name, spec = a partition spec as `fedmqtt partition` takes it, data = the pooled dataset).\n\n"
    "Examples:\n\n"
    "  fedmqtt grid grid.toml --out runs/grid\n\n"
    "  fedmqtt grid grid.toml --out runs/grid --list\n\n"
    "  fedmqtt grid grid.toml --out runs/grid --only fedavg-bn-s0-natural --export   (configs for MQTT)\n\n"
    "  fedmqtt report runs/grid --metric auroc --out runs/grid/report\n"
)
REPORT_EPILOG = (
    "Examples:\n\n"
    "  fedmqtt report runs/grid --metric auroc --out runs/grid/report\n\n"
    "  fedmqtt report runs/fedavg runs/fedprox --metric accuracy --which best\n"
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
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
) -> None:
    """Run every point of an experiment grid (algorithms x norms x seeds x partitions) as a simulation.

    Run names read ALGORITHM-NORM-sSEED-PARTITION, e.g. fedavg-bn-s0-label_skew_0.1. Combinations an
    algorithm cannot use (adafed without BatchNorm...) are skipped and listed. Then `fedmqtt report OUT`.
    """
    from fedmqtt.errors import FedMqttError
    from fedmqtt.experiments import grid as g

    try:
        grid = g.load_grid(spec)
        points = [p for p in g.expand(grid) if not only or p.name in only]
        if list_points or export:
            _list_or_export(grid, points, out, export=export, fed_dir=fed_dir)
            return
        entries = g.run_grid(grid, out, resume=resume, progress=progress, only=only or None)
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

    for point in points:
        line = point.name
        if export:
            line += f" -> {export_point(point, out, fed_dir=fed_dir)}"
        typer.echo(line)
    for skip in g.skipped_combinations(grid):
        typer.echo(f"skipped {skip['algorithm']} with norm {skip['norm']}: {skip['reason']}")
    typer.echo(f"{len(points)} points")


@app.command("report", epilog=REPORT_EPILOG)
def report_command(
    runs: list[Path] = typer.Argument(..., help="Run folders (with report.json), grid folders (grid.json) "
                                      "or folders of run folders."),
    metric: str = typer.Option("auroc", "--metric", "-m", help="Test metric to tabulate (auroc, auprc, "
                               "accuracy, balanced_accuracy, loss, mae...); loss-type metrics: lower is best."),
    which: str = typer.Option("final", "--which", help="final: the final model's test metrics; best: the "
                              "best-validation-round model's (algorithms.md 17.1), where the report has them."),
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


def role_configs(cfg: SimulationConfig, *, fed_dir: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The PS config and one site config per site for running `cfg` over MQTT with `fed_dir`'s credentials."""
    from fedmqtt.errors import ConfigError
    from fedmqtt.experiments.grid import SIMULATION_ONLY

    if cfg.algorithm in SIMULATION_ONLY:
        raise ConfigError(f"{cfg.algorithm} is a simulation-only baseline (no federation to deploy)")
    if cfg.pretrain_fraction is not None and cfg.pretrained is None:
        made = cfg.out_dir / "pretrained.safetensors"
        if not made.is_file():
            raise ConfigError(f"{cfg.algorithm} pretrains in simulation (pretrain_fraction): simulate this point "
                              f"once, then export again to use {made}")
        cfg = cfg.model_copy(update={"pretrained": made})
    creds = Path(fed_dir).resolve() / "credentials"
    ps = cfg.daemon_config().model_dump(mode="json", exclude_none=True)
    ps.update(credentials=str(creds / "ps.toml"), out_dir=str(cfg.out_dir / "mqtt" / "ps"))
    sites = {s.site_id: {**s.model_dump(mode="json", exclude_none=True), "credentials": str(creds / f"{s.site_id}.toml"),
                         "state_dir": str(cfg.out_dir / "mqtt" / "state" / s.site_id), "device": "auto"}
             for s in cfg.site_configs()}
    return ps, sites


def to_toml(data: Mapping[str, Any], prefix: str = "") -> str:
    """Nested dicts of plain values as TOML (None left out; dicts inside lists as inline tables)."""
    plain = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, Mapping)]
    blocks = ["\n".join(plain)]
    for key, table in ((k, v) for k, v in data.items() if isinstance(v, Mapping)):
        name = f"{prefix}.{_key(key)}" if prefix else _key(key)
        inner = to_toml(table, name).rstrip("\n")
        # A table holding only tables needs no header of its own: theirs carry the full dotted name.
        own = not table or any(v is not None and not isinstance(v, Mapping) for v in table.values())
        blocks.append(f"[{name}]\n{inner}".rstrip("\n") if own else inner)
    return "\n\n".join(b for b in blocks if b) + "\n"


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    return json.dumps(str(value), ensure_ascii=False)  # JSON string escapes are valid TOML


def export_point(point: GridPoint, out_dir: Path, *, fed_dir: Path) -> Path:
    """Write `out_dir/configs/<run>/`: simulation.toml, and ps.toml + sites/<id>.toml where possible.

    Returns:
        The folder written. The MQTT configs are left out (with a note file) when the point cannot be
        deployed yet (see `role_configs`).
    """
    from fedmqtt.errors import FedMqttError
    from fedmqtt.experiments.grid import point_to_simulation_config

    cfg = point_to_simulation_config(point, out_dir)
    folder = Path(out_dir) / "configs" / point.name
    (folder / "sites").mkdir(parents=True, exist_ok=True)
    (folder / "simulation.toml").write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    try:
        ps, sites = role_configs(cfg, fed_dir=fed_dir)
    except FedMqttError as exc:
        (folder / "NOT-EXPORTED.txt").write_text(f"ps.toml and sites/ not written: {exc}\n")
        return folder
    (folder / "ps.toml").write_text(to_toml(ps))
    for site, site_cfg in sites.items():
        (folder / "sites" / f"{site}.toml").write_text(to_toml(site_cfg))
    return folder
