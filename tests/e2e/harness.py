"""A federation driven only through the `fedmqtt` CLI, each role its own process (broker, PS, sites)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np
from forked import ForkedProcess, fresh_only
from safetensors.numpy import load_file

from broker.config import free_port
from broker.federation import FederationLayout, load_federation
from fedmqtt.config_io import dump_toml, read_toml
from fedmqtt.demo import write_role_configs
from fedmqtt.errors import BrokerError
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport

SITES = ("cleveland", "hungary", "switzerland", "va")
# Small but real local work, so four sites and the PS fit on two cores.
FAST_TRAIN = {"epochs": 1, "batch_size": 32, "lr": 0.003, "optimizer": "adam"}
# free_port() only says a port was free a moment ago: under pytest-xdist another worker's broker (or any
# process) can take it before Mosquitto binds it. A start that finds its port taken tries a new one.
PORT_TRIES = 5
_PORT_TAKEN = ("address already in use", "cannot listen on")  # Mosquitto, aiohttp, BrokerProcess
T = TypeVar("T")
Process = subprocess.Popen[bytes] | ForkedProcess  # what cli() starts; both answer poll, wait, send_signal, kill


def port_taken(text: str) -> bool:
    """Whether a broker's error output says its port was taken by someone else."""
    return any(sign in text.lower() for sign in _PORT_TAKEN)


def on_free_port(start: Callable[[int], T], tries: int = PORT_TRIES) -> T:
    """`start(port)` with a free port; again with a new one (up to `tries` in all) while it raises a
    BrokerError saying the port was taken. `start` must lay out everything that names the port itself."""
    for attempt in range(1, tries + 1):
        try:
            return start(free_port())
        except BrokerError as exc:
            if attempt == tries or not port_taken(str(exc)):
                raise
    raise AssertionError("unreachable")


def stop_processes(procs: Iterable[tuple[Process, int]], timeout_s: float = 10.0) -> None:
    """Send each (process, signal) its signal first, then wait for all of them against one deadline, then
    SIGKILL and reap whatever is left: teardown costs the slowest process, not the sum of them."""
    procs = list(procs)
    for proc, signum in procs:
        if proc.poll() is None:
            proc.send_signal(signum)
    deadline = time.monotonic() + timeout_s
    for proc, _ in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    for proc, _ in procs:
        proc.wait()


def cli(*args: str, log: Path, env: dict[str, str] | None = None, fresh: bool = False) -> Process:
    """`python -m fedmqtt ARGS` as its own process, its output appended to `log`: forked from a pre-imported
    parent (forked.py, zygote.py) unless `fresh`, FEDMQTT_TEST_FRESH=1 or an environment that changes where
    modules come from asks for a fresh interpreter."""
    log.parent.mkdir(parents=True, exist_ok=True)
    same_imports = env is None or env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    if same_imports and not (fresh or fresh_only()):
        return ForkedProcess(args, log, dict(os.environ if env is None else env))
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "fedmqtt", *args], stdout=fh, stderr=subprocess.STDOUT, env=env)


class CliFederation:
    """Broker, PS and site processes of one federation, plus an observer connection to watch them."""

    def __init__(self, work: Path, *, run_id: str, rounds: int, sites: tuple[str, ...] = SITES,
                 round_timeout_s: float = 60.0, algorithm: str = "fedavg", hyper: dict | None = None,
                 train: dict | None = None, model: dict | None = None, share_label_histogram: bool = False,
                 ps_extra: dict | None = None, broker_extra: dict | None = None,
                 init_extra: tuple[str, ...] = (), fresh: bool = False) -> None:
        """`broker_extra`: BrokerSettings keys appended to every party's `[broker]` table (e.g. chunk sizes);
        `init_extra`: more `broker init` options (e.g. "--tls"); `fresh`: every role from a fresh interpreter
        (see cli)."""
        self.work = work
        self.fresh = fresh
        self.sites = sites
        self.logs = work / "logs"
        self._run_id, self._broker_extra, self._init_extra = run_id, broker_extra or {}, init_extra
        self.layout: FederationLayout = self._init_federation(free_port())
        self.ps_config, self.site_configs = write_role_configs(
            self.layout, work, rounds=rounds, seed=0, round_timeout_s=round_timeout_s, train=train or FAST_TRAIN,
            algorithm=algorithm, hyper=hyper, model=model, share_label_histogram=share_label_histogram,
            ps_extra=ps_extra)
        self.procs: dict[str, Process] = {}
        self.observer: Channel | None = None

    def _init_federation(self, port: int, *, force: bool = False) -> FederationLayout:
        """`broker init` on `port`; again with force=True gives the same federation a new port and passwords
        (the role configs name only the credentials files, which keep their paths)."""
        fed = self.work / "federation"
        args = ["broker", "init", "--dir", str(fed), "--run-id", self._run_id, "--port", str(port)]
        for site in self.sites:
            args += ["--site", site]
        args += [*self._init_extra, *(["--force"] if force else [])]
        log = self.logs / "broker-init.log"
        assert cli(*args, log=log, fresh=self.fresh).wait(60) == 0, log.read_text()
        layout = load_federation(fed)
        for path in layout.credentials.values():
            with open(path, "a", encoding="utf-8") as fh:
                fh.writelines(f"{key} = {value}\n" for key, value in self._broker_extra.items())
        return layout

    # -- processes ------------------------------------------------------------------------------
    def start_broker(self) -> None:
        """`broker start`, back once it has written its pid file (after Mosquitto accepted a connection). The
        first start of the federation moves to a new port if another process took its port (see on_free_port);
        a restart keeps its port, which the clients know."""
        for attempt in range(1, PORT_TRIES + 1):
            exited = self._start_broker_once()
            if exited is None:
                return
            first_start = list(self.procs) == ["broker"]
            if not (first_start and port_taken(exited)) or attempt == PORT_TRIES:
                raise AssertionError(f"broker start exited with {self.procs['broker'].returncode}:\n{exited}")
            self.layout = self._init_federation(free_port(), force=True)

    def _start_broker_once(self) -> str | None:
        """None once the broker is up; the output of `broker start` if it exited instead."""
        log, pid_path = self.logs / "broker.log", self.layout.pid_path
        offset = log.stat().st_size if log.exists() else 0
        stale = pid_path.read_text() if pid_path.is_file() else None  # left by a SIGKILLed `broker start`
        proc = self.procs["broker"] = cli("broker", "start", "--dir", str(self.layout.fed_dir), log=log,
                                           fresh=self.fresh)

        def up_or_exited() -> bool:
            if proc.poll() is not None:
                return True
            pid = pid_path.read_text() if pid_path.is_file() else None
            return pid not in (None, "", stale) and _port_open(self.layout.host, self.layout.port)

        wait_until(up_or_exited, 15, "broker started")
        return None if proc.poll() is None else log.read_bytes()[offset:].decode(errors="replace")

    def start_ps(self, *, resume: bool = False, fault: str | None = None, extra: tuple[str, ...] = ()) -> None:
        """`fault` (e.g. "after_checkpoint:1") makes the PS SIGKILL itself at that point (FEDMQTT_FAULT);
        `extra`: more `ps start` options (e.g. "--force")."""
        env = {**os.environ, **({"FEDMQTT_FAULT": fault} if fault else {})}
        self.procs["ps"] = cli("ps", "start", "--config", str(self.ps_config), *(["--resume"] if resume else []),
                               *extra, log=self.logs / "ps.log", env=env, fresh=self.fresh)

    def start_killed_and_resumed(self, sites: Iterable[str] | None = None, after_round: int = 1) -> None:
        """Start the PS to SIGKILL itself after round `after_round`'s checkpoint, start `sites` (all by default),
        check it was killed, and start it again with --resume."""
        self.start_ps(fault=f"after_checkpoint:{after_round}")
        for site in self.sites if sites is None else sites:
            self.start_site(site)
        killed = self.procs["ps"].wait(180)
        assert killed == -signal.SIGKILL, self.tail("ps")
        self.start_ps(resume=True)

    def start_site(self, site: str, *, fault: str | None = None) -> None:
        """`fault` (e.g. "site_before_publish:2") makes the site SIGKILL itself there (FEDMQTT_FAULT)."""
        env = {**os.environ, **({"FEDMQTT_FAULT": fault} if fault else {})}
        self.procs[site] = cli("site", "start", "--config", str(self.site_configs[site]),
                               log=self.logs / f"{site}.log", env=env, fresh=self.fresh)

    def set_privacy(self, site: str, rules: dict[str, object]) -> None:
        """Write the site's `[privacy]` policy (docs/privacy.md) into its config, before it starts."""
        path = self.site_configs[site]
        config = read_toml(path)
        config["privacy"] = rules
        path.write_text(dump_toml(config))

    def start_watched(self) -> None:
        """Broker, the observer's subscription (so no status is missed), the PS and every site."""
        self.start_broker()
        self.watch()
        self.start_ps()
        for site in self.sites:
            self.start_site(site)

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

    def stop_all(self, timeout_s: float = 10.0) -> None:
        stop_federations([self], timeout_s)

    # -- watching -------------------------------------------------------------------------------
    def watch(self) -> Channel:
        """Subscribe as the observer (status and metrics only, as the ACL allows)."""
        if self.observer is None:
            t = MqttTransport(self.layout.settings("observer"), client_id=f"obs-{os.getpid()}-{time.monotonic_ns()}")
            t.connect()
            run = self.layout.run_id
            t.subscribe([topics.ps_metrics_topic(run), topics.ps_status_topic(run)])
            self.observer = Channel(t, run_id=run, identity=self.layout.identity("observer"))
        return self.observer

    def wait_message(self, predicate: Callable[[object], bool], timeout_s: float, what: str) -> object:
        channel, end = self.watch(), time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.check_alive()
            inbound = channel.receive(0.3)
            if inbound is not None and predicate(inbound.message):
                return inbound.message
        raise AssertionError(f"timed out waiting for {what}; logs in {self.logs}:\n{self.tail('ps')}")

    def retained_ps_status(self) -> object:
        """ps/status as a newcomer reads it: the retained copy, on a fresh connection, verified as the dashboard
        verifies it (the watcher's channel would give the newest status it has seen, not what the broker keeps)."""
        transport = MqttTransport(self.layout.settings("observer"), client_id="fresh", seat="1").connect(timeout_s=10)
        try:
            transport.subscribe([topics.ps_status_topic(self.layout.run_id)])
            channel = Channel(transport, run_id=self.layout.run_id, identity=self.layout.identity("observer"))
            arrived = channel.receive(10.0)
            assert arrived is not None, "no retained ps/status within 10 s"
            return arrived.message
        finally:
            transport.close()

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


def stop_federations(feds: Iterable[CliFederation], timeout_s: float = 10.0) -> None:
    """SIGTERM the PS and the sites of every federation at once and wait for them together, so they say goodbye
    to a live broker; then SIGINT the brokers (Ctrl-C: each stops its Mosquitto). Stragglers are SIGKILLed."""
    feds = list(feds)
    for fed in feds:
        if fed.observer is not None:
            fed.observer.transport.close()
            fed.observer = None
    stop_processes([(proc, signal.SIGTERM) for fed in feds for name, proc in fed.procs.items() if name != "broker"],
                   timeout_s)
    stop_processes([(fed.procs["broker"], signal.SIGINT) for fed in feds if "broker" in fed.procs], timeout_s)


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
