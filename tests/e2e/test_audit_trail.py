"""The audit trail written by real processes: the broker CLI's party changes and broker runs, and a PS run with
a kill, `--resume` and `--force`; `fedmqtt audit verify` passes on both logs and fails after a one-byte edit."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import CliFederation, cli, stop_processes, wait_until

from broker.acl import login_names
from broker.certs import fingerprint_sha256
from broker.config import free_port
from broker.federation import load_federation
from fedmqtt.audit.writer import local_actor
from fedmqtt.transport import topics
from ps_daemon.config import load_daemon_config
from tests.integration.test_security import publish

pytestmark = pytest.mark.e2e
SITES = ("cleveland", "hungary")


def fedmqtt(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedmqtt", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def events(path: Path) -> list[str]:
    return [r["event"] for r in records(path)]


def edit_one_byte(path: Path, line: int, old: bytes, new: bytes) -> None:
    """Replace `old` with `new` on `line` (1-based): the same length, one byte apart, as a hand edit would."""
    assert sum(a != b for a, b in zip(old, new, strict=True)) == 1
    lines = path.read_bytes().splitlines(keepends=True)
    assert lines[line - 1].count(old) == 1
    lines[line - 1] = lines[line - 1].replace(old, new)
    path.write_bytes(b"".join(lines))


def test_broker_cli_records_who_changed_which_party(mosquitto_bin: str, tmp_path: Path) -> None:
    # Prepare: a federation under mutual TLS (each party also has a client certificate), its broker running.
    fed = tmp_path / "fed"
    log = fed / "audit" / "broker.jsonl"
    init = fedmqtt("broker", "init", "--dir", fed, "--run-id", "e2e-audit", "--site", "alpha", "--site", "beta",
                   "--port", free_port(), "--tls", "--mtls")
    assert init.returncode == 0, init.stderr
    broker = cli("broker", "start", "--dir", str(fed), log=tmp_path / "broker.log")
    try:
        wait_until(lambda: "broker-start" in events(log), 30, "the broker-start record")
        # Execute: one change of each kind while the broker runs, then stop it.
        for args in (("add-site", "--site", "gamma"), ("rotate", "--party", "beta"),
                     ("remove-site", "--site", "alpha")):
            done = fedmqtt("broker", *args, "--dir", fed)
            assert done.returncode == 0, done.stderr
            assert "reloads" in done.stdout  # the running broker was told
    finally:
        broker.send_signal(signal.SIGINT)
        broker.wait(30)

    # Assert: the records, in order, by this OS user, naming each party and its new credential.
    got = records(log)
    assert [(r["event"], r["details"].get("party")) for r in got] == [
        ("broker-init", None), ("party-add", "alpha"), ("party-add", "beta"), ("party-add", "observer"),
        ("party-add", "ps"), ("broker-start", None), ("party-add", "gamma"), ("party-rotate", "beta"),
        ("party-remove", "alpha"), ("broker-stop", None)]
    assert {r["actor"] for r in got} == {local_actor("broker-cli")}
    assert got[0]["details"]["mtls"] is True and got[0]["details"]["ca_sha256"]
    assert got[-1]["details"]["cause"] == "signal" and got[-1]["details"]["pid"] == got[5]["details"]["pid"]
    layout = load_federation(fed)
    beta = layout.settings("beta")
    passwd = (fed / "broker" / "passwd").read_text().splitlines()
    live = sorted(line for line in passwd if line.split(":", 1)[0] in set(login_names("beta")))
    rotated = got[7]["details"]
    assert rotated["password_entry_sha256"] == hashlib.sha256("\n".join(live).encode()).hexdigest()
    assert rotated["password_entry_sha256"] != got[2]["details"]["password_entry_sha256"]
    assert beta.tls_cert_pem is not None
    assert rotated["client_cert_sha256"] == fingerprint_sha256(beta.tls_cert_pem.encode())
    # Never a secret: no password and no private key of any party is in the log.
    text = log.read_text()
    for user in layout.credentials:
        settings = layout.settings(user)
        assert settings.password not in text
        assert settings.tls_key_pem is not None and settings.tls_key_pem.splitlines()[1] not in text

    ok = fedmqtt("audit", "verify", log)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "intact: 10 record(s) of chain broker/e2e-audit" in ok.stdout
    edit_one_byte(log, 9, b'"party":"alpha"', b'"party":"alphe"')  # who was removed
    broken = fedmqtt("audit", "verify", log)
    assert broken.returncode == 1
    assert "BROKEN at line 9 (seq 9): edited" in broken.stdout


def test_ps_records_start_rounds_resume_force_and_finish(cli_federation, paho_client) -> None:  # noqa: ANN001
    # Prepare: one small run, two sites, two rounds; an unsigned report left retained with cleveland's password,
    # which each PS process refuses once.
    fed: CliFederation = cli_federation("audit", run_id="e2e-audit-ps", rounds=2, sites=SITES,
                                        ps_extra={"quorum": len(SITES)})
    log = fed.work / "ps" / "audit" / "ps.jsonl"
    fed.start_broker()
    publish(paho_client(fed.layout.settings("cleveland")), topics.site_report_topic(fed.layout.run_id, "cleveland"),
            b"unsigned junk")
    for site in SITES:
        fed.start_site(site)

    # Execute: the PS is killed right after round 1's checkpoint, resumed to the end, then started over with
    # --force and stopped by SIGTERM while it waits.
    fed.start_ps(fault="after_checkpoint:1")
    assert fed.procs["ps"].wait(180) == -signal.SIGKILL, fed.tail("ps")
    fed.start_ps(resume=True)
    fed.wait_ps_done(180)
    # The sites stop first, so the forced run waits for them (with them it may close rounds before the SIGTERM).
    stop_processes([(fed.procs[site], signal.SIGTERM) for site in SITES])
    fed.start_ps(extra=("--force",))
    wait_until(lambda: "run-force-restart" in events(log), 60, "the run-force-restart record")
    fed.procs["ps"].send_signal(signal.SIGTERM)
    fed.procs["ps"].wait(30)

    # Assert
    got = records(log)
    assert [r["event"] for r in got] == ["run-start", "round-close", "run-resume", "round-close", "run-finish",
                                         "run-force-restart", "run-stop"], got
    config_hash = load_daemon_config(fed.ps_config).config_hash()
    starts = [got[0], got[2], got[5]]
    assert {r["details"]["config_hash"] for r in starts} == {config_hash}
    assert got[0]["details"]["session"] == got[2]["details"]["session"] != got[5]["details"]["session"]
    assert got[2]["details"]["round"] == 2  # resumed at round 2: round 1's checkpoint
    assert [(r["details"]["round"], r["details"]["accepted"]) for r in (got[1], got[3])] == [(1, 2), (2, 2)]
    # each process's first round counts the refusal of the retained junk; the refusals are the round's own
    assert [r["details"]["refused"].get("unsigned") for r in (got[1], got[3])] == [1, 1], got
    assert got[4]["details"]["rounds"] == 2
    assert got[5]["details"]["removed_checkpoints"] >= 1
    assert got[6]["details"]["cause"] == "signal"
    assert {r["actor"] for r in got} == {"ps"} and {r["chain"] for r in got} == {"ps/e2e-audit-ps"}

    ok = fedmqtt("audit", "verify", log)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "intact: 7 record(s)" in ok.stdout
    edit_one_byte(log, 2, b'"accepted":2', b'"accepted":3')  # round 1's accepted updates
    broken = fedmqtt("audit", "verify", log)
    assert broken.returncode == 1
    assert "BROKEN at line 2 (seq 2): edited" in broken.stdout
