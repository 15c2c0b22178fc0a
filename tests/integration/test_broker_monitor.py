"""The `monitor` login that `broker init` creates: on a real Mosquitto it reads the broker's `$SYS` numbers and
nothing of the run, and writes nothing; no other login reads `$SYS` (docs/monitoring.md, "Watching the broker")."""

from __future__ import annotations

import stat
import threading
import time
from collections.abc import Callable

import paho.mqtt.client as mqtt

from fedmqtt.transport import topics
from fedmqtt.transport.settings import load_credentials

SYS_WANTED = "$SYS/broker/clients/connected"  # published every sys_interval (10 s by default)


def _collect(client: mqtt.Client, filters: list[str]) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def on_message(_c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        with lock:
            got.append((msg.topic, bytes(msg.payload)))

    client.on_message = on_message
    client.subscribe([(f, 1) for f in filters])
    return got


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_the_monitor_reads_sys_only_and_no_party_reads_sys(federation, paho_client) -> None:  # noqa: ANN001
    # Prepare: a retained message of the run, and the monitor's login file as `broker init` wrote it
    run_id = federation.run_id
    status = topics.ps_status_topic(run_id)
    ps = paho_client(federation.settings("ps"))
    ps.publish(status, b"from the ps", qos=1, retain=True).wait_for_publish(10)
    path = federation.layout.monitor_login_path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monitor_settings = load_credentials(path)
    assert monitor_settings.username == "monitor"

    # Execute: the monitor and the observer both ask for $SYS and the whole run; the monitor tries to write
    monitor = paho_client(monitor_settings)
    observer = paho_client(federation.settings("observer"))
    by_monitor = _collect(monitor, [topics.broker_sys_filter(), topics.run_filter(run_id)])
    by_observer = _collect(observer, [topics.broker_sys_filter(), topics.ps_status_topic(run_id)])
    monitor.publish(status, b"from the monitor", qos=1, retain=True).wait_for_publish(10)
    # the broker's count, once its next $SYS round counts the three of us (ps, monitor, observer)
    got_sys = _wait(lambda: any(t == SYS_WANTED and int(p) >= 3 for t, p in list(by_monitor)), 25)
    time.sleep(1.0)

    # Check: the monitor gets the broker's numbers and nothing of the run; the observer the run's status only
    assert got_sys, by_monitor
    assert all(t.startswith("$SYS/") for t, _ in by_monitor), [t for t, _ in by_monitor if not t.startswith("$SYS")]
    assert not [t for t, _ in by_observer if t.startswith("$SYS")]
    assert by_observer and {(t, p) for t, p in by_observer} == {(status, b"from the ps")}  # the write was dropped
