"""The PS reads every site's privacy policy before round 1, over a real broker and real processes: with quorum 2
and cleveland's policy requiring record-level DP, a run without DP cannot start; the PS waits and says, in
ps/status and its log, which site refuses and under which rule. Once cleveland restarts with a policy the run
meets, round 1 starts and the run finishes with both sites."""

from __future__ import annotations

import json

import pytest

from schemas import messages as m

pytestmark = pytest.mark.e2e


def test_the_ps_waits_while_no_quorum_accepts_its_run_and_names_the_refusing_site(cli_federation) -> None:
    # Prepare: no DP in the run; cleveland demands it
    fed = cli_federation("policy-quorum", run_id="e2e-policy-quorum", rounds=1, sites=("cleveland", "hungary"),
                         ps_extra={"quorum": 2})
    fed.set_privacy("cleveland", {"require_record_dp": True})
    fed.start_watched()
    # Execute + assert: the PS waits, naming cleveland and its rule
    waiting = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and "Refusing:" in msg.detail, 60,
                               "ps/status naming the refusing site")
    assert isinstance(waiting, m.DaemonStatus) and waiting.state == "waiting_for_sites" and waiting.round == 0
    assert "fewer than quorum 2" in waiting.detail
    assert "cleveland (require_record_dp: the run has no record-level DP" in waiting.detail
    assert "hungary (" not in waiting.detail
    assert "cleveland (require_record_dp" in fed.tail("ps", 200)
    # cleveland's hospital relaxes its policy and restarts: the run now starts and finishes with both sites
    fed.kill("cleveland")
    fed.set_privacy("cleveland", {"max_rounds": 5, "models": ["mlp"]})
    fed.start_site("cleveland")
    fed.wait_ps_done(120)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["sites"] for r in report["rounds"]] == [["cleveland", "hungary"]]
    assert not report["rounds"][0].get("skipped")
