"""Check an audit log that may have been tampered with: every record, every link, in one streaming pass.

Lines are read with a size limit before they are parsed. The first problem stops the check and is named with
its line, its record's seq and what it most likely is: edited, deleted, reordered, inserted, truncated,
malformed or a bad signature. Records cut from the end of a log leave no broken link: `expect_head` (a hash
noted earlier, e.g. from the summary of a previous check) catches that.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fedmqtt.audit.record import MAX_LINE_BYTES, AuditRecord, RecordError, genesis, parse_line
from fedmqtt.audit.signing import signature_problem


@dataclass(frozen=True)
class Break:
    """The first broken record of a log: its line, its seq where readable, and what is wrong."""

    line: int
    seq: int | None
    kind: str  # edited, deleted, reordered, inserted, truncated, malformed, bad signature
    why: str

    def __str__(self) -> str:
        seq = f" (seq {self.seq})" if self.seq is not None else ""
        return f"line {self.line}{seq}: {self.kind}: {self.why}"


@dataclass
class Verdict:
    """What a check found: the records read up to the first break (all of them when `broken` is None)."""

    path: Path
    records: int = 0
    chain: str | None = None
    first_ts: str | None = None
    last_ts: str | None = None
    head: str | None = None  # the last good record's hash: note it to catch records cut from the end later
    signed: int = 0
    events: Counter[str] = field(default_factory=Counter)
    broken: Break | None = None

    @property
    def ok(self) -> bool:
        return self.broken is None


def read_lines(fh: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes with the newline) per line, none read past MAX_LINE_BYTES + 1 bytes; a line
    without its newline is either cut short (the last line) or too long."""
    number = 0
    while raw := fh.readline(MAX_LINE_BYTES + 1):
        number += 1
        yield number, raw


def verify_log(path: Path, *, keys: dict[str, Ed25519PublicKey] | None = None,
               expect_head: str | None = None) -> Verdict:
    """Check the log at `path`; with `keys`, every record must carry a valid signature by one of them."""
    verdict = Verdict(Path(path))
    head_seen = False
    with open(path, "rb") as fh:
        last: tuple[AuditRecord, int] | None = None  # the last good record and its line
        for number, raw in read_lines(fh):
            record, broken = _check_line(number, raw, last, fh, keys)
            if broken is not None or record is None:
                verdict.broken = broken
                return verdict
            last = (record, number)
            _count(verdict, record)
            head_seen = head_seen or record.hash == expect_head
    if expect_head is not None and not head_seen:
        verdict.broken = Break((last[1] if last else 0) + 1, None, "truncated",
                               f"no record has the expected head hash {expect_head}: records were cut from the end, "
                               "or the hash belongs to another log")
    return verdict


def _check_line(number: int, raw: bytes, last: tuple[AuditRecord, int] | None, fh: BinaryIO,
                keys: dict[str, Ed25519PublicKey] | None) -> tuple[AuditRecord | None, Break | None]:
    """The record on this line, or what is wrong with it."""
    if not raw.endswith(b"\n"):
        if len(raw) > MAX_LINE_BYTES:
            return None, Break(number, None, "malformed", f"a line longer than {MAX_LINE_BYTES} bytes")
        return None, Break(number, _seq_hint(raw), "truncated",
                           "the last line is incomplete (a write cut short, or the file was cut)")
    try:
        record = parse_line(raw[:-1])
    except RecordError as exc:
        seq = _seq_hint(raw)  # a line that still reads as a numbered record was changed; anything else is junk
        return None, Break(number, seq, "edited" if seq is not None else "malformed", str(exc))
    broken = _link_problem(last, record, number, fh)
    if broken is None and keys is not None and (why := signature_problem(record, keys)):
        broken = Break(number, record.seq, "bad signature", why)
    return record, broken


def _count(verdict: Verdict, record: AuditRecord) -> None:
    verdict.records += 1
    verdict.chain = record.chain
    verdict.first_ts = verdict.first_ts or record.ts
    verdict.last_ts = record.ts
    verdict.head = record.hash
    verdict.signed += record.sig is not None
    verdict.events[record.event] += 1


def _link_problem(last: tuple[AuditRecord, int] | None, record: AuditRecord, number: int,
                  fh: BinaryIO) -> Break | None:
    """Whether `record` follows `last` (None: it is the first): seq, prev link, chain and time."""
    expected = 1 if last is None else last[0].seq + 1
    if record.seq > expected:
        if _seq_later(fh, expected):
            return Break(number, record.seq, "reordered", f"seq {record.seq} where {expected} was due; "
                         f"seq {expected} comes later in the file")
        missing = f"seq {expected}" if record.seq == expected + 1 else f"seqs {expected}-{record.seq - 1}"
        return Break(number, record.seq, "deleted", f"{missing} missing before it")
    if last is None:
        if record.prev != genesis(record.chain):
            return Break(number, record.seq, "edited", f"the first record does not link to the start of chain "
                         f"{record.chain} (rewritten, or records before it removed and renumbered)")
        return None
    previous, previous_line = last
    if record.seq == previous.seq:
        return Break(number, record.seq, "inserted", f"seq {record.seq} is also on line {previous_line}: one of "
                     "the two was inserted")
    if record.seq < previous.seq:
        return Break(number, record.seq, "inserted", f"seq {record.seq} after seq {previous.seq}: a copy of an "
                     "earlier record")
    if record.chain != previous.chain:
        return Break(number, record.seq, "inserted", f"a record of chain {record.chain} in chain {previous.chain}")
    if record.prev != previous.hash:
        return Break(number, record.seq, "edited", f"it does not link to seq {previous.seq} on line "
                     f"{previous_line}: one of the two was replaced by a record with a recomputed hash")
    if record.ts < previous.ts:
        return Break(number, record.seq, "edited", f"its time {record.ts} is before the previous record's "
                     f"{previous.ts}")
    return None


def _seq_later(fh: BinaryIO, seq: int) -> bool:
    """Whether a later line (best effort: anything that parses as JSON with that seq) holds `seq`."""
    for _, raw in read_lines(fh):
        if _seq_hint(raw) == seq:
            return True
    return False


def _seq_hint(raw: bytes) -> int | None:
    """The seq a damaged line claims, when it still parses that far (for the message only)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    seq = obj.get("seq") if isinstance(obj, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None
