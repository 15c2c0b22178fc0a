"""Property: whatever invalid messages a party with one site's real credentials (broker login and signing key)
publishes, signed with that key, during a real run
(broker, PS and site processes), the PS never crashes, refuses and logs every one of them with its reason, and
the run ends with a final model bit-identical to the same run without that party.

Generated messages are invalid by construction (each carries at least one defect the PS must catch): arbitrary
bytes, arbitrary JSON and msgpack documents, and well-formed messages of every kind a site may send with one
field made hostile. Half the updates carry the live round and model hash, so they get past the round check and
must be refused for their content.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from harness import FAST_TRAIN, CliFederation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from broker.process import find_mosquitto
from fedmqtt.demo import DEMO_MODEL
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from fedmqtt.transport import topics
from fedmqtt.transport.signing import Identity
from schemas import messages as m
from schemas.codec import decode, encode
from schemas.tensors import TensorBlob

pytestmark = pytest.mark.slow
RUN = "e2e-fuzz"
HONEST = ("cleveland", "hungary")
MALLORY = "switzerland"
ROUNDS = 2
EXAMPLES = 3
_ids = itertools.count()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)

# One defect each; applied to an otherwise valid update (as a dict on its way to msgpack).
UPDATE_DEFECTS = [
    ("non-finite loss", lambda d: d.update(train_loss=float("nan"))),
    ("infinite compute time", lambda d: d.update(compute_seconds=float("inf"))),
    ("non-finite metric", lambda d: d.update(val_metrics={"auroc": float("-inf")})),
    ("negative samples", lambda d: d.update(n_samples=-1)),
    ("zero samples", lambda d: d.update(n_samples=0)),
    ("huge integer", lambda d: d.update(local_steps=2**63 - 1)),
    ("wrong sender", lambda d: d.update(sender="hungary")),
    ("wrong run", lambda d: d.update(run_id="other-run")),
    ("future schema", lambda d: d.update(schema_version=2)),
    ("far round", lambda d: d.update(round=2**40)),
    ("unknown model version", lambda d: d.update(base_model_hash=secrets.token_hex(32))),
    ("bfloat16 tensor", lambda d: d["tensors"][0].update(
        dtype="bfloat16", data=d["tensors"][0]["data"][: len(d["tensors"][0]["data"]) // 2])),
    ("bytes do not fit the shape", lambda d: d["tensors"][0].update(data=d["tensors"][0]["data"][:-4])),
    ("NaN weights", lambda d: d["tensors"][0].update(data=np.full(len(d["tensors"][0]["data"]) // 4, np.nan,
                                                                   np.float32).tobytes())),
    ("missing tensor", lambda d: d.update(tensors=d["tensors"][1:])),
    ("extra tensor", lambda d: d.update(tensors=[*d["tensors"], dict(d["tensors"][0], name="intruder.weight")])),
    ("wrong shape", lambda d: d["tensors"][0].update(shape=[1, *d["tensors"][0]["shape"]])),
    ("control variates for fedavg", lambda d: d.update(control_variates=d["tensors"][:1])),
    ("bad histogram", lambda d: d.update(label_histogram={"not-a-class": 3})),
    ("unknown field", lambda d: d.update(exploit=True)),
    ("deep metrics", lambda d: d.update(val_metrics=_deep(200))),
]
STATUS_DEFECTS = [
    ("bad state", lambda d: d.update(state="pwned")),
    ("wrong sender", lambda d: d.update(sender="cleveland")),
    ("non-finite time", lambda d: d.update(sent_at=float("inf"))),
    ("negative rows", lambda d: d.update(n_train=-5)),
    ("bad histogram", lambda d: d.update(label_histogram={"0": -1})),
    ("wrong kind", lambda d: d.update(kind="daemon_status")),
]


def _deep(depth: int) -> Any:
    value: Any = 1.0
    for _ in range(depth):
        value = {"x": value}
    return value


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, allow_nan=True))


@st.composite
def hostile(draw: st.DrawFn) -> tuple[str, str, Any]:
    """(topic kind, how to build, argument): the payload is built at publish time, when the live round is known."""
    choice = draw(st.sampled_from(["bytes", "json", "msgpack", "update", "update", "update", "status", "report"]))
    if choice == "bytes":
        return "update", "bytes", draw(st.binary(min_size=1, max_size=300).filter(lambda b: b[:1] != b"{"))
    if choice == "json":
        return "status", "json", draw(st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=5))
    if choice == "msgpack":
        return "report", "msgpack", draw(st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=5))
    if choice == "status":
        return "status", "status", draw(st.sampled_from(STATUS_DEFECTS))
    if choice == "report":
        return "report", "report", draw(st.sampled_from(["nan", "wrong model"]))
    return "update", "update", (draw(st.sampled_from(UPDATE_DEFECTS)), draw(st.booleans()))


def _build(how: str, arg: Any, live: m.GlobalModel | None) -> bytes:
    msg_id = f"{next(_ids):08d}{secrets.token_hex(8)}"
    if how == "bytes":
        return arg
    if how == "json":
        return json.dumps(_jsonable(arg), allow_nan=True).encode()
    if how == "msgpack":
        return msgpack.packb(arg, use_bin_type=True)
    if how == "status":
        (_, defect) = arg
        d = m.SiteStatus(run_id=RUN, sender=MALLORY, round=0, state="online", msg_id=msg_id).model_dump(mode="json")
        defect(d)
        return json.dumps(d, allow_nan=True).encode()
    if how == "report":
        d = m.EvalReport(run_id=RUN, sender=MALLORY, round=ROUNDS + 1, msg_id=msg_id, tag="final",
                         model_hash=secrets.token_hex(32), metrics={"test": {"auroc": 0.5}},
                         n_samples={"test": 3}).model_dump()
        if arg == "nan":
            d["metrics"] = {"test": {"auroc": float("nan")}}
        return msgpack.packb(d, use_bin_type=True)
    (_, defect), use_live = arg
    tensors = live.tensors if live is not None else (TensorBlob.from_numpy("w", np.zeros(3, np.float32)),
                                                     TensorBlob.from_numpy("b", np.zeros(1, np.float32)))
    base = m.ClientUpdate(run_id=RUN, sender=MALLORY, round=live.round if use_live and live else 7,
                          session=live.session if use_live and live else "",
                          base_model_hash=live.model_hash if use_live and live else "0" * 64, tensors=tensors,
                          n_samples=40, local_steps=2, msg_id=msg_id)
    d = base.model_dump()
    d["tensors"] = [dict(t, shape=list(t["shape"])) for t in d["tensors"]]
    defect(d)
    return msgpack.packb(d, use_bin_type=True)


class _Intruder:
    """A real paho client with the hostile site's own credentials; signs what it sends with the site's own key and
    remembers the newest global model."""

    def __init__(self, client: mqtt.Client, me: Identity) -> None:
        self.client = client
        self.me = me
        self.model: m.GlobalModel | None = None
        self.seen_model = threading.Event()
        client.on_message = self._on_message
        client.subscribe(topics.ps_model_topic(RUN), qos=2)

    def _on_message(self, _c, _u, msg) -> None:  # noqa: ANN001
        if msg.payload:
            body = self.me.ring.open(msg.topic, "ps", msg.payload, max_bytes=64 * 1024 * 1024)
            model = decode(body, max_bytes=64 * 1024 * 1024)
            if isinstance(model, m.GlobalModel):
                self.model = model
                self.seen_model.set()

    def publish(self, kind: str, payload: bytes, *, retain: bool = False) -> None:
        topic = {"status": topics.site_status_topic(RUN, MALLORY), "update": topics.site_update_topic(RUN, MALLORY),
                 "report": topics.site_report_topic(RUN, MALLORY)}[kind]
        info = self.client.publish(topic, self.me.seal(topic, payload), qos=2, retain=retain)
        info.wait_for_publish(10)
        assert info.is_published(), f"broker did not take a message on {topic}"


def _connect(fed: CliFederation) -> mqtt.Client:
    s = fed.layout.settings(MALLORY)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{MALLORY}-fuzz", protocol=mqtt.MQTTv5)
    client.username_pw_set(s.username, s.password)
    connected = threading.Event()
    client.on_connect = lambda *_a: connected.set()
    client.connect(s.host, s.port)
    client.loop_start()
    assert connected.wait(10), "intruder could not connect"
    return client


@pytest.fixture(scope="module")
def clean_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    find_mosquitto()
    out = tmp_path_factory.mktemp("clean")
    run_simulation(SimulationConfig(run_id=RUN, algorithm="fedavg", rounds=ROUNDS, seed=0, out_dir=out,
                                    model=DEMO_MODEL, train=FAST_TRAIN,
                                    sites={s: d for s, d in bundled_sites().items() if s in HONEST}), progress=False)
    return load_file(str(out / "final_model.safetensors"))


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(before=st.lists(hostile(), min_size=5, max_size=25), during=st.lists(hostile(), min_size=10, max_size=40))
def test_hostile_messages_during_a_real_run_change_nothing(clean_model, mosquitto_bin, reachable_by_broker, before,  # noqa: ANN001
                                                            during) -> None:
    work = reachable_by_broker(Path(tempfile.mkdtemp(prefix="fuzz-")))
    fed = CliFederation(work, run_id=RUN, rounds=ROUNDS, sites=(*HONEST, MALLORY),
                        ps_extra={"quorum": len(HONEST), "min_sites": len(HONEST)})
    try:
        fed.start_broker()
        fed.start_ps()
        intruder = _Intruder(_connect(fed), fed.layout.identity(MALLORY))
        # Mallory says it is offline (a valid, retained message), so rounds do not wait for it; everything after
        # is hostile, published once the PS listens.
        intruder.publish("status", encode(m.SiteStatus(run_id=RUN, sender=MALLORY, round=0, state="offline")),
                         retain=True)
        fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and msg.state == "waiting_for_sites", 60,
                         "the PS listening")
        for kind, how, arg in before:
            intruder.publish(kind, _build(how, arg, None))
        for site in HONEST:
            fed.start_site(site)
        assert intruder.seen_model.wait(60), "no round started"
        for kind, how, arg in during:
            intruder.publish(kind, _build(how, arg, intruder.model))
        fed.wait_ps_done(180)
        intruder.client.disconnect()
        intruder.client.loop_stop()

        final = fed.final_weights()
        assert sorted(final) == sorted(clean_model)
        for name in clean_model:
            np.testing.assert_array_equal(final[name], clean_model[name], err_msg=name)
        log = (fed.logs / "ps.log").read_text(errors="replace")
        assert "Traceback" not in log
        # Refusals are logged at a bounded rate (fedmqtt.logs.RefusalLog): the first few per sender and reason
        # verbatim, the rest counted in one summary line; together they account for every hostile message.
        lines = log.splitlines()
        verbatim = [line for line in lines if re.search(r"(rejected|refused)", line) and MALLORY in line]
        summarised = sum(int(match.group(1).replace(",", "")) for line in lines
                         if (match := re.search(rf"{MALLORY}: ([\d,]+) more refusals? \(", line)))
        sent = len(before) + len(during)
        assert len(verbatim) + summarised == sent, \
            f"{sent} hostile messages, {len(verbatim)} refusals logged and {summarised} summarised"
        report = json.loads((fed.work / "ps" / "report.json").read_text())
        assert [r["sites"] for r in report["rounds"]] == [list(HONEST)] * ROUNDS
    finally:
        fed.stop_all()
        shutil.rmtree(work, ignore_errors=True)
