"""check_message: a payload is accepted only on its own topic, from its own sender, in this run. Every payload here
is signed by the party that may write its topic (tests/unit/test_signatures.py covers the signature itself), so
each test reaches the check it is about."""

from __future__ import annotations

import numpy as np
import pytest
from signed_wire import ring, signed

from fedmqtt.errors import SchemaError, TopicError
from fedmqtt.transport import topics as t
from fedmqtt.transport.channel import check_message
from schemas import messages as m
from schemas.codec import encode
from schemas.tensors import arrays_to_blobs

RUN = "r1"
MAX = 1 << 20


def _check(topic: str, message: object, *, max_bytes: int = MAX):  # noqa: ANN202
    """check_message of `message` as the topic's owner signs and publishes it."""
    return check_message(topic, signed(RUN, topic, encode(message)), run_id=RUN, max_bytes=max_bytes, keys=ring(RUN))


def _update(sender: str = "site-a", run_id: str = RUN) -> m.ClientUpdate:
    return m.ClientUpdate(
        run_id=run_id,
        sender=sender,
        round=1,
        base_model_hash="h" * 64,
        tensors=arrays_to_blobs({"w": np.ones(3, np.float32)}),
        n_samples=10,
        local_steps=2,
    )


def _model(sender: str = "ps") -> m.GlobalModel:
    return m.GlobalModel(
        run_id=RUN,
        sender=sender,
        round=1,
        model=m.ModelSpec(name="mlp"),
        model_hash="h" * 64,
        tensors=arrays_to_blobs({"w": np.zeros(3, np.float32)}),
    )


def _task(site_id: str = "site-a", sender: str = "ps") -> m.TrainTask:
    return m.TrainTask(
        run_id=RUN,
        sender=sender,
        round=1,
        site_id=site_id,
        model_hash="h" * 64,
        deadline=10.0,
        settings=m.TrainSettings(),
    )


def test_accepts_an_update_from_its_own_site() -> None:
    """A ClientUpdate from site-a on site/site-a/update passes and comes back parsed."""
    # Prepare
    topic = t.site_update_topic(RUN, "site-a")
    update = _update()
    # Execute
    parsed, message = _check(topic, update)
    # Assert
    assert (parsed.run_id, parsed.role, parsed.kind, parsed.site_id) == (RUN, "site", "update", "site-a")
    assert message == update


@pytest.mark.parametrize(
    ("topic", "message"),
    [
        (t.ps_model_topic(RUN), _model()),
        (t.ps_task_topic(RUN, "site-a"), _task()),
        (t.ps_task_topic(RUN, "site-b"), _task("site-b")),
        (
            t.site_status_topic(RUN, "site-a"),
            m.SiteStatus(run_id=RUN, sender="site-a", round=0, state="online"),
        ),
        (t.ps_status_topic(RUN), m.DaemonStatus(run_id=RUN, sender="ps", round=0, state="waiting_for_sites")),
    ],
    ids=["model", "task-a", "task-b", "site-status", "ps-status"],
)
def test_accepts_each_kind_on_its_topic(topic: str, message: object) -> None:
    """Well-formed messages on their own topics are accepted."""
    _, got = _check(topic, message)
    assert got == message


REJECTED = [
    pytest.param(
        t.site_update_topic(RUN, "site-a"),
        _update(sender="site-b"),
        SchemaError,
        "sender 'site-b' claims another identity",
        id="sender-spoofing",
    ),
    pytest.param(
        t.site_update_topic(RUN, "site-a"),
        _model(),
        SchemaError,
        "a global_model does not belong on this topic",
        id="model-on-site-topic",
    ),
    pytest.param(
        t.ps_model_topic(RUN),
        _update(),
        SchemaError,
        "a client_update does not belong on this topic",
        id="update-on-model-topic",
    ),
    pytest.param(
        t.site_report_topic(RUN, "site-a"),
        _update(),
        SchemaError,
        "does not belong on this topic",
        id="update-on-report-topic",
    ),
    pytest.param(
        t.site_update_topic("r2", "site-a"),
        _update(),
        TopicError,
        "run 'r2' is not this run",
        id="wrong-run-in-topic",
    ),
    pytest.param(
        t.site_update_topic(RUN, "site-a"),
        _update(run_id="r2"),
        SchemaError,
        "message run_id 'r2'",
        id="wrong-run-in-payload",
    ),
    pytest.param(
        t.ps_task_topic(RUN, "site-a"),
        _task(site_id="site-b"),
        SchemaError,
        "task addressed to 'site-b' on 'site-a'",
        id="task-for-another-site",
    ),
    pytest.param(
        t.ps_model_topic(RUN),
        _model(sender="site-a"),
        SchemaError,
        "sender 'site-a' claims another identity than its topic ('ps')",
        id="ps-topic-not-from-ps",
    ),
    pytest.param(
        t.ps_task_topic(RUN, "site-a"),
        _task(sender="site-a"),
        SchemaError,
        "sender 'site-a'",
        id="task-not-from-ps",
    ),
]


@pytest.mark.parametrize(("topic", "message", "error", "needle"), REJECTED)
def test_rejects_and_names_the_problem(
    topic: str, message: object, error: type[Exception], needle: str
) -> None:
    """Spoofed, misplaced or foreign messages raise an error whose text says why."""
    with pytest.raises(error) as info:
        _check(topic, message)
    assert needle in str(info.value)


def test_rejects_garbage_and_oversized_payloads() -> None:
    """Undecodable bytes and payloads over max_bytes are SchemaErrors, never exceptions of other types."""
    topic = t.site_update_topic(RUN, "site-a")
    with pytest.raises(SchemaError, match="malformed payload"):
        check_message(topic, signed(RUN, topic, b"\xc1\xc1"), run_id=RUN, max_bytes=MAX, keys=ring(RUN))
    with pytest.raises(SchemaError, match="exceeds the budget of 64 bytes"):
        _check(topic, _update(), max_bytes=64)


def test_rejects_a_topic_outside_the_table() -> None:
    """A topic that is not in the topic table is a TopicError before the payload is read."""
    with pytest.raises(TopicError, match="unknown fedmqtt topic"):
        check_message("fedmqtt/v1/r1/site/site-a/secrets", b"", run_id=RUN, max_bytes=MAX, keys=ring(RUN))


@pytest.mark.parametrize(("topic", "message", "category"), [
    (t.site_update_topic(RUN, "site-a"), _model(), "wrong topic"),
    (t.site_update_topic("r2", "site-a"), _update(), "wrong run"),
    (t.site_update_topic(RUN, "site-a"), _update(run_id="r2"), "wrong run"),
    (t.ps_task_topic(RUN, "site-a"), _task(site_id="site-b"), "wrong address"),
    (t.ps_turn_topic(RUN, "site-a"), m.UploadTurn(run_id=RUN, sender="ps", round=1, site_id="site-b", grant=1),
     "wrong address"),
    (t.ps_turn_topic(RUN, "site-a"), _task(site_id="site-a"), "wrong topic"),
    (t.ps_model_topic(RUN), _model(sender="site-a"), "wrong sender"),
    ("fedmqtt/v1/r1/site/site-a/secrets", _update(), "bad topic"),
], ids=["kind", "run-in-topic", "run-in-payload", "address", "turn-address", "turn-kind", "sender", "topic"])
def test_each_refusal_has_a_stable_category(topic: str, message: object, category: str) -> None:
    """Counters key on these short categories (the PS publishes them per site), never on free text."""
    from fedmqtt.transport.channel import rejection_category

    with pytest.raises((SchemaError, TopicError)) as info:
        _check(topic, message)
    assert rejection_category(info.value) == category
