"""A federation driven only through the `fedmqtt` CLI, each role its own process (broker, PS, sites)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from broker.config import free_port
from broker.federation import FederationLayout, load_federation
from fedmqtt.demo import write_role_configs
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport

SITES = ("cleveland", "hungary", "switzerland", "va")
# Small but real local work, so four sites and the PS fit on two cores.
FAST_TRAIN = {"epochs": 1, "batch_size": 32, "lr": 0.003, "optimizer": "adam"}


def cli(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "fedmqtt", *args], stdout=fh, stderr=subprocess.STDOUT, env=env)


class CliFederation:
    """Broker, PS and site processes of one federation, plus an observer connection to watch them."""

    def __init__(self, work: Path, *, run_id: str, rounds: int, sites: tuple[str, ...] = SITES,
                 round_timeout_s: float = 60.0, algorithm: str = "fedavg", hyper: dict | None = None,
                 train: dict | None = None, model: dict | None = None, share_label_histogram: bool = False,
                 ps_extra: dict | None = None, broker_extra: dict | None = None,
                 init_extra: tuple[str, ...] = ()) -> None:
        """`broker_extra`: BrokerSettings keys appended to every party's `[broker]` table (e.g. chunk sizes);
        `init_extra`: more `broker init` options (e.g. "--tls")."""
        self.work = work
        self.sites = sites
        self.logs = work / "logs"
        fed = work / "federation"
        args = ["broker", "init", "--dir", str(fed), "--run-id", run_id, "--port", str(free_port())]
        for site in sites:
            args += ["--site", site]
        args += list(init_extra)
        subprocess.run([sys.executable, "-m", "fedmqtt", *args], check=True, capture_output=True)
        self.layout: FederationLayout = load_federation(fed)
        for path in self.layout.credentials.values():
            with open(path, "a", encoding="utf-8") as fh:
                fh.writelines(f"{key} = {value}\n" for key, value in (broker_extra or {}).items())
        self.ps_config, self.site_configs = write_role_configs(
            self.layout, work, rounds=rounds, seed=0, round_timeout_s=round_timeout_s, train=train or FAST_TRAIN,
            algorithm=algorithm, hyper=hyper, model=model, share_label_histogram=share_label_histogram,
            ps_extra=ps_extra)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.observer: Channel | None = None

    # -- processes ------------------------------------------------------------------------------
    def start_broker(self) -> None:
        self.procs["broker"] = cli("broker", "start", "--dir", str(self.layout.fed_dir), log=self.logs / "broker.log")
        wait_until(lambda: _port_open(self.layout.host, self.layout.port), 15, "broker port open")

    def start_ps(self, *, resume: bool = False, fault: str | None = None, extra: tuple[str, ...] = ()) -> None:
        """`fault` (e.g. "after_checkpoint:1") makes the PS SIGKILL itself at that point (FEDMQTT_FAULT);
        `extra`: more `ps start` options (e.g. "--force")."""
        env = {**os.environ, **({"FEDMQTT_FAULT": fault} if fault else {})}
        self.procs["ps"] = cli("ps", "start", "--config", str(self.ps_config), *(["--resume"] if resume else []),
                               *extra, log=self.logs / "ps.log", env=env)

    def start_site(self, site: str, *, fault: str | None = None) -> None:
        """`fault` (e.g. "site_before_publish:2") makes the site SIGKILL itself there (FEDMQTT_FAULT)."""
        env = {**os.environ, **({"FEDMQTT_FAULT": fault} if fault else {})}
        self.procs[site] = cli("site", "start", "--config", str(self.site_configs[site]),
                               log=self.logs / f"{site}.log", env=env)

    def run_to_completion(self, timeout_s: float) -> None:
        """Broker, PS and every site, then wait for the PS to finish the run."""
        self.start_broker()
        self.start_ps()
        for site in self.sites:
            self.start_site(site)
        self.wait_ps_done(timeout_s)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        if self.observer is not None:
            self.observer.transport.close()
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT if name == "broker" else signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    # -- watching -------------------------------------------------------------------------------
    def watch(self) -> Channel:
        """Subscribe as the observer (status and metrics only, as the ACL allows)."""
        if self.observer is None:
            t = MqttTransport(self.layout.settings("observer"), client_id=f"obs-{os.getpid()}-{time.monotonic_ns()}")
            t.connect()
            run = self.layout.run_id
            t.subscribe([topics.ps_metrics_topic(run), topics.ps_status_topic(run)])
            self.observer = Channel(t, run_id=run, sender="observer")
        return self.observer

    def wait_message(self, predicate: Callable[[object], bool], timeout_s: float, what: str) -> object:
        channel, end = self.watch(), time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.check_alive()
            inbound = channel.receive(0.3)
            if inbound is not None and predicate(inbound.message):
                return inbound.message
        raise AssertionError(f"timed out waiting for {what}; logs in {self.logs}:\n{self.tail('ps')}")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() not in (None, 0) and proc.returncode != -signal.SIGKILL:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")

    def wait_ps_done(self, timeout_s: float) -> None:
        try:
            rc = self.procs["ps"].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"PS did not finish in {timeout_s} s:\n{self.tail('ps')}") from None
        assert rc == 0, f"PS exited with {rc}:\n{self.tail('ps')}"

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def final_weights(self) -> dict[str, np.ndarray]:
        return load_file(str(self.work / "ps" / "final_model.safetensors"))


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def mosquitto_pid(conf: Path) -> int:
    """The process id of the mosquitto that `fedmqtt broker start` runs with `conf` (to signal it directly)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"mosquitto") and str(conf).encode() in argv:
                return int(entry.name)
    raise AssertionError(f"no mosquitto running with {conf}")


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
