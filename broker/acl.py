"""Render the Mosquitto ACL of one run from the topic builders, so topics and rights never drift apart.

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
Mosquitto 2.0.11 offers no per-user client-id restriction without replacing password_file and acl_file by
the dynamic-security plugin, which this forced mapping makes unnecessary.
"""

from __future__ import annotations

from fedmqtt.transport import topics

BULK_SEAT = "bulk"  # MqttTransport(seat=...) of Channel.open's second connection
CHECK_SEAT = "check"  # MqttTransport(seat=...) of `fedmqtt site check`: read-only, see check_rules
OBSERVER_SEATS = 7  # extra observer logins: observer.1 ... observer.7
# What broker/config.py must write right after every `listener` line. Placed before any listener (e.g. in the
# base mosquitto.conf), Mosquitto 2.0.11 applies it to an implicit default listener and opens port 1883.
LISTENER_IDENTITY_LINES = ("use_username_as_clientid true",)


def login_names(user: str, *, observer_user: str = "observer") -> list[str]:
    """Every broker user of one party: itself, its bulk connection, the extra observer seats, and (not for the
    observer, which has nothing to check) its read-only check login."""
    names = [user, f"{user}.{BULK_SEAT}"]
    if user == observer_user:
        names += [f"{user}.{seat}" for seat in range(1, OBSERVER_SEATS + 1)]
    else:
        names.append(check_login(user))
    return names


def check_login(user: str) -> str:
    """The login `fedmqtt site check` uses for `user`: never one a running party is connected with."""
    return f"{user}.{CHECK_SEAT}"


def check_rules(run_id: str) -> list[tuple[str, str]]:
    """The check login's rights: read the PS's status (run state, a clock reference) and the model (its size),
    nothing else; no write, so a pre-flight cannot publish into a running federation."""
    return [("read", topics.ps_status_topic(run_id)), ("read", topics.ps_model_topic(run_id))]


def render_acl(
    run_id: str, site_ids: list[str], *, ps_user: str = "ps", observer_user: str = "observer"
) -> str:
    """ACL text: the PS reads and writes the run, each site writes its own subtree, observers read status.

    Every user gets an explicit `user` block; there are no `pattern` lines, because a pattern applies to
    every user and would hand site rights to the PS and observer accounts as well. Each login of a party
    (`login_names`) gets the same block.
    """
    topics.validate_id(run_id, what="run id")
    sites = sorted(topics.validate_id(site, what="site id") for site in site_ids)
    checks = check_rules(run_id)
    blocks = _party_blocks(ps_user, [("readwrite", topics.run_filter(run_id))], observer_user, checks)
    blocks += _party_blocks(
        observer_user,
        [
            ("read", topics.ps_status_topic(run_id)),
            ("read", topics.ps_metrics_topic(run_id)),
            ("read", topics.any_site_filter(run_id, "status")),
            ("read", topics.any_bridge_filter(run_id)),  # a hospital broker's bridge up/down
        ],
        observer_user,
        checks,
    )
    for site in sites:
        # A site's username is its site id, so one password identifies exactly one hospital.
        rules = [
            ("write", topics.site_all_filter(run_id, site)),
            ("read", topics.ps_status_topic(run_id)),
            ("read", topics.ps_model_topic(run_id)),
            ("read", topics.chunk_filter(topics.ps_model_topic(run_id))),
            ("read", topics.ps_task_topic(run_id, site)),
            ("read", topics.chunk_filter(topics.ps_task_topic(run_id, site))),
            ("read", topics.ps_turn_topic(run_id, site)),
        ]
        blocks += _party_blocks(site, rules, observer_user, checks)
    header = f"# fedmqtt ACL for run {run_id}: generated by broker/acl.py, do not edit.\n"
    return header + "\n" + "\n".join(blocks)


def _party_blocks(user: str, rules: list[tuple[str, str]], observer_user: str,
                  checks: list[tuple[str, str]]) -> list[str]:
    return [_user_block(name, checks if name == check_login(user) else rules)
            for name in login_names(user, observer_user=observer_user)]


def _user_block(user: str, rules: list[tuple[str, str]]) -> str:
    lines = [f"user {user}"] + [f"topic {access} {topic}" for access, topic in rules]
    return "\n".join(lines) + "\n"
