"""A site's memory of its secure aggregation rounds: the round's secrets and what it received, one file a round.

The secrets (share-encryption key, mask seed, self-mask seed: fedmqtt.secagg.site.SiteSecrets) are saved before
the advertisement that commits to them leaves, and the roster, inbox and unmasking request before the message
that answers each; so a site that restarts anywhere in the round resumes where it was (same advertisement, same
shares held, same answer) and never answers a second, different unmasking request. Files are 0600 in a 0700
folder, written atomically (fedmqtt.atomic). A file is the site's own, but it is read as carefully as anything:
size first, then msgpack, then the schema of each message (schemas.codec.decode); a damaged file is refused with
the reason, and the site then sits the round out rather than use half a record.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
from pydantic import Field, ValidationError

from fedmqtt.atomic import private_dir, write_atomic
from fedmqtt.errors import SchemaError
from schemas import secagg as wire
from schemas.base import Frozen, RoundNo, Session
from schemas.codec import decode, encode
from schemas.secagg import Attempt

MAX_RECORD_BYTES = 16 * 1024 * 1024  # a roster and an inbox of thousands of neighbours stay far below
KEEP_ROUNDS = 2  # the open round and the one before (a PS that resumed may still ask for it)
# fedmqtt.secagg.site.SECRETS_BYTES (a signing seed and two 128-bit seeds), written out: every site opens this
# store at start, and importing the protocol's site module for one number cost about 24 ms of CPU there
# (tests/unit/test_site_startup.py checks that the two agree).
SECRETS_BYTES = 64


class RoundRecord(Frozen):
    """One round as the site keeps it: the encoded messages, checked again by their schemas when read."""

    session: Session
    round: RoundNo
    attempt: Attempt = 0
    secrets: bytes = Field(min_length=SECRETS_BYTES, max_length=SECRETS_BYTES, strict=True, repr=False)
    roster: bytes | None = Field(default=None, strict=True)
    inbox: bytes | None = Field(default=None, strict=True)
    request: bytes | None = Field(default=None, strict=True)


class SecAggRecordError(SchemaError):
    """A round record that cannot be read back (damaged, or not a record)."""


class SecAggStore:
    def __init__(self, folder: Path) -> None:
        self.folder = private_dir(Path(folder))

    def path(self, session: str, round_no: int, attempt: int = 0) -> Path:
        return self.folder / f"round-{round_no:06d}-{session[:16] or 'none'}-{attempt}.msgpack"

    def save(self, record: RoundRecord) -> Path:
        path = write_atomic(self.path(record.session, record.round, record.attempt),
                            msgpack.packb(record.model_dump(), use_bin_type=True))
        for old in sorted(self.folder.glob("round-*.msgpack"))[:-KEEP_ROUNDS]:
            old.unlink(missing_ok=True)
        return path

    def load(self, session: str, round_no: int, attempt: int = 0) -> RoundRecord | None:
        """The record of that try of the round, or None if there is none; SecAggRecordError if it cannot be
        trusted."""
        path = self.path(session, round_no, attempt)
        if not path.is_file():
            return None
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise SecAggRecordError(f"{path.name}: {path.stat().st_size} bytes, more than a round record holds")
        try:
            record = RoundRecord.model_validate(msgpack.unpackb(path.read_bytes(), raw=False))
        except (ValueError, ValidationError, msgpack.UnpackException) as exc:
            raise SecAggRecordError(f"{path.name}: not a readable round record ({str(exc)[:200]})") from None
        if (record.session, record.round, record.attempt) != (session, round_no, attempt):
            raise SecAggRecordError(f"{path.name}: holds session {record.session!r} round {record.round} try "
                                    f"{record.attempt}")
        return record

    def discard_before(self, round_no: int) -> None:
        """Forget the secrets of rounds before `round_no` (the PS moved on: nobody may ask for them again)."""
        for old in self.folder.glob("round-*.msgpack"):
            if int(old.name.split("-")[1]) < round_no:
                old.unlink(missing_ok=True)


def pack_message(message: wire.SecAggRoster | wire.SecAggInbox | wire.SecAggUnmask) -> bytes:
    return encode(message, max_bytes=MAX_RECORD_BYTES)


def unpack_message(data: bytes | None, kind: type[wire.SecAggRoster] | type[wire.SecAggInbox]
                   | type[wire.SecAggUnmask]) -> object | None:
    """The stored message, validated by its schema, or None; SecAggRecordError if it is not one of `kind`."""
    if data is None:
        return None
    try:
        message = decode(data, max_bytes=MAX_RECORD_BYTES)
    except SchemaError as exc:
        raise SecAggRecordError(f"a stored {kind.__name__}: {exc}") from None
    if not isinstance(message, kind):
        raise SecAggRecordError(f"a stored {kind.__name__} is a {type(message).__name__}")
    return message
