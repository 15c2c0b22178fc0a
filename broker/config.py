"""Render a federation's mosquitto.conf: the repo's base file plus the per-federation lines."""

from __future__ import annotations

import os
import pwd
import socket
from dataclasses import dataclass
from pathlib import Path

from broker.acl import MONITOR_USER, login_names
from fedmqtt.errors import BrokerError

BROKER_SYSTEM_USER = "mosquitto"

# Room in every listener's max_connections beyond the parties' own seats: for sites added while the broker runs
# (Mosquitto 2.0.11 reads max_connections only at start, not on the SIGHUP of add-site), eight sites of two
# connections, each with a reconnect in flight; and for probes such as `broker start` checking the port.
CONNECTION_HEADROOM = 32


def connection_limit(site_count: int) -> int:
    """`max_connections` of each listener: every login of every party (`broker.acl.login_names`: the PS and each
    site three times, with the bulk and the `site check` logins; the observer's nine seats; the monitor's one)
    twice, because a reconnect opens its new socket before the broker drops the old one (a takeover of the same
    client id), plus CONNECTION_HEADROOM. Sockets that never send CONNECT count too: Mosquitto 2.0.11 closes any
    socket past the limit at once, so this is also what bounds the descriptors and buffers that unauthenticated
    sockets can hold (each for up to 1.5 x 60 s, its keepalive before CONNECT). 2 sites: 70; 100 sites: 658."""
    logins = (len(login_names("ps")) + len(login_names("observer")) + len(login_names(MONITOR_USER))
              + site_count * len(login_names("site")))
    return 2 * logins + CONNECTION_HEADROOM


def limit_lines(max_connections: int | None) -> list[str]:
    """What follows each listener's own lines: its connection limit (none given: Mosquitto's unlimited)."""
    return [] if max_connections is None else [f"max_connections {max_connections}"]


def set_connection_limit(conf: str, max_connections: int) -> str:
    """`conf` with every listener's max_connections set to `max_connections` (add-site and remove-site: the
    broker reads it at its next start)."""
    return "".join(f"max_connections {max_connections}\n" if line.startswith("max_connections ") else line
                   for line in conf.splitlines(keepends=True))


def base_config_path() -> Path:
    """The deployable base config: package data in an installed wheel, else the repository's top-level file.

    In a checkout `broker/mosquitto.conf` is a symbolic link to the top-level file, which the wheel build
    copies into the package (the top-level file stays where operators expect it).
    """
    here = Path(__file__).resolve().parent
    for path in (here / "mosquitto.conf", here.parent / "mosquitto.conf"):
        if path.is_file():
            return path.resolve()
    raise BrokerError(f"base broker config not found in {here} or {here.parent}; is the fedmqtt install complete?")


@dataclass(frozen=True)
class TlsFiles:
    """A TLS listener's certificate files and whether clients must present a certificate (mutual TLS, where the
    certificate is then the client's identity)."""

    cafile: Path
    certfile: Path
    keyfile: Path
    require_certificate: bool = False
    crlfile: Path | None = None


@dataclass(frozen=True)
class Listener:
    """One `listener` block: bind address, port, and TLS files (None: plain TCP)."""

    port: int
    host: str
    tls: TlsFiles | None = None

    def lines(self) -> list[str]:
        from broker.acl import LISTENER_IDENTITY_LINES  # client id = user name: see broker/acl.py

        out = [f"listener {self.port} {self.host}", *LISTENER_IDENTITY_LINES]
        if self.tls is not None:
            t = self.tls
            out += [
                f"cafile {Path(t.cafile).resolve()}",
                f"certfile {Path(t.certfile).resolve()}",
                f"keyfile {Path(t.keyfile).resolve()}",
                "tls_version tlsv1.2",  # the floor: 1.3 is negotiated when both ends have it
                f"require_certificate {'true' if t.require_certificate else 'false'}",
            ]
            if t.require_certificate:
                # The certificate is the identity: its common name becomes the user name and the password is
                # ignored, so a password without the party's own certificate logs in as nobody. Every
                # connection of a party logs in as its own user (broker/acl.py), so each has its certificate.
                out.append("use_identity_as_username true")
            if t.crlfile is not None:
                out.append(f"crlfile {Path(t.crlfile).resolve()}")
        return out


def render_broker_config(
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    listeners: list[Listener] | None = None,
    password_file: Path,
    acl_file: Path,
    persistence_dir: Path,
    log_file: Path | None = None,
    user: str | None = None,
    extra: list[str] | None = None,
    max_connections: int | None = None,
) -> str:
    """The base settings followed by this federation's listeners, auth files, persistence and log target.

    `listeners` replaces the single plain `port`/`host` listener; `extra` lines go last (e.g. a bridge).
    `max_connections`: each listener's connection limit (`connection_limit`; None: unlimited).

    `user`: the account Mosquitto runs as (`broker_user()` by default). Started as root, Mosquitto switches to it
    before it reads any file but this one; broker/process.py hands it the files it needs.
    """
    base = base_config_path()
    if listeners is None:
        if port is None:
            raise BrokerError("render_broker_config needs a port or a list of listeners")
        listeners = [Listener(port, host)]
    user = user or broker_user()
    log_dest = f"log_dest file {Path(log_file).resolve()}" if log_file is not None else "log_dest stdout"
    federation = [
        "# " + "-" * 100,
        "# federation-specific",
        "# " + "-" * 100,
        *[line for listener in listeners for line in [*listener.lines(), *limit_lines(max_connections)]],
        f"password_file {Path(password_file).resolve()}",
        f"acl_file {Path(acl_file).resolve()}",
        # Mosquitto 1.x appends the file name to this string as is; 2.0.11 adds a separator itself and a
        # double slash is harmless, so always end it with one.
        f"persistence_location {Path(persistence_dir).resolve()}/",
        log_dest,
        f"user {user}",
        *(extra or []),
    ]
    header = f"# Generated by fedmqtt from {base}; edit the base file, not this one.\n\n"
    return header + base.read_text(encoding="utf-8").rstrip("\n") + "\n\n" + "\n".join(federation) + "\n"


def broker_user() -> str:
    """The account the broker runs as: never root. The invoking user when that is not root (Mosquitto started
    by it cannot switch users anyway); as root, the dedicated system user `mosquitto` (the Debian package
    creates it), which Mosquitto switches to right after reading its config."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid()).pw_name
    try:
        pwd.getpwnam(BROKER_SYSTEM_USER)
    except KeyError:
        raise BrokerError(
            f"running as root, the broker needs the unprivileged system user {BROKER_SYSTEM_USER!r} to run as, and "
            f"there is none: create it with `adduser --system --group --no-create-home {BROKER_SYSTEM_USER}` "
            "(the Debian package mosquitto does), or run fedmqtt as a normal user"
        ) from None
    return BROKER_SYSTEM_USER


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (Mosquitto 2.0 reads `listener 0` as a Unix socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
