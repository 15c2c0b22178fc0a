"""Once a run is over, nothing the sites sent up is left retained at the broker: no update, no chunk of one, no
report, as a real MQTT client that subscribes afterwards sees it (each would cost broker memory until removed)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from harness import wait_until

from fedmqtt.transport import topics

pytestmark = pytest.mark.slow

SITES = ("cleveland", "hungary")
SMALL_CHUNKS = {"chunk_threshold_bytes": 1024, "chunk_bytes": 1024}  # every model and update travels chunked


def _retained(client, filters: list[str], wait_s: float = 2.0) -> list[tuple[str, bytes]]:  # noqa: ANN001
    """(topic, payload) of every retained message under `filters` (empty payloads are none: the broker drops them)."""
    got: queue.Queue[tuple[str, bytes]] = queue.Queue()
    acked = threading.Event()
    client.on_message = lambda _c, _u, msg: got.put((msg.topic, bytes(msg.payload))) if msg.retain else None
    client.on_subscribe = lambda *_args: acked.set()
    client.subscribe([(f, 2) for f in filters])
    assert acked.wait(10), "no SUBACK"
    time.sleep(wait_s)
    return [got.get() for _ in range(got.qsize())]


def test_no_update_chunk_or_report_is_left_retained_after_a_run(cli_federation, paho_client) -> None:
    # Prepare: every model and update chunked; two rounds and the final evaluation
    run_id = "e2e-retained"
    fed = cli_federation("retained", run_id=run_id, rounds=2, sites=SITES, broker_extra=SMALL_CHUNKS)

    # Execute: the run to its end; each site removes its report once the PS says it is done
    fed.run_to_completion(240)
    wait_until(lambda: all("removed our report from the broker" in fed.tail(s, 400) for s in SITES), 30,
               "each site removed its report")
    reader = paho_client(fed.layout.settings("ps"))  # the PS has exited; its user may read every site topic
    prefix = topics.run_prefix(run_id)
    left = _retained(reader, [f"{prefix}/site/+/{kind}/#" for kind in ("update", "report", "secagg", "status")])

    # Assert: the sites' statuses are there (the reader does see retained messages), and nothing else
    assert {t for t, _ in left if t.endswith("/status")} == {topics.site_status_topic(run_id, s) for s in SITES}
    assert [t for t, _ in left if not t.endswith("/status")] == []
    for site in SITES:
        assert "removed our update from the broker" in fed.tail(site, 400)
