"""`fedmqtt dashboard`: watch a federation (live, as the observer) or finished runs (report.json) in a browser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def dashboard(
    federation: Optional[Path] = typer.Option(None, "--federation", help="A federation directory made by "
                                              "`fedmqtt broker init`: uses its credentials/observer.toml."),
    credentials: Optional[Path] = typer.Option(None, "--credentials", help="An observer credentials TOML "
                                               "(its broker table); needs --run-id."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="The run to watch (default: the federation's)."),
    run: list[Path] = typer.Option([], "--run", help="A finished run directory holding report.json (repeat to "
                                   "show runs side by side); no broker needed."),
    host: str = typer.Option("127.0.0.1", "--host", help="Loopback only (the page has no login or TLS)."),
    port: int = typer.Option(8765, "--port", min=0, max=65535),
    seat: str = typer.Option("2", "--seat", help="Observer seat (the broker allows one connection per login; "
                             "`topics watch` takes seat 1 by default)."),
) -> None:
    """Serve a read-only page with the run's progress, every site's state and the metrics per round."""
    from broker.federation import load_federation
    from fedmqtt.config_io import load_toml
    from fedmqtt.dashboard.server import Board, BrokerListener, require_loopback, serve
    from fedmqtt.dashboard.state import RunView
    from fedmqtt.errors import FedMqttError
    from fedmqtt.transport.settings import BrokerSettings

    require_loopback(host)
    if bool(federation) + bool(credentials) + bool(run) != 1:
        raise FedMqttError("give exactly one of --federation DIR, --credentials observer.toml (with --run-id) "
                           "or --run DIR (repeatable)")
    views: list[RunView] = []
    listener = None
    if run:
        for directory in run:
            path = directory / "report.json"
            if not path.is_file():
                raise FedMqttError(f"{path} not found: --run takes a finished run directory (the PS's out dir)")
            try:
                report = json.loads(path.read_text(encoding="utf-8"))
                views.append(RunView.from_report(report, label=str(directory)))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise FedMqttError(f"{path} is not a report.json this version can read: {exc}") from None
        board = Board(views)
    else:
        if federation is not None:
            layout = load_federation(federation)
            settings = layout.settings("observer")
            run_id = run_id or layout.run_id
        else:
            settings = load_toml(credentials, BrokerSettings, section="broker")
            if not run_id:
                raise FedMqttError("--credentials needs --run-id (the run to watch)")
        if settings.username != "observer":
            raise FedMqttError(f"the dashboard logs in as the observer only (read-only ACL); "
                               f"{settings.username!r} could publish. Use credentials/observer.toml.")
        view = RunView(run_id=run_id)
        board = Board([view])
        listener = BrokerListener(board, view, settings, seat=seat)
        listener.connect()
        listener.start()
    try:
        serve(board, host=host, port=port, on_ready=lambda url: typer.echo(f"dashboard: {url}  (Ctrl-C to stop)"))
    finally:
        if listener is not None:
            listener.close()
