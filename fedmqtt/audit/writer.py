"""Append records to an audit log: under an exclusive lock, in one write with O_APPEND, then fsync.

Each tool keeps its own file (the broker tooling `<fed>/audit/broker.jsonl`, the PS `<out_dir>/audit/ps.jsonl`):
they run on different hosts as different users. Several processes of one tool may still write one file at
once (two `broker add-site`, a `broker start` logging its stop), so every append holds `flock` on the file
while it reads the last record (for `seq`, `prev` and `ts`) and writes the new ones.

A last line without its newline (power lost mid-write) is never repaired here: appending is refused, with the
fix, and `fedmqtt audit verify` reports it.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedmqtt.audit.record import (
    MAX_LINE_BYTES,
    AuditError,
    AuditRecord,
    RecordError,
    details_problem,
    genesis,
    parse_line,
    seal,
    utc_now,
)
from fedmqtt.audit.signing import Signer, signature_for


def local_actor(tool: str) -> str:
    """`tool:<effective OS user>`, reduced to the characters a record's actor allows."""
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        user = f"uid{os.geteuid()}"
    return f"{tool}:{re.sub(r'[^A-Za-z0-9._@-]', '_', user)[:64] or 'unknown'}"


class AuditLog:
    """One audit log file. `chain` ("<tool>/<id>") names a new log's genesis; an existing log keeps its own."""

    def __init__(self, path: Path, *, chain: str, actor: str, signer: Signer | None = None) -> None:
        self.path = Path(path)
        self.chain = chain
        self.actor = actor
        self.signer = signer  # hook: sign each record with the party's key (fedmqtt.audit.signing)

    def append(self, event: str, **details: Any) -> AuditRecord:
        return self.append_many([(event, details)])[-1]

    def append_many(self, entries: Sequence[tuple[str, Mapping[str, Any]]]) -> list[AuditRecord]:
        """Append one record per (event, details), all in one write; return them."""
        try:
            return self._append(entries)
        except OSError as exc:  # no space, no permission: the caller's one error type, naming the file
            raise AuditError(f"cannot write audit log {self.path}: {exc.strerror or exc}") from exc

    def _append(self, entries: Sequence[tuple[str, Mapping[str, Any]]]) -> list[AuditRecord]:
        created = self._prepare_folder()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._check_mode(os.fstat(fd).st_mode, self.path, "file")
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes
            last = self._last_record(fd)
            records = []
            for event, details in entries:
                last = self._next(last, event, dict(details))
                records.append(last)
            _write_all(fd, b"".join(r.line() for r in records))
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _fsync_dir(self.path.parent)  # the new file's name is durable too
        return records

    def _next(self, last: AuditRecord | None, event: str, details: dict[str, Any]) -> AuditRecord:
        problem = details_problem(details)
        if problem:
            raise ValueError(f"audit record {event}: {problem}")
        chain = last.chain if last else self.chain
        ts = utc_now() if last is None else max(utc_now(), last.ts)  # a clock stepped back never breaks the order
        try:
            record = seal(seq=last.seq + 1 if last else 1, ts=ts, chain=chain, actor=self.actor, event=event,
                          details=details, prev=last.hash if last else genesis(chain))
        except ValidationError as exc:
            raise ValueError(f"audit record {event}: {exc}") from None
        if self.signer is not None:
            record = record.model_copy(update={"sig": signature_for(record.hash, self.signer)})
        if len(record.line()) > MAX_LINE_BYTES:
            raise ValueError(f"audit record {event}: longer than {MAX_LINE_BYTES} bytes")
        return record

    def _last_record(self, fd: int) -> AuditRecord | None:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        tail = os.pread(fd, min(size, MAX_LINE_BYTES + 1), size - min(size, MAX_LINE_BYTES + 1))
        if not tail.endswith(b"\n"):
            raise AuditError(f"{self.path} ends in an incomplete line (a write cut short, e.g. by a power loss); "
                             f"nothing was appended. Check it with `fedmqtt audit verify {self.path}`, keep it as "
                             "evidence and move it aside: the next record then starts a new log")
        start = tail.rfind(b"\n", 0, len(tail) - 1) + 1
        if start == 0 and len(tail) == MAX_LINE_BYTES + 1:
            raise AuditError(f"{self.path}: its last line is longer than {MAX_LINE_BYTES} bytes; nothing was "
                             f"appended (see `fedmqtt audit verify {self.path}`)")
        try:
            return parse_line(tail[start:-1])
        except RecordError as exc:
            raise AuditError(f"{self.path}: its last record cannot be chained to ({exc}); nothing was appended "
                             f"(see `fedmqtt audit verify {self.path}`)") from None

    def _prepare_folder(self) -> bool:
        """Create the log's folder (0700) if needed; True when the log file does not exist yet."""
        folder = self.path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._check_mode(folder.stat().st_mode, folder, "folder")
        return not self.path.exists()

    @staticmethod
    def _check_mode(mode: int, path: Path, what: str) -> None:
        """Others who may write the log's folder or file could rewrite it unseen: refuse, with the fix."""
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            fix = "700" if what == "folder" else "600"
            raise AuditError(f"audit log {what} {path} is writable by others; run `chmod {fix} {path}`")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # one write for a regular file; a short write (disk full) is completed or raises
        view = view[os.write(fd, view):]


def _fsync_dir(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
