"""docs/protocol.md and docs/schemas/*.json: the wire protocol, made from the code that speaks it.

The prose is the template fedmqtt/docgen/templates/protocol.md; each `@@NAME@@` in it is filled with a table
or value made from the code, so the document cannot drift from it:
- topics and filters: by calling every `*_topic`/`*_filter` builder of fedmqtt.transport.topics;
- payload kinds per topic: the channel's own table of what it accepts where;
- encoding: schemas.messages.TEXT_KINDS (JSON) versus everything else (msgpack);
- who may write and read: the Mosquitto ACL that broker/acl.py renders, matched topic by topic;
- QoS and retention: the values in protocol_topics, which tests/integration/test_docs_protocol.py checks against a
  real broker;
- payload schemas: each pydantic model's JSON Schema;
- limits, states and reason codes: the constants themselves.
Tables about topics are made in protocol_topics, about payloads in protocol_payloads, and the rest in
protocol_limits.
"""

from __future__ import annotations

from importlib import resources

from fedmqtt.docgen.protocol_limits import chunk_limits_table, reason_codes_table, states, timing_table
from fedmqtt.docgen.protocol_payloads import categories_table, ps_categories_table, schema_files, schemas_table
from fedmqtt.docgen.protocol_topics import (
    QOS,
    DocDrift,
    builders_table,
    check_catalogue,
    delivery_table,
    observer_logins,
    topics_table,
)
from fedmqtt.docgen.tables import code
from fedmqtt.transport import topics
from ps_daemon import turns
from schemas.messages import TEXT_KINDS, DaemonStatus, SiteStatus

PATH = "docs/protocol.md"


def template() -> str:
    """The document's prose with its `@@NAME@@` placeholders (shipped in the wheel as package data)."""
    return (resources.files("fedmqtt.docgen") / "templates" / "protocol.md").read_text(encoding="utf-8")


def render_protocol() -> str:
    check_catalogue()
    parts = {
        "ROOT": f"{topics.ROOT}/{topics.VERSION}",
        "TOPICS": topics_table(),
        "QOS": str(QOS),
        "DELIVERY": delivery_table(),
        "BUILDERS": builders_table(),
        "OBSERVERS": observer_logins(),
        "TEXT_KINDS": ", ".join(code(k) for k in sorted(TEXT_KINDS)),
        "SCHEMAS": schemas_table(),
        "CATEGORIES": categories_table(),
        "PS_CATEGORIES": ps_categories_table(),
        "CHUNK_LIMITS": chunk_limits_table(),
        "TURN_GRACE": f"{turns.TURN_GRACE_S:g}",
        "TURN_PER_MB": f"{1e6 / turns.TURN_MIN_RATE_BYTES_PER_S:g}",
        "PS_STATES": states(DaemonStatus),
        "SITE_STATES": states(SiteStatus),
        "TIMING": timing_table(),
        "REASON_CODES": reason_codes_table(),
    }
    text = template()
    for name, value in parts.items():
        text = text.replace(f"@@{name}@@", value)
    if "@@" in text:
        raise DocDrift(f"unfilled placeholder in the protocol template: {text[text.index('@@'):][:40]}")
    # The last placeholder is a table that ends in its own newline, and the template file ends in one too.
    return text.rstrip("\n") + "\n"


def render() -> dict[str, str]:
    """docs/protocol.md and every docs/schemas/*.json."""
    return {PATH: render_protocol(), **schema_files()}
