"""`fedmqtt audit verify` and `show` on logs written by the PS's and the broker tooling's audit code."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedmqtt.audit.verify import verify_log
from fedmqtt.cli import app
from ps_daemon.audit_trail import AUDIT_FILE, RunAudit, refusal_totals
from ps_daemon.config import DaemonConfig
from ps_daemon.state import DaemonState, RoundRecord


def _config(tmp_path: Path) -> DaemonConfig:
    return DaemonConfig.model_validate({
        "run_id": "unit-audit", "credentials": str(tmp_path / "ps.toml"), "out_dir": str(tmp_path / "ps"),
        "sites": ["a", "b", "c"], "rounds": 3, "model": {"name": "mlp", "args": {"in_features": 4}}})


def _round(n: int, sites: tuple[str, ...]) -> RoundRecord:
    return RoundRecord(round=n, sites=sites, stragglers=("c",), per_site={}, mean={}, train_loss=None, n_samples={},
                       started_at=10.0 * n, closed_at=10.0 * n + 2.5, model_hash=f"hash{n}")


@pytest.fixture
def ps_log(tmp_path: Path) -> Path:
    """A PS's log: start, two rounds with refusals, finish (what runner.py records, without a broker)."""
    config = _config(tmp_path)
    audit = RunAudit(config)
    state = DaemonState(phase="waiting_for_sites", round=1, weights={}, model_hash="h0", session="s1")
    audit.started("fresh", state)
    audit.round_closed(_round(1, ("a", "b")), refusal_totals({"malformed": 2}, [{"wrong round": 1}]))
    audit.round_closed(_round(2, ("a",)), refusal_totals({"malformed": 5}, [{"wrong round": 1}, {"duplicate": 4}]))
    audit.finished(state)
    return config.out_dir / AUDIT_FILE


def test_the_ps_records_each_rounds_refusals_since_the_last_round(ps_log: Path, tmp_path: Path) -> None:
    records = [json.loads(line) for line in ps_log.read_text().splitlines()]
    assert [r["event"] for r in records] == ["run-start", "round-close", "round-close", "run-finish"]
    assert records[0]["details"]["config_hash"] == _config(tmp_path).config_hash()
    assert records[1]["details"]["refused"] == {"malformed": 2, "wrong round": 1}
    assert records[2]["details"]["refused"] == {"malformed": 3, "duplicate": 4}  # the round's own, not the total
    assert records[2]["details"]["accepted"] == 1 and records[2]["details"]["stragglers"] == 1
    assert {r["actor"] for r in records} == {"ps"} and records[0]["chain"] == "ps/unit-audit"


def test_refusal_categories_are_bounded(tmp_path: Path) -> None:
    audit = RunAudit(_config(tmp_path))
    audit.round_closed(_round(1, ("a",)), Counter({f"reason {i}": 1 for i in range(40)}))
    refused = json.loads(audit.log.path.read_text())["details"]["refused"]
    assert len(refused) == 17 and refused["other"] == 24


def test_verify_exits_0_with_a_summary_and_1_naming_the_broken_record(ps_log: Path) -> None:
    ok = CliRunner().invoke(app, ["audit", "verify", str(ps_log)])
    assert ok.exit_code == 0, ok.output
    assert "intact: 4 record(s) of chain ps/unit-audit" in ok.output and "round-close 2" in ok.output
    head = verify_log(ps_log).head
    assert head is not None and head in ok.output

    lines = ps_log.read_bytes().splitlines(keepends=True)
    ps_log.write_bytes(lines[0] + lines[2] + lines[3])
    broken = CliRunner().invoke(app, ["audit", "verify", str(ps_log)])
    assert broken.exit_code == 1
    assert "BROKEN at line 2 (seq 3): deleted: seq 2 missing before it" in broken.output


def test_verify_expect_head_catches_records_cut_from_the_end(ps_log: Path) -> None:
    head = verify_log(ps_log).head
    assert head is not None
    ps_log.write_bytes(b"".join(ps_log.read_bytes().splitlines(keepends=True)[:-1]))
    assert CliRunner().invoke(app, ["audit", "verify", str(ps_log)]).exit_code == 0
    cut = CliRunner().invoke(app, ["audit", "verify", str(ps_log), "--expect-head", head])
    assert cut.exit_code == 1 and "truncated" in cut.output


def test_show_prints_a_table_or_json_and_the_chain_state(ps_log: Path) -> None:
    table = CliRunner().invoke(app, ["audit", "show", str(ps_log)])
    assert table.exit_code == 0, table.output
    rows = table.output.splitlines()
    assert rows[0].split() == ["SEQ", "TIME", "(UTC)", "ACTOR", "EVENT", "DETAILS"]
    assert "round-close" in rows[2] and "round=1" in rows[2] and 'refused={"malformed":2,"wrong round":1}' in rows[2]
    assert rows[-1] == "chain: intact"
    as_json = CliRunner().invoke(app, ["audit", "show", str(ps_log), "--json", "--last", "2"])
    assert [json.loads(line)["event"] for line in as_json.stdout.splitlines()] == ["round-close", "run-finish"]

    ps_log.write_bytes(ps_log.read_bytes().replace(b'"accepted":1', b'"accepted":3'))
    edited = CliRunner().invoke(app, ["audit", "show", str(ps_log)])
    assert edited.exit_code == 1
    assert "line 3: not a valid record: its content does not match its hash" in edited.output
    assert "chain: BROKEN at line 3 (seq 3): edited" in edited.output
