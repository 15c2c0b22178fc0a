"""The end-to-end tests' processes forked from pre-imported parents (harness.cli, forked.py, zygote.py) behave
as `python -m fedmqtt` started afresh: the entry point's output in the log, its exit code, its own pid,
signals delivered to it, and the environment and folder of the request."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from forked import ForkedProcess
from harness import _port_open, cli, stop_processes, wait_until

from broker.config import free_port
from broker.federation import load_federation


def test_a_forked_role_runs_the_entry_point_and_returns_its_exit_code(tmp_path: Path) -> None:
    log = tmp_path / "help.log"
    proc = cli("--help", log=log)
    assert isinstance(proc, ForkedProcess) or os.environ.get("FEDMQTT_TEST_FRESH") == "1"
    assert proc.wait(60) == 0
    assert "Usage:" in log.read_text() and proc.pid != os.getpid()
    bad = cli("no-such-command", log=tmp_path / "bad.log")
    assert bad.wait(60) == 2
    assert "No such command" in (tmp_path / "bad.log").read_text()


def _broker_stopped_by_sigterm(tmp_path: Path, *, fresh: bool) -> tuple[int, str]:
    """`broker init`, then `broker start` until its Mosquitto is up, then SIGTERM: exit code and log."""
    fed, log = tmp_path / "fed", tmp_path / "broker.log"
    init = cli("broker", "init", "--dir", str(fed), "--run-id", "forked", "--port", str(free_port()), "--site", "a",
               log=tmp_path / "init.log", env={**os.environ, "NO_COLOR": "1"}, fresh=fresh)
    assert init.wait(60) == 0, (tmp_path / "init.log").read_text()
    layout = load_federation(fed)
    proc = cli("broker", "start", "--dir", str(fed), log=log, fresh=fresh)
    try:
        wait_until(lambda: _port_open(layout.host, layout.port) and layout.pid_path.is_file(), 30, "broker up")
        assert Path(f"/proc/{proc.pid}/cmdline").read_bytes().count(b"broker")  # the role's own process
        proc.send_signal(signal.SIGTERM)
        return proc.wait(30), log.read_text()
    finally:
        stop_processes([(proc, signal.SIGKILL)])


def test_a_forked_role_stops_on_sigterm_as_a_fresh_one_does(tmp_path: Path, mosquitto_bin: str) -> None:
    forked_rc, forked_log = _broker_stopped_by_sigterm(tmp_path / "forked", fresh=False)
    fresh_rc, fresh_log = _broker_stopped_by_sigterm(tmp_path / "fresh", fresh=True)
    assert forked_rc == fresh_rc, (forked_log, fresh_log)
    assert "stopping mosquitto" in forked_log and "stopping mosquitto" in fresh_log
