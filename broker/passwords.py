"""Create the Mosquitto password file with the `mosquitto_passwd` tool and generate strong passwords."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path

from broker.acl import login_names
from fedmqtt.errors import BrokerError

_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin"])


def generate_password() -> str:
    """A random URL-safe password (32 bytes of entropy)."""
    return secrets.token_urlsafe(32)


def write_password_file(path: Path, users: dict[str, str]) -> None:
    """Write `users` (name -> clear password) to `path` as a hashed Mosquitto password file, mode 0600.

    Each user also gets its other logins (`broker.acl.login_names`: `<user>.bulk`, observer seats) with the
    same password: the broker forces client id = user name, so each simultaneous connection needs a user."""
    tool = shutil.which("mosquitto_passwd", path=_SEARCH_PATH)
    if tool is None:
        raise BrokerError("mosquitto_passwd not found: install the Debian package mosquitto")
    for name, password in users.items():
        if not name or ":" in name or "\n" in name or not password or "\n" in password:
            raise BrokerError(f"unusable broker user or password for {name!r}")
    path = Path(path)
    path.unlink(missing_ok=True)
    # Write clear text to a 0600 file and let `mosquitto_passwd -U` hash it in place: the passwords never
    # appear on a command line, where any local user could read them from /proc.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(f"{login}:{password}\n" for name, password in users.items() for login in login_names(name))
    result = subprocess.run([tool, "-U", str(path)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        path.unlink(missing_ok=True)
        raise BrokerError(f"mosquitto_passwd failed on {path}: {(result.stderr or result.stdout).strip()}")
    path.chmod(0o600)
