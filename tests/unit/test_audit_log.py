"""The audit log: a valid log of any length verifies; any single edit, deletion, swap or insertion is caught and
named; the file is hostile input (size limit before parsing); appends are atomic, locked, private and never
repair a torn line."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmqtt.audit import record as audit_record
from fedmqtt.audit.record import MAX_LINE_BYTES, AuditError, canonical, genesis, parse_line, seal
from fedmqtt.audit.signing import Ed25519Signer, load_public_keys
from fedmqtt.audit.verify import read_lines, verify_log
from fedmqtt.audit.writer import AuditLog

CHAIN = "ps/unit-run"
REPO = Path(__file__).resolve().parents[2]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**62), 2**62),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
detail_values = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=8), scalars,
                                                                                   max_size=4))
details = st.dictionaries(st.from_regex(r"[a-z_]{1,10}", fullmatch=True), detail_values, max_size=4)
events = st.sampled_from(sorted(audit_record.EVENTS))
entries = st.lists(st.tuples(events, details), min_size=1, max_size=12)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _write_log(folder: Path, batch: list[tuple[str, dict[str, Any]]], **kw: Any) -> Path:
    path = folder / "audit" / "ps.jsonl"
    AuditLog(path, chain=CHAIN, actor="ps", **kw).append_many(batch)
    return path


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


@PROPERTY
@given(batch=entries)
def test_a_valid_log_of_any_length_verifies(batch: list[tuple[str, dict[str, Any]]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_log(Path(tmp), batch)
        verdict = verify_log(path)
        assert verdict.ok, verdict.broken
        assert verdict.records == len(batch)
        first = json.loads(_lines(path)[0])
        assert first["seq"] == 1 and first["prev"] == genesis(CHAIN)
        assert verify_log(path, expect_head=verdict.head).ok


@PROPERTY
@given(batch=entries, data=st.data())
def test_any_single_byte_edit_is_caught(batch: list[tuple[str, dict[str, Any]]], data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_log(Path(tmp), batch)
        raw = bytearray(path.read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1), label="offset")
        raw[at] = data.draw(st.integers(0, 255).filter(lambda b: b != raw[at]), label="new byte")
        path.write_bytes(bytes(raw))
        verdict = verify_log(path)
        assert not verdict.ok
        assert verdict.broken is not None and verdict.broken.kind in ("edited", "malformed", "truncated")


@PROPERTY
@given(batch=entries, data=st.data())
def test_any_edited_field_is_named_as_edited(batch: list[tuple[str, dict[str, Any]]], data: st.DataObject) -> None:
    """A record re-written in canonical form with one field changed (the hash left as it was)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_log(Path(tmp), batch)
        lines = _lines(path)
        i = data.draw(st.integers(0, len(lines) - 1), label="record")
        obj = json.loads(lines[i])
        key = data.draw(st.sampled_from(["details", "event", "actor", "ts", "prev"]), label="field")
        forged = {"details": [{"forged": True}], "event": ["party-remove", "party-add"],
                  "actor": ["broker-cli:mallory"], "ts": ["2000-01-01T00:00:00.000000Z"], "prev": ["0" * 64]}[key]
        obj[key] = next(v for v in forged if v != obj[key])  # a real change (the drawn record may hold the first)
        lines[i] = canonical(obj) + b"\n"
        path.write_bytes(b"".join(lines))
        verdict = verify_log(path)
        assert verdict.broken is not None
        assert (verdict.broken.line, verdict.broken.kind) == (i + 1, "edited"), verdict.broken


@PROPERTY
@given(batch=entries, data=st.data())
def test_any_deleted_record_is_caught(batch: list[tuple[str, dict[str, Any]]], data: st.DataObject) -> None:
    """Inside the log by the broken link; at its end (no link follows) by the head noted earlier."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_log(Path(tmp), batch)
        head = verify_log(path).head
        lines = _lines(path)
        i = data.draw(st.integers(0, len(lines) - 1), label="deleted")
        path.write_bytes(b"".join(lines[:i] + lines[i + 1:]))
        verdict = verify_log(path, expect_head=head)
        assert verdict.broken is not None
        if i < len(lines) - 1:
            assert (verdict.broken.line, verdict.broken.kind) == (i + 1, "deleted"), verdict.broken
            assert not verify_log(path).ok  # the link alone shows it
        else:
            assert verdict.broken.kind == "truncated"


@PROPERTY
@given(batch=entries.filter(lambda b: len(b) >= 2), data=st.data())
def test_any_swap_of_two_records_is_caught(batch: list[tuple[str, dict[str, Any]]], data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_log(Path(tmp), batch)
        lines = _lines(path)
        i = data.draw(st.integers(0, len(lines) - 2), label="first")
        j = data.draw(st.integers(i + 1, len(lines) - 1), label="second")
        lines[i], lines[j] = lines[j], lines[i]
        path.write_bytes(b"".join(lines))
        verdict = verify_log(path)
        assert verdict.broken is not None
        assert (verdict.broken.line, verdict.broken.kind) == (i + 1, "reordered"), verdict.broken


@PROPERTY
@given(batch=entries, data=st.data())
def test_any_inserted_record_is_caught(batch: list[tuple[str, dict[str, Any]]], data: st.DataObject) -> None:
    """A copy of a record anywhere, or a forged record with a valid hash of its own anywhere but after the last
    (a valid continuation at the end is what only a signature can tell from the writer's: see below)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_log(Path(tmp), batch)
        lines = _lines(path)
        records = [json.loads(line) for line in lines]
        if data.draw(st.booleans(), label="copy"):
            extra = lines[data.draw(st.integers(0, len(lines) - 1), label="copied")]
            at = data.draw(st.integers(0, len(lines)), label="at")
        else:
            prev = data.draw(st.sampled_from([genesis(CHAIN), *(r["hash"] for r in records)]), label="prev")
            forged = seal(seq=data.draw(st.integers(1, len(lines) + 1), label="seq"), ts=records[-1]["ts"],
                          chain=CHAIN, actor="ps", event="round-close", details={"accepted": 99}, prev=prev)
            extra = forged.line()
            at = data.draw(st.integers(0, len(lines) - 1), label="at")
        lines.insert(at, extra)
        path.write_bytes(b"".join(lines))
        verdict = verify_log(path)
        assert verdict.broken is not None
        assert verdict.broken.kind in ("inserted", "edited", "deleted", "reordered"), verdict.broken
        assert verdict.broken.line <= at + 2  # named at the insertion (or the record whose link it breaks)


def test_a_torn_last_line_is_reported_and_never_appended_to(tmp_path: Path) -> None:
    path = _write_log(tmp_path, [("run-start", {"a": 1}), ("round-close", {"round": 1})])
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # power lost mid-write
    verdict = verify_log(path)
    assert verdict.broken is not None and (verdict.broken.line, verdict.broken.kind) == (2, "truncated")
    with pytest.raises(AuditError, match="incomplete line"):
        AuditLog(path, chain=CHAIN, actor="ps").append("run-stop")
    assert path.read_bytes() == whole[:-7]  # left as evidence, not "fixed"


@pytest.mark.parametrize(("line", "why"), [
    (b"[" * 5000 + b"]" * 5000, "not a JSON object|not a JSON record"),  # deep nesting: no crash
    (b'{"seq": NaN}', "not a JSON record"),
    (b'{"seq": 1e999}', "schema"),
    (b"\xff\xfe{}", "not a JSON record"),
    (b'{"seq":' + b"9" * 5000 + b"}", "not a JSON record"),
])
def test_hostile_lines_are_refused_with_a_reason(line: bytes, why: str) -> None:
    with pytest.raises(audit_record.RecordError, match=why):
        parse_line(line)


def test_a_line_is_read_with_a_limit_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    path.write_bytes(b'{"seq":1,"x":"' + b"a" * (4 * MAX_LINE_BYTES) + b'"}\n')
    with open(path, "rb") as fh:
        first = next(read_lines(fh))
    assert len(first[1]) == MAX_LINE_BYTES + 1
    verdict = verify_log(path)
    assert verdict.broken is not None and verdict.broken.kind == "malformed" and "longer than" in verdict.broken.why


def test_a_repeated_key_or_a_space_is_an_edit_although_json_hides_it(tmp_path: Path) -> None:
    path = _write_log(tmp_path, [("run-start", {"a": 1})])
    line = _lines(path)[0]
    for edited in (line.replace(b'"v":1', b'"v":1,"v":1'), line.replace(b'"seq":1', b'"seq": 1')):
        path.write_bytes(edited)
        verdict = verify_log(path)
        assert verdict.broken is not None and verdict.broken.kind == "edited", verdict.broken
        assert "canonical" in verdict.broken.why


def test_details_out_of_bounds_are_never_written(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit" / "ps.jsonl", chain=CHAIN, actor="ps")
    for bad in ({"x": "a" * (audit_record.MAX_DETAILS_BYTES + 1)}, {"x": float("nan")}, {"x": [[[["deep"]]]]},
                {"x": list(range(audit_record.MAX_DETAIL_ITEMS + 1))}, {"x": object()}):
        with pytest.raises(ValueError, match="audit record"):
            log.append("run-start", **bad)
    assert not log.path.exists() or log.path.read_bytes() == b""


def test_files_are_private_and_a_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    path = _write_log(tmp_path, [("run-start", {})])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.parent.chmod(0o777)
    with pytest.raises(AuditError, match="chmod 700"):
        AuditLog(path, chain=CHAIN, actor="ps").append("run-stop")


def test_a_clock_stepped_back_never_breaks_the_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = AuditLog(tmp_path / "audit" / "ps.jsonl", chain=CHAIN, actor="ps")
    log.append("run-start")
    monkeypatch.setattr("fedmqtt.audit.writer.utc_now", lambda: "2001-01-01T00:00:00.000000Z")
    second = log.append("round-close", round=1)
    assert second.ts > "2001-01-01T00:00:00.000000Z"
    assert verify_log(log.path).ok


def test_an_existing_log_keeps_its_chain(tmp_path: Path) -> None:
    path = _write_log(tmp_path, [("broker-init", {"run_id": "first"})])
    AuditLog(path, chain="broker/second", actor="broker-cli:x").append("broker-init", run_id="second")
    verdict = verify_log(path)
    assert verdict.ok and verdict.chain == CHAIN and verdict.records == 2


def test_concurrent_writers_never_interleave_or_fork_the_chain(tmp_path: Path) -> None:
    """Separate processes appending to one log at once (two `broker add-site`): flock keeps seq and links whole."""
    path = tmp_path / "audit" / "broker.jsonl"
    script = ("import sys; from pathlib import Path; from fedmqtt.audit.writer import AuditLog\n"
              "log = AuditLog(Path(sys.argv[1]), chain='broker/race', actor='broker-cli:w' + sys.argv[2])\n"
              "for i in range(40): log.append('party-rotate', party='s' + sys.argv[2], i=i)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(n)], env=env) for n in range(3)]
    assert [p.wait(60) for p in procs] == [0, 0, 0]
    verdict = verify_log(path)
    assert verdict.ok, verdict.broken
    assert verdict.records == 120


def _key_pem(key: Ed25519PrivateKey, folder: Path, name: str) -> Path:
    path = folder / f"{name}.pem"
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def test_signed_records_verify_and_a_forged_continuation_does_not(tmp_path: Path) -> None:
    """The hook for party keys: each record signed; with the public key given, an appended record that is a
    valid continuation of the chain but not signed by it is caught, and so is a stripped signature."""
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    keys = load_public_keys([_key_pem(key, tmp_path, "ps")])
    path = _write_log(tmp_path, [("run-start", {}), ("round-close", {"round": 1})], signer=Ed25519Signer(key))
    assert verify_log(path, keys=keys).ok
    assert verify_log(path).signed == 2

    whole = path.read_bytes()
    AuditLog(path, chain=CHAIN, actor="ps", signer=Ed25519Signer(other)).append("run-finish")
    verdict = verify_log(path, keys=keys)
    assert verdict.broken is not None and (verdict.broken.line, verdict.broken.kind) == (3, "bad signature")
    assert verify_log(path).ok  # without keys, a valid continuation is all a chain can check

    first, second = whole.splitlines(keepends=True)
    stripped = json.loads(second)
    del stripped["sig"]
    path.write_bytes(first + canonical(stripped) + b"\n")
    verdict = verify_log(path, keys=keys)
    assert verdict.broken is not None and "not signed" in verdict.broken.why
