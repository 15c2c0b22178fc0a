"""`harness.cli`'s processes forked from pre-imported parents (zygote.py), behind the part of subprocess.Popen's
interface the tests use. FEDMQTT_TEST_FRESH=1 starts every process from a fresh interpreter instead."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ZYGOTE = Path(__file__).with_name("zygote.py")
# What each kind of parent imports: a site's (torch and the training code) and the rest's (the PS, the broker
# commands, the dashboard), which must not hold torch: the PS makes its round-1 model in a child process only
# when torch is not loaded (ps_daemon/model_init.py), and that path is the deployed one.
MODULES = {
    "site": ("fedmqtt.cli", "site_agent.agent", "site_agent.trainer", "torch"),
    "light": ("fedmqtt.cli", "ps_daemon.runner", "broker.process", "broker.federation"),
}
START_TIMEOUT_S = 120.0
_zygotes: dict[str, tuple[subprocess.Popen[bytes], str]] = {}


def fresh_only() -> bool:
    return os.environ.get("FEDMQTT_TEST_FRESH") == "1"


def _kind(args: tuple[str, ...]) -> str:
    return "site" if args[:2] == ("site", "start") else "light"


def _zygote(kind: str) -> str:
    """The socket of this process's parent of `kind`, started on first use."""
    running = _zygotes.get(kind)
    if running is not None and running[0].poll() is None:
        return running[1]
    path = os.path.join(tempfile.mkdtemp(prefix="zyg-"), "sock")
    proc = subprocess.Popen([sys.executable, str(ZYGOTE), path, *MODULES[kind]], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        proc.kill()
        raise RuntimeError(f"the {kind} zygote did not start (exit code {proc.wait()})")
    _zygotes[kind] = (proc, path)
    return path


@atexit.register
def _stop_zygotes() -> None:
    for proc, _ in _zygotes.values():
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # end of input: the parent returns from its loop
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if proc.poll() is None:
            proc.kill()


class ForkedProcess:
    """A role forked by a zygote: signalled by pid; its exit code comes over the request's connection."""

    def __init__(self, args: tuple[str, ...], log: Path, env: dict[str, str]) -> None:
        self.args = ["fedmqtt", *args]
        self.returncode: int | None = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_zygote(_kind(args)))
        request = {"args": list(args), "cwd": os.getcwd(), "env": env, "log": str(log)}
        self._conn.sendall(json.dumps(request).encode() + b"\n")
        self._buffer = b""
        first = self._line(START_TIMEOUT_S)
        if first is None or not first.startswith("pid "):
            raise RuntimeError(f"the zygote did not start {self.args}: {first!r}")
        self.pid = int(first.split()[1])

    def _line(self, timeout: float | None) -> str | None:
        """The next line from the intermediate, or None if none came within `timeout` seconds."""
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"lost the intermediate of {self.args} (pid {getattr(self, 'pid', None)})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        return self._finish(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._finish(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def _finish(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is not None:
                self.returncode = int(line.split()[1])
                self._conn.close()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
