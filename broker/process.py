"""Start Mosquitto as a subprocess, wait until it accepts connections, and stop or kill it."""

from __future__ import annotations

import collections
import logging
import re
import resource
import shutil
import socket
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
