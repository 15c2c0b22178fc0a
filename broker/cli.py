"""`fedmqtt broker ...`: create a federation's broker files and run Mosquitto with them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Set up and run the Mosquitto broker of a federation.", no_args_is_help=True)


@app.command("init")
def init(
    fed_dir: Path = typer.Option(..., "--dir", help="Federation directory to create."),
    run_id: str = typer.Option(..., "--run-id", help="Run id: a-z, 0-9 and '-'."),
    sites: list[str] = typer.Option(..., "--site", help="A site id; repeat for every hospital."),
    host: str = typer.Option("127.0.0.1", help="Address the broker listens on and parties connect to."),
    port: Optional[int] = typer.Option(None, help="Port (default: a free one)."),
    force: bool = typer.Option(False, help="Replace an existing federation in --dir."),
) -> None:
    """Write mosquitto.conf, the password file (mosquitto_passwd), the ACL and one credentials file per party."""
    from broker.federation import init_federation

    layout = init_federation(fed_dir, run_id=run_id, site_ids=sites, host=host, port=port, force=force)
    typer.echo(f"federation {layout.run_id} in {layout.fed_dir}")
    typer.echo(f"  broker config : {layout.conf_path}  (listens on {layout.host}:{layout.port})")
    for user, path in sorted(layout.credentials.items()):
        typer.echo(f"  credentials   : {path}  ({user})")
    typer.echo("Give each hospital only its own credentials file.")


@app.command("start")
def start(fed_dir: Path = typer.Option(..., "--dir", help="Federation directory made by `broker init`.")) -> None:
    """Run Mosquitto for the federation in the foreground until Ctrl-C."""
    from broker.federation import load_federation
    from broker.process import BrokerProcess

    layout = load_federation(fed_dir)
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.host) as proc:
        typer.echo(f"mosquitto pid {proc.pid} on {layout.host}:{layout.port}; log {layout.log_path}; Ctrl-C stops")
        try:
            while proc.alive:
                time.sleep(0.5)
        except KeyboardInterrupt:
            typer.echo("stopping mosquitto")
    if not proc.alive:
        typer.echo(proc.output_tail())


@app.command("acl")
def acl(
    run_id: str = typer.Option(..., "--run-id"),
    sites: list[str] = typer.Option(..., "--site", help="A site id; repeat for every hospital."),
) -> None:
    """Print the ACL the federation would use (generated from the topic builders)."""
    from broker.acl import render_acl

    typer.echo(render_acl(run_id, sites), nl=False)
