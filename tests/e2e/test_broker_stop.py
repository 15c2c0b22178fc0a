"""`fedmqtt broker start` stopped by SIGTERM (kill, a service manager) stops its Mosquitto too, as Ctrl-C does:
no orphaned broker keeps the port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import _port_open, wait_until

from broker.config import free_port
from broker.federation import load_federation


def test_sigterm_stops_the_broker_it_started(tmp_path: Path) -> None:
    # Prepare: a federation and its broker, started as an operator does
    fed = tmp_path / "fed"
    subprocess.run([sys.executable, "-m", "fedmqtt", "broker", "init", "--dir", str(fed), "--run-id", "stop",
                    "--port", str(free_port()), "--site", "a"], check=True, capture_output=True)
    layout = load_federation(fed)
    log = tmp_path / "broker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fedmqtt", "broker", "start", "--dir", str(fed)],
                                stdout=out, stderr=subprocess.STDOUT)
    mosquitto = None
    try:
        wait_until(lambda: _port_open(layout.host, layout.port) and layout.pid_path.is_file(), 15, "broker up")
        mosquitto = int(layout.pid_path.read_text().strip())
        # Execute
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        # Assert: the CLI said so, Mosquitto is gone and the port is free
        assert "stopping mosquitto" in log.read_text()
        deadline = time.monotonic() + 10
        while _alive(mosquitto) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(mosquitto)
        assert not _port_open(layout.host, layout.port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if mosquitto is not None and _alive(mosquitto):
            os.kill(mosquitto, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")
