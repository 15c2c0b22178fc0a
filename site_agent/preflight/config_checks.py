"""The site config parses (as `fedmqtt site start` loads it) and the credentials file is private and complete."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from broker.acl import CHECK_SEAT, check_login
from fedmqtt.errors import FedMqttError
from fedmqtt.transport.settings import BrokerSettings, check_private, load_credentials
from site_agent.config import SiteConfig, load_site_config
from site_agent.preflight.findings import Finding, failed, passed, warned

CONFIG, CREDENTIALS = "config", "credentials"


def check_config(path: Path) -> tuple[SiteConfig | None, Finding]:
    if not path.is_file():
        return None, failed(CONFIG, f"{path}: no such file", "Give the site config (TOML) that `fedmqtt site start` "
                            "uses: `fedmqtt site check --config PATH`.")
    try:
        config = load_site_config(path)
    except (FedMqttError, OSError, ValueError) as exc:
        return None, failed(CONFIG, _one_line(exc), f"Correct the key named above in {path} "
                            "(docs/configuration.md lists every site key).")
    d = config.data
    return config, passed(CONFIG, f"{path.name}: site {config.site_id}, run {config.run_id}, {d.format} data, "
                          f"device {config.device}", path=str(path), site_id=config.site_id, run_id=config.run_id)


def check_credentials(config: SiteConfig) -> tuple[BrokerSettings | None, Finding]:
    """Private (0600, this user's), loadable, this site's own, TLS with a pinned broker key where it matters."""
    path, site = config.credentials, config.site_id
    if not path.is_file():
        return None, failed(CREDENTIALS, f"{path}: no such file",
                            f"Copy the credentials file `fedmqtt broker init` (or `broker add-site`) wrote for {site} "
                            f"(credentials/{site}.toml in the federation folder) to {path}, then `chmod 600 {path}`.")
    st = path.stat()
    if st.st_uid != os.geteuid():
        me = user_name(os.geteuid())
        return None, failed(CREDENTIALS, f"{path} belongs to {user_name(st.st_uid)}, not to {me} who runs the agent",
                            f"Make it yours: `sudo chown {me} {path}` (whoever owns it can change the password and "
                            "the broker this site talks to).")
    try:
        check_private(path)
    except FedMqttError as exc:
        return None, failed(CREDENTIALS, str(exc).split("; make it private", 1)[0],
                            f"Make it private: `chmod 600 {path}`.", mode=f"{stat.S_IMODE(st.st_mode):04o}")
    try:
        settings = load_credentials(path)
    except FedMqttError as exc:
        return None, failed(CREDENTIALS, _one_line(exc), f"Use the file `fedmqtt broker init` wrote for {site}, "
                            "unedited (docs/configuration.md lists the [broker] keys).")
    if settings.username != site:
        return None, failed(CREDENTIALS, f"{path.name} logs in as {settings.username!r}, but this site is {site!r}",
                            f"Use {site}'s own credentials file (credentials/{site}.toml), or correct site_id.")
    for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        named = getattr(settings, key)
        if named is not None and not Path(named).is_file():
            return None, failed(CREDENTIALS, f"{key} = {str(named)!r}: no such file",
                                f"Put the file there or correct {key} in the [broker] table of {path}.")
    mode = f"{stat.S_IMODE(st.st_mode):04o}"
    found = (f"{path.name}: private ({mode}, yours); user {settings.username} at {settings.host}:{settings.port}, "
             f"{_transport(settings)}")
    facts = {"path": str(path), "mode": mode, "user": settings.username, "host": settings.host,
             "port": settings.port, "tls": settings.tls, "pinned": settings.tls_broker_key_sha256 is not None}
    if settings.tls and settings.tls_broker_key_sha256 is None:
        return settings, warned(CREDENTIALS, f"{found}; no pinned broker key", "Ask the broker's operator for a "
                                "current credentials file (`fedmqtt broker rotate --party " + site + "` writes "
                                "tls_broker_key_sha256): without it any server the CA vouches for under the broker's "
                                "name is taken for the broker.", **facts)
    if settings.tls_cert_pem is not None and settings.seat_cert(CHECK_SEAT) is None:
        return settings, warned(CREDENTIALS, f"{found}; no client certificate for {check_login(site)}",
                                _rotate_fix(site, "a certificate for the check login"), **facts)
    return settings, passed(CREDENTIALS, found, **facts)


def _transport(settings: BrokerSettings) -> str:
    if not settings.tls:
        return "plain TCP"
    mutual = "mutual TLS (client certificate)" if settings.tls_cert_pem or settings.tls_cert_file else "TLS"
    pin = "broker key pinned" if settings.tls_broker_key_sha256 else "no key pin"
    return f"{mutual}, {pin}"


def _rotate_fix(site: str, what: str) -> str:
    return (f"Credentials made before `fedmqtt site check` existed lack {what}: the broker's operator runs "
            f"`fedmqtt broker rotate --dir FED --party {site}` and sends you the new file. Until then the check does "
            "not log in (it would push a running agent off).")


def user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _one_line(exc: BaseException) -> str:
    """A multi-line error (pydantic's list of fields) as one line: the checklist has one line per finding."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
