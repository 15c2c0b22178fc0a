"""`fedmqtt audit ...`: check an audit log's hash chain, and print its records."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from fedmqtt.audit.record import AuditRecord
    from fedmqtt.audit.verify import Verdict

app = typer.Typer(help="Check and read audit logs: the hash-chained records of party changes and runs.",
                  no_args_is_help=True)
DETAILS_SHOWN = 110  # characters of a record's details in the table (--json prints them whole)
HASH = re.compile(r"[0-9a-f]{64}|([0-9A-F]{2}:){31}[0-9A-F]{2}")  # SHA-256: hex, or as openssl prints it
FIRST = ("party", "role", "round", "run_id")  # details shown first in the table (who or what a record is about)


@app.command("verify")
def verify(
    paths: list[Path] = typer.Argument(..., help="Audit logs: a federation's audit/broker.jsonl, a PS's "
                                       "audit/ps.jsonl in its out_dir."),
    public_keys: list[Path] = typer.Option(
        [], "--public-key", help="An Ed25519 public key (PEM); repeat for more. Every record must then carry a "
        "valid signature by one of them."),
    expect_head: str | None = typer.Option(
        None, "--expect-head", help="A head hash an earlier check printed: the log must still hold that record "
        "(records cut from the end leave no broken link otherwise). One log only."),
) -> None:
    """Check each log: every line is a record of the schema (read with a size limit first), in canonical form,
    matching its own hash; seq counts up from 1; each record links to the one before (the first to its chain's
    start); times never go back.

    Exits 0 with a summary per log when all are intact; otherwise 1, naming each log's first broken record and
    what most likely happened to it (edited, deleted, reordered, inserted, truncated, malformed).
    """
    from fedmqtt.audit.signing import load_public_keys
    from fedmqtt.audit.verify import verify_log

    if expect_head is not None and len(paths) != 1:
        raise typer.BadParameter("--expect-head checks one log: give one path")
    try:
        keys = load_public_keys(public_keys) if public_keys else None
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"--public-key: {exc}") from None
    failed = 0
    for path in paths:
        try:
            verdict = verify_log(path, keys=keys, expect_head=expect_head)
        except OSError as exc:
            typer.echo(f"{path}: cannot read: {exc.strerror or exc}", err=True)
            failed += 1
            continue
        typer.echo(_summary(verdict, signatures_checked=keys is not None))
        failed += not verdict.ok
    if failed:
        raise typer.Exit(code=1)


def _summary(v: Verdict, *, signatures_checked: bool) -> str:
    if v.broken is not None:
        good = f"{v.records} good record(s) before it" if v.records else "no good record before it"
        return f"{v.path}: BROKEN at {v.broken} ({good})"
    if not v.records:
        return f"{v.path}: intact but empty (no records)"
    events = ", ".join(f"{name} {n}" for name, n in sorted(v.events.items()))
    signed = ("every record signed by a given key" if signatures_checked
              else f"{v.signed} signed, signatures not checked (give --public-key)" if v.signed else "unsigned")
    return (f"{v.path}: intact: {v.records} record(s) of chain {v.chain}, {v.first_ts} to {v.last_ts}; "
            f"{signed}\n  events: {events}\n  head: {v.head}")


@app.command("show")
def show(
    path: Path = typer.Argument(..., help="An audit log (.jsonl)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON record per line, as stored, instead of a table."),
    last: int | None = typer.Option(None, "--last", min=1, help="Only the last N records."),
) -> None:
    """Print a log's records as a table (seq, time, actor, event, details), then whether its chain is intact.

    Exits 1 when the chain is broken (the records are printed all the same: unreadable lines as such).
    """
    from fedmqtt.audit.verify import verify_log

    rows = _rows(path)
    if not as_json:
        typer.echo(f"{'SEQ':>5}  {'TIME (UTC)':<19}  {'ACTOR':<24} {'EVENT':<18} DETAILS")
    for row in rows[-last:] if last else rows:
        if isinstance(row, str):
            typer.echo(row, err=as_json)
        elif as_json:
            typer.echo(row.line().decode("ascii"), nl=False)
        else:
            typer.echo(_table_row(row))
    verdict = verify_log(path)
    typer.echo(f"chain: {'intact' if verdict.ok else f'BROKEN at {verdict.broken}'}", err=as_json)
    if not verdict.ok:
        raise typer.Exit(code=1)


def _rows(path: Path) -> list[AuditRecord | str]:
    """Each line's record, or a note for a line that is none (read with the same size limit as verify)."""
    from fedmqtt.audit.record import RecordError, parse_line
    from fedmqtt.audit.verify import read_lines

    rows: list[AuditRecord | str] = []
    try:
        with open(path, "rb") as fh:
            for number, raw in read_lines(fh):
                try:
                    if not raw.endswith(b"\n"):
                        raise RecordError("incomplete or over-long line")
                    rows.append(parse_line(raw[:-1]))
                except RecordError as exc:
                    rows.append(f"line {number}: not a valid record: {exc}")
    except OSError as exc:
        raise typer.BadParameter(f"{path}: {exc.strerror or exc}") from None
    return rows


def _table_row(r: AuditRecord) -> str:
    when = r.ts.replace("T", " ")[:19]
    keys = sorted(r.details, key=lambda k: (FIRST.index(k) if k in FIRST else len(FIRST), k))
    details = " ".join(f"{k}={_compact(r.details[k])}" for k in keys)
    if len(details) > DETAILS_SHOWN:
        details = details[:DETAILS_SHOWN - 3] + "..."
    return f"{r.seq:>5}  {when}  {r.actor:<24} {r.event:<18} {details}"


def _compact(value: Any) -> str:
    if isinstance(value, str):
        return value[:12] + "..." if HASH.fullmatch(value) else value  # a hash or fingerprint: its start will do
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
