"""Render the Mosquitto ACL of one run from the topic builders, so topics and rights never drift apart.

Rights are exact (bounds on what one party can make the broker hold): every party may write only the topics
the protocol gives it (docs/protocol.md), never a `#` under its subtree. A retained message costs the broker
memory and a place in mosquitto.db across restarts, so a write right on `site/<id>/#` let a site store as many
retained messages as it liked under made-up subtopics (40 of 1 MiB grew the broker from 10 to 51 MB). Mosquitto's
`+` matches any name at its level too, so a site's chunk topics are listed one by one, `<topic>/chunk/0` ...
`<topic>/chunk/{MAX_CHUNKS-1}`: what a site can make the broker keep is at most `site_write_topics` (262 topics)
of at most max_packet_size each. Reads create nothing at the broker and keep `+` (and the PS reads the whole
run). The PS, the coordinator, writes its own topics with `+` for chunk indices and site ids: it already decides
what every site stores.

Adding a topic: give it a builder in fedmqtt/transport/topics.py (and an entry in the docs catalogue,
fedmqtt/docgen/protocol_topics.py), then add `(WRITE, builder(...))` to the rules of the one party that writes
it (`ps_rules`, `site_rules`, or a new party's function wired into `render_acl`) and `(READ, builder(...))` to
the rules of each party that reads it. tests/unit/test_acl.py states every right a party has.

Identity (why every party has several broker users): Mosquitto ends an existing connection when another one
logs in with the same MQTT client id, and the victim's Last Will fires. Client ids are chosen by the client,
so any party with valid credentials could knock any other off (a site could make the PS drop a peer from a
round). The broker therefore replaces every client id by the user name (`use_username_as_clientid true`, set
after each `listener` line, see `LISTENER_IDENTITY_LINES`): a connection can then only ever take over a
connection of its own user. That needs one user per simultaneous connection of a party: `<user>` for the
control connection (with the Last Will) and `<user>.bulk` for the bulk one (same password, same rights; a dot
is not allowed in a site id, so it cannot collide with a site). Observers are read-only and often several at
once (a dashboard and `mosquitto_sub`): they get `observer` and `observer.1` ... `observer.7`, all with the
observer password; two watchers on the same name would push each other off (0x8E session taken over).
Sites and the PS also get `<user>.check` (same password): `fedmqtt site check` logs in with it, so a pre-flight
never takes over a running agent's connection, and it may only read `ps/status` and `ps/model` (the run's state
and the model's size): whatever it does, it cannot change the federation.
The `monitor` login reads the broker's `$SYS` tree and nothing of any run (an exporter for Prometheus, or
`mosquitto_sub` on the broker host: docs/monitoring.md); it has one login only, since it neither signs nor needs
a second connection.
Mosquitto 2.0.11 offers no per-user client-id restriction without replacing password_file and acl_file by
the dynamic-security plugin, which this forced mapping makes unnecessary.
"""

from __future__ import annotations

from fedmqtt.transport import topics

BULK_SEAT = "bulk"  # MqttTransport(seat=...) of Channel.open's second connection
CHECK_SEAT = "check"  # MqttTransport(seat=...) of `fedmqtt site check`: read-only, see check_rules
OBSERVER_SEATS = 7  # extra observer logins: observer.1 ... observer.7
MONITOR_USER = "monitor"  # reads $SYS only (monitor_rules)
# What broker/config.py must write right after every `listener` line. Placed before any listener (e.g. in the
# base mosquitto.conf), Mosquitto 2.0.11 applies it to an implicit default listener and opens port 1883.
LISTENER_IDENTITY_LINES = ("use_username_as_clientid true",)
READ, WRITE = "read", "write"
Rule = tuple[str, str]  # (access, topic or filter): one `topic <access> <topic>` line


def login_names(user: str, *, observer_user: str = "observer") -> list[str]:
    """Every broker user of one party: itself, its bulk connection, the extra observer seats, and (not for the
    observer, which has nothing to check) its read-only check login."""
    if user == MONITOR_USER:
        return [user]
    names = [user, f"{user}.{BULK_SEAT}"]
    if user == observer_user:
        names += [f"{user}.{seat}" for seat in range(1, OBSERVER_SEATS + 1)]
    else:
        names.append(check_login(user))
    return names


def site_write_topics(run_id: str, site: str) -> list[str]:
    """Every topic a site may publish: its status, update, report and bridge state, and chunks 0 ...
    MAX_CHUNKS-1 of the chunked ones. Small topics first: Mosquitto checks a user's rules in file order."""
    own = [topics.site_topic(run_id, site, kind) for kind in topics.SITE_KINDS]
    chunked = [topic for topic in own if topics.parse_topic(topic).base in topics.CHUNKED_KINDS]
    chunks = [topics.chunk_topic(topic, index) for topic in chunked for index in range(topics.MAX_CHUNKS)]
    return [*own, topics.site_bridge_topic(run_id, site), *chunks]


def site_rules(run_id: str, site: str) -> list[Rule]:
    """A site writes exactly its own topics and reads the PS's status, the model and its own task and turn."""
    model, task = topics.ps_model_topic(run_id), topics.ps_task_topic(run_id, site)
    reads = [topics.ps_status_topic(run_id), model, topics.chunk_filter(model), task, topics.chunk_filter(task),
             topics.ps_turn_topic(run_id, site), topics.ps_features_topic(run_id)]
    return [(READ, topic) for topic in reads] + [(WRITE, topic) for topic in site_write_topics(run_id, site)]


def ps_rules(run_id: str, sites: list[str]) -> list[Rule]:
    """The PS reads the whole run, writes its own topics and each site's task and turn, and clears a site's update
    once it holds it (Channel.clear_received)."""
    model = topics.ps_model_topic(run_id)
    writes = [topics.ps_status_topic(run_id), model, topics.chunk_filter(model), topics.ps_metrics_topic(run_id),
              topics.ps_features_topic(run_id)]
    for site in sites:
        task, update = topics.ps_task_topic(run_id, site), topics.site_update_topic(run_id, site)
        writes += [task, topics.chunk_filter(task), topics.ps_turn_topic(run_id, site), update,
                   topics.chunk_filter(update)]
    return [(READ, topics.run_filter(run_id))] + [(WRITE, topic) for topic in writes]


def observer_rules(run_id: str) -> list[Rule]:
    """Observers read statuses, metrics and bridge states: never a model, task, update or report."""
    reads = [topics.ps_status_topic(run_id), topics.ps_metrics_topic(run_id), topics.any_site_filter(run_id, "status"),
             topics.any_bridge_filter(run_id)]  # a hospital broker's bridge up/down
    return [(READ, topic) for topic in reads]


def monitor_rules() -> list[Rule]:
    """The monitor login's rights: read the broker's own `$SYS` numbers; nothing of the run, no write."""
    return [(READ, topics.broker_sys_filter())]


def check_login(user: str) -> str:
    """The login `fedmqtt site check` uses for `user`: never one a running party is connected with."""
    return f"{user}.{CHECK_SEAT}"


def check_rules(run_id: str) -> list[Rule]:
    """The check login's rights: read the PS's status (run state, a clock reference) and the model (its size),
    nothing else; no write, so a pre-flight cannot publish into a running federation."""
    return [(READ, topics.ps_status_topic(run_id)), (READ, topics.ps_model_topic(run_id))]


def render_acl(
    run_id: str, site_ids: list[str], *, ps_user: str = "ps", observer_user: str = "observer",
    coordinator_user: str = "coordinator",
) -> str:
    """ACL text: one `user` block per login of each party (`login_names`), with that party's rules. Everyone reads
    the federation's key list, which only the coordinator's tooling writes.

    There are no `pattern` lines, because a pattern applies to every user and would hand site rights to the PS
    and observer accounts as well.
    """
    topics.validate_id(run_id, what="run id")
    sites = sorted(topics.validate_id(site, what="site id") for site in site_ids)
    keys: Rule = (READ, topics.federation_keys_topic(run_id))  # signed by the coordinator: every party verifies
    checks = [*check_rules(run_id), keys]
    blocks = _party_blocks(ps_user, ps_rules(run_id, sites), observer_user, checks)  # reads the whole run
    blocks += _party_blocks(coordinator_user, [("readwrite", topics.federation_keys_topic(run_id))], observer_user,
                            checks)
    blocks += _party_blocks(observer_user, [keys, *observer_rules(run_id)], observer_user, checks)
    for site in sites:
        # A site's username is its site id, so one password identifies exactly one hospital.
        blocks += _party_blocks(site, [*site_rules(run_id, site), keys], observer_user, checks)
    blocks.append(_user_block(MONITOR_USER, monitor_rules()))
    header = f"# fedmqtt ACL for run {run_id}: generated by broker/acl.py, do not edit.\n"
    return header + "\n" + "\n".join(blocks)


def _party_blocks(user: str, rules: list[Rule], observer_user: str, checks: list[Rule]) -> list[str]:
    return [_user_block(name, checks if name == check_login(user) else rules)
            for name in login_names(user, observer_user=observer_user)]


def _user_block(user: str, rules: list[Rule]) -> str:
    lines = [f"user {user}"] + [f"topic {access} {topic}" for access, topic in rules]
    return "\n".join(lines) + "\n"
