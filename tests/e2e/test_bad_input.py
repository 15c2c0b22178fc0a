"""Bad input from a real MQTT client holding a site's own credentials (broker login and signing key): rejected,
named, run unharmed."""

from __future__ import annotations

import json
import threading

import msgpack
import numpy as np
import paho.mqtt.client as mqtt

from fedmqtt.transport import topics
from fedmqtt.transport.signing import Identity
from schemas import messages as m
from schemas.codec import decode, encode
from schemas.tensors import TensorBlob


def _retained_model(client: mqtt.Client, run_id: str, me: Identity) -> m.GlobalModel:
    got: list[bytes] = []
    ready = threading.Event()

    def on_message(_c, _u, msg) -> None:  # noqa: ANN001
        got.append(msg.payload)
        ready.set()

    client.on_message = on_message
    client.subscribe(topics.ps_model_topic(run_id), qos=2)
    assert ready.wait(60), "no retained model"
    model = decode(me.ring.open(topics.ps_model_topic(run_id), "ps", got[0], max_bytes=1 << 26))
    assert isinstance(model, m.GlobalModel)
    return model


def _publish(client: mqtt.Client, topic: str, payload: bytes, me: Identity) -> None:
    """`payload` signed with the credentials' own key, so the PS judges what it says."""
    client.publish(topic, me.seal(topic, payload), qos=2, retain=True).wait_for_publish(10)


def test_ps_rejects_bad_updates_and_finishes(cli_federation, paho_client) -> None:
    """Garbage, wrong schema version, NaN weights, a spoofed sender and wrong shapes are each refused."""
    # Prepare: broker and PS up; cleveland's credentials in an intruder's hands.
    fed = cli_federation("bad", run_id="e2e-bad", rounds=2, sites=("cleveland", "hungary"))
    fed.start_broker()
    fed.start_ps()
    fed.start_site("hungary")
    intruder = paho_client(fed.layout.settings("cleveland"))
    me = fed.layout.identity("cleveland")
    # A valid "online" status from cleveland's credentials lets the PS start round 1.
    _publish(intruder, topics.site_status_topic("e2e-bad", "cleveland"),
             encode(m.SiteStatus(run_id="e2e-bad", sender="cleveland", round=0, state="online")), me)
    model = _retained_model(intruder, "e2e-bad", me)
    update_topic = topics.site_update_topic("e2e-bad", "cleveland")
    good = m.ClientUpdate(run_id="e2e-bad", sender="cleveland", round=1, session=model.session,
                          base_model_hash=model.model_hash,
                          tensors=model.tensors, n_samples=10, local_steps=1)
    raw = good.model_dump()
    nan = dict(raw, tensors=[dict(raw["tensors"][0], data=np.full(
        int(np.prod(raw["tensors"][0]["shape"])), np.nan, np.float32).tobytes()), *raw["tensors"][1:]])
    small = TensorBlob.from_numpy(model.tensors[0].name, np.zeros(3, np.float32))
    wrong_shape = good.model_copy(update={"tensors": (small, *model.tensors[1:])})
    # Execute
    _publish(intruder, topics.site_status_topic("e2e-bad", "cleveland"), b"{not json", me)
    _publish(intruder, update_topic, b"\x00garbage\xff", me)
    _publish(intruder, update_topic, msgpack.packb(dict(raw, schema_version=2)), me)
    _publish(intruder, update_topic, msgpack.packb(nan), me)
    _publish(intruder, update_topic, encode(good.model_copy(update={"sender": "hungary"})), me)
    _publish(intruder, update_topic, encode(wrong_shape), me)
    # One connection per login (the broker forces client id = user name): the intruder leaves before the real
    # cleveland agent logs in, or the two would push each other off.
    intruder.disconnect()
    intruder.loop_stop()
    fed.start_site("cleveland")
    fed.wait_ps_done(240)
    # Assert: each bad message was named in the PS log, and the real sites finished the run.
    log = fed.tail("ps", 2000)
    for reason in ("malformed payload", "schema_version 2 is not supported", "contains NaN or Inf",
                   "claims another identity", "the model has", "site/cleveland/status: malformed payload"):
        assert reason in log, f"PS log does not name {reason!r}"
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert sum(report["traffic"]["rejected"].values()) >= 5
    assert [r["sites"] for r in report["rounds"]] == [["cleveland", "hungary"]] * 2
