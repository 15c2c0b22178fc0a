"""`fedmqtt simulate`: the PS and every site in one process, without a broker."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from fedmqtt.tracking.spec import DEFAULT_EXPERIMENT, TRACK_HELP

if TYPE_CHECKING:
    from fedmqtt.strategies.params import HyperValue

app = typer.Typer()


@app.command("simulate")
def simulate(
    config: Path | None = typer.Argument(None, help="Simulation TOML (default: the bundled heart-disease sites)."),
    algorithm: str | None = typer.Option(None, "--algorithm", "-a", help="Algorithm name (see `fedmqtt algorithms`)."),
    rounds: int | None = typer.Option(None, min=1, help="Federated rounds."),
    seed: int | None = typer.Option(None, help="Run seed."),
    out: Path | None = typer.Option(None, "--out", help="Where report.json, models and checkpoints go."),
    optimizer: str | None = typer.Option(None, help="Local optimizer: sgd, adam or adamw."),
    lr: float | None = typer.Option(None, help="Local learning rate."),
    epochs: int | None = typer.Option(None, min=1, help="Local epochs per round."),
    hyper: list[str] = typer.Option([], "--hyper", "-H", help="Algorithm hyper-parameter NAME=VALUE (repeat): a "
                                    "number, or a word where the rule takes a choice (partial_labels=masked_loss)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar over the rounds."),
    track: list[str] = typer.Option([], "--track", metavar="BACKEND[:WHERE]", help=TRACK_HELP),
) -> None:
    """Run the PS and every site in this process, without a broker (same code path as a deployment)."""
    from fedmqtt.simulation import load_simulation_config, run_simulation
    from fedmqtt.tracking import parse_tracks, tracked_run
    from ps_daemon.report import baseline_warnings, final_table, render_table

    specs = parse_tracks(track)  # a missing package stops here, before any data is read
    cfg = load_simulation_config(config, algorithm=algorithm, rounds=rounds, seed=seed, out_dir=out)
    train = {k: v for k, v in {"optimizer": optimizer, "lr": lr, "epochs": epochs}.items() if v is not None}
    if train or hyper:
        cfg = cfg.model_validate({**cfg.model_dump(), "train": {**cfg.train.model_dump(), **train},
                                  "hyper": {**cfg.hyper, **_parse_hyper(hyper)}})
    cfg.daemon_config()  # validate the algorithm and its hyper-parameters before anything starts
    # Named by the output folder, which differs between runs (the run id is "sim" unless the TOML says otherwise):
    # runs sent to one tensorboard:DIR do not replace each other.
    with tracked_run(specs, root=cfg.out_dir, run_name=cfg.out_dir.resolve().name, experiment=DEFAULT_EXPERIMENT,
                     config=cfg.model_dump(mode="json")) as tracker:
        report = run_simulation(cfg, progress=progress, tracker=tracker)
    typer.echo(render_table(final_table(report)))
    for warning in baseline_warnings(report):  # the model does not beat a baseline, or the partition leaks
        typer.echo(f"warning: {warning}")
    typer.echo(f"report: {cfg.out_dir / 'report.json'}")


def _parse_hyper(items: list[str]) -> dict[str, HyperValue]:
    """NAME=VALUE pairs: a number where VALUE reads as one, else the word (a rule's choice, e.g.
    partial_labels=masked_loss); the rule's own parameter check then refuses a word where it wants a number."""
    out: dict[str, HyperValue] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise typer.BadParameter(f"--hyper {item!r}: expected NAME=VALUE")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            out[name.strip()] = value.strip()
    return out
