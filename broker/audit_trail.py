"""What the broker tooling records in a federation's audit log (`<fed>/audit/broker.jsonl`): who created the
federation, added, removed or rotated which party with which new credential, and when the broker ran.

A credential is named by fingerprints only, never by a secret: the SHA-256 of the party's hashed entries in the
broker's password file (salted hashes the broker holds already; compare with `broker/passwd` to see which
credential is live) and, under mutual TLS, its client certificate's SHA-256 as `openssl x509 -fingerprint`
prints it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from broker import certs
from broker.acl import login_names
from broker.federation import OBSERVER_USER, PS_USER, FederationLayout
from fedmqtt.audit.writer import AuditLog, local_actor
from fedmqtt.config_io import load_toml
from fedmqtt.transport.settings import BrokerSettings

AUDIT_FILE = Path("audit") / "broker.jsonl"  # under the federation directory; `broker init --force` keeps it
TOOL = "broker-cli"


def audit_log(layout: FederationLayout) -> AuditLog:
    return AuditLog(layout.fed_dir / AUDIT_FILE, chain=f"broker/{layout.run_id}", actor=local_actor(TOOL))


def record_init(layout: FederationLayout, *, force: bool) -> None:
    """`broker init`: the federation's shape, then one party-add per party (one write for all of them)."""
    init: dict[str, Any] = {"run_id": layout.run_id, "host": layout.host, "port": layout.port, "tls": layout.tls,
                            "mtls": layout.mtls, "sites": len(layout.site_ids), "force": force}
    if layout.tls:
        init["ca_sha256"] = layout.ca_fingerprint()
    parties = [("party-add", {**_party(layout, user), "via": "init"}) for user in sorted(layout.credentials)]
    audit_log(layout).append_many([("broker-init", init), *parties])


def record_party_change(layout: FederationLayout, event: str, party: str) -> None:
    """party-add, party-rotate (with the new credential's fingerprints) or party-remove, after the change."""
    details = {"party": party, "role": _role(party)} if event == "party-remove" else _party(layout, party)
    audit_log(layout).append(event, **details)


def record_broker(layout: FederationLayout, event: str, **details: Any) -> None:
    """broker-start / broker-stop."""
    audit_log(layout).append(event, **details)


def credential_fingerprints(layout: FederationLayout, user: str) -> dict[str, str]:
    """Fingerprints of `user`'s current credential (another kind of key adds its own entry here)."""
    logins = set(login_names(user))
    entries = sorted(line for line in (layout.broker_dir / "passwd").read_text(encoding="utf-8").splitlines()
                     if line.split(":", 1)[0] in logins)
    out = {"password_entry_sha256": hashlib.sha256("\n".join(entries).encode()).hexdigest()}
    if layout.mtls:
        cert = load_toml(layout.credentials[user], BrokerSettings, section="broker").tls_cert_pem
        if cert is not None:
            out["client_cert_sha256"] = certs.fingerprint_sha256(cert.encode("ascii"))
    return out


def _party(layout: FederationLayout, user: str) -> dict[str, Any]:
    return {"party": user, "role": _role(user), **credential_fingerprints(layout, user)}


def _role(user: str) -> str:
    return user if user in (PS_USER, OBSERVER_USER) else "site"
