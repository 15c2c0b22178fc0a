"""`fedmqtt site ...`: run the agent a hospital deploys next to its data."""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

app = typer.Typer(help="Run a hospital's site agent.", no_args_is_help=True)


@app.command("start")
def start(
    config: list[Path] = typer.Option(..., "--config", help="Site config file (TOML): site id, credentials, data "
                                      "path. Repeat it to run several sites on this host (see below)."),
    exit_when_done: bool = typer.Option(False, help="Exit once the PS reports the run is done."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages too."),
) -> None:
    """Connect (outbound only), train on local data when the PS asks, publish updates. Reconnects by itself.

    A hospital runs one site: one --config. Several --config start several sites on one host (a local federation,
    a benchmark, a test run) from one interpreter that imports once: each site is then a forked process of its
    own (its own broker connection, state folder and data; log lines tagged with its site id), which saves each
    site its own start-up imports (torch most of them). SIGTERM and SIGINT reach every site; the command reports
    each site's end and exits with the first failure's code. Needs os.fork (Linux, macOS).
    """
    load_site_modules()
    from fedmqtt.logs import setup_logging
    from site_agent.agent import SiteAgent
    from site_agent.config import load_site_config

    if len(config) > 1:
        from site_agent.launcher import run_sites

        raise typer.Exit(run_sites(config, exit_when_done=exit_when_done, verbose=verbose))
    setup_logging(verbose)
    SiteAgent(load_site_config(config[0])).run(exit_when_done=exit_when_done)


@app.command("check")
def check(
    config: Path = typer.Option(..., "--config", help="Site config file (TOML): the one `site start` uses."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (each check's status, finding, fix "
                                 "and facts) instead of the checklist."),
    timeout_s: float = typer.Option(5.0, "--timeout", min=0.5, help="Seconds to wait at each network step (name "
                                    "lookup and TCP connection, TLS handshake, login)."),
    colour: bool | None = typer.Option(None, "--color/--no-color", help="Colour the statuses (default: on a "
                                       "terminal, unless NO_COLOR is set)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also log what the connection does."),
) -> None:
    """Pre-flight before joining: config, credentials file, data, device, privacy policy and ledger, broker (name,
    TCP, TLS with CA, name and pinned key), login, the run, clock and state directory, each PASS, WARN or FAIL with
    the fix.

    Logs in with the site's read-only check login (`<site>.check`): publishes nothing and never pushes a running
    agent off. Exit code 0 when nothing failed (warnings allowed), 1 when a check failed.
    """
    import logging
    import os
    import sys

    from site_agent.preflight.render import Checklist, json_text, terminal_width
    from site_agent.preflight.runner import run_checks

    if verbose:
        from fedmqtt.logs import setup_logging

        setup_logging(True)
    else:  # the checklist says what went wrong; the transport's own log lines would only repeat it
        logging.getLogger().addHandler(logging.NullHandler())
    if as_json:
        report = run_checks(config, timeout_s=timeout_s)
        typer.echo(json_text(report))
        raise typer.Exit(report.exit_code)
    tty = sys.stdout.isatty()
    checklist = Checklist(colour=colour if colour is not None else tty and "NO_COLOR" not in os.environ,
                          width=terminal_width() if tty else None)
    typer.echo(checklist.header(str(config)))
    report = run_checks(config, timeout_s=timeout_s, on_finding=lambda f: typer.echo(checklist.line(f)))
    typer.echo(checklist.summary(report, str(config)))
    raise typer.Exit(report.exit_code)


def load_site_modules() -> None:
    """What a site process imports before it goes online, without the collector's passes, then kept out of
    later ones (fedmqtt/startup.py): its own start-up path, before any agent object exists. torch follows on
    the agent's worker thread (site_agent/trainer.py imports it the same way). bench/site_imports.py calls
    this too, so it measures what `site start` does."""
    from fedmqtt.startup import imports_without_gc, keep_what_is_loaded

    with imports_without_gc():
        for name in ("fedmqtt.logs", "site_agent.config", "site_agent.agent", "site_agent.launcher"):
            importlib.import_module(name)
    keep_what_is_loaded()
