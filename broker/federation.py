"""Lay out one federation on disk: broker config, password file, ACL, a credentials file per party, and the
coordinator's signing key and key list (broker/keys.py)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from broker import certs
from broker.acl import MONITOR_USER, login_names, render_acl
from broker.config import (
    Listener,
    TlsFiles,
    connection_limit,
    free_port,
    render_broker_config,
    set_connection_limit,
)
from broker.keys import COORDINATOR_DIR, Coordinator
from broker.passwords import generate_password, write_password_file
from broker.process import prepare_for_broker_user
from fedmqtt.config_io import dump_toml, load_toml
from fedmqtt.errors import BrokerError, ConfigError
from fedmqtt.transport.settings import BrokerSettings, load_credentials
from fedmqtt.transport.signing import SIGNING_TABLE, Identity, load_identity, new_private_key, public_raw
from fedmqtt.transport.topics import validate_id
from schemas.signed import COORDINATOR

PS_USER = "ps"
OBSERVER_USER = "observer"
FEDERATION_FILE = "federation.toml"
_MANAGED = (FEDERATION_FILE, "broker", "credentials", COORDINATOR_DIR)  # what init writes, all that force removes
DEFAULT_TLS_PORT = 8883
ISSUING_CERT, ISSUING_KEY = "issuing-ca.crt", "issuing-ca.key"  # the CA that signs leaves (broker/certs.py)
CA_CHAIN = "ca-chain.crt"  # root + issuing CA: what the broker checks client certificates against
PID_FILE = "mosquitto.pid"  # written by `broker start`, read by add-site/remove-site/rotate to reload


class _FederationFile(BaseModel):
    """`federation.toml`: what `load_federation` needs to rebuild the layout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    host: str  # the address every party connects to
    port: int = Field(ge=1, le=65535)  # the port every party connects to (the TLS one when tls)
    site_ids: list[str]
    tls: bool = False
    mtls: bool = False
    bind: str | None = None  # the TLS (or network) listener's bind address; None: `host`
    plain_port: int | None = Field(default=None, ge=1, le=65535)  # loopback plain listener next to TLS
    names: list[str] = Field(default_factory=list)  # host names / addresses in the server certificate
    max_inflight: int | None = Field(default=None, ge=1, le=65535)  # overrides mosquitto.conf (bridged sites)


@dataclass(frozen=True)
class ListenerInfo:
    host: str
    port: int
    tls: bool
    mtls: bool = False

    def describe(self) -> str:
        kind = "TLS, client certificate required" if self.mtls else "TLS" if self.tls else "plain TCP, no TLS"
        return f"{self.host}:{self.port} ({kind})"


@dataclass(frozen=True)
class FederationLayout:
    """Where one federation's files are, and how each party reaches the broker."""

    fed_dir: Path
    run_id: str
    site_ids: tuple[str, ...]
    host: str
    port: int
    conf_path: Path
    credentials: dict[str, Path]
    tls: bool = False
    mtls: bool = False
    bind: str = ""
    plain_port: int | None = None
    names: tuple[str, ...] = field(default=())
    max_inflight: int | None = None

    @property
    def broker_dir(self) -> Path:
        return self.fed_dir / "broker"

    @property
    def log_path(self) -> Path:
        return self.broker_dir / "mosquitto.log"

    @property
    def listen_host(self) -> str:
        """Where the party-facing listener binds (what `BrokerProcess` probes)."""
        return self.bind or self.host

    @property
    def ca_path(self) -> Path:
        """The root CA certificate: the parties' trust anchor (what their credentials carry)."""
        return self.broker_dir / "ca.crt"

    @property
    def root_key_path(self) -> Path:
        """The root CA's key, unless `broker init --export-root-key` put it elsewhere (off this host)."""
        return self.broker_dir / "root-ca.key"

    @property
    def monitor_login_path(self) -> Path:
        """The `monitor` login (reads the broker's `$SYS` numbers only), for an exporter on the broker host."""
        return self.broker_dir / "monitor.toml"

    @property
    def pid_path(self) -> Path:
        return self.broker_dir / PID_FILE

    def listeners(self) -> list[ListenerInfo]:
        out = [ListenerInfo(self.listen_host, self.port, self.tls, self.mtls)]
        if self.plain_port is not None:  # under mutual TLS it asks for a certificate too: it accepts parties
            out.append(ListenerInfo("127.0.0.1", self.plain_port, self.mtls, self.mtls))
        return out

    def ca_fingerprint(self) -> str | None:
        return certs.fingerprint_sha256(self.ca_path.read_bytes()) if self.tls else None

    def broker_key_fingerprint(self) -> str | None:
        """SHA-256 of the broker certificate's public key: what every party's credentials pin."""
        return certs.broker_key_sha256((self.broker_dir / "server.crt").read_bytes()) if self.tls else None

    def settings(self, user: str) -> BrokerSettings:
        """The `[broker]` settings of `user` (ps, observer or a site id) from its credentials file."""
        if user not in self.credentials:
            raise ConfigError(
                f"no broker user {user!r} in federation {self.fed_dir}; have {sorted(self.credentials)}"
            )
        return load_credentials(self.credentials[user])

    def identity(self, user: str) -> Identity:
        """What `user` signs with and verifies against (the `[signing]` table of its credentials file)."""
        self.settings(user)  # names the known users if `user` is not one
        return load_identity(self.credentials[user], run_id=self.run_id)

    @property
    def coordinator(self) -> Coordinator:
        """The coordinator's signing key and key list (only where the coordinating team keeps this folder)."""
        return Coordinator(self.fed_dir, self.run_id)


@dataclass(frozen=True)
class OwnCertificates:
    """Certificates an operator brings instead of the generated private CA (PEM files)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    ca_key: Path | None = None  # needed only to issue client certificates (--mtls)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def init_federation(
    fed_dir: Path,
    *,
    run_id: str,
    site_ids: list[str],
    host: str = "127.0.0.1",
    port: int | None = None,
    force: bool = False,
    tls: bool | None = None,
    mtls: bool = False,
    names: list[str] | None = None,
    bind: str | None = None,
    tls_port: int | None = None,
    insecure_plaintext: bool = False,
    own_certs: OwnCertificates | None = None,
    max_inflight: int | None = None,
    export_root_key: Path | None = None,
) -> FederationLayout:
    """Create broker config, ACL, password file and per-user credentials for one run under `fed_dir`.

    TLS is on by default when `host` (what parties connect to) or `bind` is not a loopback address, whatever the
    bind address: a broker bound to loopback behind a port forward still has its passwords cross the network.
    A root CA, a name-constrained issuing CA and a server certificate for `host` and `names` are created (or
    `own_certs` used), the TLS listener takes `tls_port` (8883) and a plain listener stays on 127.0.0.1:`port`
    for tools on the broker host. A plain listener for a network host needs `insecure_plaintext`. `tls=True`
    forces TLS on loopback (tests); `mtls` makes the client certificate the identity on every listener.
    `export_root_key`: write the root CA's key there (a new file) instead of into the broker folder, so it can
    leave the broker host. `max_inflight`: the broker's QoS 2 window, raised for hospitals bridged over slow
    links (see broker/bridge.py).
    """
    fed_dir = Path(fed_dir).resolve()
    users = _check_ids(run_id, site_ids)
    network = not is_loopback(host) or (bind is not None and not is_loopback(bind))
    tls = (network and not insecure_plaintext) if tls is None else tls
    if mtls and not tls:
        raise ConfigError("--mtls needs TLS")
    if tls and insecure_plaintext:
        raise ConfigError("--insecure-plaintext and TLS exclude each other")
    if not tls and network and not insecure_plaintext:
        where = host if not is_loopback(host) else bind
        raise ConfigError(
            f"{where} is a network name or address: without TLS every password and model crosses the network in "
            "clear text, whatever address the broker binds (a port forward or proxy carries it on). Drop --no-tls, "
            "or pass --insecure-plaintext if this network is truly private."
        )
    if export_root_key is not None and (own_certs is not None or not tls):
        raise ConfigError("--export-root-key needs the federation's own CA (TLS, without --ca-cert)")
    if export_root_key is not None and Path(export_root_key).exists():
        raise ConfigError(f"{export_root_key} exists already: the root CA key goes to a new file")
    if own_certs is not None and mtls and own_certs.ca_key is None:
        raise ConfigError("--mtls with your own CA needs its key (--ca-key) to issue the client certificates")
    existing = [name for name in _MANAGED if (fed_dir / name).exists()]
    if existing and not force:
        raise BrokerError(
            f"{fed_dir} already holds a federation ({', '.join(existing)}); pass force to replace it"
        )
    for name in existing:
        target = fed_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    # Under mutual TLS the loopback listener is a TLS one as well, so our certificate names 127.0.0.1 too.
    loopback_name = ["127.0.0.1"] if mtls and own_certs is None else []
    all_names = list(dict.fromkeys([host, *(names or []), *loopback_name]))
    if tls:
        party_port = tls_port if tls_port is not None else (DEFAULT_TLS_PORT if network else free_port())
        plain_port = port if port is not None else free_port("127.0.0.1")
    else:
        party_port = port if port is not None else free_port(bind or host)
        plain_port = None
    meta = _FederationFile(
        run_id=run_id, host=host, port=party_port, site_ids=users[2:], tls=tls, mtls=mtls, bind=bind,
        plain_port=plain_port, names=all_names if tls else [], max_inflight=max_inflight,
    )
    layout = _layout(fed_dir, meta)
    layout.broker_dir.mkdir(parents=True, mode=0o700)
    if tls:
        _write_server_certs(layout, own_certs, export_root_key)
    _write_broker_files(layout)
    passwords = {user: generate_password() for user in [*users, COORDINATOR, MONITOR_USER]}
    write_password_file(layout.broker_dir / "passwd", passwords)
    coordinator, keys = Coordinator.create(fed_dir, run_id, [user for user in users if user != OBSERVER_USER])
    _write_login(layout, COORDINATOR, passwords[COORDINATOR], coordinator.login_path)
    _write_login(layout, MONITOR_USER, passwords[MONITOR_USER], layout.monitor_login_path)
    (fed_dir / "credentials").mkdir(mode=0o700)
    for user in users:
        _write_credentials(layout, user, passwords[user], coordinator.signing_table(user, keys.get(user)))
    (fed_dir / FEDERATION_FILE).write_text(dump_toml(meta.model_dump(exclude_none=True)), encoding="utf-8")
    return layout


def load_federation(fed_dir: Path) -> FederationLayout:
    """The layout that `init_federation` wrote to `fed_dir`."""
    fed_dir = Path(fed_dir).resolve()
    meta = load_toml(fed_dir / FEDERATION_FILE, _FederationFile)
    _check_ids(meta.run_id, meta.site_ids)
    return _layout(fed_dir, meta)


# -- one party at a time, on a running broker ---------------------------------------------------------


def add_site(layout: FederationLayout, site: str) -> tuple[FederationLayout, Path]:
    """Add one hospital: its user, ACL block, signing key (a new key list) and credentials file; nobody else's
    secrets change."""
    validate_id(site, what="site id")
    if site in layout.credentials:
        raise ConfigError(f"{site!r} is already a party of this federation; use rotate to replace its secrets")
    key = new_private_key()
    layout.coordinator.change(set_keys={site: public_raw(key)})  # first: it fails without the coordinator key
    new = _save_sites(layout, [*layout.site_ids, site])
    password = generate_password()
    _set_password_entry(new, site, password)
    _write_credentials(new, site, password, new.coordinator.signing_table(site, key))
    _write_acl(new)
    _write_connection_limit(new)
    return new, new.credentials[site]


def remove_site(layout: FederationLayout, site: str) -> FederationLayout:
    """Take one hospital out: its password entry, its ACL rights, its key (a new key list) and its credentials
    file go."""
    if site not in layout.site_ids:
        raise ConfigError(f"{site!r} is not a site of this federation; sites: {list(layout.site_ids)}")
    layout.coordinator.change(remove=(site,))
    new = _save_sites(layout, [s for s in layout.site_ids if s != site])
    _set_password_entry(new, site, None)
    _write_acl(new)  # the removed user has no ACL block left, so it has no rights at all
    _write_connection_limit(new)
    _revoke_client_cert(layout, site)
    layout.credentials[site].unlink(missing_ok=True)
    return new


def rotate(layout: FederationLayout, user: str) -> Path:
    """A new password, signing key (a new key list; not for the observer, which signs nothing) and, under
    mutual TLS, client certificate for one party; the old ones stop working."""
    if user not in layout.credentials:
        raise ConfigError(f"no party {user!r}; parties: {sorted(layout.credentials)}")
    key = None if user == OBSERVER_USER else new_private_key()
    if key is not None:
        layout.coordinator.change(set_keys={user: public_raw(key)})
    password = generate_password()
    _revoke_client_cert(layout, user)
    _set_password_entry(layout, user, password)
    _write_credentials(layout, user, password, layout.coordinator.signing_table(user, key))
    _write_acl(layout)  # unchanged, except for a federation made before a login (`<user>.check`) existed
    return layout.credentials[user]


def reload_broker(layout: FederationLayout) -> int | None:
    """SIGHUP the running broker of this federation (Mosquitto re-reads its password file and ACL).

    Returns the pid signalled, or None when no broker of this federation runs (the change applies at its next
    start). The pid is only trusted if that process runs mosquitto with this federation's config.
    """
    try:
        pid = int(layout.pid_path.read_text(encoding="ascii").strip())
    except (FileNotFoundError, ValueError):
        return None
    if not _runs_our_broker(pid, layout.conf_path):
        return None
    prepare_for_broker_user(layout.conf_path)  # files replaced as root: readable by the broker's user again
    os.kill(pid, signal.SIGHUP)
    return pid


def _runs_our_broker(pid: int, conf_path: Path) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and argv[0].endswith(b"mosquitto") and str(conf_path).encode() in argv


def _check_ids(run_id: str, site_ids: list[str]) -> list[str]:
    """Validate ids and return every broker user: ps, observer, then the sorted site ids."""
    validate_id(run_id, what="run id")
    sites = sorted(validate_id(site, what="site id") for site in site_ids)
    if not sites:
        raise ConfigError("a federation needs at least one site id")
    if len(set(sites)) != len(sites):
        raise ConfigError(f"duplicate site ids in {site_ids}")
    reserved = {PS_USER, OBSERVER_USER, COORDINATOR, MONITOR_USER} & set(sites)
    if reserved:
        raise ConfigError(
            f"site ids may not be {sorted(reserved)}: those names are the PS, observer, coordinator and monitor "
            "users"
        )
    return [PS_USER, OBSERVER_USER, *sites]


def _layout(fed_dir: Path, meta: _FederationFile) -> FederationLayout:
    sites = sorted(meta.site_ids)
    users = [PS_USER, OBSERVER_USER, *sites]
    return FederationLayout(
        fed_dir=fed_dir,
        run_id=meta.run_id,
        site_ids=tuple(sites),
        host=meta.host,
        port=meta.port,
        conf_path=fed_dir / "broker" / "mosquitto.conf",
        credentials={user: fed_dir / "credentials" / f"{user}.toml" for user in users},
        tls=meta.tls,
        mtls=meta.mtls,
        bind=meta.bind or "",
        plain_port=meta.plain_port,
        names=tuple(meta.names),
        max_inflight=meta.max_inflight,
    )


def _meta(layout: FederationLayout, site_ids: list[str]) -> _FederationFile:
    return _FederationFile(
        run_id=layout.run_id, host=layout.host, port=layout.port, site_ids=site_ids, tls=layout.tls,
        mtls=layout.mtls, bind=layout.bind or None, plain_port=layout.plain_port, names=list(layout.names),
        max_inflight=layout.max_inflight,
    )


def _save_sites(layout: FederationLayout, site_ids: list[str]) -> FederationLayout:
    _check_ids(layout.run_id, site_ids)
    meta = _meta(layout, site_ids)
    path = layout.fed_dir / FEDERATION_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_toml(meta.model_dump(exclude_none=True)), encoding="utf-8")
    os.replace(tmp, path)
    return _layout(layout.fed_dir, meta)


def _write_server_certs(layout: FederationLayout, own: OwnCertificates | None, export_root_key: Path | None) -> None:
    """ca.crt (the parties' trust anchor), the issuing CA, ca-chain.crt (what the broker checks client
    certificates against), server.crt (with its chain) and server.key, and under mutual TLS an empty CRL."""
    d = layout.broker_dir
    if own is None:
        root = certs.create_root_ca(layout.run_id)
        issuing = certs.create_issuing_ca(root, layout.run_id, list(layout.names))
        server = certs.issue_server_cert(issuing, list(layout.names))
        server = certs.KeyPair(server.cert_pem + issuing.cert_pem, server.key_pem)  # parties hold the root only
        certs.write_private(Path(export_root_key) if export_root_key is not None else layout.root_key_path,
                            root.key_pem)
        certs.write_private(d / ISSUING_KEY, issuing.key_pem)  # signs client certificates on add-site/rotate
        (d / ISSUING_CERT).write_bytes(issuing.cert_pem)
        anchor, chain = root.cert_pem, root.cert_pem + issuing.cert_pem
    else:
        anchor = chain = Path(own.ca_cert).read_bytes()
        server = certs.KeyPair(Path(own.server_cert).read_bytes(), Path(own.server_key).read_bytes())
        certs.check_server_cert(server.cert_pem, anchor, list(layout.names))
        if own.ca_key is not None:  # their CA issues the client certificates itself
            certs.write_private(d / ISSUING_KEY, Path(own.ca_key).read_bytes())
            (d / ISSUING_CERT).write_bytes(anchor)
    (d / "ca.crt").write_bytes(anchor)
    (d / CA_CHAIN).write_bytes(chain)
    (d / "server.crt").write_bytes(server.cert_pem)
    certs.write_private(d / "server.key", server.key_pem)
    if layout.mtls:  # an empty CRL from the start: Mosquitto refuses to start on a missing crlfile
        (d / "crl.pem").write_bytes(certs.revoke(_issuer(layout), None, None))


def _issuer(layout: FederationLayout) -> certs.KeyPair:
    """The CA that signs client certificates: the issuing CA (a federation made before it existed: ca.key)."""
    d = layout.broker_dir
    if (d / ISSUING_KEY).is_file():
        return certs.KeyPair((d / ISSUING_CERT).read_bytes(), (d / ISSUING_KEY).read_bytes())
    return certs.KeyPair(layout.ca_path.read_bytes(), (d / "ca.key").read_bytes())


def _revoke_client_cert(layout: FederationLayout, user: str) -> None:
    """Under mutual TLS, put `user`'s current client certificates (every login's) on the CRL the broker checks."""
    if not layout.mtls or not layout.credentials[user].is_file():
        return
    old = load_toml(layout.credentials[user], BrokerSettings, section="broker")
    if old.tls_cert_pem is None:
        return
    pem = (old.tls_cert_pem + (old.tls_seat_certs_pem or "")).encode("ascii")
    crl = layout.broker_dir / "crl.pem"
    certs.write_private(crl, certs.revoke(_issuer(layout), crl.read_bytes() if crl.is_file() else None, pem))
    crl.chmod(0o644)


def _write_acl(layout: FederationLayout) -> None:
    path = layout.broker_dir / "acl"
    tmp = path.with_name("acl.tmp")
    tmp.write_text(render_acl(layout.run_id, list(layout.site_ids)), encoding="utf-8")
    os.replace(tmp, path)  # the broker never reads half an ACL on reload


def _write_connection_limit(layout: FederationLayout) -> None:
    """Each listener's max_connections for the sites now in the federation (Mosquitto reads it at its next start;
    until then the headroom of `connection_limit` lets added sites in)."""
    conf = layout.conf_path.read_text(encoding="utf-8")
    layout.conf_path.write_text(set_connection_limit(conf, connection_limit(len(layout.site_ids))), encoding="utf-8")


def _write_broker_files(layout: FederationLayout) -> None:
    data_dir = layout.broker_dir / "data"
    data_dir.mkdir(parents=True, mode=0o700)
    _write_acl(layout)
    d = layout.broker_dir
    tls = (
        TlsFiles(cafile=d / CA_CHAIN, certfile=d / "server.crt", keyfile=d / "server.key",
                 require_certificate=layout.mtls, crlfile=d / "crl.pem" if layout.mtls else None)
        if layout.tls
        else None
    )
    listeners = [Listener(layout.port, layout.listen_host, tls)]
    if layout.plain_port is not None:
        # Broker-host tools only. Under mutual TLS it takes certificates like the other one: a listener that
        # accepted a password alone would be the way around them.
        listeners.append(Listener(layout.plain_port, "127.0.0.1", tls if layout.mtls else None))
    conf = render_broker_config(
        listeners=listeners,
        password_file=layout.broker_dir / "passwd",
        acl_file=layout.broker_dir / "acl",
        persistence_dir=data_dir,
        log_file=layout.log_path,
        # later lines win in Mosquitto: this overrides the base file's window for this broker only
        extra=[f"max_inflight_messages {layout.max_inflight}"] if layout.max_inflight is not None else None,
        max_connections=connection_limit(len(layout.site_ids)),
    )
    layout.conf_path.write_text(conf, encoding="utf-8")


def _set_password_entry(layout: FederationLayout, user: str, password: str | None) -> None:
    """Replace (or with None remove) one user's line of the hashed password file, leaving the others as they are."""
    passwd = layout.broker_dir / "passwd"
    logins = set(login_names(user))  # the party's control, bulk and observer-seat users go together
    lines = [ln for ln in passwd.read_text(encoding="utf-8").splitlines() if ln and ln.split(":", 1)[0] not in logins]
    if password is not None:
        with tempfile.TemporaryDirectory(dir=layout.broker_dir) as tmp:  # hash via mosquitto_passwd -U
            one = Path(tmp) / "one"
            write_password_file(one, {user: password})
            lines += one.read_text(encoding="utf-8").split()
    tmp_path = passwd.with_name("passwd.tmp")
    tmp_path.unlink(missing_ok=True)
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(f"{ln}\n" for ln in lines))
    os.replace(tmp_path, passwd)


def _write_credentials(layout: FederationLayout, user: str, password: str, signing: dict[str, object]) -> None:
    """One file per party, 0600: its `[signing]` table (its own signing key, the coordinator's public key and
    the key list) and its `[broker]` table (last, so lines appended to the file land there)."""
    _write_login(layout, user, password, layout.credentials[user], signing=signing)


def _write_login(layout: FederationLayout, user: str, password: str, path: Path, *,
                 signing: dict[str, object] | None = None) -> None:
    """Broker address, user, password and, with TLS, the CA (and its own client certificate and key under
    mutual TLS) as PEM text, so nothing else has to travel with it; 0600."""
    table: dict[str, object] = {"host": layout.host, "port": layout.port, "username": user, "password": password}
    if layout.tls:
        table["tls_ca_pem"] = layout.ca_path.read_text(encoding="ascii")
        table["tls_broker_key_sha256"] = layout.broker_key_fingerprint()
    if layout.mtls:
        issuer = _issuer(layout)
        logins = login_names(user, observer_user=OBSERVER_USER)
        client = certs.issue_client_cert(issuer, logins[0], run_id=layout.run_id)
        seats = [certs.issue_client_cert(issuer, login, run_id=layout.run_id, key_pem=client.key_pem)
                 for login in logins[1:]]
        table["tls_cert_pem"] = client.cert_pem.decode("ascii")
        table["tls_key_pem"] = client.key_pem.decode("ascii")
        table["tls_seat_certs_pem"] = b"".join(seat.cert_pem for seat in seats).decode("ascii")
    BrokerSettings.model_validate(table)  # fail here, not when a party first loads its file
    data: dict[str, object] = {SIGNING_TABLE: signing, "broker": table} if signing is not None else {"broker": table}
    certs.write_private(path, dump_toml(data).encode("utf-8"))
