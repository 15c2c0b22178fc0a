"""`fedmqtt site ...`: run the agent a hospital deploys next to its data."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Run a hospital's site agent.", no_args_is_help=True)


@app.command("start")
def start(
    config: Path = typer.Option(..., "--config", help="Site config file (TOML): site id, credentials, data path."),
    exit_when_done: bool = typer.Option(False, help="Exit once the PS reports the run is done."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages too."),
) -> None:
    """Connect (outbound only), train on local data when the PS asks, publish updates. Reconnects by itself."""
    from fedmqtt.logs import setup_logging
    from site_agent.agent import SiteAgent
    from site_agent.config import load_site_config

    setup_logging(verbose)
    SiteAgent(load_site_config(config)).run(exit_when_done=exit_when_done)
