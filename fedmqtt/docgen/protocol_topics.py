"""docs/protocol.md's topic tables: every topic, who publishes and reads it, at what QoS, under which rights.

Topics come from calling every `*_topic`/`*_filter` builder of fedmqtt.transport.topics with sample ids, the
payload kinds per topic from the channel's own table (`channel.KINDS_BY_TOPIC`), the rights from the Mosquitto
ACL that broker/acl.py renders, matched topic by topic. Publisher and subscriber columns (`CATALOGUE`) are
written here by hand: they explain, they do not define.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from paho.mqtt.client import topic_matches_sub

from broker import acl
from fedmqtt.docgen.tables import code, table
from fedmqtt.transport import channel, topics
from schemas.messages import TEXT_KINDS

# Every message fedmqtt publishes goes out at this QoS (fedmqtt.transport.mqtt publishes and subscribes at
# QoS 2 only), and so do the Last Wills. Checked against a real Mosquitto by tests/integration/test_docs_protocol.py.
QOS = 2
# Mosquitto's bridge notification (site/<id>/bridge) and its Will: QoS 1, retained (Mosquitto's own choice).
BRIDGE_QOS = 1

# Sample ids: every builder is called with them, and the results are shown with placeholders instead.
SAMPLE_RUN = "run"
SAMPLE_SITE = "site-a"
OTHER_SITE = "site-b"
SAMPLE_CHUNK = 0
_PLACEHOLDERS = ((re.compile(rf"^({topics.ROOT}/{topics.VERSION})/{SAMPLE_RUN}(?=/|$)"), r"\1/<run>"),
                 (re.compile(rf"(?<=/){SAMPLE_SITE}(?=/|$)"), "<site>"),
                 (re.compile(rf"(?<=/{topics.CHUNK}/){SAMPLE_CHUNK}$"), "<i>"))


class DocDrift(RuntimeError):
    """The code gained something this generator does not know how to describe: teach it (see the message)."""


def placeholder(topic: str) -> str:
    """`fedmqtt/v1/run/site/site-a/update/chunk/0` -> `fedmqtt/v1/<run>/site/<site>/update/chunk/<i>`."""
    for pattern, replacement in _PLACEHOLDERS:
        topic = pattern.sub(replacement, topic)
    return topic


# -- the topic catalogue: who publishes and who listens (hand-written), keyed by the builder -------------
@dataclass(frozen=True)
class TopicDoc:
    builder: str
    summary: str
    publisher: str
    subscribers: str


CATALOGUE = (
    TopicDoc("ps_status_topic", "the PS's state: phase, round, who is online, who it waits for, refusals",
             "PS (control connection); its Last Will (`offline`) on network loss",
             "every site; observers (dashboard, `fedmqtt topics watch`)"),
    TopicDoc("ps_model_topic", "the global model of the open round (and server state every site needs)",
             "PS", "every site"),
    TopicDoc("ps_metrics_topic", "the summary of the last closed round, then of the final evaluation",
             "PS", "observers (dashboard, `fedmqtt topics watch`)"),
    TopicDoc("ps_features_topic", "the federation's feature statistics (clip bounds, fills, means, scales), "
             "combined from the sites' summaries before round 1 (`feature_statistics = \"federated\"`)",
             "PS", "every site"),
    TopicDoc("ps_task_topic", "this site's work: train, evaluate, or the recruitment result; under "
             "secure aggregation also its roster, inbox of sealed shares and unmasking request",
             "PS", "the addressed site only"),
    TopicDoc("ps_turn_topic", "this site's turn to upload its large update of the open round",
             "PS", "the addressed site only"),
    TopicDoc("site_status_topic",
             "a site's state, its row counts, its privacy policy and (if allowed) its label histogram",
             "site agent; its Last Will (`offline`) on network loss", "PS; observers"),
    TopicDoc("site_update_topic", "a site's trained tensors for one round", "site agent", "PS"),
    TopicDoc("site_report_topic", "a site's metrics of the final model on its own splits",
             "site agent", "PS"),
    TopicDoc("site_secagg_topic", "a site's secure-aggregation messages of the open round: key advertisement, "
             "sealed shares, unmasking answer (its masked input travels on `update`)", "site agent", "PS"),
    TopicDoc("site_features_topic", "a site's feature summary: counts, sums, sums of squares and a histogram "
             "per column of its training split (no patient-level value)", "site agent", "PS"),
    TopicDoc("site_bridge_topic", "a hospital broker's bridge link: `1` up, `0` down",
             "the hospital's Mosquitto (bridge notification, and its Will on the central broker)",
             "PS; observers"),
    TopicDoc("federation_keys_topic", "every party's signing key, signed by the coordinator (the key list)",
             "the coordinator's tooling (`broker start`, `add-site`, `remove-site`, `rotate`, `broker keys`)",
             "every party, observers included"),
)


def builders() -> dict[str, Callable[..., str]]:
    """Every topic and filter builder of fedmqtt.transport.topics, by name."""
    return {name: fn for name, fn in vars(topics).items()
            if inspect.isfunction(fn) and fn.__module__ == topics.__name__
            and name.endswith(("_topic", "_filter"))
            and inspect.signature(fn).return_annotation in ("str", str)}  # parse_topic takes apart


def built(name: str, fn: Callable[..., str]) -> list[str]:
    """What one builder makes from the sample ids, one result per value of a `kind` or `topic` argument."""
    params = list(inspect.signature(fn).parameters)
    calls: list[dict[str, object]] = [{}]
    for param in params:
        if param == "run_id":
            values: Sequence[object] = [SAMPLE_RUN]
        elif param == "site_id":
            values = [SAMPLE_SITE]
        elif param == "kind":
            values = list(topics.SITE_KINDS)
        elif param == "index":
            values = [SAMPLE_CHUNK]
        elif param == "topic":
            values = chunked_topics()
        else:
            raise DocDrift(f"topics.{name} takes {param!r}: tell fedmqtt/docgen/protocol_topics.py which sample "
                           "to pass")
        calls = [{**call, param: value} for call in calls for value in values]
    return [fn(**call) for call in calls]


def chunked_topics() -> list[str]:
    """The sample topics whose large payloads travel as chunks (topics.CHUNKED_KINDS)."""
    out = []
    for doc in CATALOGUE:
        sample = built(doc.builder, builders()[doc.builder])[0]
        if doc.builder != "site_bridge_topic" and topics.parse_topic(sample).base in topics.CHUNKED_KINDS:
            out.append(sample)
    return out


# -- rights: the ACL broker/acl.py writes, applied to sample topics ----------------------------------------
PARTIES = (("ps", "PS"), ("observer", "observers"), (SAMPLE_SITE, "the site itself"),
           (OTHER_SITE, "other sites"), ("coordinator", "the coordinator's tooling"))


def acl_rules() -> dict[str, list[tuple[str, str]]]:
    """user -> [(access, filter)] of the ACL for a sample run with two sites."""
    rules: dict[str, list[tuple[str, str]]] = {}
    user = ""
    for line in acl.render_acl(SAMPLE_RUN, [SAMPLE_SITE, OTHER_SITE]).splitlines():
        if line.startswith("user "):
            user = line.split(" ", 1)[1]
            rules[user] = []
        elif line.startswith("topic "):
            _, access, pattern = line.split(" ", 2)
            rules[user].append((access, pattern))
    return rules


def who_may(topic: str, access: str) -> str:
    """The parties whose ACL grants `access` ("read" or "write") on `topic`."""
    rules = acl_rules()
    may = [label for user, label in PARTIES
           if any(a in (access, "readwrite") and topic_matches_sub(f, topic) for a, f in rules.get(user, []))]
    return ", ".join(may) or "nobody"


# -- per-topic facts -----------------------------------------------------------------------------------------
def kinds_on(topic: str) -> list[str]:
    """Payload kinds the channel accepts on `topic` (a chunk topic carries `chunk`)."""
    parsed = topics.parse_topic(topic)
    if parsed.chunk is not None:
        return ["chunk"]
    kinds = sorted(channel.KINDS_BY_TOPIC[parsed.base])  # the channel's table is the definition
    if parsed.base in topics.CHUNKED_KINDS:
        kinds.append("chunk_manifest")
    return kinds


def encoding(kind: str) -> str:
    return "JSON" if kind in TEXT_KINDS else "msgpack"


def retained_by_default() -> bool:
    """Channel.send retains unless told otherwise (no caller tells it otherwise)."""
    return bool(inspect.signature(channel.Channel.send).parameters["retain"].default)


def topic_rows() -> list[tuple[str, TopicDoc, str]]:
    """(sample topic, catalogue entry, payload column) for every concrete topic, chunk topics included."""
    rows = []
    for doc in CATALOGUE:
        sample = built(doc.builder, builders()[doc.builder])[0]
        if doc.builder == "site_bridge_topic":
            rows.append((sample, doc, "raw bytes `0` or `1` (not a schema message)"))
            continue
        kinds = kinds_on(sample)
        rows.append((sample, doc, ", ".join(f"`{k}` ({encoding(k)})" for k in kinds)))
        if topics.parse_topic(sample).base in topics.CHUNKED_KINDS:
            chunk = topics.chunk_topic(sample, SAMPLE_CHUNK)
            chunk_doc = TopicDoc(doc.builder, f"one chunk of a large payload of `{placeholder(sample)}`",
                                 f"{doc.publisher.split(';')[0]} (bulk connection)",
                                 f"{doc.subscribers.split(';')[0]}, a window of chunks at a time")
            rows.append((chunk, chunk_doc, "`chunk` (msgpack)"))
    return rows


def topics_table() -> str:
    return table(("Topic", "Carries", "Publisher", "Subscribers", "Payload"),
                 ((code(placeholder(t)), d.summary, d.publisher, d.subscribers, p)
                  for t, d, p in topic_rows()))


def delivery_table() -> str:
    retained = "yes" if retained_by_default() else "no"
    rows = []
    for sample, doc, _ in topic_rows():
        bridge = doc.builder == "site_bridge_topic"
        rows.append((code(placeholder(sample)), BRIDGE_QOS if bridge else QOS, "yes" if bridge else retained,
                     who_may(sample, "write"), who_may(sample, "read")))
    return table(("Topic", "QoS", "Retained", "Who may write (ACL)", "Who may read (ACL)"), rows)


def builders_table() -> str:
    """Every builder and what it makes: a new builder shows up here by itself."""
    rows = []
    for name, fn in sorted(builders().items()):
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        made = [placeholder(t) for t in built(name, fn)]
        if not doc:
            entries = [d for d in CATALOGUE if d.builder == name] or [
                d for d in CATALOGUE if placeholder(built(d.builder, builders()[d.builder])[0]) in made]
            if not entries:
                raise DocDrift(f"topics.{name} has no docstring and no entry in CATALOGUE "
                               "(fedmqtt/docgen/protocol_topics.py): say what it is for")
            doc = "; ".join(d.summary for d in entries)
        rows.append((code(f"topics.{name}"), "<br>".join(code(t) for t in made), doc))
    return table(("Builder", "Builds", "What for"), rows)


def check_catalogue() -> None:
    """Every concrete topic a builder makes must be described in CATALOGUE (or be a chunk of one that is)."""
    known = {placeholder(t) for t, _, _ in topic_rows()}
    for name, fn in builders().items():
        for topic in built(name, fn):
            if name.endswith("_topic") and placeholder(topic) not in known:
                raise DocDrift(f"topics.{name} builds {placeholder(topic)}, which CATALOGUE in "
                               "fedmqtt/docgen/protocol_topics.py does not describe")


def observer_logins() -> str:
    """The observer's logins (one connection each), as inline code."""
    return ", ".join(code(n) for n in acl.login_names("observer"))
