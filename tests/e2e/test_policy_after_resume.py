"""A site's privacy policy holds after the PS is SIGKILLed and resumed from its checkpoint, over a real broker and real
processes. The PS keeps no copy of the policies in its checkpoint: it reads them only before round 1, as a forecast,
and each site judges every task by its own policy, whichever PS process sends the task."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e
ROUNDS = 3
REFUSAL = "refused by this site's privacy policy: algorithm 'fedavg' is not one this site accepts (fedprox)"


def test_a_resumed_ps_cannot_get_round_updates_a_sites_policy_refuses(cli_federation) -> None:
    # Prepare: hungary accepts only FedProx; the run is FedAvg with quorum 1 (cleveland carries it)
    fed = cli_federation("policy-resume", run_id="e2e-policy-resume", rounds=ROUNDS, sites=("cleveland", "hungary"))
    fed.set_privacy("hungary", {"algorithms": ["fedprox"]})
    fed.start_broker()
    # Execute: killed after round 1's checkpoint, resumed from it
    fed.start_killed_and_resumed()
    fed.wait_ps_done(240)
    # Assert: the rounds of the resumed PS got no update from hungary, which said why each time
    assert "resuming from checkpoint of round 1" in fed.tail("ps", 400)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["sites"] for r in report["rounds"]] == [["cleveland"]] * ROUNDS
    for r in report["rounds"]:
        assert REFUSAL in r["skipped"]["hungary"], r["skipped"]
    assert fed.tail("hungary", 2000).count(REFUSAL) >= ROUNDS
