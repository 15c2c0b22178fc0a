"""`fedmqtt demo`: a real federation on this machine with the bundled data."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer()


@app.command("demo")
def demo(
    out: Path | None = typer.Option(None, "--out", help="Keep the run here: report.json, models, logs, configs."),
    rounds: int = typer.Option(20, min=1, help="Federated rounds."),
    seed: int = typer.Option(0, help="Run seed (model init and local shuffling)."),
    timeout: float = typer.Option(900.0, help="Give up after this many seconds."),
    algorithm: str = typer.Option("fedavg", "--algorithm", "-a", help="Any of `fedmqtt algorithms` that needs "
                                  "no extra setup (SGD-only rules get SGD; AdaFed needs a pretrained model)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar over the rounds "
                                  "(with --no-progress, one line per round instead)."),
    secure_aggregation: bool = typer.Option(False, "--secure-aggregation", help="Run every round under SecAgg+: "
                                            "the PS sees only the sum of the updates (docs/secure-aggregation.md; "
                                            "rules that need each update are refused)."),
) -> None:
    """Run a real federation on this machine with the bundled data; print per-site test metrics.

    Mosquitto, the PS and four hospital site agents run as separate processes and train FedAvg (or
    --algorithm) on the bundled UCI heart-disease data.
    """
    from fedmqtt.demo import run_demo
    from fedmqtt.errors import FedMqttError

    try:
        run_demo(out=out, rounds=rounds, seed=seed, timeout_s=timeout, algorithm=algorithm, progress=progress,
                 secure_aggregation=secure_aggregation)
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    except KeyboardInterrupt:
        typer.echo("\ninterrupted: broker, PS and sites stopped", err=True)
        raise typer.Exit(code=130) from None
