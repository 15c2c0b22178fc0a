"""A site does not take the PS's participant-level noise on trust, over a real broker and real processes: the PS
runs DP-FedAvg with noise multiplier 0.3; hungary's policy demands at least 1.0 and a run epsilon of at most 50 by
its own accountant. Before round 1 the PS names hungary as a site that will refuse (quorum 1: cleveland accepts, so
the run starts); hungary then refuses every round before touching a record, and the PS shows why in its log,
ps/status ("dropped") and the round records of its report, while cleveland's rounds go on."""

from __future__ import annotations

import json

import pytest

from schemas import messages as m

pytestmark = pytest.mark.e2e
pytest.importorskip("opacus")

REFUSAL = ("refused by this site's privacy policy: participant-level noise multiplier 0.3 is below this site's "
           "min_participant_noise_multiplier 1")


def test_a_site_refuses_a_run_with_less_participant_noise_than_its_policy_allows(cli_federation) -> None:
    # Prepare: DP-FedAvg with too little noise for hungary's policy
    # cleveland's rounds last seconds after hungary's answer, so ps/status shows hungary dropped (progress is
    # published at most once a second, and a round that closes at once would replace it)
    hyper = {"clip_norm": 1.0, "noise_multiplier": 0.3}
    train = {"epochs": 150, "batch_size": 32, "lr": 0.003, "optimizer": "adam"}
    fed = cli_federation("participant-noise", run_id="e2e-participant-noise", rounds=2,
                         sites=("cleveland", "hungary"), algorithm="dp-fedavg", hyper=hyper, train=train,
                         ps_extra={"quorum": 1}, round_timeout_s=600.0)  # a round that waits for its deadline fails
    fed.set_privacy("hungary", {"min_participant_noise_multiplier": 1.0, "max_participant_epsilon": 50.0})
    # Execute
    fed.start_watched()
    shown = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and "hungary" in msg.dropped, 120,
                             "ps/status naming hungary as dropped")
    fed.wait_ps_done(180)
    # Assert: named before round 1, refused in every round, with the reason on ps/status, the log and the report
    ps_log = fed.tail("ps", 2000)
    assert ("starting although the privacy policies of some sites refuse this run (they will answer without "
            "updates): hungary (min_participant_noise_multiplier 1: the run's noise multiplier is 0.3)") in ps_log
    assert isinstance(shown, m.DaemonStatus) and REFUSAL in shown.dropped["hungary"]
    assert REFUSAL in ps_log
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["sites"] for r in report["rounds"]] == [["cleveland"], ["cleveland"]]
    for r in report["rounds"]:
        assert REFUSAL in r["skipped"]["hungary"]
        assert r["server"]["epsilon"] > 0  # cleveland's rounds were released under the PS's (weak) noise
    assert REFUSAL in fed.tail("hungary", 2000)
