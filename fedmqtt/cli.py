"""The `fedmqtt` command: one sub-command group per deployed role, plus the demo and inspection tools."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from broker.cli import app as broker_app
from fedmqtt.dashboard.cli import dashboard as dashboard_command
from fedmqtt.experiments.cli import app as experiments_app
from fedmqtt.partition_cli import app as partition_app
from fedmqtt.recruit_cli import app as recruit_app
from fedmqtt.topics_cli import app as topics_app
from ps_daemon.cli import app as ps_app
from site_agent.cli import app as site_app

app = typer.Typer(
    help="fedmqtt: federated learning for hospital networks over MQTT. Patient data never leaves a site.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(broker_app, name="broker")
app.add_typer(ps_app, name="ps")
app.add_typer(site_app, name="site")
app.add_typer(topics_app, name="topics")
app.registered_commands.extend(recruit_app.registered_commands)  # `fedmqtt recruit`
app.registered_commands.extend(partition_app.registered_commands)  # `fedmqtt partition`
app.registered_commands.extend(experiments_app.registered_commands)  # `fedmqtt grid`, `fedmqtt report`
app.command("dashboard")(dashboard_command)  # `fedmqtt dashboard`


@app.command("demo")
def demo(
    out: Optional[Path] = typer.Option(None, "--out", help="Keep the run here: report.json, models, logs, configs."),
    rounds: int = typer.Option(20, min=1, help="Federated rounds."),
    seed: int = typer.Option(0, help="Run seed (model init and local shuffling)."),
    timeout: float = typer.Option(900.0, help="Give up after this many seconds."),
    algorithm: str = typer.Option("fedavg", "--algorithm", "-a", help="Any of `fedmqtt algorithms` that needs "
                                  "no extra setup (SGD-only rules get SGD; AdaFed needs a pretrained model)."),
) -> None:
    """Run a real federation on this machine: Mosquitto, the PS and four hospital site agents as separate
    processes, FedAvg (or --algorithm) on the bundled UCI heart-disease data; print per-site test metrics."""
    from fedmqtt.demo import run_demo
    from fedmqtt.errors import FedMqttError

    try:
        run_demo(out=out, rounds=rounds, seed=seed, timeout_s=timeout, algorithm=algorithm)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted: broker, PS and sites stopped", err=True)
        raise typer.Exit(code=130)


@app.command("algorithms")
def algorithms() -> None:
    """List every algorithm with one line and its hyper-parameters (set them in the `hyper` table or with --hyper)."""
    from fedmqtt.strategies import describe_strategies

    for name, summary, params in describe_strategies():
        typer.echo(f"{name:<11} {summary}")
        for param, default, description in params:
            typer.echo(f"{'':<13}{param} = {default!r}: {description}")
    typer.echo(f"{'central':<11} Central (pooled) baseline, `fedmqtt simulate` only: one model on every site's "
               "training rows")


@app.command("simulate")
def simulate(
    config: Optional[Path] = typer.Argument(None, help="Simulation TOML (default: the bundled heart-disease sites)."),
    algorithm: Optional[str] = typer.Option(None, "--algorithm", "-a", help="Algorithm name (see `fedmqtt algorithms`)."),
    rounds: Optional[int] = typer.Option(None, min=1, help="Federated rounds."),
    seed: Optional[int] = typer.Option(None, help="Run seed."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where report.json, models and checkpoints go."),
    optimizer: Optional[str] = typer.Option(None, help="Local optimizer: sgd, adam or adamw."),
    lr: Optional[float] = typer.Option(None, help="Local learning rate."),
    epochs: Optional[int] = typer.Option(None, min=1, help="Local epochs per round."),
    hyper: list[str] = typer.Option([], "--hyper", "-H", help="Algorithm hyper-parameter NAME=VALUE (repeat)."),
) -> None:
    """Run the PS and every site in this process, without a broker (same code path as a deployment)."""
    from fedmqtt.simulation import load_simulation_config, run_simulation
    from ps_daemon.report import final_table, render_table

    cfg = load_simulation_config(config, algorithm=algorithm, rounds=rounds, seed=seed, out_dir=out)
    train = {k: v for k, v in {"optimizer": optimizer, "lr": lr, "epochs": epochs}.items() if v is not None}
    if train or hyper:
        cfg = cfg.model_validate({**cfg.model_dump(), "train": {**cfg.train.model_dump(), **train},
                                  "hyper": {**cfg.hyper, **_parse_hyper(hyper)}})
    cfg.daemon_config()  # validate the algorithm and its hyper-parameters before anything starts
    report = run_simulation(cfg)
    typer.echo(render_table(final_table(report)))
    typer.echo(f"report: {cfg.out_dir / 'report.json'}")


def _parse_hyper(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise typer.BadParameter(f"--hyper {item!r}: expected NAME=NUMBER") from None
        if not sep:
            raise typer.BadParameter(f"--hyper {item!r}: expected NAME=NUMBER")
    return out


def main() -> None:
    """Console entry point: a FedMqttError (bad config, broker unreachable...) is one clear line, exit 2."""
    from fedmqtt.errors import FedMqttError

    try:
        app()
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    main()
