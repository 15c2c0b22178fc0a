"""The `fedmqtt` command: one sub-command group per deployed role, plus the demo and inspection tools."""

from __future__ import annotations

import inspect

from fedmqtt.startup import imports_without_gc

with imports_without_gc():  # every command's process starts here: its imports without the collector's passes
    import typer

    from fedmqtt.cli import (
        algorithms,
        audit,
        broker,
        dashboard,
        demo,
        grid,
        partition,
        pretrain,
        ps,
        recruit,
        report,
        simulate,
        site,
        topics,
    )

app = typer.Typer(
    help="fedmqtt: federated learning for hospital networks over MQTT. Patient data never leaves a site.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(broker.app, name="broker")
app.add_typer(ps.app, name="ps")
app.add_typer(site.app, name="site")
app.add_typer(topics.app, name="topics")
app.add_typer(audit.app, name="audit")
# Single commands: each module's Typer holds one command, mounted at the top level.
for module in (demo, simulate, pretrain, algorithms, grid, report, partition, recruit):
    app.registered_commands.extend(module.app.registered_commands)
app.command("dashboard")(dashboard.dashboard)  # `fedmqtt dashboard`


def reflow(text: str | None) -> str | None:
    """Help text with each paragraph on one line, so the terminal wraps it.

    Rich help keeps a docstring's line breaks as they are, which breaks sentences mid-line at any width.
    Paragraphs that start with "\\b" or hold indented lines (examples) keep their layout.
    """
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") or any(line[:1].isspace() for line in p.splitlines())
                       else " ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _reflow_all(typer_app: typer.Typer) -> None:
    for info in typer_app.registered_commands:
        info.help = reflow(info.help or inspect.getdoc(info.callback))
        info.epilog = reflow(info.epilog)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _reflow_all(group.typer_instance)


_reflow_all(app)


def main() -> None:
    """Console entry point: a FedMqttError (bad config, broker unreachable...) is one clear line, exit 2."""
    from fedmqtt.errors import FedMqttError
    from fedmqtt.transport.heap import tune_heap

    tune_heap()  # every PS, site and simulation process reuses its model-sized buffers (see heap.py)
    try:
        app()
    except FedMqttError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    main()

