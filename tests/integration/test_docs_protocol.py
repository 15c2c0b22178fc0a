"""docs/protocol.md, docs/schemas/ and docs/configuration.md are generated from the code: they must be
current, name every topic the code can build, describe every config key, and say true things about delivery
(checked against a real Mosquitto)."""

from __future__ import annotations

import inspect
import json
import threading
import time
import typing
from pathlib import Path

import numpy as np
import pytest

from fedmqtt.docgen import REPO, configuration, protocol, protocol_payloads, protocol_topics
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport
from schemas import messages as m
from schemas.chunks import MIN_CHUNK_BYTES
from schemas.tensors import arrays_to_blobs, tensors_hash

RUN, SITE = "run", "site-a"


def _on_disk(rel: str) -> str | None:
    path = REPO / rel
    return path.read_text(encoding="utf-8") if path.is_file() else None


@pytest.mark.parametrize("generator", [protocol, configuration], ids=["protocol", "configuration"])
def test_generated_files_are_current(generator) -> None:
    """What the generator makes now is what is committed (else: run `python -m fedmqtt.docgen`)."""
    rendered = generator.render()
    stale = sorted(rel for rel, text in rendered.items() if _on_disk(rel) != text)
    assert not stale, f"stale generated files (run: python -m fedmqtt.docgen): {stale}"


def test_no_stray_schema_files() -> None:
    """Every file in docs/schemas/ is one the generator makes: a removed model leaves no orphan behind."""
    made = {Path(rel).name for rel in protocol.render() if rel.startswith(protocol_payloads.SCHEMA_DIR)}
    present = {p.name for p in (REPO / protocol_payloads.SCHEMA_DIR).glob("*.json")}
    assert present == made


def test_every_wire_model_has_a_schema_file_that_validates_as_its_model() -> None:
    """One schema per member of the wire union, and it is that model's own JSON Schema."""
    union = typing.get_args(typing.get_args(m.Message)[0])
    for model in union:
        text = _on_disk(f"docs/schemas/{model.__name__}.json")
        assert text is not None, model.__name__
        assert json.loads(text) == model.model_json_schema()


@pytest.mark.parametrize("model", configuration.DESCRIBED, ids=lambda model: model.__name__)
def test_every_config_field_has_a_description(model) -> None:
    missing = [name for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"{model.__name__}: fields without description=: {missing}"


def test_every_config_key_appears_in_configuration_md() -> None:
    text = _on_disk(configuration.PATH) or ""
    for model, prefix in ((configuration.DaemonConfig, ""), (configuration.SiteConfig, ""),
                          (configuration.BrokerSettings, ""), (configuration.TrainSettings, "train."),
                          (configuration.RecruitmentConfig, "recruitment.")):
        for name in model.model_fields:
            assert f"| `{prefix}{name}` |" in text, f"{model.__name__}.{name} is not in {configuration.PATH}"


def _samples(fn) -> list[str]:
    """Every topic one builder of fedmqtt.transport.topics makes from sample ids (independent of the
    generator's own enumeration, so a builder it skips is noticed here)."""
    calls: list[dict[str, object]] = [{}]
    bases = [topics.ps_model_topic(RUN), topics.ps_task_topic(RUN, SITE), topics.site_update_topic(RUN, SITE),
             topics.site_report_topic(RUN, SITE)]
    values = {"run_id": [RUN], "site_id": [SITE], "kind": list(topics.SITE_KINDS), "index": [0],
              "topic": bases}
    for param in inspect.signature(fn).parameters:
        calls = [{**call, param: value} for call in calls for value in values[param]]
    return [fn(**call) for call in calls]


def test_every_topic_the_topics_module_can_build_appears_in_protocol_md() -> None:
    text = _on_disk(protocol.PATH) or ""
    builders = {name: fn for name, fn in vars(topics).items() if inspect.isfunction(fn)
                and fn.__module__ == topics.__name__ and name.endswith(("_topic", "_filter"))
                and name != "parse_topic"}
    assert len(builders) >= 14  # the enumeration itself works: ps/site topics, chunk and filter builders
    for name, fn in builders.items():
        for topic in _samples(fn):
            shown = protocol_topics.placeholder(topic)
            assert f"`{shown}`" in text, f"topics.{name} builds {shown}, not in {protocol.PATH}"


def test_chunked_kinds_have_a_chunk_row() -> None:
    text = _on_disk(protocol.PATH) or ""
    assert "## Chunked transfer" in text
    bases = {("ps", "model"): topics.ps_model_topic(RUN), ("ps", "task"): topics.ps_task_topic(RUN, SITE),
             ("site", "update"): topics.site_update_topic(RUN, SITE),
             ("site", "report"): topics.site_report_topic(RUN, SITE)}
    for kind in topics.CHUNKED_KINDS:
        chunk = protocol_topics.placeholder(topics.chunk_topic(bases[kind], 0))
        assert f"| `{chunk}` |" in text, chunk


def test_delivery_table_matches_the_acl() -> None:
    """Spot checks of the generated rights against what the README promises: observers never read a model."""
    text = (_on_disk(protocol.PATH) or "").split("### Delivery and rights", 1)[1].split("\n### ", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| `fedmqtt/v1/<run>/")}
    assert "observers" not in rows["`fedmqtt/v1/<run>/ps/model`"].split("|")[5]
    assert "other sites" not in rows["`fedmqtt/v1/<run>/ps/task/<site>`"].split("|")[5]
    assert "observers" in rows["`fedmqtt/v1/<run>/ps/metrics`"].split("|")[5]
    assert rows["`fedmqtt/v1/<run>/site/<site>/update`"].split("|")[4].strip() == "PS, the site itself"


def test_qos_and_retention_as_documented(federation, paho_client) -> None:
    """What protocol.md says about QoS and retention is what a real broker delivers: a client that subscribes
    after the PS published gets the status, the model's manifest and its chunks, retained, at the documented
    QoS."""
    # Prepare: a PS channel that chunks anything above 1 KiB
    run = federation.run_id
    settings = federation.settings("ps").model_copy(update={"chunk_threshold_bytes": MIN_CHUNK_BYTES,
                                                            "chunk_bytes": MIN_CHUNK_BYTES})
    ps = Channel.open(lambda **kw: MqttTransport(settings, **kw), client_id="ps-docs", will=None, run_id=run,
                      identity=federation.layout.identity("ps"))
    ps.connect(timeout_s=10)
    blobs = arrays_to_blobs({"w": np.arange(2048, dtype=np.float32)})
    model = m.GlobalModel(run_id=run, sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                          model_hash=tensors_hash(blobs), tensors=blobs)
    status = m.DaemonStatus(run_id=run, sender="ps", round=0, state="waiting_for_sites")
    # Execute: publish first, subscribe afterwards (only retained messages can arrive)
    ps.send(topics.ps_status_topic(run), status)
    ps.send(topics.ps_model_topic(run), model)
    got: dict[str, tuple[int, bool]] = {}
    lock = threading.Lock()

    def on_message(_client, _userdata, message) -> None:  # noqa: ANN001
        with lock:
            got[message.topic] = (message.qos, bool(message.retain))

    site = paho_client(federation.settings(SITE))
    site.on_message = on_message
    site.subscribe([(topics.ps_status_topic(run), 2), (topics.ps_model_topic(run), 2),
                    (topics.chunk_filter(topics.ps_model_topic(run)), 2)])
    model_topic = topics.ps_model_topic(run)
    wanted = {topics.ps_status_topic(run), model_topic, topics.chunk_topic(model_topic, 0)}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not wanted <= set(got):
        time.sleep(0.05)
    ps.close()
    # Assert
    retained = protocol_topics.retained_by_default()
    for topic in wanted:
        assert got.get(topic) == (protocol_topics.QOS, retained), (topic, got.get(topic))
