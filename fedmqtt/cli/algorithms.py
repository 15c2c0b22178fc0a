"""`fedmqtt algorithms`: the catalogue of strategies and their hyper-parameters."""

from __future__ import annotations

import typer

app = typer.Typer()


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
