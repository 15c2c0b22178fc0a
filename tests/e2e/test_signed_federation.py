"""A broker-level attacker against real processes (broker, PS and sites through the CLI): a client holding the PS's
broker password but not its signing key leaves a forged model and a forged task at the broker. The sites refuse
both, naming why, never train on them, and the run then ends with the simulation's exact weights. And a
man-in-the-middle relay between a site process and the broker that rewrites its update: the PS refuses it, and
the run ends with the simulation's exact weights too."""

from __future__ import annotations

import time

import numpy as np
import pytest
from harness import FAST_TRAIN, wait_until
from safetensors.numpy import load_file

from fedmqtt.demo import DEMO_MODEL
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from fedmqtt.training.weights import initial_arrays
from fedmqtt.transport import topics
from schemas import messages as m
from schemas.codec import encode
from schemas.tensors import arrays_to_blobs, tensors_hash
from tests.integration.test_security import publish

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RUN = "e2e-signed"
SITES = ("cleveland", "hungary")
ROUNDS = 2


def test_a_model_and_task_forged_with_the_ps_password_are_never_trained_on(cli_federation, paho_client,
                                                                            tmp_path) -> None:  # noqa: ANN001
    # Prepare: the broker alone; the attacker logs in as the PS (its password, not its key) and leaves a model of
    # the right architecture with other weights, and a task naming it, retained for the sites to find
    fed = cli_federation("forged", run_id=RUN, rounds=ROUNDS, sites=SITES)
    fed.start_broker()
    mitm = paho_client(fed.layout.settings("ps"))
    blobs = arrays_to_blobs(initial_arrays(DEMO_MODEL["name"], DEMO_MODEL["args"], 999))
    forged = m.GlobalModel(run_id=RUN, sender="ps", round=1, session="f" * 16, model=m.ModelSpec(**DEMO_MODEL),
                           model_hash=tensors_hash(blobs), tensors=blobs)
    model_topic, task_topic = topics.ps_model_topic(RUN), topics.ps_task_topic(RUN, "cleveland")
    task = m.TrainTask(run_id=RUN, sender="ps", round=1, session="f" * 16, site_id="cleveland",
                       model_hash=forged.model_hash, deadline=time.time() + 600,
                       settings=m.TrainSettings(**FAST_TRAIN))
    publish(mitm, model_topic, encode(forged))  # unsigned
    publish(mitm, task_topic, fed.layout.identity("hungary").seal(task_topic, encode(task)))  # another party's key
    mitm.disconnect()  # the real PS takes its login next
    mitm.loop_stop()
    # Execute: the sites start and find the forgeries; then the PS starts and runs
    for site in SITES:
        fed.start_site(site)
    wait_until(lambda: "rejected (unsigned) a message on fedmqtt/v1/e2e-signed/ps/model" in fed.tail("cleveland", 400)
               and "rejected (wrong signer)" in fed.tail("cleveland", 400), 60, "the sites refusing the forgeries")
    assert not (fed.work / "state" / "cleveland" / "session").exists()  # it never worked on the forged task
    fed.start_ps()
    fed.wait_ps_done(240)
    # Assert: the simulation's weights, bit for bit; the refusals named for hungary too
    sim = SimulationConfig(run_id=RUN, algorithm="fedavg", rounds=ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           model=DEMO_MODEL, train=FAST_TRAIN,
                           sites={s: d for s, d in bundled_sites().items() if s in SITES})
    run_simulation(sim, progress=False)
    expected, got = load_file(str(tmp_path / "sim" / "final_model.safetensors")), fed.final_weights()
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert "rejected (unsigned) a message on fedmqtt/v1/e2e-signed/ps/model" in fed.tail("hungary", 2000)
    for site in SITES:
        assert "Traceback" not in fed.tail(site, 2000)


def test_an_update_rewritten_in_flight_is_refused_and_the_run_ends_as_without_it(cli_federation,
                                                                                  tmp_path) -> None:  # noqa: ANN001
    """cleveland's site process reaches the broker through a man-in-the-middle relay that turns its first update
    into one weighing 1000 times as much, under cleveland's own signature. The PS process refuses it as a bad
    signature; the round is re-published after stall_s, cleveland re-sends its stored update (untouched now),
    and the run ends with the simulation's exact weights."""
    from tests.integration.test_mitm_broker import MitmBroker, _reseal

    # Prepare: the broker; cleveland's credentials point at the relay in front of it
    run = "e2e-mitm"
    fed = cli_federation("mitm", run_id=run, rounds=ROUNDS, sites=SITES,
                         ps_extra={"quorum": len(SITES), "stall_s": 6.0})
    fed.start_broker()
    update_topic = topics.site_update_topic(run, "cleveland")

    def heavier(update: m.Message) -> m.Message:
        assert isinstance(update, m.ClientUpdate)
        return update.model_copy(update={"n_samples": update.n_samples * 1000})

    relay = MitmBroker(fed.layout.port, update_topic, "broker", lambda payload: _reseal(payload, heavier), limit=1)
    credentials = fed.layout.credentials["cleveland"]
    text = credentials.read_text()
    assert text.count(f"port = {fed.layout.port}\n") == 1
    credentials.write_text(text.replace(f"port = {fed.layout.port}\n", f"port = {relay.port}\n"))
    try:
        # Execute
        for site in SITES:
            fed.start_site(site)
        fed.start_ps()
        fed.wait_ps_done(240)
    finally:
        relay.close()

    # Assert
    assert relay.rewritten == 1 and relay.passed.count(update_topic) >= 2
    log = fed.tail("ps", 4000)
    assert f"rejected (bad signature) a message on {update_topic}" in log, log
    sim = SimulationConfig(run_id=run, algorithm="fedavg", rounds=ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           model=DEMO_MODEL, train=FAST_TRAIN,
                           sites={s: d for s, d in bundled_sites().items() if s in SITES})
    run_simulation(sim, progress=False)
    expected, got = load_file(str(tmp_path / "sim" / "final_model.safetensors")), fed.final_weights()
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
