"""The one module that builds and parses topics; the broker ACL is generated from it.

Every topic lives under `fedmqtt/v1/<run_id>/`. Ids are `[a-z0-9-]` so that they can
never contain MQTT wildcards or level separators.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fedmqtt.errors import TopicError
from schemas.chunks import MAX_CHUNKS
from schemas.signed import COORDINATOR

ROOT = "fedmqtt"
VERSION = "v1"
_ID = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62})$")

PS_STATUS = "ps/status"
PS_MODEL = "ps/model"
PS_METRICS = "ps/metrics"
PS_FEATURES = "ps/features"
FEDERATION_KEYS = "federation/keys"
# secagg: a site's small secure-aggregation messages (keys, sealed shares, unmasking answers); its masked input
# travels on `update`, chunked like an update (docs/secure-aggregation.md, "Wire messages").
# features: a site's feature summary before round 1, when the run standardises with the federation's statistics.
SITE_KINDS = ("status", "update", "report", "secagg", "features")
BRIDGE = "bridge"  # site/<id>/bridge: a hospital broker's bridge notification, "1" or "0" (not a schema message)
# Payloads that may be too big for one MQTT message travel as chunks under `<topic>/chunk/<index>`
# (docs/protocol.md, "Chunked transfer"); the small manifest stays on `<topic>` itself.
CHUNKED_KINDS = {("ps", "model"), ("ps", "task"), ("site", "update"), ("site", "report")}
CHUNK = "chunk"


def validate_id(value: str, *, what: str = "id") -> str:
    """Return `value` if it is a valid run or site id, else raise TopicError naming it."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise TopicError(
            f"invalid {what} {value!r}: use 1-63 characters from a-z, 0-9 and '-', starting with a letter or digit"
        )
    return value


def run_prefix(run_id: str) -> str:
    return f"{ROOT}/{VERSION}/{validate_id(run_id, what='run id')}"


def run_filter(run_id: str) -> str:
    """Subscription filter for everything of one run."""
    return f"{run_prefix(run_id)}/#"


def ps_status_topic(run_id: str) -> str:
    return f"{run_prefix(run_id)}/{PS_STATUS}"


def ps_model_topic(run_id: str) -> str:
    return f"{run_prefix(run_id)}/{PS_MODEL}"


def ps_metrics_topic(run_id: str) -> str:
    return f"{run_prefix(run_id)}/{PS_METRICS}"


def ps_features_topic(run_id: str) -> str:
    """`ps/features` (retained): the federation's feature statistics, combined from the sites' summaries."""
    return f"{run_prefix(run_id)}/{PS_FEATURES}"


def federation_keys_topic(run_id: str) -> str:
    """`federation/keys` (retained): the coordinator-signed list of every party's signing key
    (fedmqtt/transport/signing.py). Only the coordinator's tooling writes it."""
    return f"{run_prefix(run_id)}/{FEDERATION_KEYS}"


def ps_task_topic(run_id: str, site_id: str) -> str:
    return f"{run_prefix(run_id)}/ps/task/{validate_id(site_id, what='site id')}"


def ps_turn_topic(run_id: str, site_id: str) -> str:
    """`ps/turn/<site>`: this site's upload turn (ps_daemon/turns.py)."""
    return f"{run_prefix(run_id)}/ps/turn/{validate_id(site_id, what='site id')}"


def site_topic(run_id: str, site_id: str, kind: str) -> str:
    if kind not in SITE_KINDS:
        raise TopicError(f"unknown site topic kind {kind!r}; expected one of {SITE_KINDS}")
    return f"{run_prefix(run_id)}/site/{validate_id(site_id, what='site id')}/{kind}"


def site_status_topic(run_id: str, site_id: str) -> str:
    return site_topic(run_id, site_id, "status")


def site_update_topic(run_id: str, site_id: str) -> str:
    return site_topic(run_id, site_id, "update")


def site_report_topic(run_id: str, site_id: str) -> str:
    return site_topic(run_id, site_id, "report")


def site_secagg_topic(run_id: str, site_id: str) -> str:
    """`site/<id>/secagg`: this site's key advertisement, sealed shares and unmasking answers of the open round."""
    return site_topic(run_id, site_id, "secagg")


def site_features_topic(run_id: str, site_id: str) -> str:
    """`site/<id>/features` (retained): this site's feature summary (sums over its training values)."""
    return site_topic(run_id, site_id, "features")


def site_bridge_topic(run_id: str, site_id: str) -> str:
    """`site/<id>/bridge`: a hospital broker's bridge state, retained "1" (up) or "0" (down, its Will on the
    central broker). Outside SITE_KINDS on purpose: Mosquitto writes it, not the site agent, and its payload is
    not a schema message. The site's ACL lists it among the site's own topics (broker/acl.py)."""
    return f"{run_prefix(run_id)}/site/{validate_id(site_id, what='site id')}/bridge"


def site_all_filter(run_id: str, site_id: str) -> str:
    """`site/<id>/#`: everything under one site, what a hospital broker's bridge forwards (not an ACL right).

    The ACL grants a site its exact topics only (broker/acl.py)."""
    return f"{run_prefix(run_id)}/site/{validate_id(site_id, what='site id')}/#"


def any_bridge_filter(run_id: str) -> str:
    """`site/+/bridge`: every hospital broker's bridge state (the PS maps "0" to that site going offline)."""
    return f"{run_prefix(run_id)}/site/+/{BRIDGE}"


def broker_sys_filter() -> str:
    """`$SYS/#`: the broker's own numbers (clients, messages, bytes, load); only the `monitor` login reads them.

    They lie outside every run (broker/acl.py, docs/monitoring.md)."""
    return "$SYS/#"


def any_site_filter(run_id: str, kind: str) -> str:
    """`site/+/<kind>` for one kind of site message (the PS and observers subscribe to these)."""
    if kind not in SITE_KINDS:
        raise TopicError(f"unknown site topic kind {kind!r}; expected one of {SITE_KINDS}")
    return f"{run_prefix(run_id)}/site/+/{kind}"


def chunk_topic(topic: str, index: int) -> str:
    """Where chunk `index` of a large payload for `topic` travels."""
    if not 0 <= index < MAX_CHUNKS:
        raise TopicError(f"chunk index {index} out of range")
    return f"{topic}/{CHUNK}/{index}"


def chunk_filter(topic: str) -> str:
    """Every chunk of `topic` (the ACL grants reads with this filter)."""
    return f"{topic}/{CHUNK}/+"


@dataclass(frozen=True)
class ParsedTopic:
    """A topic taken apart: who it is about and what it carries."""

    run_id: str
    role: str  # "ps", "site" or "federation"
    kind: str  # status | model | metrics | features | task | turn | update | report | secagg | keys
    site_id: str | None = None
    chunk: int | None = None  # set on `<topic>/chunk/<index>`

    @property
    def base(self) -> tuple[str, str]:
        return (self.role, self.kind)

    @property
    def owner(self) -> str:
        """The one party that may write this topic, and whose signature its messages must carry."""
        if self.role == "site" and self.site_id:
            return self.site_id
        return COORDINATOR if self.role == "federation" else "ps"


def parse_topic(topic: str) -> ParsedTopic:
    """Split a concrete topic into its parts, or raise TopicError."""
    parts = topic.split("/")
    if len(parts) < 5 or parts[0] != ROOT or parts[1] != VERSION:
        raise TopicError(f"not a fedmqtt {VERSION} topic: {topic!r}")
    run_id = validate_id(parts[2], what="run id")
    rest = parts[3:]
    if len(rest) >= 3 and rest[-2] == CHUNK:
        index = rest[-1]
        if not (index.isdigit() and len(index) <= len(str(MAX_CHUNKS)) and str(int(index)) == index
                and int(index) < MAX_CHUNKS):
            raise TopicError(f"bad chunk index in topic {topic!r} (0 to {MAX_CHUNKS - 1})")
        base = parse_topic("/".join(parts[:-2]))
        if base.base not in CHUNKED_KINDS:
            raise TopicError(f"{base.role}/{base.kind} payloads are never chunked: {topic!r}")
        return ParsedTopic(base.run_id, base.role, base.kind, base.site_id, int(index))
    if rest[0] == "ps" and len(rest) == 2 and rest[1] in ("status", "model", "metrics", "features"):
        return ParsedTopic(run_id, "ps", rest[1])
    if "/".join(rest) == FEDERATION_KEYS:
        return ParsedTopic(run_id, "federation", "keys")
    if rest[0] == "ps" and len(rest) == 3 and rest[1] in ("task", "turn"):
        return ParsedTopic(run_id, "ps", rest[1], validate_id(rest[2], what="site id"))
    if rest[0] == "site" and len(rest) == 3 and rest[2] in SITE_KINDS:
        return ParsedTopic(run_id, "site", rest[2], validate_id(rest[1], what="site id"))
    raise TopicError(f"unknown fedmqtt topic: {topic!r}")
