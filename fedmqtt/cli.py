"""The `fedmqtt` command: one sub-command group per deployed role, plus the demo and inspection tools."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from broker.cli import app as broker_app
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


@app.command("demo")
def demo(
    out: Optional[Path] = typer.Option(None, "--out", help="Keep the run here: report.json, models, logs, configs."),
    rounds: int = typer.Option(20, min=1, help="Federated rounds."),
    seed: int = typer.Option(0, help="Run seed (model init and local shuffling)."),
    timeout: float = typer.Option(900.0, help="Give up after this many seconds."),
) -> None:
    """Run a real federation on this machine: Mosquitto, the PS and four hospital site agents as separate
    processes, FedAvg on the bundled UCI heart-disease data; print per-site test AUROC and accuracy."""
    from fedmqtt.demo import run_demo
    from fedmqtt.errors import FedMqttError

    try:
        run_demo(out=out, rounds=rounds, seed=seed, timeout_s=timeout)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted: broker, PS and sites stopped", err=True)
        raise typer.Exit(code=130)


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
