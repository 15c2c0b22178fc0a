"""Broker faults: Mosquitto SIGKILLed mid-run, with or without its persistence file, a site restarted meanwhile.

Before, the PS waited for ever: after reconnecting it re-published its status but not the open round's task and
model, which the broker no longer held. Now it re-publishes the open round on every reconnect, and a round that
receives nothing for `stall_s` is re-published under new message ids (a site re-sends its stored update).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from harness import FAST_TRAIN, CliFederation, mosquitto_pid

from fedmqtt.demo import DEMO_MODEL
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from schemas import messages as m

pytestmark = pytest.mark.slow
ROUNDS = 4
SITES = ("cleveland", "hungary")


@pytest.mark.parametrize("keep_db", [True, False], ids=["with-db", "db-lost"])
def test_run_survives_broker_sigkill_and_site_restart(cli_federation, tmp_path, keep_db: bool) -> None:  # noqa: ANN001
    fed: CliFederation = cli_federation("fault", run_id="e2e-broker", rounds=ROUNDS, sites=SITES,
                                        ps_extra={"quorum": len(SITES), "stall_s": 6.0})
    fed.start_broker()
    fed.start_ps()
    for site in SITES:
        fed.start_site(site)
    fed.wait_message(lambda msg: isinstance(msg, m.RoundMetrics) and msg.round == 1, 120, "round 1 closed")

    # Mid round 2: the broker dies without saving; maybe its database too; one site dies while it is down.
    conf = fed.layout.conf_path
    os.kill(mosquitto_pid(conf), signal.SIGKILL)
    fed.procs["broker"].wait(15)
    if fed.observer is not None:
        fed.observer.transport.close()
        fed.observer = None
    if not keep_db:
        for db in (fed.layout.broker_dir / "data").glob("*.db"):
            db.unlink()
    fed.kill("cleveland")
    time.sleep(2)
    fed.start_broker()
    fed.start_site("cleveland")
    fed.wait_ps_done(240)

    # The same run without faults, in one process.
    sim = SimulationConfig(run_id="e2e-broker", algorithm="fedavg", rounds=ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           model=DEMO_MODEL, train=FAST_TRAIN,
                           sites={s: d for s, d in bundled_sites().items() if s in SITES})
    run_simulation(sim, progress=False)
    from safetensors.numpy import load_file

    simulated, over_mqtt = load_file(str(tmp_path / "sim" / "final_model.safetensors")), fed.final_weights()
    assert sorted(over_mqtt) == sorted(simulated)
    for name in simulated:
        np.testing.assert_array_equal(over_mqtt[name], simulated[name], err_msg=name)
    log = (fed.logs / "ps.log").read_text(errors="replace")
    assert "re-publishing the status and the open round" in log
    assert "Traceback" not in log
