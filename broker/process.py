"""Start Mosquitto as a subprocess, wait until it accepts connections, and stop or kill it."""

from __future__ import annotations

import collections
import logging
import os
import pwd
import re
import resource
import shutil
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType

from fedmqtt.errors import BrokerError

log = logging.getLogger(__name__)
_TAIL_LINES = 40
# Mosquitto holds one descriptor per connection, and every site has two (control and bulk): 500 sites need
# over 1,000, more than the common default soft limit of 1,024.
_WANTED_OPEN_FILES = 65536
_LOG_DEST = re.compile(r"^log_dest\s+file\s+(\S.*?)\s*$", re.MULTILINE)
# Directives naming files Mosquitto reads; it reads all of them (and its config again on SIGHUP) after it
# switched to its `user`.
_READ_FILES = ("password_file", "acl_file", "cafile", "certfile", "keyfile", "crlfile", "bridge_cafile",
               "bridge_certfile", "bridge_keyfile")


def raise_open_file_limit(wanted: int = _WANTED_OPEN_FILES) -> int:
    """Raise this process's soft limit on open files towards `wanted`, as far as the hard limit allows (no
    privilege needed); the broker started next inherits it. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d (%s): the broker can serve about "
                        "%d sites (two connections each)", soft, target, exc, soft // 2 - 16)
            return soft
        log.info("open-file limit raised from %d to %d for the broker", soft, target)
        return target
    return soft


def find_mosquitto() -> str:
    """Path of the mosquitto binary; Debian installs it in /usr/sbin, often not on a normal user's PATH."""
    found = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise BrokerError(
            "mosquitto not found: install it with `sudo apt-get install mosquitto` (Debian/Ubuntu)"
        )
    return found


def prepare_for_broker_user(conf_path: Path) -> None:
    """As root, refuse a config that would keep Mosquitto root, and let its `user` reach the files it needs.

    Mosquitto started as root switches to the config's `user` (default `mosquitto`) right after reading the
    config and before it opens anything else: the log, the password file, the ACL, the TLS files, the CRL, the
    persistence folder, and the config itself again on SIGHUP. Those files are given to that user with their
    modes unchanged (a 0600 key stays readable by one account; root writes them anew on add-site, rotate and
    remove-site, and `reload_broker` hands them over again); a private (0700) folder holding them opens to the
    user's group for passing through only (0710). A folder further up that the user cannot pass is not changed:
    that is refused with the command that fixes it. Nothing to do when not root (Mosquitto cannot switch users)."""
    if os.geteuid() != 0:
        return
    conf_path = Path(conf_path).resolve()
    directives = _directives(conf_path.read_text(encoding="utf-8"))
    name = directives.get("user", ["mosquitto"])[-1]
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise BrokerError(f"{conf_path} runs mosquitto as user {name!r}, which does not exist: create it "
                          f"(`adduser --system --group --no-create-home {name}`) or set another `user`") from None
    if account.pw_uid == 0:
        raise BrokerError(
            f"{conf_path} would keep mosquitto running as root (`user {name}`): a broker that takes connections "
            "from the network must not. Re-run `fedmqtt broker init` (it writes `user mosquitto` when run as root) "
            f"or change that line to `user mosquitto`"
        )
    uid, gid = account.pw_uid, account.pw_gid
    groups = set(os.getgrouplist(name, gid))
    reads = [conf_path, *(Path(v) for key in _READ_FILES for v in directives.get(key, []))]
    writes = [Path(v) for v in directives.get("persistence_location", [])]
    log_files = [Path(match) for match in _LOG_DEST.findall(conf_path.read_text(encoding="utf-8"))]
    for path in reads:
        if path.is_file():
            os.chown(path, uid, gid)  # its mode stays: a 0600 key or password file stays readable by one account
    for log_file in log_files:
        if not log_file.exists():
            os.close(os.open(log_file, os.O_WRONLY | os.O_CREAT, 0o600))
        os.chown(log_file, uid, gid)
    for folder in writes:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, uid, gid, follow_symlinks=False)
    for path in [*reads, *log_files, *writes]:
        _open_private_parent(path.parent, gid)
        blocked = _blocked_ancestor(path, uid, groups)
        if blocked is not None:
            raise BrokerError(
                f"mosquitto runs as user {name!r} and cannot reach {path}: {blocked} is closed to it (mode "
                f"{stat.S_IMODE(blocked.stat().st_mode):04o}). Keep the federation where that user can pass, or "
                f"open the folder for passing through only: chmod o+x {blocked}"
            )


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and not parts[0].startswith("#"):
            out.setdefault(parts[0], []).append(parts[1].strip())
    return out


def _open_private_parent(folder: Path, gid: int) -> None:
    """A root-owned folder closed to everyone else (e.g. the federation's 0700 broker folder): let the broker's
    group pass through it (0710), without listing or reading anything else in it."""
    st = folder.stat()
    if st.st_uid == 0 and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        os.chown(folder, -1, gid)
        folder.chmod(stat.S_IMODE(st.st_mode) | stat.S_IXGRP)


def _blocked_ancestor(path: Path, uid: int, groups: set[int]) -> Path | None:
    """The first folder above `path` that user `uid` (in `groups`) cannot pass through, or None."""
    for folder in reversed(path.parents):
        st = folder.stat()
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid in groups else stat.S_IXOTH
        if not st.st_mode & bit:
            return folder
    return None


class BrokerProcess:
    """One running mosquitto; use `BrokerProcess.start(...)`, ideally as a context manager."""

    def __init__(
        self,
        proc: subprocess.Popen[str],
        *,
        conf_path: Path,
        host: str,
        port: int,
        log: tuple[Path | None, int],
    ) -> None:
        self._proc = proc
        self.conf_path = conf_path
        self.host = host
        self.port = port
        self._output: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        # Drain stdout/stderr so a chatty broker never blocks on a full pipe.
        self._reader = threading.Thread(target=self._drain, name=f"mosquitto-{proc.pid}", daemon=True)
        self._reader.start()
        self._log_file, self._log_offset = log

    @classmethod
    def start(
        cls, conf_path: Path, *, port: int, host: str = "127.0.0.1", timeout_s: float = 10.0
    ) -> BrokerProcess:
        """Run `mosquitto -c conf_path` and return once host:port accepts TCP connections."""
        conf_path = Path(conf_path).resolve()
        cmd = [find_mosquitto(), "-c", str(conf_path)]
        prepare_for_broker_user(conf_path)
        _check_port_free(host, port)
        log_at = _log_file_and_offset(conf_path)
        raise_open_file_limit()
        # Own session: a Ctrl-C meant for our CLI must not kill the broker before the clients say goodbye.
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        broker = cls(proc, conf_path=conf_path, host=host, port=port, log=log_at)
        try:
            broker._wait_ready(timeout_s)
        except BaseException:
            broker.stop()
            raise
        return broker

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (Mosquitto saves its database), then SIGKILL if it does not exit in time."""
        if self.alive:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._reap()

    def kill(self) -> None:
        """SIGKILL without a database save, as in a crash (for fault tests)."""
        if self.alive:
            self._proc.kill()
        self._reap()

    def output_tail(self) -> str:
        """The last lines mosquitto printed and logged since this start, for error messages."""
        lines = list(self._output)
        if self._log_file is not None and self._log_file.is_file():
            with self._log_file.open(encoding="utf-8", errors="replace") as f:
                f.seek(self._log_offset)
                lines += f.read().splitlines()
        return "\n".join(lines[-_TAIL_LINES:])

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float) -> None:
        # A wildcard listen address is reachable on loopback.
        probe_host = (
            "127.0.0.1" if self.host in ("", "0.0.0.0") else "::1" if self.host == "::" else self.host
        )
        deadline = time.monotonic() + timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise BrokerError(f"mosquitto exited with code {code} at startup:\n{self.output_tail()}")
            try:
                with socket.create_connection((probe_host, self.port), timeout=0.5):
                    pass
            except OSError:
                if time.monotonic() > deadline:
                    raise BrokerError(
                        f"mosquitto did not accept connections on {probe_host}:{self.port} "
                        f"within {timeout_s} s:\n{self.output_tail()}"
                    ) from None
                time.sleep(0.02)
                continue
            if self.alive:
                return

    def _drain(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._output.append(line.rstrip("\n"))

    def _reap(self) -> None:
        self._proc.wait()
        self._reader.join(timeout=5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _log_file_and_offset(conf_path: Path) -> tuple[Path | None, int]:
    """The `log_dest file` of the config and its current size, so error tails show only this run's lines."""
    match = _LOG_DEST.search(conf_path.read_text(encoding="utf-8")) if conf_path.is_file() else None
    if match is None:
        return None, 0
    log_file = Path(match.group(1))
    return log_file, log_file.stat().st_size if log_file.is_file() else 0


def _check_port_free(host: str, port: int) -> None:
    """Fail early if something listens on host:port: the readiness probe would mistake it for our broker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Like Mosquitto itself, ignore TIME_WAIT leftovers of a broker that just stopped (restart tests).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise BrokerError(
                f"cannot listen on {host}:{port}: {exc.strerror}; is another broker running?"
            ) from None
