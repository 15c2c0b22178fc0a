"""A hospital's privacy policy, over a real broker and real processes: the run trains with record-level DP-SGD;
hungary's budget (max_epsilon) is smaller than one round would spend, so it refuses every round before touching a
record, and the PS shows why (its log, ps/status "dropped", the round records of its report) while cleveland's
DP training goes on and its epsilon reaches ps/status."""

from __future__ import annotations

import json

import pytest

from schemas import messages as m

pytestmark = pytest.mark.e2e
pytest.importorskip("opacus")

REFUSAL = "refused by this site's privacy policy: round 1 would bring epsilon to"


def test_a_site_refuses_rounds_beyond_its_privacy_budget_and_the_ps_shows_why(cli_federation) -> None:
    # Prepare: DP-SGD for everyone; hungary allows epsilon 0.05 in all (one round here spends far more)
    # cleveland's rounds last seconds after hungary's answer, so ps/status shows hungary dropped (progress is
    # published at most once a second, and a round that closes at once would replace it)
    train = {"epochs": 150, "batch_size": 32, "lr": 0.003, "optimizer": "adam",
             "dp": {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "delta": 1e-5}}
    fed = cli_federation("dp-policy", run_id="e2e-dp-policy", rounds=2, sites=("cleveland", "hungary"), train=train,
                         round_timeout_s=600.0)  # a round that waits for its deadline fails the test
    fed.set_privacy("hungary", {"max_epsilon": 0.05, "require_record_dp": True})
    # Execute
    fed.start_watched()
    shown = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and "hungary" in msg.dropped, 120,
                             "ps/status naming hungary as dropped")
    fed.wait_ps_done(180)
    # Assert: the reason on ps/status, in the PS log and in every round's record
    assert isinstance(shown, m.DaemonStatus)
    assert "max_epsilon 0.05" in shown.dropped["hungary"]
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["sites"] for r in report["rounds"]] == [["cleveland"], ["cleveland"]]
    for r in report["rounds"]:
        assert REFUSAL.replace("round 1", f"round {r['round']}") in r["skipped"]["hungary"]
    assert "took no training step in round 1" in fed.tail("ps", 2000) and REFUSAL in fed.tail("ps", 2000)
    assert not report["traffic"].get("rejected")  # the answer was taken, not refused
    # cleveland trained under DP: its epsilon after two rounds is on the final ps/status, and its ledger kept it
    final = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and msg.state == "done", 30, "final status")
    assert isinstance(final, m.DaemonStatus) and "hungary" not in final.epsilon
    spent = final.epsilon["cleveland"]
    assert spent.epsilon > 0.05 and spent.delta == 1e-5 and spent.noise_multiplier == 1.0
    ledger = json.loads((fed.work / "state" / "cleveland" / "privacy" / "accountant.json").read_text())
    assert sum(steps for _, _, steps in ledger["history"]) == spent.steps
    assert report["privacy"]["record_level"]["cleveland"]["epsilon"] == pytest.approx(spent.epsilon)
    assert not (fed.work / "state" / "hungary" / "privacy" / "accountant.json").exists()  # nothing spent
