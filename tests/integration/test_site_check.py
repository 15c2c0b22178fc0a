"""`fedmqtt site check` against a real Mosquitto federation over TLS (CA, host name and pinned broker key).

A correct site passes every check and exits 0; each way a hospital gets it wrong (password, CA file, a readable
credentials file, data missing or not matching its spec, the broker's port closed, the wrong run) fails the
check that concerns it, with its fix, and exits 1. And the check leaves no trace: a running agent's connections
stay up and an observer of the whole run sees nothing from it."""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from typer.testing import CliRunner

from broker import certs
from broker.config import free_port
from broker.federation import FederationLayout, init_federation
from broker.process import BrokerProcess
from fedmqtt.cli import app
from fedmqtt.config_io import dump_toml, read_toml
from fedmqtt.data.heart_disease import bundled_path
from fedmqtt.transport import topics
from fedmqtt.transport.mqtt import MqttTransport
from schemas import messages as m
from schemas.codec import encode

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Site:
    """One site's files, made as a hospital would have them: its config, its credentials, its data."""

    folder: Path
    layout: FederationLayout

    @property
    def config(self) -> Path:
        return self.folder / "site.toml"

    @property
    def credentials(self) -> Path:
        return self.folder / "site-a.toml"

    def write(self, *, site: dict[str, Any] | None = None, broker: dict[str, Any] | None = None) -> Path:
        table = {**read_toml(self.layout.credentials["site-a"])["broker"], **(broker or {})}  # type: ignore[dict-item]
        self.credentials.write_text(dump_toml({"broker": {k: v for k, v in table.items() if v is not None}}))
        self.credentials.chmod(0o600)
        cfg = {"site_id": "site-a", "run_id": self.layout.run_id, "credentials": self.credentials.name,
               "state_dir": "state", "data": {"format": "heart_disease", "path": str(bundled_path("hungary"))},
               **(site or {})}
        self.config.write_text(dump_toml(cfg))
        return self.config


@pytest.fixture(scope="module")
def fed(mosquitto_bin: str, tmp_path_factory: pytest.TempPathFactory,
        reachable_by_broker: Callable[[Path], Path]) -> Iterator[FederationLayout]:
    """One TLS federation for the module (every test only reads from it)."""
    work = reachable_by_broker(tmp_path_factory.mktemp("check"))
    layout = init_federation(work / "fed", run_id=f"t-{secrets.token_hex(3)}", site_ids=["site-a", "site-b"],
                             host="127.0.0.1", port=free_port(), tls=True)
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.listen_host):
        yield layout


@pytest.fixture
def site(fed: FederationLayout, tmp_path: Path) -> Site:
    made = Site(tmp_path / "hospital", fed)
    made.folder.mkdir()
    made.write()
    return made


@pytest.fixture
def ps_status(fed: FederationLayout) -> Iterator[Callable[..., None]]:
    """`ps_status(live=False, **fields)`: the PS's retained status, as the real PS publishes it, with its own
    login; `live`: again every half second, as a PS in a round does. Cleared at the end."""
    ps = MqttTransport(fed.settings("ps"), client_id="ps").connect(timeout_s=10)
    topic = topics.ps_status_topic(fed.run_id)
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def send(fields: dict[str, Any]) -> None:
        status = {"state": "training", "sites_expected": ("site-a", "site-b"), "sites_online": ("site-b",), **fields}
        ps.publish(topic, encode(m.DaemonStatus(run_id=fed.run_id, sender="ps", round=1, **status)))

    def publish(*, live: bool = False, **fields: Any) -> None:
        send(fields)
        if live:
            threads.append(threading.Thread(target=lambda: [send(fields) for _ in iter(lambda: stop.wait(0.5), True)],
                                            daemon=True))
            threads[-1].start()

    yield publish
    stop.set()
    for thread in threads:
        thread.join()
    ps.clear_retained(topic)
    ps.close()


def check(config: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    """`fedmqtt site check --json` in this process: its exit code and report."""
    result = CliRunner().invoke(app, ["site", "check", "--config", str(config), "--json", "--timeout", "3", *extra])
    return result.exit_code, json.loads(result.stdout)


def finding(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in report["checks"] if f["check"] == name)


def test_a_correct_site_passes_every_check_and_exits_0(site: Site, ps_status: Callable[..., None]) -> None:
    """The real command, as hospital IT runs it: every line PASS, aligned, no colour when not on a terminal."""
    # Prepare
    ps_status(live=True)  # a PS in a round: a clock reference sent now

    # Execute
    out = subprocess.run([sys.executable, "-m", "fedmqtt", "site", "check", "--config", str(site.config)],
                         capture_output=True, text=True, timeout=120, cwd=site.folder,
                         env={**os.environ, "PYTHONPATH": str(REPO)})

    # Assert
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("  ")]
    assert [line.split()[1] for line in lines] == ["config", "credentials", "data", "device", "privacy", "broker",
                                                   "TLS", "login", "run", "clock", "state"]
    assert all(line.startswith("  PASS  ") for line in lines), out.stdout
    assert len({line.index(line.split()[2]) for line in lines if line.split()[1] != "state"}) == 1  # one column
    assert "\033[" not in out.stdout
    assert "pinned broker key matches" in out.stdout and "site-a.check" in out.stdout
    assert "All 11 checks passed" in out.stdout


@pytest.mark.parametrize(("case", "check_name", "says", "fix_says"), [
    ("wrong password", "login", "not authorized (0x87)", "credentials file"),
    ("wrong CA file", "TLS", "unable to get local issuer certificate", "federation's CA certificate"),
    ("host name not in the certificate", "TLS", "Hostname mismatch", "not issued for 'localhost'"),
    ("world-readable credentials", "credentials", "open to its group and other users (mode 0644)", "chmod 600"),
    ("missing data file", "data", "no such file", "path in the [data] table"),
    ("data not matching the spec", "data", "expected 14 comma-separated columns", "match the [data] spec"),
    ("broker port closed", "broker", "refused the connection", "Is the broker running"),
    ("wrong run id", "run", "the broker serves run", "Set run_id"),
    ("site not in the run", "run", "expects site-b; not site-a", "add site-a to sites in the PS config"),
])
def test_each_mistake_fails_its_check_with_the_fix_and_exits_1(
    site: Site, ps_status: Callable[..., None], tmp_path: Path, case: str, check_name: str, says: str,
    fix_says: str,
) -> None:
    # Prepare
    ps_status()
    if case == "wrong password":
        site.write(broker={"password": "not-the-password"})
    elif case == "wrong CA file":
        other_ca = tmp_path / "other-ca.crt"
        other_ca.write_bytes(certs.create_root_ca("another-federation").cert_pem)
        site.write(broker={"tls_ca_pem": None, "tls_ca_file": str(other_ca)})
    elif case == "host name not in the certificate":  # the broker's address by a name its certificate lacks
        site.write(broker={"host": "localhost"})
    elif case == "world-readable credentials":
        site.credentials.chmod(0o644)
    elif case == "missing data file":
        site.write(site={"data": {"format": "heart_disease", "path": "no-such.data"}})
    elif case == "data not matching the spec":
        short_row = tmp_path / "export.data"
        short_row.write_text("63,1,1,145,233,1,2,150,0,2.3,3,0,6,0\n67,1,4,160,286,0,2,108,1,1.5,2,3,1\n")
        site.write(site={"data": {"format": "heart_disease", "path": str(short_row)}})
    elif case == "broker port closed":
        site.write(broker={"port": free_port()})
    elif case == "wrong run id":
        site.write(site={"run_id": "another-run"})
    elif case == "site not in the run":
        ps_status(sites_expected=("site-b",))

    # Execute
    code, report = check(site.config)

    # Assert
    failed = [f for f in report["checks"] if f["status"] == "fail"]
    assert code == 1 and report["exit_code"] == 1 and not report["ok"]
    assert [f["check"] for f in failed] == [check_name], json.dumps(report, indent=1)
    assert says in failed[0]["found"] and fix_says in failed[0]["fix"], failed[0]


def test_without_a_ps_status_run_and_clock_warn_and_the_check_still_exits_0(site: Site) -> None:
    """No reference to compare the clock with is a warning, not a failure (the PS may simply not be up yet)."""
    # Execute
    code, report = check(site.config)

    # Assert
    assert code == 0
    assert {f["check"]: f["status"] for f in report["checks"] if f["status"] != "pass"} == {"run": "warn",
                                                                                          "clock": "warn"}
    assert finding(report, "clock")["fix"].startswith("Turn on time synchronisation")


def test_a_clock_behind_the_ps_by_minutes_fails(site: Site, ps_status: Callable[..., None]) -> None:
    """A status the PS sent 10 minutes in our future: this host's clock is behind by at least that."""
    # Prepare
    ps_status(sent_at=time.time() + 600)

    # Execute
    code, report = check(site.config)

    # Assert
    clock = finding(report, "clock")
    assert code == 1 and clock["status"] == "fail", clock
    assert "at least 10 min behind" in clock["found"] and "timedatectl" in clock["fix"]


def test_the_model_size_on_the_broker_sets_the_disk_space_needed(
    site: Site, ps_status: Callable[..., None], fed: FederationLayout,
) -> None:
    # Prepare
    ps = MqttTransport(fed.settings("ps"), client_id="ps", seat="bulk").connect(timeout_s=10)
    model_topic = topics.ps_model_topic(fed.run_id)
    ps.publish(model_topic, secrets.token_bytes(3 << 20))  # 3 MB on ps/model
    ps_status()

    # Execute
    try:
        code, report = check(site.config)
    finally:
        ps.clear_retained(model_topic)
        ps.close()

    # Assert
    state = finding(report, "state dir")
    assert code == 0 and state["status"] == "pass"
    assert state["facts"]["model_bytes"] == 3 << 20 and state["facts"]["needed_bytes"] == 8 * (3 << 20) + (64 << 20)


def test_the_check_publishes_nothing_and_leaves_a_running_agent_connected(
    site: Site, ps_status: Callable[..., None], fed: FederationLayout,
) -> None:
    """An observer of the whole run (the PS's bulk login reads every topic of it) sees nothing while the check
    runs, and the agent's own two logins, connected with their Last Will, are never pushed off."""
    # Prepare
    ps_status()  # retained only: any live message the observer sees during the check is the check's
    seen: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    observer = _client(fed, "ps.bulk", on_message=lambda msg: seen.put(msg) if not msg.retain else None)
    observer.subscribe("#", qos=2)
    dropped = threading.Event()
    agent = [_client(fed, login, on_disconnect=dropped.set,
                     will=(topics.site_status_topic(fed.run_id, "site-a"), b"offline"))
             for login in ("site-a", "site-a.bulk")]
    time.sleep(0.5)  # the observer's subscription is in place

    # Execute
    try:
        code, report = check(site.config)
        time.sleep(0.5)  # anything the check sent has reached the observer by now
        agent_stayed = all(client.is_connected() for client in agent) and not dropped.is_set()
    finally:
        for client in (observer, *agent):
            client.disconnect()
            client.loop_stop()

    # Assert
    assert code == 0, json.dumps(report, indent=1)
    assert seen.empty(), [(msg.topic, msg.payload[:60]) for msg in list(seen.queue)]
    assert agent_stayed
    log = fed.log_path.read_text()
    assert "u'site-a.check'" in log and "Client site-a.check disconnected." in log  # its own login; clean DISCONNECT


def test_under_mutual_tls_the_check_logs_in_with_its_own_certificate(
    mosquitto_bin: str, tmp_path: Path,
) -> None:
    # Prepare
    layout = init_federation(tmp_path / "fed", run_id=f"t-{secrets.token_hex(3)}", site_ids=["site-a"],
                             host="127.0.0.1", port=free_port(), tls=True, mtls=True)
    made = Site(tmp_path / "hospital", layout)
    made.folder.mkdir()
    made.write()

    # Execute
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.listen_host):
        code, report = check(made.config)

    # Assert
    login = finding(report, "login")
    assert code == 0 and login["status"] == "pass", login
    assert "mutual TLS" in finding(report, "credentials")["found"]
    assert "u'site-a.check'" in layout.log_path.read_text()


def _client(fed: FederationLayout, login: str, *, on_message: Callable[[mqtt.MQTTMessage], None] | None = None,
            on_disconnect: Callable[[], None] | None = None, will: tuple[str, bytes] | None = None) -> mqtt.Client:
    """A plain paho client logged in as `login` with the password of its party."""
    settings = fed.settings(login.split(".")[0])
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=login, protocol=mqtt.MQTTv5)
    client.username_pw_set(login, settings.password)
    context = settings.ssl_context()
    assert context is not None
    client.tls_set_context(context)
    if will is not None:
        client.will_set(will[0], will[1], qos=1, retain=True)
    connected = threading.Event()
    client.on_connect = lambda *_: connected.set()
    if on_message is not None:
        client.on_message = lambda _c, _u, msg: on_message(msg)
    if on_disconnect is not None:
        client.on_disconnect = lambda *_: on_disconnect()
    client.connect(settings.host, settings.port)
    client.loop_start()
    assert connected.wait(10), f"{login} did not connect"
    return client
