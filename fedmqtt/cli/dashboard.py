"""`fedmqtt dashboard`: watch a federation (live, as the observer) or finished runs (report.json) in a browser."""

from __future__ import annotations

from pathlib import Path

import typer


def dashboard(
    federation: Path | None = typer.Option(None, "--federation", help="A federation directory made by "
                                              "`fedmqtt broker init`: uses its credentials/observer.toml."),
    credentials: Path | None = typer.Option(None, "--credentials", help="An observer credentials TOML "
                                               "(its broker table); needs --run-id."),
    run_id: str | None = typer.Option(None, "--run-id", help="The run to watch (default: the federation's)."),
    run: list[Path] = typer.Option([], "--run", help="A finished run directory holding report.json (repeat to "
                                   "compare runs); no broker needed."),
    runs: list[Path] = typer.Option([], "--runs", help="An output folder: lists every finished run in it and in "
                                    "its sub-folders (three deep; the newest 100), to open and compare. "
                                    "Repeatable, and combines with --run."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. Plain HTTP on loopback only; "
                             "any other address is served over HTTPS with a login."),
    port: int = typer.Option(8765, "--port", min=1, max=65535, help="TCP port to serve on."),
    seat: str = typer.Option("2", "--seat", help="Observer seat (the broker allows one connection per login; "
                             "`topics watch` takes seat 1 by default)."),
    tls: bool = typer.Option(False, "--tls", help="HTTPS and a login on loopback too (a network --host always "
                             "has them)."),
    cert: Path | None = typer.Option(None, "--cert", help="Your own server certificate (PEM), with --key; "
                                        "default with --federation: one issued by the federation's CA."),
    key: Path | None = typer.Option(None, "--key", help="The private key of --cert (PEM)."),
    name: list[str] = typer.Option([], "--name", help="Host name or address browsers use, put in the generated "
                                   "certificate (repeatable; default: --host)."),
    password_file: Path | None = typer.Option(None, "--password-file", help="A file whose first line is the "
                                                 "login password (12+ characters). Default with --federation: a "
                                                 "random one, shown once, kept only as a scrypt hash."),
    new_password: bool = typer.Option(False, "--new-password", help="Replace the stored generated password."),
    allow_host: list[str] = typer.Option([], "--allow-host", help="Another name browsers may use for this "
                                         "dashboard (repeatable), e.g. a reverse proxy's. Requests for any name "
                                         "but its own (--host, --name, the certificate's, loopback names on "
                                         "loopback) are refused: DNS rebinding."),
) -> None:
    """Serve a read-only page: a run's progress, sites, timeline and metrics per round; for finished runs their
    results, downloads and a comparison."""
    from broker.federation import load_federation
    from fedmqtt.dashboard.hosts import allowed_hosts
    from fedmqtt.dashboard.rundir import find_runs
    from fedmqtt.dashboard.server import Board, BrokerListener, check_exposure, is_loopback, serve
    from fedmqtt.dashboard.state import RunView
    from fedmqtt.errors import FedMqttError
    from fedmqtt.transport.settings import load_credentials
    from fedmqtt.transport.signing import load_identity

    secure = tls or not is_loopback(host) or cert is not None
    check_exposure(host, secure=secure)
    if bool(federation) + bool(credentials) + bool(run or runs) != 1:
        raise FedMqttError("give exactly one of --federation DIR, --credentials observer.toml (with --run-id) "
                           "or finished runs: --run DIR and/or --runs FOLDER (both repeatable)")
    access = _access(host, federation, cert, key, name, password_file, new_password) if secure else None
    hosts = allowed_hosts(host, names=name, certificate=access.certificate if access is not None else None,
                          extra=allow_host)
    views: list[RunView] = []
    listener = None
    if run or runs:
        listed = [(directory, str(directory)) for directory in run]
        for folder in runs:
            listed += [(found, str(found.relative_to(folder)) if found != folder else str(folder))
                       for found in find_runs(folder)]
        views = [_finished(directory, label) for directory, label in listed]
        typer.echo(f"{len(views)} finished run{'s' * (len(views) != 1)}")
        board = Board(views)
    else:
        if federation is not None:
            layout = load_federation(federation)
            credentials = layout.credentials["observer"]
            run_id = run_id or layout.run_id
        elif not run_id:
            raise FedMqttError("--credentials needs --run-id (the run to watch)")
        assert credentials is not None  # exactly one of --federation, --credentials, --run (checked above)
        settings = load_credentials(credentials)
        if settings.username != "observer":
            raise FedMqttError(f"the dashboard logs in as the observer only (read-only ACL); "
                               f"{settings.username!r} could publish. Use credentials/observer.toml.")
        view = RunView(run_id=run_id, keys=load_identity(credentials, run_id=run_id).ring)
        board = Board([view])
        listener = BrokerListener(board, view, settings, seat=seat)
        listener.connect()
        listener.start()
    try:
        typer.echo(f"dashboard answers to the Host names {hosts.describe()} (--allow-host adds one)")
        serve(board, host=host, port=port, access=access, hosts=hosts,
              on_ready=lambda url: typer.echo(f"dashboard: {url}  (Ctrl-C to stop)"))
    finally:
        if listener is not None:
            listener.close()


def _finished(directory: Path, label: str):
    """The view of one finished run directory: its report, audit log and downloads."""
    from fedmqtt.dashboard.finished import run_view_from_report
    from fedmqtt.dashboard.rundir import read_audit, read_report
    from fedmqtt.errors import FedMqttError

    report = read_report(directory)
    try:
        return run_view_from_report(report, label=label, directory=directory.resolve(), audit=read_audit(directory))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FedMqttError(f"{directory / 'report.json'} is not a report.json this version can read: "
                           f"{type(exc).__name__}: {exc}") from None


def _access(host: str, federation: Path | None, cert: Path | None, key: Path | None, names: list[str],
            password_file: Path | None, new_password: bool):
    """TLS context and login for HTTPS mode; says where the certificate comes from and how to log in."""
    from broker.certs import fingerprint_sha256
    from fedmqtt.dashboard import login, tls
    from fedmqtt.dashboard.server import Access
    from fedmqtt.errors import FedMqttError

    if (cert is None) != (key is None):
        raise FedMqttError("--cert and --key go together")
    if cert is None or key is None:  # both None (they go together)
        if federation is None:
            raise FedMqttError("HTTPS needs a certificate: pass --cert and --key, or --federation DIR to have its "
                               "CA issue one")
        wildcard = host in ("0.0.0.0", "::")
        if wildcard and not names:
            raise FedMqttError(f"--host {host} listens on every address: name the ones browsers use with --name "
                               "(repeatable), so the certificate covers them")
        cert, key, ca = tls.federation_certificate(federation, list(dict.fromkeys(names or [host])))
        typer.echo(f"dashboard certificate: {cert}, issued by {ca} (SHA-256 {fingerprint_sha256(ca.read_bytes())}); "
                   "browsers trust the page once they trust that CA")
    context = tls.server_context(cert, key)
    if password_file is not None:
        hashed = login.password_from_file(password_file)
    elif federation is not None:
        hashed, fresh = login.stored_password(tls.dashboard_dir(federation), renew=new_password)
        where = tls.dashboard_dir(federation) / login.HASH_FILE
        if fresh is not None:
            typer.echo(f"dashboard password (shown only now; {where} keeps its scrypt hash): {fresh}")
        else:
            typer.echo(f"dashboard password: the one shown when {where} was made (--new-password replaces it)")
    else:
        raise FedMqttError("HTTPS mode needs a login: pass --password-file (or --federation DIR for a generated one)")
    return Access(tls=context, sessions=login.Sessions(hashed), certificate=cert)
