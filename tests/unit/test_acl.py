"""The Mosquitto ACL: exact rights per user, topics only from the topic builders, ids validated."""

from __future__ import annotations

import pytest

from broker.acl import LISTENER_IDENTITY_LINES, login_names, render_acl
from fedmqtt.errors import TopicError
from fedmqtt.transport import topics

RUN = "run-1"
P = f"fedmqtt/v1/{RUN}"


def _rules(acl: str) -> set[tuple[str, str, str]]:
    """(user, access, topic) for every `topic` line, attributed to the `user` block above it."""
    rules, user = set(), ""
    for line in acl.splitlines():
        if line.startswith("user "):
            user = line.split(" ", 1)[1]
        elif line.startswith("topic "):
            _, access, topic = line.split(" ", 2)
            rules.add((user, access, topic))
    return rules


def test_acl_grants_exactly_the_design_rights_for_two_sites() -> None:
    """PS reads/writes the run, each site writes its subtree and reads its inputs, observers read status."""
    # Prepare
    expected = {
        ("ps", "readwrite", f"{P}/#"),
        ("ps", "read", f"{P}/federation/keys"),
        ("coordinator", "readwrite", f"{P}/federation/keys"),
        ("observer", "read", f"{P}/federation/keys"),
        ("observer", "read", f"{P}/ps/status"),
        ("observer", "read", f"{P}/ps/metrics"),
        ("observer", "read", f"{P}/site/+/status"),
        ("observer", "read", f"{P}/site/+/bridge"),
        ("site-a", "write", f"{P}/site/site-a/#"),
        ("site-a", "read", f"{P}/ps/status"),
        ("site-a", "read", f"{P}/ps/model"),
        ("site-a", "read", f"{P}/ps/task/site-a"),
        ("site-a", "read", f"{P}/ps/model/chunk/+"),
        ("site-a", "read", f"{P}/ps/task/site-a/chunk/+"),
        ("site-a", "read", f"{P}/ps/turn/site-a"),
        ("site-a", "read", f"{P}/federation/keys"),
        ("site-b", "write", f"{P}/site/site-b/#"),
        ("site-b", "read", f"{P}/ps/status"),
        ("site-b", "read", f"{P}/ps/model"),
        ("site-b", "read", f"{P}/ps/task/site-b"),
        ("site-b", "read", f"{P}/ps/model/chunk/+"),
        ("site-b", "read", f"{P}/ps/task/site-b/chunk/+"),
        ("site-b", "read", f"{P}/ps/turn/site-b"),
        ("site-b", "read", f"{P}/federation/keys"),
    }

    # Execute
    acl = render_acl(RUN, ["site-b", "site-a"])

    # Assert
    primary = {rule for rule in _rules(acl) if "." not in rule[0]}
    assert primary == expected
    users = [line.split(" ", 1)[1] for line in acl.splitlines() if line.startswith("user ")]
    assert [u for u in users if "." not in u] == ["ps", "coordinator", "observer", "site-a", "site-b"]  # sorted sites
    assert "pattern" not in acl  # patterns would apply to the PS and observer too


def test_every_login_of_a_party_has_exactly_the_party_rights() -> None:
    """`<user>.bulk` and the observer seats get the same rights as their party and nothing else: the broker
    forces client id = user name, so these are what a second connection of the same party logs in as."""
    # Execute
    acl = render_acl(RUN, ["site-a", "site-b"])
    rules = _rules(acl)
    users = [line.split(" ", 1)[1] for line in acl.splitlines() if line.startswith("user ")]

    # Assert
    parties = ["ps", "coordinator", "observer", "site-a", "site-b"]
    assert sorted(users) == sorted(name for party in parties for name in login_names(party))
    assert len(users) == len(set(users))
    for party in parties:
        own = {(access, topic) for user, access, topic in rules if user == party}
        for login in login_names(party):
            assert {(access, topic) for user, access, topic in rules if user == login} == own, login
    assert login_names("site-a") == ["site-a", "site-a.bulk"]
    assert login_names("observer")[2:] == [f"observer.{i}" for i in range(1, 8)]
    for login in login_names("site-a")[1:] + login_names("observer")[1:]:
        with pytest.raises(TopicError):  # a login name can never be (or impersonate) a site id
            topics.validate_id(login, what="site id")
    assert LISTENER_IDENTITY_LINES == ("use_username_as_clientid true",)


def test_acl_topics_all_come_from_the_topic_builders() -> None:
    """Every ACL topic equals the output of a transport.topics builder, so the two cannot drift."""
    # Prepare
    sites = ["site-a", "site-b"]
    built = {
        topics.run_filter(RUN),
        topics.ps_status_topic(RUN),
        topics.ps_model_topic(RUN),
        topics.ps_metrics_topic(RUN),
        topics.any_site_filter(RUN, "status"),
        topics.any_bridge_filter(RUN),
        *(topics.ps_task_topic(RUN, s) for s in sites),
        *(topics.site_all_filter(RUN, s) for s in sites),
        topics.chunk_filter(topics.ps_model_topic(RUN)),
        *(topics.chunk_filter(topics.ps_task_topic(RUN, s)) for s in sites),
        *(topics.ps_turn_topic(RUN, s) for s in sites),
        topics.federation_keys_topic(RUN),
    }

    # Execute
    acl_topics = {topic for _, _, topic in _rules(render_acl(RUN, sites))}

    # Assert
    assert acl_topics == built


def test_acl_custom_ps_and_observer_user_names() -> None:
    """The PS, observer and coordinator blocks use the user names passed in."""
    # Execute
    rules = _rules(render_acl(RUN, ["site-a"], ps_user="server", observer_user="dashboard", coordinator_user="keys"))

    # Assert
    assert ("server", "readwrite", f"{P}/#") in rules
    assert ("keys", "readwrite", f"{P}/federation/keys") in rules
    assert ("dashboard", "read", f"{P}/ps/metrics") in rules


@pytest.mark.parametrize(
    ("run_id", "site_ids"),
    [
        ("Run-1", ["site-a"]),
        ("run/1", ["site-a"]),
        (RUN, ["site+a"]),
        (RUN, ["#"]),
        (RUN, ["Site-A"]),
        (RUN, [""]),
    ],
)
def test_acl_rejects_invalid_ids(run_id: str, site_ids: list[str]) -> None:
    """Ids outside [a-z0-9-] (wildcards, separators, capitals) never reach the ACL file."""
    # Execute / Assert
    with pytest.raises(TopicError):
        render_acl(run_id, site_ids)
