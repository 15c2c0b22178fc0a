"""The topic table: builders, their inverse `parse_topic`, and the id rules."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fedmqtt.errors import TopicError
from fedmqtt.transport import topics as t
from fedmqtt.transport.topics import ParsedTopic, parse_topic, validate_id

RUN = "r1"
SITE = "site-a"

BUILDERS: list[tuple[str, Callable[[], str], str]] = [
    ("run_prefix", lambda: t.run_prefix(RUN), "fedmqtt/v1/r1"),
    ("run_filter", lambda: t.run_filter(RUN), "fedmqtt/v1/r1/#"),
    ("ps_status", lambda: t.ps_status_topic(RUN), "fedmqtt/v1/r1/ps/status"),
    ("ps_model", lambda: t.ps_model_topic(RUN), "fedmqtt/v1/r1/ps/model"),
    ("ps_metrics", lambda: t.ps_metrics_topic(RUN), "fedmqtt/v1/r1/ps/metrics"),
    ("ps_task", lambda: t.ps_task_topic(RUN, SITE), "fedmqtt/v1/r1/ps/task/site-a"),
    ("site_status", lambda: t.site_status_topic(RUN, SITE), "fedmqtt/v1/r1/site/site-a/status"),
    ("site_update", lambda: t.site_update_topic(RUN, SITE), "fedmqtt/v1/r1/site/site-a/update"),
    ("site_report", lambda: t.site_report_topic(RUN, SITE), "fedmqtt/v1/r1/site/site-a/report"),
    ("site_topic", lambda: t.site_topic(RUN, SITE, "update"), "fedmqtt/v1/r1/site/site-a/update"),
    ("site_all_filter", lambda: t.site_all_filter(RUN, SITE), "fedmqtt/v1/r1/site/site-a/#"),
    ("any_site_update", lambda: t.any_site_filter(RUN, "update"), "fedmqtt/v1/r1/site/+/update"),
    ("any_site_status", lambda: t.any_site_filter(RUN, "status"), "fedmqtt/v1/r1/site/+/status"),
]


@pytest.mark.parametrize(
    ("builder", "expected"), [(b, e) for _, b, e in BUILDERS], ids=[n for n, _, _ in BUILDERS]
)
def test_builder_gives_the_documented_topic(builder: Callable[[], str], expected: str) -> None:
    """Each builder returns exactly the topic of the table for run r1 and site site-a."""
    assert builder() == expected


PARSED = [
    ("fedmqtt/v1/r1/ps/status", ParsedTopic("r1", "ps", "status")),
    ("fedmqtt/v1/r1/ps/model", ParsedTopic("r1", "ps", "model")),
    ("fedmqtt/v1/r1/ps/metrics", ParsedTopic("r1", "ps", "metrics")),
    ("fedmqtt/v1/r1/ps/task/site-a", ParsedTopic("r1", "ps", "task", "site-a")),
    ("fedmqtt/v1/r1/site/site-a/status", ParsedTopic("r1", "site", "status", "site-a")),
    ("fedmqtt/v1/r1/site/site-a/update", ParsedTopic("r1", "site", "update", "site-a")),
    ("fedmqtt/v1/r1/site/site-a/report", ParsedTopic("r1", "site", "report", "site-a")),
]


@pytest.mark.parametrize(("topic", "expected"), PARSED, ids=[p[0].split("r1/")[1] for p in PARSED])
def test_parse_topic_inverts_the_builders(topic: str, expected: ParsedTopic) -> None:
    """parse_topic takes every concrete topic apart into run, role, kind and site."""
    assert parse_topic(topic) == expected


def test_every_concrete_builder_topic_parses() -> None:
    """Every concrete (non-filter) topic a builder makes is accepted by parse_topic with the same run."""
    concrete = [e for _, _, e in BUILDERS if "#" not in e and "+" not in e and e.count("/") >= 4]
    assert len(concrete) == 8
    for topic in concrete:
        assert parse_topic(topic).run_id == RUN


BAD_IDS = [
    pytest.param("Site-a", id="uppercase"),
    pytest.param("site+", id="plus"),
    pytest.param("+", id="plus-alone"),
    pytest.param("#", id="hash"),
    pytest.param("site/a", id="slash"),
    pytest.param("", id="empty"),
    pytest.param("a" * 64, id="too-long"),
    pytest.param("-site", id="leading-dash"),
    pytest.param("site a", id="space"),
    pytest.param("site_a", id="underscore"),
    pytest.param("site-a\n", id="trailing-newline"),
]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_invalid_ids_are_rejected(bad: str) -> None:
    """validate_id and every builder refuse ids outside [a-z0-9-]{1,63} not starting with '-'."""
    with pytest.raises(TopicError, match="invalid site id"):
        validate_id(bad, what="site id")
    with pytest.raises(TopicError, match="invalid site id"):
        t.site_update_topic(RUN, bad)
    with pytest.raises(TopicError, match="invalid site id"):
        t.ps_task_topic(RUN, bad)
    with pytest.raises(TopicError, match="invalid run id"):
        t.ps_model_topic(bad)


@pytest.mark.parametrize("good", ["a", "0", "site-a", "a" * 63, "a-", "r1-2026"])
def test_valid_ids_are_accepted(good: str) -> None:
    """Ids of 1-63 characters from a-z, 0-9 and '-' starting with a letter or digit pass unchanged."""
    assert validate_id(good) == good


UNKNOWN = [
    "fedmqtt/v2/r1/ps/status",
    "other/v1/r1/ps/status",
    "fedmqtt/v1/r1/ps",
    "fedmqtt/v1/r1/ps/weights",
    "fedmqtt/v1/r1/ps/task",
    "fedmqtt/v1/r1/ps/task/site-a/extra",
    "fedmqtt/v1/r1/site/site-a",
    "fedmqtt/v1/r1/site/site-a/secrets",
    "fedmqtt/v1/r1/site/site-a/update/extra",
    "fedmqtt/v1/r1/site/+/update",
    "fedmqtt/v1/r1/#",
    "fedmqtt/v1/R1/ps/status",
    "fedmqtt/v1/r1/ps/task/Site-A",
    "",
]


@pytest.mark.parametrize("topic", UNKNOWN)
def test_unknown_or_malformed_topics_are_rejected(topic: str) -> None:
    """parse_topic raises TopicError for anything outside the table (wildcards and bad ids included)."""
    with pytest.raises(TopicError):
        parse_topic(topic)


def test_unknown_site_kind_is_rejected_by_the_builders() -> None:
    """site_topic and any_site_filter accept only status, update and report."""
    with pytest.raises(TopicError, match="unknown site topic kind 'model'"):
        t.site_topic(RUN, SITE, "model")
    with pytest.raises(TopicError, match="unknown site topic kind '#'"):
        t.any_site_filter(RUN, "#")
