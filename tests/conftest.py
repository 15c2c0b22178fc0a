"""Shared fixtures: a real Mosquitto per test with its own federation and run id, real paho clients, and a
`fedmqtt dashboard` process; the markers each test folder implies."""

from __future__ import annotations

import gc
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.reasoncodes import ReasonCode

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "e2e"))  # harness.py: the CLI federation and process helpers

from harness import PORT_TRIES, _port_open, on_free_port, port_taken, stop_processes  # noqa: E402

from broker.config import free_port  # noqa: E402
from broker.federation import FederationLayout, init_federation  # noqa: E402
from broker.process import BrokerProcess, find_mosquitto  # noqa: E402
from fedmqtt.errors import BrokerError  # noqa: E402
from fedmqtt.transport.settings import BrokerSettings  # noqa: E402

CONNECT_TIMEOUT_S = 5.0
# What a test needs follows from its folder: the marker is set here, once, not in each file.
FOLDER_MARKERS = {"integration": "integration", "e2e": "e2e", "browser": "browser"}
# Modules whose tests share a module-scoped fixture too costly to build on every pytest-xdist worker (a Dask
# cluster of worker processes): with `--dist loadgroup` (scripts/test.sh) one worker runs all of them.
ONE_WORKER_MODULES = {"integration/test_grid_cluster.py"}


# Folders in the order their tests start: the long ones (real processes, a browser) first, so that pytest-xdist
# hands them out while every worker is free and the short unit tests fill the gaps at the end, instead of one
# worker finishing a federation test long after the others ran out of work.
START_ORDER = {"e2e": 0, "browser": 1, "integration": 2}


def _start_rank(item: pytest.Item) -> int:
    path = item.path.resolve()
    return START_ORDER.get(path.relative_to(TESTS).parts[0], 3) if path.is_relative_to(TESTS) else 3


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker and xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_start_rank)  # stable: the order within a folder stays as collected
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(TESTS):
            continue
        relative = path.relative_to(TESTS)
        marker = FOLDER_MARKERS.get(relative.parts[0])
        if marker is not None:
            item.add_marker(marker)
        if relative.as_posix() in ONE_WORKER_MODULES and item.config.pluginmanager.hasplugin("xdist"):
            item.add_marker(pytest.mark.xdist_group(relative.stem))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection made (torch, scikit-learn, every test module: some 300,000 objects) out of the
    cycle collector's sight: each full collection during the run then costs next to nothing instead of about
    0.1 s, those of _collect_mqtt_garbage included."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _collect_mqtt_garbage(request: pytest.FixtureRequest) -> Iterator[None]:
    """A closed paho client that sits in a reference cycle (its callbacks are bound methods of its owner) is
    left to the cycle collector, which may finalise its socket pair before the client's __del__ closes it: a
    ResourceWarning, an error under filterwarnings, in whichever test runs next on this pytest-xdist worker.
    Collect each MQTT test's garbage at its own teardown, quietly, as test_tls.py does after a failed
    handshake."""
    yield
    if any(request.node.get_closest_marker(name) for name in FOLDER_MARKERS.values()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def reachable_by_broker(path: Path) -> Path:
    """As root, Mosquitto runs as the unprivileged `mosquitto` user (broker/config.py, broker_user), which must
    pass through the folders above a federation; pytest makes its temporary folders 0700. Let others pass
    through (o+x: no listing, no reading) the root-owned ones from `path` up; the files stay private."""
    if os.geteuid() == 0:
        for folder in (path, *path.parents):
            st = folder.stat()
            if st.st_uid == 0 and not st.st_mode & 0o001:
                folder.chmod(st.st_mode & 0o7777 | 0o001)
    return path


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    """pytest's tmp_path, which the broker's own user can pass through when the tests run as root."""
    return reachable_by_broker(tmp_path)


@pytest.fixture(name="reachable_by_broker", scope="session")
def reachable_by_broker_fixture() -> Callable[[Path], Path]:
    """`reachable_by_broker` for folders made otherwise (tmp_path_factory.mktemp, tempfile.mkdtemp)."""
    return reachable_by_broker


@pytest.fixture(scope="session")
def mosquitto_bin() -> str:
    """Path of the mosquitto binary; skips broker tests locally when it is missing, fails them under CI."""
    try:
        return find_mosquitto()
    except BrokerError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc} (CI must run the broker tests)")
        pytest.skip(f"mosquitto not installed ({exc})")


@dataclass
class RunningFederation:
    """A federation laid out under tmp_path and its running broker."""

    layout: FederationLayout
    broker: BrokerProcess

    @property
    def run_id(self) -> str:
        return self.layout.run_id

    @property
    def port(self) -> int:
        return self.layout.port

    def settings(self, user: str) -> BrokerSettings:
        """Broker settings with the credentials of `user` (ps, observer or a site id)."""
        return self.layout.settings(user)

    def restart(self, *, kill: bool = False) -> None:
        """Stop the broker and start it again: SIGTERM saves the database, kill=True loses unsaved changes."""
        if kill:
            self.broker.kill()
        else:
            self.broker.stop()
        self.broker = BrokerProcess.start(self.layout.conf_path, port=self.port, host=self.layout.host)


@pytest.fixture
def federation(mosquitto_bin: str, tmp_path: Path) -> Iterator[RunningFederation]:
    """Sites site-a and site-b, a fresh run id, a broker on a free loopback port; stopped at teardown."""
    run_id = f"t-{secrets.token_hex(4)}"

    def start(port: int) -> RunningFederation:
        layout = init_federation(tmp_path / "fed", run_id=run_id, site_ids=["site-a", "site-b"], port=port,
                                 force=True)
        return RunningFederation(layout, BrokerProcess.start(layout.conf_path, port=layout.port))

    running = on_free_port(start)
    try:
        yield running
    finally:
        running.broker.stop()


@pytest.fixture
def paho_client() -> Iterator[Callable[..., mqtt.Client]]:
    """Factory: `paho_client(settings, client_id=None)` -> a connected MQTT v5 client with its loop started.

    Fails the test if the broker refuses the connection; every client is disconnected at teardown.
    """
    clients: list[mqtt.Client] = []

    def connect(settings: BrokerSettings, *, client_id: str | None = None) -> mqtt.Client:
        client_id = client_id or f"{settings.username}-{secrets.token_hex(3)}"
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        client.username_pw_set(settings.username, settings.password)
        connected = threading.Event()
        outcome: list[ReasonCode] = []

        def on_connect(_c: mqtt.Client, _u: object, _f: object, reason: ReasonCode, _p: object) -> None:
            outcome.append(reason)
            connected.set()

        client.on_connect = on_connect
        clients.append(client)
        client.connect(settings.host, settings.port, keepalive=settings.keepalive_s)
        client.loop_start()
        if not connected.wait(CONNECT_TIMEOUT_S):
            pytest.fail(f"no CONNACK for {client_id} within {CONNECT_TIMEOUT_S} s")
        if outcome[0].is_failure:
            pytest.fail(f"broker refused {client_id} ({settings.username}): {outcome[0]}")
        return client

    yield connect
    for client in clients:
        client.disconnect()
        client.loop_stop()
        # Callbacks (e.g. an Inbox's) refer back to their holder: without them the client is freed at once, and
        # its __del__ closes its socket pair; left to the cycle collector, the sockets may be finalised first
        # and warn ("unclosed socket"), which fails the session at exit.
        client.on_message = client.on_connect = client.on_subscribe = client.on_disconnect = None
    clients.clear()


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Factory: `dashboard(*cli_args)` starts `fedmqtt dashboard ... --port P` and returns its URL (https with
    --tls); its output goes to `dashboard-<port>.log` in the test's tmp dir. All are stopped at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> str:
        for attempt in range(1, PORT_TRIES + 1):
            port = free_port()
            log = tmp_path / f"dashboard-{port}.log"
            with open(log, "wb") as fh:
                proc = subprocess.Popen([sys.executable, "-m", "fedmqtt", "dashboard", *args, "--port", str(port)],
                                        stdout=fh, stderr=subprocess.STDOUT)
            procs.append(proc)
            if _wait_listening(port, 30, proc, log):
                return f"{'https' if '--tls' in args else 'http'}://127.0.0.1:{port}/"
            output = log.read_text(errors="replace")
            if attempt == PORT_TRIES or not port_taken(output):  # else another process took the port: again
                pytest.fail(f"dashboard exited with {proc.returncode}:\n{output}")
        raise AssertionError("unreachable")

    yield start
    stop_processes([(proc, signal.SIGTERM) for proc in procs])


def _wait_listening(port: int, timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> bool:
    """True once the process listens on `port`, False if it exited first; fails the test after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        if _port_open("127.0.0.1", port):
            return True
        time.sleep(0.1)
    pytest.fail(f"dashboard did not listen on {port} within {timeout_s} s:\n{log.read_text(errors='replace')}")
