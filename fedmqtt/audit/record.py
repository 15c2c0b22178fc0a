"""One audit record: its schema, its canonical bytes and the hashes that chain it to the record before it.

A record is one line of canonical JSON (sorted keys, no spaces, ASCII only). `hash` is the SHA-256 of the
canonical bytes of every field but `hash` and `sig`; `prev` is the previous record's `hash`, or for the first
record of a log the genesis value of its `chain` (the tool and the federation or run it belongs to). Editing,
dropping, inserting or reordering a record therefore breaks a hash or a link that `verify` checks.
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedmqtt.errors import FedMqttError

FORMAT_VERSION = 1
# A log is hostile input too: a line is read with this limit before it is parsed, and a writer never writes more.
MAX_LINE_BYTES = 16 * 1024
MAX_DETAILS_BYTES = 8 * 1024  # the canonical `details` object of one record
MAX_DETAIL_DEPTH = 3  # details hold scalars, or lists/objects of them, nested at most this deep
MAX_DETAIL_ITEMS = 64  # entries of one list or object inside details
MAX_DETAIL_TEXT = 1024  # characters of one string inside details
TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"  # fixed width, so records' times compare as text
HEX64 = r"^[0-9a-f]{64}$"

# event -> what it records (docs/audit.md lists the same); an event outside this list is still a valid record,
# so a newer writer's log verifies with an older fedmqtt.
EVENTS: dict[str, str] = {
    "broker-init": "a federation's broker files were created (`broker init`)",
    "party-add": "a party got its first credentials (at init, or `broker add-site`)",
    "party-remove": "a site was taken out (`broker remove-site`)",
    "party-rotate": "a party got new credentials (`broker rotate`)",
    "broker-start": "`broker start` started Mosquitto",
    "broker-stop": "that Mosquitto stopped",
    "run-start": "the PS started a run from its configuration",
    "run-resume": "the PS continued a run (`ps start --resume`)",
    "run-force-restart": "the PS started over, deleting earlier checkpoints (`ps start --force`)",
    "round-close": "a round closed: updates accepted, stragglers, messages refused by category",
    "run-finish": "the run's final outputs were written",
    "run-stop": "the PS stopped before the run finished (signal or error)",
}


class AuditError(FedMqttError):
    """An audit log cannot be appended to (torn last line, unreadable record, bad permissions)."""


class RecordError(ValueError):
    """One line is not a valid record; `why` says what is wrong with it."""


def canonical(obj: object) -> bytes:
    """The one byte form of a JSON value that is hashed and written: sorted keys, no spaces, ASCII, finite."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def genesis(chain: str) -> str:
    """What the first record of `chain` links to: deleting the first records is then caught like any other."""
    return sha256_hex(b"fedmqtt audit genesis\n" + chain.encode("ascii"))


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime(TS_FORMAT)


class Signature(BaseModel):
    """An Ed25519 signature over the record's hash (see fedmqtt.audit.signing)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    key: str = Field(pattern=r"^[0-9a-f]{16}$")  # key id: the first 16 hex digits of SHA-256(raw public key)
    ed25519: str = Field(pattern=r"^[A-Za-z0-9+/]{86}==$")  # 64 bytes, base64


class AuditRecord(BaseModel):
    """One line of an audit log."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    v: Literal[1]
    seq: int = Field(ge=1, le=2**53)  # 1, 2, 3... within the log
    ts: str = Field(pattern=r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")  # UTC, never earlier than the previous
    chain: str = Field(pattern=r"^[a-z]{1,16}/[a-z0-9][a-z0-9-]{0,62}$")  # "<tool>/<federation or run id>"
    actor: str = Field(pattern=r"^[a-z][a-z0-9-]{0,31}(:[A-Za-z0-9._@-]{1,64})?$")  # "broker-cli:<os user>", "ps"
    event: str = Field(pattern=r"^[a-z]+(-[a-z]+){0,4}$", max_length=40)
    details: dict[str, Any]
    prev: str = Field(pattern=HEX64)
    hash: str = Field(pattern=HEX64)
    sig: Signature | None = None

    @field_validator("ts")
    @classmethod
    def _real_time(cls, ts: str) -> str:
        datetime.strptime(ts, TS_FORMAT)  # a month 13 matches the pattern but is no time
        return ts

    @field_validator("details")
    @classmethod
    def _bounded(cls, details: dict[str, Any]) -> dict[str, Any]:
        problem = details_problem(details)
        if problem:
            raise ValueError(problem)
        return details

    def body(self) -> dict[str, Any]:
        """What `hash` covers: every field but the hash itself and the signature over it."""
        return {"v": self.v, "seq": self.seq, "ts": self.ts, "chain": self.chain, "actor": self.actor,
                "event": self.event, "details": self.details, "prev": self.prev}

    def line(self) -> bytes:
        """The record as written: canonical JSON and a newline."""
        full: dict[str, Any] = {**self.body(), "hash": self.hash}
        if self.sig is not None:
            full["sig"] = self.sig.model_dump()
        return canonical(full) + b"\n"


def details_problem(details: object) -> str | None:
    """Why `details` is not a bounded JSON object of scalars, lists and objects; None when it is."""
    if not isinstance(details, dict):
        return "details must be an object"
    try:
        size = len(canonical(details))
    except (TypeError, ValueError) as exc:
        return f"details are not finite JSON: {exc}"
    if size > MAX_DETAILS_BYTES:
        return f"details take {size} bytes, more than {MAX_DETAILS_BYTES}"
    return _value_problem(details, 0)


def _value_problem(value: object, depth: int) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if abs(value) < 2**63 else "an integer beyond 64 bits"
    if isinstance(value, float):
        return None if math.isfinite(value) else "a non-finite number"
    if isinstance(value, str):
        return None if len(value) <= MAX_DETAIL_TEXT else f"a text longer than {MAX_DETAIL_TEXT} characters"
    if isinstance(value, (list, dict)):
        if depth >= MAX_DETAIL_DEPTH:
            return f"details nested deeper than {MAX_DETAIL_DEPTH}"
        if len(value) > MAX_DETAIL_ITEMS:
            return f"a list or object of more than {MAX_DETAIL_ITEMS} entries"
        if isinstance(value, dict):
            if any(not isinstance(k, str) or len(k) > 64 for k in value):
                return "an object key longer than 64 characters"
            items: list[object] = list(value.values())
        else:
            items = list(value)
        return next((p for p in (_value_problem(v, depth + 1) for v in items) if p), None)
    return f"a {type(value).__name__} is no JSON value"


def seal(*, seq: int, ts: str, chain: str, actor: str, event: str, details: dict[str, Any], prev: str,
         sig: Signature | None = None) -> AuditRecord:
    """A valid record with its hash computed (raises ValidationError for fields out of bounds)."""
    body = {"v": FORMAT_VERSION, "seq": seq, "ts": ts, "chain": chain, "actor": actor, "event": event,
            "details": details, "prev": prev}
    return AuditRecord.model_validate({**body, "hash": sha256_hex(canonical(body)), "sig": sig})


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def parse_line(raw: bytes) -> AuditRecord:
    """The record on one line (its newline stripped), checked against the schema and its own hash.

    Raises RecordError naming the first problem. The line must be exactly the record's canonical bytes, so a
    change anywhere in it (even a space) is caught, including changes that JSON parsing would hide (a repeated
    key, an escaped character)."""
    try:
        obj = json.loads(raw.decode("ascii"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RecordError(f"not a JSON record ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(obj, dict):
        raise RecordError("not a JSON object")
    try:
        record = AuditRecord.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "record"
        raise RecordError(f"schema: {where}: {first['msg']}") from None
    if sha256_hex(canonical(record.body())) != record.hash:
        raise RecordError("its content does not match its hash")
    if record.line() != raw + b"\n":
        raise RecordError("not in canonical form (bytes changed that JSON parsing hides)")
    return record
