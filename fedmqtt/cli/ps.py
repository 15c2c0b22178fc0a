"""`fedmqtt ps ...`: run the parameter-server daemon."""

from __future__ import annotations

from pathlib import Path

import typer

from fedmqtt.tracking.spec import DEFAULT_EXPERIMENT, TRACK_HELP

app = typer.Typer(help="Run the parameter-server daemon (PS).", no_args_is_help=True)


@app.command("start")
def start(
    config: Path = typer.Option(..., "--config", help="PS config file (TOML)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint in out_dir (with none "
                                "yet, start the run from its config)."),
    force: bool = typer.Option(False, "--force", help="Start afresh even though out_dir holds checkpoints of an "
                               "earlier start (they are deleted)."),
    algorithm: str = typer.Option(None, "--algorithm", "-a",
                                  help="Override the config's algorithm (see `fedmqtt algorithms`)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages too."),
    track: list[str] = typer.Option([], "--track", metavar="BACKEND[:WHERE]", help=TRACK_HELP + " With "
                                    "--resume the run's tracking goes on where it stopped."),
) -> None:
    """Wait for the sites, run every round (aggregate, checkpoint, publish), then write the final model and report.

    Start order does not matter: the PS waits for sites, and sites wait for the PS.
    """
    import json

    from fedmqtt.logs import setup_logging
    from fedmqtt.tracking import parse_tracks, tracked_run
    from ps_daemon.config import load_daemon_config
    from ps_daemon.runner import DaemonRunner

    setup_logging(verbose)
    specs = parse_tracks(track)  # a missing package stops here, before the PS connects
    cfg = load_daemon_config(config, algorithm=algorithm)
    if resume and force:
        raise typer.BadParameter("--resume continues a run, --force starts it over: choose one")
    with tracked_run(specs, root=cfg.out_dir, run_name=cfg.run_id, experiment=DEFAULT_EXPERIMENT,
                     config=cfg.model_dump(mode="json", exclude={"credentials"}), fresh=force,
                     resume=resume) as tracker:
        runner = DaemonRunner(cfg, resume=resume, force=force,
                              on_round=None if tracker is None else tracker.round_closed)
        runner.run()
        if tracker is not None and runner.finished is not None:
            tracker.run_finished(json.loads((cfg.out_dir / "report.json").read_text()), cfg.out_dir)
    if runner.finished is None:
        latest = runner.store.latest()
        state = getattr(runner, "state", None)
        done = f" (rounds before {state.round} are done)" if state is not None else ""
        saved = (f"last checkpoint: {latest}{done}" if latest is not None
                 else "no checkpoint yet (round 1 had not closed)")
        typer.echo(f"PS stopped; {saved}. Continue with:\n  fedmqtt ps start --config {config} --resume", err=True)
        raise typer.Exit(code=1)
    typer.echo(f"report: {cfg.out_dir / 'report.json'}")
