"""The Mosquitto ACL: exact rights per user (no made-up topics to store retained messages under), topics only from
the topic builders, ids validated."""

from __future__ import annotations

import pytest

from broker.acl import LISTENER_IDENTITY_LINES, check_login, login_names, render_acl, site_write_topics
from fedmqtt.errors import TopicError
from fedmqtt.transport import topics
from fedmqtt.transport.channel import KINDS_BY_TOPIC
from schemas.chunks import MAX_CHUNKS

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


def _site_writes(site: str) -> set[tuple[str, str, str]]:
    """The protocol's own definition of what a site publishes: its topic kinds in the channel's table, the
    bridge state, and chunks 0 ... MAX_CHUNKS-1 of the kinds that travel chunked."""
    own = {topics.site_topic(RUN, site, kind) for role, kind in KINDS_BY_TOPIC if role == "site"}
    chunks = {topics.chunk_topic(t, i) for t in own if topics.parse_topic(t).base in topics.CHUNKED_KINDS
              for i in range(MAX_CHUNKS)}
    return {(site, "write", t) for t in {*own, topics.site_bridge_topic(RUN, site), *chunks}}


def test_acl_grants_exactly_the_design_rights_for_two_sites() -> None:
    """The PS reads the run and writes its own topics, each site writes exactly its protocol topics and reads its
    inputs, observers read status."""
    # Prepare
    ps_writes = [f"{P}/ps/status", f"{P}/ps/model", f"{P}/ps/model/chunk/+", f"{P}/ps/metrics", f"{P}/ps/features"]
    for site in ("site-a", "site-b"):
        ps_writes += [f"{P}/ps/task/{site}", f"{P}/ps/task/{site}/chunk/+", f"{P}/ps/turn/{site}",
                      f"{P}/site/{site}/update", f"{P}/site/{site}/update/chunk/+"]
    expected = {
        ("ps", "read", f"{P}/#"),
        *(("ps", "write", topic) for topic in ps_writes),
        ("coordinator", "readwrite", f"{P}/federation/keys"),
        ("observer", "read", f"{P}/federation/keys"),
        ("observer", "read", f"{P}/ps/status"),
        ("observer", "read", f"{P}/ps/metrics"),
        ("observer", "read", f"{P}/site/+/status"),
        ("observer", "read", f"{P}/site/+/bridge"),
        *_site_writes("site-a"),
        ("site-a", "read", f"{P}/ps/status"),
        ("site-a", "read", f"{P}/ps/model"),
        ("site-a", "read", f"{P}/ps/task/site-a"),
        ("site-a", "read", f"{P}/ps/model/chunk/+"),
        ("site-a", "read", f"{P}/ps/features"),
        ("site-a", "read", f"{P}/ps/task/site-a/chunk/+"),
        ("site-a", "read", f"{P}/ps/turn/site-a"),
        ("site-a", "read", f"{P}/federation/keys"),
        *_site_writes("site-b"),
        ("site-b", "read", f"{P}/ps/status"),
        ("site-b", "read", f"{P}/ps/model"),
        ("site-b", "read", f"{P}/ps/task/site-b"),
        ("site-b", "read", f"{P}/ps/model/chunk/+"),
        ("site-b", "read", f"{P}/ps/features"),
        ("site-b", "read", f"{P}/ps/task/site-b/chunk/+"),
        ("site-b", "read", f"{P}/ps/turn/site-b"),
        ("site-b", "read", f"{P}/federation/keys"),
    }

    # Execute
    acl = render_acl(RUN, ["site-b", "site-a"])

    # Assert
    primary = {rule for rule in _rules(acl) if "." not in rule[0] and rule[0] != "monitor"}
    assert primary == expected
    assert {rule for rule in _rules(acl) if rule[0] == "monitor"} == {("monitor", "read", "$SYS/#")}  # nothing else
    assert not [rule for rule in _rules(acl) if rule[2].startswith("$SYS") and rule[0] != "monitor"]  # nor others
    users = [line.split(" ", 1)[1] for line in acl.splitlines() if line.startswith("user ")]
    assert [u for u in users if "." not in u] == ["ps", "coordinator", "observer", "site-a", "site-b", "monitor"]
    assert "pattern" not in acl  # patterns would apply to the PS and observer too


def test_no_party_may_write_a_wildcard_and_a_site_only_protocol_topics() -> None:
    """Retained messages are what a party makes the broker keep: no write right ends in `#` (a subtree of made-up
    topics), a site's has no wildcard at all (`+` matches any name, so chunk indices are listed), and every topic
    a site may write parses as a topic of the protocol: 5 topics (status, update, report, secagg, bridge) and
    2 x MAX_CHUNKS chunks."""
    # Execute
    rules = _rules(render_acl(RUN, ["site-a", "site-b"]))

    # Assert
    writes = [(user, topic) for user, access, topic in rules if access in ("write", "readwrite")]
    assert not [topic for _, topic in writes if "#" in topic]
    site_writes = [topic for user, topic in writes if user.split(".")[0].startswith("site-")]
    assert not [topic for topic in site_writes if "+" in topic]
    for topic in site_writes:
        if not topic.endswith("/" + topics.BRIDGE):
            assert topics.parse_topic(topic).site_id in ("site-a", "site-b")
    assert len(site_write_topics(RUN, "site-a")) == 6 + 2 * MAX_CHUNKS == 262
    assert {("site-a", "write", t) for t in site_write_topics(RUN, "site-a")} == _site_writes("site-a")


def test_every_login_of_a_party_has_exactly_the_party_rights() -> None:
    """`<user>.bulk` and the observer seats get the same rights as their party and nothing else: the broker
    forces client id = user name, so these are what a second connection of the same party logs in as."""
    # Execute
    acl = render_acl(RUN, ["site-a", "site-b"])
    rules = _rules(acl)
    users = [line.split(" ", 1)[1] for line in acl.splitlines() if line.startswith("user ")]

    # Assert
    parties = ["ps", "coordinator", "observer", "site-a", "site-b", "monitor"]
    assert sorted(users) == sorted(name for party in parties for name in login_names(party))
    assert login_names("monitor") == ["monitor"]  # one login: it signs nothing and needs no second connection
    assert len(users) == len(set(users))
    for party in parties:
        own = {(access, topic) for user, access, topic in rules if user == party}
        for login in login_names(party):
            if login != check_login(party):
                assert {(access, topic) for user, access, topic in rules if user == login} == own, login
    assert login_names("site-a") == ["site-a", "site-a.bulk", "site-a.check"]
    assert login_names("ps") == ["ps", "ps.bulk", "ps.check"]
    assert login_names("observer")[2:] == [f"observer.{i}" for i in range(1, 8)]  # nothing to check: no .check
    for login in login_names("site-a")[1:] + login_names("observer")[1:]:
        with pytest.raises(TopicError):  # a login name can never be (or impersonate) a site id
            topics.validate_id(login, what="site id")
    assert LISTENER_IDENTITY_LINES == ("use_username_as_clientid true",)


def test_the_check_login_reads_the_ps_status_and_model_and_writes_nothing() -> None:
    """`fedmqtt site check` logs in as `<site>.check`: it must not be able to publish anything (a pre-flight
    never changes a running federation) nor read what its site may not (tasks, chunks, other sites)."""
    # Execute
    rules = _rules(render_acl(RUN, ["site-a", "site-b"]))

    # Assert
    for party in ("ps", "site-a", "site-b"):
        granted = {(access, topic) for user, access, topic in rules if user == check_login(party)}
        assert granted == {("read", f"{P}/ps/status"), ("read", f"{P}/ps/model"),
                           ("read", f"{P}/federation/keys")}, party  # the key list: to verify what it reads
    assert not [user for user, _, _ in rules if user == "observer.check"]


def test_acl_topics_all_come_from_the_topic_builders() -> None:
    """Every ACL topic equals the output of a transport.topics builder, so the two cannot drift."""
    # Prepare
    sites = ["site-a", "site-b"]
    built = {
        topics.run_filter(RUN),
        topics.ps_status_topic(RUN),
        topics.ps_model_topic(RUN),
        topics.ps_metrics_topic(RUN),
        topics.ps_features_topic(RUN),
        topics.any_site_filter(RUN, "status"),
        topics.any_bridge_filter(RUN),
        *(topics.ps_task_topic(RUN, s) for s in sites),
        *(topics.site_topic(RUN, s, kind) for s in sites for kind in topics.SITE_KINDS),
        *(topics.site_bridge_topic(RUN, s) for s in sites),
        *(topics.chunk_topic(topics.site_topic(RUN, s, kind), i) for s in sites for kind in ("update", "report")
          for i in range(MAX_CHUNKS)),
        topics.chunk_filter(topics.ps_model_topic(RUN)),
        *(topics.chunk_filter(topics.ps_task_topic(RUN, s)) for s in sites),
        *(topics.chunk_filter(topics.site_update_topic(RUN, s)) for s in sites),
        *(topics.ps_turn_topic(RUN, s) for s in sites),
        topics.federation_keys_topic(RUN),
        topics.broker_sys_filter(),
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
    assert ("server", "read", f"{P}/#") in rules
    assert ("server", "write", f"{P}/ps/status") in rules
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
