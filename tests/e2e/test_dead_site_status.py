"""What ps/status says after a site dies: the rounds go on without it, and so does the status. Read with a real
MQTT client (the observer's login), as a dashboard or `mosquitto_sub` would.

Before: the PS closed rounds without the dead site, but ps/status still listed it among the sites the round
waited for and said "training on 3 sites"."""

from __future__ import annotations

import pytest
from harness import CliFederation

from schemas import messages as m

pytestmark = [pytest.mark.e2e]
SITES = ("cleveland", "hungary", "switzerland")
DEAD = "switzerland"


def test_a_dead_site_is_not_waited_for_and_ps_status_says_why(cli_federation) -> None:  # noqa: ANN001
    # Prepare: three sites; one SIGKILLs itself in round 2 before its update goes out (its Will: offline)
    fed: CliFederation = cli_federation("dead", run_id="e2e-dead", rounds=3, sites=SITES)
    fed.start_broker()
    fed.start_ps()
    for site in SITES:
        fed.start_site(site, fault="site_before_publish:2" if site == DEAD else None)

    # Execute: read every ps/status of the run
    seen: list[m.DaemonStatus] = []

    def record(msg: object) -> bool:
        if isinstance(msg, m.DaemonStatus):
            seen.append(msg)
        return isinstance(msg, m.DaemonStatus) and msg.state == "done"

    fed.wait_message(record, 240, "the run to finish")
    fed.wait_ps_done(60)
    final = fed.retained_ps_status()
    assert isinstance(final, m.DaemonStatus)

    # Assert: once dropped, never waited for, with why; "training on" counts the sites that can answer
    assert fed.procs[DEAD].returncode == -9
    dropped = [msg for msg in seen if DEAD in msg.dropped]
    assert dropped, [(msg.round, msg.detail) for msg in seen]
    for msg in seen[seen.index(dropped[0]):]:
        assert DEAD not in msg.waiting_for and msg.dropped[DEAD].startswith("offline since 20"), msg
    round_3 = [msg.detail for msg in seen if msg.round == 3 and msg.state == "training"]
    assert "round 3: training on 2 sites (1 offline, not waited for)" in round_3, round_3
    assert final.state == "done" and final.waiting_for == ()
    assert list(final.dropped) == [DEAD] and final.dropped[DEAD].startswith("offline since 20")
    assert final.detail == f"done; no final report from {DEAD}"
