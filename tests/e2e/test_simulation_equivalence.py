"""One code path: `fedmqtt simulate` and a real MQTT federation end with bit-identical weights."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedmqtt.demo import DEMO_MODEL
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from harness import FAST_TRAIN

pytestmark = pytest.mark.e2e
ROUNDS = 2
# Algorithms whose whole client and server rule run in both runners; each gets one tiny federation.
ALGORITHMS = [("fedavg", {})]


@pytest.mark.parametrize(("algorithm", "hyper"), ALGORITHMS, ids=[a for a, _ in ALGORITHMS])
def test_simulation_matches_mqtt_bit_for_bit(cli_federation, tmp_path, algorithm, hyper) -> None:
    """The same config and seed give identical final weights in simulation and over Mosquitto."""
    # Prepare
    sites = ("cleveland", "switzerland")
    run_id = f"eq-{algorithm}"
    fed = cli_federation(algorithm, run_id=run_id, rounds=ROUNDS, sites=sites, algorithm=algorithm, hyper=hyper)
    sim = SimulationConfig(run_id=run_id, algorithm=algorithm, hyper=hyper, rounds=ROUNDS, seed=0,
                           out_dir=tmp_path / "sim", model=DEMO_MODEL, train=FAST_TRAIN,
                           sites={s: d for s, d in bundled_sites().items() if s in sites})
    # Execute
    fed.start_broker()
    fed.start_ps()
    for site in sites:
        fed.start_site(site)
    fed.wait_ps_done(240)
    run_simulation(sim, progress=False)
    # Assert
    over_mqtt = fed.final_weights()
    simulated = load_file(str(tmp_path / "sim" / "final_model.safetensors"))
    assert sorted(over_mqtt) == sorted(simulated)
    for name in over_mqtt:
        np.testing.assert_array_equal(over_mqtt[name], simulated[name], err_msg=name)
