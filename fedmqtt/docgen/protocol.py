"""docs/protocol.md and docs/schemas/*.json: the wire protocol, made from the code that speaks it.

What is generated and from where (so the document cannot drift from the code):
- topics and filters: by calling every `*_topic`/`*_filter` builder of fedmqtt.transport.topics;
- payload kinds per topic: the channel's own table of what it accepts where;
- encoding: schemas.messages.TEXT_KINDS (JSON) versus everything else (msgpack);
- who may write and read: the Mosquitto ACL that broker/acl.py renders, matched topic by topic;
- QoS and retention: the values below, which tests/integration/test_docs_protocol.py checks against a real broker;
- payload schemas: each pydantic model's JSON Schema;
- limits, states and reason codes: the constants themselves.
Publisher and subscriber columns and the prose are written here by hand: they explain, they do not define.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass

from paho.mqtt.client import topic_matches_sub

from broker import acl
from fedmqtt.docgen.tables import code, size, table
from fedmqtt.transport import bulk, channel, mqtt, topics
from fedmqtt.transport.settings import BrokerSettings
from ps_daemon import admission, runner, turns
from ps_daemon.config import DaemonConfig
from schemas import chunks, codec
from schemas.checkpoint import Checkpoint
from schemas.messages import TEXT_KINDS, DaemonStatus, Message, SiteStatus

PATH = "docs/protocol.md"
SCHEMA_DIR = "docs/schemas"
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
    TopicDoc("ps_task_topic", "this site's work: train, evaluate, or the recruitment result",
             "PS", "the addressed site only"),
    TopicDoc("ps_turn_topic", "this site's turn to upload its large update of the open round",
             "PS", "the addressed site only"),
    TopicDoc("site_status_topic", "a site's state, its row counts and (if allowed) its label histogram",
             "site agent; its Last Will (`offline`) on network loss", "PS; observers"),
    TopicDoc("site_update_topic", "a site's trained tensors for one round", "site agent", "PS"),
    TopicDoc("site_report_topic", "a site's metrics of the final model on its own splits",
             "site agent", "PS"),
    TopicDoc("site_bridge_topic", "a hospital broker's bridge link: `1` up, `0` down",
             "the hospital's Mosquitto (bridge notification, and its Will on the central broker)",
             "PS; observers"),
)
_CATALOGUE = {doc.builder: doc for doc in CATALOGUE}


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
            values: list[object] = [SAMPLE_RUN]
        elif param == "site_id":
            values = [SAMPLE_SITE]
        elif param == "kind":
            values = list(topics.SITE_KINDS)
        elif param == "index":
            values = [SAMPLE_CHUNK]
        elif param == "topic":
            values = chunked_topics()
        else:
            raise DocDrift(f"topics.{name} takes {param!r}: tell fedmqtt/docgen/protocol.py which sample "
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
           (OTHER_SITE, "other sites"))


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
    kinds = sorted(channel._KINDS_BY_TOPIC[parsed.base])  # the channel's table is the definition
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
                               "(fedmqtt/docgen/protocol.py): say what it is for")
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
                               "fedmqtt/docgen/protocol.py does not describe")


# -- payload schemas -----------------------------------------------------------------------------------------
def message_models() -> list[type]:
    """The models of the wire union `schemas.messages.Message`, in its order."""
    union = typing.get_args(Message)[0]
    return list(typing.get_args(union))


def schema_files() -> dict[str, str]:
    """docs/schemas/<Model>.json for every wire message, the checkpoint, and the union (Message.json)."""
    out = {f"{SCHEMA_DIR}/{model.__name__}.json": _json(model.model_json_schema())
           for model in [*message_models(), Checkpoint]}
    out[f"{SCHEMA_DIR}/Message.json"] = _json(codec.json_schemas())
    return out


def _json(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def _kind(model: type) -> str:
    return model.model_fields["kind"].default


def schemas_table() -> str:
    where: dict[str, list[str]] = {}
    for sample, _, _ in topic_rows():
        if sample.endswith("/bridge"):
            continue
        for kind in kinds_on(sample):
            where.setdefault(kind, []).append(placeholder(sample))
    rows = []
    for model in message_models():
        kind = _kind(model)
        doc = (inspect.getdoc(model) or "").split("\n")[0]
        rows.append((f"[`{model.__name__}`](schemas/{model.__name__}.json)", code(kind),
                     "<br>".join(code(t) for t in where.get(kind, [])), encoding(kind), doc))
    rows.append(("[`Checkpoint`](schemas/Checkpoint.json)", code(_kind(Checkpoint)),
                 "on disk, never on the wire", "msgpack",
                 "what the PS saves after every aggregation (`--resume` reads it)"))
    return table(("Model", "kind", "Topics", "Encoding", "What it is"), rows)


# -- limits, states, reason codes ----------------------------------------------------------------------------
def _setting(name: str) -> tuple[str, object, str]:
    field = BrokerSettings.model_fields[name]
    return code(f"[broker] {name}"), _size(field.default), field.description or ""


def _size(value: object) -> str:
    return str(value) if size(value) == str(value) else f"{value} ({size(value)})"


def chunk_limits_table() -> str:
    settings = ("chunk_threshold_bytes", "chunk_bytes", "fetch_window_bytes", "chunk_stall_s",
                "chunk_refetches", "max_pending_chunk_bytes", "max_pending_manifests",
                "chunk_min_rate_bytes_per_s",
                "max_payload_bytes")
    rows = [_setting(name) for name in settings]
    rows += [
        (code("MIN_CHUNK_BYTES"), _size(chunks.MIN_CHUNK_BYTES), "smallest chunk a manifest may declare"),
        (code("MAX_CHUNK_BYTES"), _size(chunks.MAX_CHUNK_BYTES),
         "largest chunk: keeps every MQTT packet under the broker's max_packet_size"),
        (code("MAX_CHUNKS"), chunks.MAX_CHUNKS,
         "chunks per transfer (the topic's index has at most 6 digits)"),
        (code("MAX_WINDOW_CHUNKS"), bulk.MAX_WINDOW_CHUNKS,
         "chunk topics subscribed at once, whatever their size"),
        (code("CHUNKED_UPDATE_SLACK_BYTES"), _size(admission.CHUNKED_UPDATE_SLACK_BYTES),
         "the PS refuses a chunked update declaring more than the model's size plus this (control variates, "
         "layer statistics)"),
    ]
    return table(("Setting or constant", "Value (default)", "Meaning"), rows)


def _states(model: type) -> str:
    return ", ".join(code(s) for s in typing.get_args(model.model_fields["state"].annotation))


def timing_table() -> str:
    fields = DaemonConfig.model_fields
    rows: list[tuple[str, object, str]] = [
        (code(name), fields[name].default, fields[name].description or "")
        for name in ("round_timeout_s", "stall_s")]
    rows += [
        (code("REMIND_S"), runner.REMIND_S,
         "a waiting PS logs what it waits for, and who is missing, at least this often"),
        (code("STATUS_REFRESH_S"), runner.STATUS_REFRESH_S,
         "new refusal counts reach ps/status at most this often"),
    ]
    return table(("Setting", "Default (s)", "Meaning"), rows)


_NAMES_PAHO_LACKS = {0x92: "Packet identifier not found"}


def _code_name(code_value: int) -> str:
    return _NAMES_PAHO_LACKS.get(code_value) or mqtt._code_name(code_value)


def reason_codes_table() -> str:
    rows = [(f"0x{c:02X}", _code_name(c), "transient", "wait and retry with backoff "
             f"({mqtt.backoff_s(0)} s doubling up to {mqtt.backoff_s(99)} s); logged as transient")
            for c in sorted(mqtt.TRANSIENT_CODES)]
    rows += [(f"0x{c:02X}", _code_name(c), "permanent",
              "stop and say what to change: " + fix.format(user="<user>", broker="<host:port>"))
             for c, fix in sorted(mqtt._FIXES.items())]
    return table(("Code", "Name", "Kind", "What the client does"), rows)


# Why a receiver refuses a payload: the counter keys of ChannelStats and of ps/status's `rejected`.
_CATEGORY_MEANING = {
    "TOO_LARGE": "payload above max_payload_bytes (or a JSON kind above its text limit)",
    "TOO_DEEP": "nesting deeper than the codec allows",
    "MALFORMED": "not valid msgpack/JSON, or the wrong one of the two for its kind",
    "WRONG_VERSION": "schema_version is not this one",
    "SCHEMA": "fails its pydantic model (types, patterns, unknown fields)",
    "NON_FINITE": "NaN or Inf in a number or tensor",
    "OUT_OF_RANGE": "a number outside its field's bounds",
    "TENSOR_LAYOUT": "tensor bytes do not match dtype x shape",
    "BAD_TOPIC": "not a topic of this protocol",
    "WRONG_RUN": "a topic of another run",
    "WRONG_TOPIC": "a kind that does not belong on that topic",
    "WRONG_SENDER": "header `sender` is not the topic's owner",
    "WRONG_ADDRESS": "a task whose site_id is not the one in its topic",
    "MANIFEST_REFUSED": "the receiver refused the chunked transfer before fetching it (e.g. an update it did "
                        "not ask for)",
    "OVER_BUDGET": "the sender already has too many or too large chunked transfers queued",
    "TRANSFER_FAILED": "chunks missing or corrupt after every re-fetch, or slower than the minimum rate",
    "MISMATCH": "the reassembled message differs from its manifest",
    "INTERNAL": "a bug on the receiving side (logged with a traceback); the sender is not blamed",
}


def categories_table() -> str:
    rows = []
    for name, meaning in _CATEGORY_MEANING.items():
        module = codec if hasattr(codec, name) else channel
        rows.append((code(getattr(module, name)), meaning))
    return table(("Category", "Refused because"), rows)


def ps_categories_table() -> str:
    """The PS's own refusals (ps_daemon/runner.py): what its reason says, and the key ps/status counts it
    under."""
    labels: dict[str, list[str]] = {}
    for text, label in runner._CATEGORIES:
        labels.setdefault(label, []).append(f'"{text}"')
    return table(("Category", "The PS's reason mentions"),
                 ((code(k), ", ".join(v)) for k, v in labels.items()))


def observer_logins() -> str:
    return ", ".join(code(n) for n in acl.login_names("observer"))


# -- the document --------------------------------------------------------------------------------------------
TEMPLATE = """\
# Protocol

<!-- Generated by fedmqtt/docgen/protocol.py from the code: edit that file, then run
     `python -m fedmqtt.docgen`. A test fails while this file is out of date. -->

Everything in a federation travels through one MQTT v5 broker (Mosquitto). The parameter server (PS), each
site agent and any observer are ordinary MQTT clients; none of them accepts an inbound connection, so a
hospital only needs to reach the broker. This page lists every topic, who writes and reads it, how each
payload is encoded and validated, how large payloads are cut into chunks, how a round and a run unfold, and
what a client does when the broker refuses something.

## Topics

All topics of a run live under `@@ROOT@@/<run>/`. Run and site ids are 1 to 63 characters of `a-z`, `0-9` and
`-`, starting with a letter or digit, so an id can never contain an MQTT wildcard or a level separator.
`fedmqtt/transport/topics.py` is the only code that builds or parses topics, and `broker/acl.py` makes the
broker's access list from the same builders.

@@TOPICS@@
### Delivery and rights

Every message is published at QoS @@QOS@@ (exactly once) and retained, so a client that connects late, or
reconnects after a network loss, receives the latest state, model and task at once. Statuses are also the Last
Will of their writer: when a connection drops without a clean goodbye, the broker publishes that party's
`offline` status for it. The rights below are read from the ACL that `fedmqtt broker init` writes; the broker
enforces them, and the channel checks again on receipt that a message's `sender` owns its topic.

@@DELIVERY@@
### Every builder

@@BUILDERS@@
### What any MQTT client can read

The broker allows no anonymous login. The observer account is read-only and sees exactly the status and
metrics topics above: `ps/status`, `ps/metrics`, every `site/<site>/status` and every bridge state; never a
model, a task, an update or a report. Those it can read are JSON text, so `mosquitto_sub` or any MQTT library
can follow a run without project code:

```
mosquitto_sub -h <host> -p <port> -u observer.1 -P <observer password> -V mqttv5 -v -t '@@ROOT@@/<run>/#'
```

The broker maps every client id to its user name (so no client can push another party off by reusing its
client id), which means one connection per login. The observer therefore has several logins with the same
password and the same rights: @@OBSERVERS@@. The dashboard and `fedmqtt topics watch` each take one. Every
other party has two logins: `<user>` for its control connection (with the Last Will) and `<user>.bulk` for
chunked transfers.

## Payloads

Every payload is one pydantic model from `schemas/`, tagged by its `kind` field. The kinds that observers read
(@@TEXT_KINDS@@) travel as UTF-8 JSON; every other kind travels as msgpack, with tensors as raw little-endian
`bin` bytes (name, dtype, shape, data; no pickle, no base64). A msgpack map never starts with `{`, so the
first byte tells the two encodings apart, and a kind sent in the wrong one is refused.

Every message carries the same header: `schema_version`, `run_id`, `sender`, `round`, `msg_id` and `sent_at`.
Receivers drop a `msg_id` they have already seen from that sender (statuses excepted: they are state, and a
Last Will repeats its bytes), so re-publishing is always safe.

The JSON Schema of each model is generated into `docs/schemas/` (`Message.json` holds the whole union, for
clients in other languages; `fedmqtt topics schema` prints the same). In JSON Schema, `bytes` fields appear as
strings of format `binary`; on the wire they are msgpack `bin`.

@@SCHEMAS@@
### What a receiver refuses

Decoding treats every payload as hostile: sizes, nesting, container and string lengths are bounded before
anything is allocated, then the model checks types, ranges and finiteness, then the channel checks that the
kind belongs on the topic, the run is this run and the sender owns the topic. A refused message is counted per
sender and category, logged once in one bounded line, and never acted on; the PS publishes its counts in
`ps/status` under `rejected`, so an operator sees who sends what.

@@CATEGORIES@@
On top of these, the PS judges every update, report and chunked upload against the open round before it stores
anything (`ps_daemon/admission.py`): the right round and session, a site that was asked, the first answer
only, the current model version, the model's exact tensor layout, bounded scalars and histograms. Its refusals
are counted under these keys (any other reason under `refused`):

@@PS_CATEGORIES@@
## Chunked transfer

A model of hundreds of megabytes does not fit one MQTT packet, and a broker that queues too much for one
client drops messages silently. So any encoded payload larger than `chunk_threshold_bytes` on a topic that
allows it (the model, a task, an update, a report) is cut into equal chunks:

1. The sender publishes every chunk, retained, on `<topic>/chunk/<i>` (`i` from 0), over its bulk connection,
   with a bounded number of QoS 2 exchanges in flight.
2. Only then does it publish the small **manifest** (kind `chunk_manifest`) on `<topic>` itself. A manifest
   therefore always points at chunks the broker already holds, and a receiver that starts late still finds
   them. It names the transfer (the inner message's `msg_id`), its inner kind and round, the total bytes, the
   chunk size, the SHA-256 of every chunk, a root SHA-256 over the concatenated chunk digests, and the index
   of the tensors inside (name, dtype, shape) so a receiver can check the layout before fetching anything.
3. The receiver checks the manifest against its own budget for that sender and (the PS) against the open
   round, then subscribes to the exact chunk topics a window at a time (`fetch_window_bytes`, at most
   `MAX_WINDOW_CHUNKS` topics), asking for more once half the window has arrived and unsubscribing from the
   chunks it holds. One transfer is fetched at a time, so the broker never queues more than one window per
   client and a receiver holds one reassembly buffer at a time.
4. Each chunk is verified against its digest and length before it is kept. A corrupt or missing chunk is
   fetched again by subscribing once more (the broker replays the retained copy); after `chunk_refetches`
   attempts, or when the transfer runs slower than `chunk_min_rate_bytes_per_s`, the transfer fails with a
   reason naming the chunks and the receiver moves on. A chunk of another transfer is stale and ignored. A
   failed transfer never yields a wrong payload.
5. The reassembled bytes are decoded and checked like any other message, and must match the manifest's kind,
   `msg_id`, round and tensor index.

A newer manifest on the same topic supersedes the transfer in progress. When a later payload on a topic needs
fewer chunks, the sender clears the surplus retained chunks so they do not sit in the broker's memory. Nothing
is sized by what a manifest declares: the buffer grows only with verified chunks.

@@CHUNK_LIMITS@@
## Upload turns

A chunked update stays retained at the broker until the PS has fetched it, so N sites that finish a round
together would make the broker hold N updates beside the model. Large updates therefore go up in turns:

1. A site whose encoded update is larger than `chunk_threshold_bytes` stores it (as every update, before it
   leaves) and publishes its status `update_ready`, with the round in `round` and the size in `update_bytes`.
   The status is retained, so a PS that starts later still learns who is ready. A smaller update is published
   at once, as before.
2. The PS grants at most `upload_turns` turns at once (PS config, default 2), to the sites of the open round
   whose update it does not hold yet, the oldest announcement first. Each grant goes at once to that site
   alone, as an `upload_turn` (round, session, grant number) retained on `ps/turn/<site>`: one small message
   per turn, where a turn announced on `ps/status` would reach every site. `ps/status` lists the current turns
   in `upload_turns` for observers, at its own pace.
3. A site with a ready update of that round and session, and a grant number it has not answered yet,
   publishes its stored update (chunks first, then the manifest, as above).
4. Once the PS has accepted a chunked update, it clears the manifest and the chunks at the broker (empty
   retained messages; the ACL lets the PS write the whole run) and the turn passes on. A refused update ends
   the turn as well. A site that has not started its upload @@TURN_GRACE@@ s after the grant (plus
   @@TURN_PER_MB@@ s per MB of its update: its chunks go up before the manifest the PS sees) loses the turn and
   waits behind the others; a site that goes offline loses it at once. A turn that ended, for any of these
   reasons, is removed from `ps/turn/<site>` (an empty retained message), so a site that restarts never
   uploads on a turn the PS no longer counts.

So the broker holds the model plus at most `upload_turns` updates, whatever the number of sites. Nothing of it
has to survive the PS: a resumed PS learns again from the retained `update_ready` statuses who is ready and
grants new turns for the updates it no longer holds (it first removes every turn the process before it left
at the broker); grant numbers start from the PS's start time, so a site answers each new grant once. A site that reconnects announces `update_ready` again rather than `online`.

## Lifecycle of a run

The PS is a pure state machine (`ps_daemon/machine.py`) driven by events: started, site online, site offline,
update received, report received, and a clock tick. Its phases, as published in `ps/status` `state`, are
@@PS_STATES@@; a site's states in `site/<site>/status` are @@SITE_STATES@@.

1. **Session.** A fresh `fedmqtt ps start` draws a new random session id and stamps it on every model, task
   and answer; `--resume` keeps the session of the checkpoint. A site follows the newest session it sees, and
   the PS refuses an update or report of another session (`wrong session`), so a new run with the same run id
   and seed is never confused with an old one whose messages are still retained.
2. **Waiting for sites.** The PS publishes `waiting_for_sites` and collects site statuses. Each site announces
   itself `online` with its row counts (and its label histogram if its config allows it to leave the site).
   Round 1 starts once `min_sites` sites (by default all of them) are online. Until then `ps/status` names the
   sites online and those it waits for (`sites_online`, `waiting_for`), and is re-published as each site
   arrives; the PS log says the same at least every `REMIND_S` seconds. With `selection = "recruited"` the PS
   first scores the online sites and sends each a `recruitment_result` on its task topic.
3. **A round.** The PS selects the round's sites (all online sites, a seeded fraction, or the recruited set),
   publishes the global model on `ps/model` and a `train_task` on each selected site's task topic, with the
   deadline, the training settings, and the commit rule (`accepted_round`: the round of that site's last
   update the PS aggregated). A site trains only once it holds the model whose hash the task names, stores its
   update on disk, then publishes it on `site/<site>/update`; after a restart it re-sends the stored update
   instead of training twice.
4. **Closing a round.** An update is admitted only for the open round, from a selected site, once per site
   (the first wins), trained from the current model version, with exactly the model's tensor names, dtypes and
   shapes. The round closes when every selected site that has not been seen going offline has answered and at
   least `quorum` updates are in, or at the deadline if the quorum is met. Otherwise the deadline is extended
   and the missing sites are named in `ps/status`, never a silent wait.
5. **Aggregate, checkpoint, metrics.** The strategy aggregates the updates (sorted by site, so arrival order
   does not matter). A result with NaN or Inf is refused: the updates are discarded and the round goes out
   again after `stall_s`. Otherwise the PS saves a checkpoint (`Checkpoint`, msgpack) before it publishes
   anything of the next round, then the round's `round_metrics` on `ps/metrics`, then the next model and
   tasks.
6. **Final evaluation.** After the last round the PS publishes the final model and an `eval_task` (tag
   `final`) to every site in the pool. Each site evaluates that model, and its best-round model, on its own
   splits and publishes an `eval_report`. When every site has reported (or gone offline), or at the deadline,
   the PS publishes `round_metrics` with phase `final`, writes its run report and publishes `done`.
7. **Stall re-publish.** If nothing arrives for the open round for `stall_s` seconds (a broker that lost its
   retained messages, a lost uplink), the PS re-publishes the model and the tasks of the sites still missing
   under new message ids and says so in `ps/status`. A site that already trained re-sends its stored update.
8. **Reconnects.** After a network loss the broker has published the party's Will (`offline`); on reconnect
   the PS re-publishes its status and the open round with the same message ids (receivers that have them drop
   the copies), and a site re-announces itself `online`. Retained topics replay the latest model and task, so
   the start order of PS and sites does not matter.
9. **Resume.** `fedmqtt ps start --resume` loads the latest checkpoint, keeps its session, and re-sends the
   round it stopped in (or the final evaluation). Between the two starts only `credentials`, `out_dir`,
   `round_timeout_s`, `keep_checkpoints` and `pretrained` may change: the checkpoint stores a hash of the rest
   of the config, and a resume with a different one is refused.

@@TIMING@@
## Reason codes

Every MQTT reason code of 0x80 or above that the broker sends (in CONNACK, PUBACK/PUBREC/PUBCOMP, SUBACK or
DISCONNECT) is sorted into transient or permanent. A transient code is retried with backoff and logged as
such; a permanent one stops the client with a message that names the cause and what to change, because the
same request would be refused again. A code not listed here is treated as permanent, with "see the broker's
log".

@@REASON_CODES@@"""


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
        "PS_STATES": _states(DaemonStatus),
        "SITE_STATES": _states(SiteStatus),
        "TIMING": timing_table(),
        "REASON_CODES": reason_codes_table(),
    }
    text = TEMPLATE
    for name, value in parts.items():
        text = text.replace(f"@@{name}@@", value)
    if "@@" in text:
        raise DocDrift(f"unfilled placeholder in the protocol template: {text[text.index('@@'):][:40]}")
    return text


def render() -> dict[str, str]:
    """docs/protocol.md and every docs/schemas/*.json."""
    return {PATH: render_protocol(), **schema_files()}
