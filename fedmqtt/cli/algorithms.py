"""`fedmqtt algorithms [NAME]`: the catalogue of strategies, or one strategy's reference section."""

from __future__ import annotations

import typer

app = typer.Typer()

CENTRAL = ("Central (pooled) baseline, `fedmqtt simulate` only: one model on every site's training rows")


@app.command("algorithms")
def algorithms(
    name: str | None = typer.Argument(
        None, show_default=False, metavar="NAME",
        help="A strategy's registry name (e.g. fedavg, scaffold, d-adafed): print its reference section (the "
             "same text as docs/algorithms.md). Without it: list every strategy."),
) -> None:
    """List every algorithm with one line and its hyper-parameters, or explain one (set hyper-parameters in
    the `hyper` table of a config or with --hyper name=value)."""
    from fedmqtt.strategies import STRATEGIES, describe_strategies
    from fedmqtt.strategies.about import secure_aggregation_line

    if name is None:
        for key, summary, params in describe_strategies():
            typer.echo(f"{key:<11} {summary}")
            for param, default, description in params:
                typer.echo(f"{'':<13}{param} = {default!r}: {description}")
            typer.echo(f"{'':<13}secure aggregation: {secure_aggregation_line(key)}")
        typer.echo(f"{'central':<11} {CENTRAL}")
        typer.echo("\nMore on one of them: fedmqtt algorithms NAME (the same text as docs/algorithms.md).")
        return
    if name == "central":
        typer.echo(f"central: {CENTRAL}.")
        return
    if name not in STRATEGIES:
        raise typer.BadParameter(f"unknown algorithm {name!r}; known: {', '.join([*STRATEGIES, 'central'])}",
                                 param_hint="NAME")
    from fedmqtt.strategies.about import about_of, render_section

    typer.echo(render_section(about_of(name)), nl=False)
