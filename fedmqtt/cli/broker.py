"""`fedmqtt broker ...`: create a federation's broker files and run Mosquitto with them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from broker.federation import FederationLayout

app = typer.Typer(help="Set up and run the Mosquitto broker of a federation.", no_args_is_help=True)


@app.command("init")
def init(
    fed_dir: Path = typer.Option(..., "--dir", help="Federation directory to create."),
    run_id: str = typer.Option(..., "--run-id", help="Run id: a-z, 0-9 and '-'."),
    sites: list[str] = typer.Option(..., "--site", help="A site id; repeat for every hospital."),
    hosts: list[str] = typer.Option(
        ["127.0.0.1"], "--host",
        help="Name or address parties connect to; repeat for more names (all go into the server certificate).",
    ),
    sans: list[str] = typer.Option([], "--san", help="Another name or address for the server certificate only."),
    bind: str | None = typer.Option(None, help="Address the network listener binds (default: the first --host)."),
    port: int | None = typer.Option(
        None, help="Plain port: the only listener on loopback, or the loopback one next to TLS (under --mtls it "
        "asks for a client certificate too) (default: free)."
    ),
    tls: bool | None = typer.Option(
        None, "--tls/--no-tls", help="TLS listener (default: on unless --host and --bind are loopback; --tls forces "
        "it there)."
    ),
    tls_port: int | None = typer.Option(None, help="TLS port (default 8883; a free one on loopback)."),
    mtls: bool = typer.Option(False, "--mtls", help="Mutual TLS: the client certificate is the login on every "
                              "listener (one per connection user, CN = user); a password alone is refused."),
    insecure_plaintext: bool = typer.Option(
        False, "--insecure-plaintext",
        help="Allow plain text for a network --host or --bind (even one bound to loopback behind a port forward): "
        "passwords and models travel unencrypted.",
    ),
    ca_cert: Path | None = typer.Option(None, help="Your own CA certificate (PEM) instead of a new private CA."),
    ca_key: Path | None = typer.Option(None, help="Its key: only needed with --mtls (to issue client certs)."),
    server_cert: Path | None = typer.Option(None, help="Your own server certificate (PEM), issued by --ca-cert."),
    server_key: Path | None = typer.Option(None, help="Its private key (PEM)."),
    max_inflight: int | None = typer.Option(
        None, help="QoS 2 window of the broker (mosquitto.conf: 20). Hospitals bridged over slow links need the "
        "value `broker bridge` prints."),
    export_root_key: Path | None = typer.Option(
        None, help="Write the root CA's key to this new file instead of the broker folder, and take it off the "
        "broker host: running, add-site and rotate never need it (the issuing CA signs)."),
    force: bool = typer.Option(False, help="Replace an existing federation in --dir (every secret changes)."),
) -> None:
    """Create a federation: broker config, passwords, ACL, TLS certificates, one credentials file per party.

    Writes mosquitto.conf, the password file (mosquitto_passwd), the ACL, TLS certificates and one credentials
    file per party. Off loopback the broker listens with TLS; each credentials file carries the CA.
    """
    from broker.audit_trail import record_init
    from broker.federation import OwnCertificates, init_federation

    own = None
    given = [ca_cert, server_cert, server_key]
    if any(p is not None for p in given):
        if not all(p is not None for p in given):
            raise typer.BadParameter("your own certificates need all of --ca-cert, --server-cert and --server-key")
        own = OwnCertificates(ca_cert, server_cert, server_key, ca_key)  # type: ignore[arg-type]
    layout = init_federation(
        fed_dir, run_id=run_id, site_ids=sites, host=hosts[0], names=[*hosts[1:], *sans], port=port,
        force=force, tls=tls, mtls=mtls, bind=bind, tls_port=tls_port, insecure_plaintext=insecure_plaintext,
        own_certs=own, max_inflight=max_inflight, export_root_key=export_root_key,
    )
    record_init(layout, force=force)
    if insecure_plaintext:
        typer.secho("WARNING: --insecure-plaintext: passwords and models cross the network unencrypted.",
                    fg=typer.colors.RED, err=True)
    typer.echo(f"federation {layout.run_id} in {layout.fed_dir}")
    typer.echo(f"  broker config : {layout.conf_path}")
    _echo_listeners(layout)
    for user, path in sorted(layout.credentials.items()):
        typer.echo(f"  credentials   : {path}  ({user})")
    if export_root_key is not None:
        typer.echo(f"  root CA key   : {export_root_key}: move it off this host and keep it offline")
    elif layout.root_key_path.is_file():
        typer.echo(f"  root CA key   : {layout.root_key_path} (better kept off this host: --export-root-key)")
    typer.echo(f"  coordinator   : {layout.coordinator.dir}  (the key that signs the key list: yours only)")
    typer.echo(f"  monitor login : {layout.monitor_login_path}  (reads the broker's $SYS numbers only, "
               "docs/monitoring.md)")
    typer.echo("Give each party only its own credentials file (it holds its password and signing key; keep it "
               "0600). Keep the coordinator folder with the team that adds and removes parties, off the broker "
               "host if another team runs it.")


@app.command("start")
def start(fed_dir: Path = typer.Option(..., "--dir", help="Federation directory made by `broker init`.")) -> None:
    """Run Mosquitto for the federation in the foreground until Ctrl-C."""
    import os

    from broker.audit_trail import record_broker
    from broker.bridge import HOSPITAL_FILE
    from broker.federation import load_federation
    from broker.keys import publish_key_list
    from broker.process import BrokerProcess
    from fedmqtt.atomic import write_atomic

    if (fed_dir / HOSPITAL_FILE).is_file():
        _start_hospital(fed_dir)
        return
    layout = load_federation(fed_dir)
    _stop_on_sigterm()
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.listen_host) as proc:
        # A SIGTERM from here on (the pid file below tells others the broker is up) stops it as cleanly as one
        # while it serves: a test that signalled right after the pid file appeared saw exit code 130 and no output.
        try:
            # add-site/remove-site/rotate read this to make the running broker reload (SIGHUP). Written whole or
            # not at all: a reader that came at the wrong moment saw an empty file (an e2e test did).
            write_atomic(layout.pid_path, f"{proc.pid}\n".encode("ascii"), durable=False)
            record_broker(layout, "broker-start", pid=proc.pid,
                          listeners=[x.describe() for x in layout.listeners()])
            typer.echo(f"mosquitto pid {proc.pid}; log {layout.log_path}; Ctrl-C stops")
            _echo_listeners(layout)
            if layout.coordinator.login_path.is_file():  # the coordinator's folder is here: (re)publish the list
                typer.echo(publish_key_list(layout.fed_dir, layout.run_id))  # e.g. the broker's database was lost
            while proc.alive:
                time.sleep(0.5)
        except KeyboardInterrupt:
            typer.echo("stopping mosquitto")
        finally:
            record_broker(layout, "broker-stop", pid=proc.pid, cause="signal" if proc.alive else "mosquitto exited")
            if layout.pid_path.is_file() and layout.pid_path.read_text(encoding="ascii").strip() == str(proc.pid):
                os.unlink(layout.pid_path)
    if not proc.alive:
        typer.echo(proc.output_tail())


def _stop_on_sigterm() -> None:
    """SIGTERM (`kill`, a service manager) stops Mosquitto as Ctrl-C does. Mosquitto runs in its own session
    (so a terminal's Ctrl-C reaches this process first); without this, a terminated `broker start` would leave
    it running, still holding the port."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _start_hospital(out_dir: Path) -> None:
    from broker.bridge import load_hospital
    from broker.process import BrokerProcess

    hospital = load_hospital(out_dir)
    _stop_on_sigterm()
    with BrokerProcess.start(hospital.conf_path, port=hospital.port) as proc:
        typer.echo(f"hospital broker pid {proc.pid} on 127.0.0.1:{hospital.port} (plain TCP, loopback only); "
                   f"bridge state on {hospital.notification_topic}; log {out_dir / 'mosquitto.log'}; Ctrl-C stops")
        try:
            while proc.alive:
                time.sleep(0.5)
        except KeyboardInterrupt:
            typer.echo("stopping mosquitto")
    if not proc.alive:
        typer.echo(proc.output_tail())


@app.command("bridge")
def bridge_cmd(
    credentials: Path = typer.Option(..., "--credentials", help="This site's credentials file from the federation."),
    run_id: str = typer.Option(..., "--run-id", help="The federation's run id."),
    out_dir: Path = typer.Option(..., "--out", help="Directory for the hospital broker (created)."),
    model_bytes: int = typer.Option(
        64 * 1024 * 1024, "--model-bytes", help="Largest model the run exchanges, in bytes: sizes the queues."
    ),
    site: str | None = typer.Option(None, "--site", help="Site id (default: the credentials' user)."),
    port: int | None = typer.Option(None, help="Loopback port of the hospital broker (default: free)."),
    remote: str | None = typer.Option(
        None, help="HOST:PORT the bridge dials instead of the central broker's address (e.g. an outbound relay)."
    ),
    force: bool = typer.Option(False, help="Replace a hospital broker already in --out."),
) -> None:
    """Write a hospital broker, bridged to the federation's broker for this site's topics only.

    Also writes a credentials file for the hospital's site agent that points at it. Start it with
    `fedmqtt broker start --dir OUT`.
    """
    from broker.bridge import CENTRAL_MAX_QUEUED_BYTES, load_central, write_hospital_broker
    from fedmqtt.config_io import read_toml

    central = load_central(credentials)
    signing = read_toml(credentials).get("signing")  # the agent behind the hospital broker signs with it
    hospital = write_hospital_broker(central, run_id=run_id, site=site or central.username, out_dir=out_dir,
                                     model_bytes=model_bytes, local_port=port, remote=remote, force=force,
                                     signing=signing if isinstance(signing, dict) else None)
    typer.echo(f"hospital broker in {hospital.out_dir}: 127.0.0.1:{hospital.port}, bridged to "
               f"{central.host}:{central.port} over TLS")
    typer.echo(f"  site agent credentials : {hospital.credentials}")
    typer.echo(f"  bridge state topic     : {hospital.notification_topic} (\"1\" up, \"0\" down)")
    typer.echo(f"  QoS 2 window           : {hospital.flow.max_inflight_messages}; the federation's broker needs "
               f"at least as much (broker init --max-inflight {hospital.flow.max_inflight_messages}), or a slow "
               "link drops chunks")
    if 3 * model_bytes > CENTRAL_MAX_QUEUED_BYTES:
        typer.secho(f"WARNING: the central broker queues up to {CENTRAL_MAX_QUEUED_BYTES} bytes per client; "
                    f"a {model_bytes}-byte model needs max_queued_bytes >= {3 * model_bytes} there too "
                    "(docs/deployment.md, broker sizing)", fg=typer.colors.YELLOW, err=True)


@app.command("add-site")
def add_site_cmd(
    fed_dir: Path = typer.Option(..., "--dir", help="Federation directory made by `broker init`."),
    site: str = typer.Option(..., "--site", help="The new site id."),
) -> None:
    """Add one hospital (user, ACL rights, credentials file); the others keep their secrets.

    A running broker reloads at once. The PS takes its list of sites from its own config: add the site
    there too for the next run.
    """
    from broker.audit_trail import record_party_change
    from broker.federation import add_site, load_federation

    layout, path = add_site(load_federation(fed_dir), site)
    record_party_change(layout, "party-add", site)
    typer.echo(f"added {site}: hand over {path} (and only that file)")
    _publish_keys(layout, running=_reload(layout))


@app.command("remove-site")
def remove_site_cmd(
    fed_dir: Path = typer.Option(..., "--dir", help="Federation directory made by `broker init`."),
    site: str = typer.Option(..., "--site", help="The site id to remove."),
) -> None:
    """Take one hospital out: its password, ACL rights, credentials (and client certificate, on the CRL) go."""
    from broker.audit_trail import record_party_change
    from broker.federation import load_federation, remove_site

    layout = remove_site(load_federation(fed_dir), site)
    record_party_change(layout, "party-remove", site)
    typer.echo(f"removed {site}")
    _publish_keys(layout, running=_reload(layout))  # from now on every party refuses what the site signs


@app.command("rotate")
def rotate_cmd(
    fed_dir: Path = typer.Option(..., "--dir", help="Federation directory made by `broker init`."),
    user: str = typer.Option(..., "--party", help="Whose secrets: a site id, ps or observer."),
) -> None:
    """New password (and client certificate under --mtls) for one party; its old ones stop working."""
    from broker.audit_trail import record_party_change
    from broker.federation import load_federation, rotate

    layout = load_federation(fed_dir)
    path = rotate(layout, user)
    record_party_change(layout, "party-rotate", user)
    typer.echo(f"rotated {user}: hand over the new {path}; connections made with the old secrets stay up "
               "until they reconnect, but what they sign is refused once the new key list is out")
    _publish_keys(layout, running=_reload(layout))


def _reload(layout: FederationLayout) -> bool:
    """Make a running broker reload; True if one runs."""
    from broker.federation import reload_broker

    pid = reload_broker(layout)
    if pid is None:
        typer.echo("no running broker of this federation found: the change applies when it starts")
    else:
        typer.echo(f"broker pid {pid} reloads its password file, ACL and CRL (SIGHUP)")
    return pid is not None


def _publish_keys(layout: FederationLayout, *, running: bool) -> None:
    """Put the new key list on the running broker, where running parties take it at once."""
    from broker.keys import publish_key_list

    if running:
        typer.echo(publish_key_list(layout.fed_dir, layout.run_id))
    else:
        typer.echo("the new key list goes out with the next `broker start` here (or `broker keys --publish`); "
                   "until then running parties keep the one they have")


@app.command("keys")
def keys_cmd(
    fed_dir: Path = typer.Option(..., "--dir", help="Federation directory made by `broker init`."),
    publish: bool = typer.Option(False, "--publish", help="Also put the key list on the running broker "
                                 "(retained on federation/keys), e.g. after its database was lost."),
) -> None:
    """Show the federation's key list (the signing key of every party, signed by the coordinator key)."""
    from broker.federation import load_federation
    from broker.keys import publish_key_list
    from fedmqtt.transport.signing import from_b64u
    from schemas.signed import key_id

    layout = load_federation(fed_dir)
    current = layout.coordinator.key_list()
    typer.echo(f"key list version {current.version} of run {layout.run_id} (coordinator key "
               f"{key_id(layout.coordinator.public_key())})")
    for party, entry in sorted(current.keys.items()):
        typer.echo(f"  {party:<24} {key_id(from_b64u(entry.ed25519))}")
    if publish:
        typer.echo(publish_key_list(layout.fed_dir, layout.run_id))


def _echo_listeners(layout: FederationLayout) -> None:
    for listener in layout.listeners():
        typer.echo(f"  listener      : {listener.describe()}")
    fingerprint = layout.ca_fingerprint()
    if fingerprint is not None:
        typer.echo(f"  CA SHA-256    : {fingerprint}")
        typer.echo(f"  broker key    : SHA-256 {layout.broker_key_fingerprint()} (pinned in every credentials file)")


@app.command("acl")
def acl(
    run_id: str = typer.Option(..., "--run-id", help="The federation's run id."),
    sites: list[str] = typer.Option(..., "--site", help="A site id; repeat for every hospital."),
) -> None:
    """Print the ACL the federation would use (generated from the topic builders)."""
    from broker.acl import render_acl

    typer.echo(render_acl(run_id, sites), nl=False)
