"""Which `Host` names the dashboard answers to: its defence against DNS rebinding.

A page on evil.example can have its own name resolve to 127.0.0.1 (or to the dashboard's address) and then read
the dashboard as if it were evil.example: the browser's same-origin rule only sees the name. The request still
carries `Host: evil.example`, so the server refuses every name that is not its own: the names it was started
for (`--host`, `--name`), its certificate's subject alternative names, loopback names when it listens on
loopback, and the operator's `--allow-host` (a reverse proxy's public name, say). The port is not compared: an
SSH tunnel or a proxy may well forward another port to this one.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from fedmqtt.errors import ConfigError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
_LABELS = re.compile(r"^(?:[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")


def _normal(name: str) -> str | None:
    """A host name or address as compared: addresses in canonical form, names lower case without the final dot."""
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        pass
    name = name.lower().rstrip(".")
    return name if _LABELS.match(name) else None


def host_of(header: str) -> str | None:
    """The name in a `Host` header (`name`, `name:port`, `1.2.3.4:port`, `[::1]:port`), or None if malformed."""
    header = header.strip()
    if header.startswith("["):  # an IPv6 address, bracketed
        address, bracket, port = header[1:].partition("]")
        if not bracket or port and not re.fullmatch(r":[0-9]*", port):
            return None
        try:
            return ipaddress.IPv6Address(address).compressed
        except ValueError:
            return None
    name, _, port = header.partition(":")
    if not name or not re.fullmatch(r"[0-9]*", port):  # a second colon lands in `port`: refused
        return None
    return _normal(name)


def certificate_names(cert: Path) -> list[str]:
    """The DNS names and addresses in a PEM certificate's subject alternative names."""
    try:
        loaded = x509.load_pem_x509_certificate(Path(cert).read_bytes())
        san = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the names of the dashboard certificate {cert}: {exc}") from None
    return san.get_values_for_type(x509.DNSName) + [str(a) for a in san.get_values_for_type(x509.IPAddress)]


@dataclass(frozen=True)
class AllowedHosts:
    """Exact names, plus `*.suffix` patterns (a wildcard certificate) that match one more label."""

    exact: frozenset[str]
    suffixes: frozenset[str] = frozenset()

    @classmethod
    def of(cls, names: Iterable[str]) -> AllowedHosts:
        exact: set[str] = set()
        suffixes: set[str] = set()
        for raw in names:
            wildcard = raw.startswith("*.")
            name = _normal(raw[2:] if wildcard else raw)
            if name is None:
                raise ConfigError(f"not a host name or address: {raw!r} (give a name like dash.example.org, an "
                                  "address, or *.example.org; no port)")
            (suffixes if wildcard else exact).add(name)
        return cls(frozenset(exact), frozenset(suffixes))

    def allows(self, header: str | None) -> bool:
        name = host_of(header) if header is not None else None
        if name is None:
            return False
        if name in self.exact:
            return True
        label, dot, rest = name.partition(".")
        return bool(dot) and bool(label) and rest in self.suffixes

    def describe(self) -> str:
        return ", ".join(sorted(self.exact) + sorted(f"*.{s}" for s in self.suffixes))


def allowed_hosts(bind: str, *, names: Iterable[str] = (), certificate: Path | None = None,
                  extra: Iterable[str] = ()) -> AllowedHosts:
    """The dashboard's own names: the bind address, `--name`s, the certificate's names and `--allow-host`s.

    Loopback names are added when the bind address is loopback or every address (which includes loopback).
    """
    found = [*names, *extra]
    if bind not in WILDCARD_BINDS:
        found.append(bind)
    if bind in WILDCARD_BINDS or is_loopback(bind):
        found.extend(LOOPBACK_NAMES)
    if certificate is not None:
        found.extend(certificate_names(certificate))
    return AllowedHosts.of(found)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
