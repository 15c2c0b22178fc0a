"""Shared fixtures: a real Mosquitto per test with its own federation and run id, and real paho clients."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.reasoncodes import ReasonCode

from broker.config import free_port
from broker.federation import FederationLayout, init_federation
from broker.process import BrokerProcess, find_mosquitto
from fedmqtt.errors import BrokerError
from fedmqtt.transport.settings import BrokerSettings

CONNECT_TIMEOUT_S = 5.0


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
    layout = init_federation(tmp_path / "fed", run_id=run_id, site_ids=["site-a", "site-b"], port=free_port())
    running = RunningFederation(layout, BrokerProcess.start(layout.conf_path, port=layout.port))
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
