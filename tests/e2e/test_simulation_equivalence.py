"""One code path: `fedmqtt simulate` and a real MQTT federation end with bit-identical weights."""

from __future__ import annotations

import numpy as np
import pytest
from harness import FAST_TRAIN
from safetensors.numpy import load_file, save_file

from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from fedmqtt.training.weights import initial_arrays

ROUNDS = 2
SITES = ("cleveland", "switzerland")
# A BatchNorm model, so FLOATBUF/INTBUF and local normalisation layers take their real paths.
BN_MODEL = {"name": "mlp", "args": {"in_features": 15, "hidden": [16], "norm": "bn"}}
SGD = {**FAST_TRAIN, "optimizer": "sgd", "lr": 0.05}
# Every algorithm of the catalogue, client and server rule end to end.
ALGORITHMS = [
    ("fedavg", {}, FAST_TRAIN), ("fedprox", {"mu": 0.1}, FAST_TRAIN), ("fedbn", {}, FAST_TRAIN),
    ("fedpxn", {"mu": 0.1}, FAST_TRAIN), ("fedadam", {}, FAST_TRAIN), ("fedadagrad", {}, FAST_TRAIN),
    ("fedyogi", {}, FAST_TRAIN), ("feddyn", {}, SGD), ("scaffold", {}, SGD), ("fednova", {}, SGD),
    ("fedadp", {}, FAST_TRAIN), ("feddkw", {}, FAST_TRAIN), ("fedper", {}, FAST_TRAIN), ("fedfbn", {}, FAST_TRAIN),
    ("base", {}, FAST_TRAIN), ("adafed", {}, FAST_TRAIN), ("d-adafed", {}, FAST_TRAIN), ("f-adafed", {}, FAST_TRAIN),
]
NEEDS_PRETRAINED = {"adafed", "d-adafed"}


def _final(path) -> dict[str, np.ndarray]:
    return load_file(str(path / "final_model.safetensors"))


def _assert_same_final_weights(over_mqtt_dir, simulated_dir) -> None:
    """The PS's final weights over MQTT and in the simulation: the same tensors, bit for bit."""
    over_mqtt, simulated = _final(over_mqtt_dir), _final(simulated_dir)
    assert sorted(over_mqtt) == sorted(simulated)
    for name in over_mqtt:
        np.testing.assert_array_equal(over_mqtt[name], simulated[name], err_msg=name)


@pytest.mark.parametrize(("algorithm", "hyper", "train"), ALGORITHMS, ids=[a for a, _, _ in ALGORITHMS])
def test_simulation_matches_mqtt_bit_for_bit(cli_federation, tmp_path, algorithm, hyper, train) -> None:
    """The same config and seed give identical final weights and site metrics in simulation and over Mosquitto."""
    # Prepare: AdaFed's "pretrained" model is just another seed's initialisation here.
    run_id = f"eq-{algorithm}"
    pretrained = None
    if algorithm in NEEDS_PRETRAINED:
        pretrained = tmp_path / "pretrained.safetensors"
        save_file(initial_arrays(BN_MODEL["name"], BN_MODEL["args"], 123), str(pretrained))
    fed = cli_federation(algorithm, run_id=run_id, rounds=ROUNDS, sites=SITES, algorithm=algorithm, hyper=hyper,
                         train=train, model=BN_MODEL, share_label_histogram=True,
                         ps_extra={"pretrained": str(pretrained)} if pretrained else None)
    sim = SimulationConfig(run_id=run_id, algorithm=algorithm, hyper=hyper, rounds=ROUNDS, seed=0,
                           out_dir=tmp_path / "sim", model=BN_MODEL, train=train, pretrained=pretrained,
                           sites={s: d for s, d in bundled_sites().items() if s in SITES})
    # Execute
    fed.run_to_completion(240)
    sim_report = run_simulation(sim, progress=False)
    # Assert: server weights and every site's final metrics (personalised models included).
    _assert_same_final_weights(fed.work / "ps", tmp_path / "sim")
    import json

    mqtt_report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert mqtt_report["final"]["per_site"] == sim_report["final"]["per_site"]
    assert [r["per_site"] for r in mqtt_report["rounds"]] == [r["per_site"] for r in sim_report["rounds"]]


@pytest.mark.parametrize("algorithm", ["fedavg", "fedper"])
def test_chunked_transfer_changes_nothing(cli_federation, tmp_path, algorithm) -> None:
    """Models, personalised tasks and updates cut into 1 KiB chunks (real processes, real Mosquitto) end
    with the same weights as the simulation, which never chunks."""
    # Prepare
    run_id = f"chunked-{algorithm}"
    fed = cli_federation(algorithm, run_id=run_id, rounds=ROUNDS, sites=SITES, algorithm=algorithm, train=FAST_TRAIN,
                         model=BN_MODEL, broker_extra={"chunk_threshold_bytes": 1024, "chunk_bytes": 1024})
    sim = SimulationConfig(run_id=run_id, algorithm=algorithm, rounds=ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           model=BN_MODEL, train=FAST_TRAIN,
                           sites={s: d for s, d in bundled_sites().items() if s in SITES})
    # Execute
    fed.run_to_completion(240)
    run_simulation(sim, progress=False)
    # Assert
    over_mqtt, simulated = _final(fed.work / "ps"), _final(tmp_path / "sim")
    for name in simulated:
        np.testing.assert_array_equal(over_mqtt[name], simulated[name], err_msg=name)
    import json

    report = json.loads((fed.work / "ps" / "report.json").read_text())
    transfers = report["traffic"]["chunked_transfers"]
    assert transfers["completed"] >= ROUNDS * len(SITES) and transfers["failed"] == 0
    # every site's update said what its rounds cost (CPU seconds here; joules on an NVIDIA GPU)
    totals = report["usage"]["per_site_total"]
    assert sorted(totals) == sorted(SITES)
    assert all(t["rounds"] == ROUNDS and t["cpu_s"] > 0 and t["energy_j"] is None for t in totals.values())


def test_pretrained_start_is_the_same_over_mqtt(cli_federation, tmp_path) -> None:
    """`init_model` with a head that does not fit: the PS (torch in a child process, the file read in the
    daemon) and the simulation start from, and end with, the same bits."""
    # Prepare: a backbone pretrained for 3 classes; the federation's model has one output
    init = tmp_path / "pretrained-3-class.safetensors"
    save_file(initial_arrays(BN_MODEL["name"], {**BN_MODEL["args"], "out_features": 3}, 123), str(init))
    init_model = {"path": str(init), "tensors": "matching"}
    fed = cli_federation("fedfbn", run_id="eq-init", rounds=ROUNDS, sites=SITES, algorithm="fedfbn", train=FAST_TRAIN,
                         model=BN_MODEL, ps_extra={"init_model": init_model})
    sim = SimulationConfig(run_id="eq-init", algorithm="fedfbn", rounds=ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           model=BN_MODEL, train=FAST_TRAIN, init_model=init_model,
                           sites={s: d for s, d in bundled_sites().items() if s in SITES})
    # Execute
    fed.run_to_completion(240)
    sim_report = run_simulation(sim, progress=False)
    # Assert
    import json

    mqtt_report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert mqtt_report["rounds"][0]["model_hash"] == sim_report["rounds"][0]["model_hash"]
    assert mqtt_report["init_model"]["kept"] == sim_report["init_model"]["kept"] == ["head.weight", "head.bias"]
    over_mqtt, simulated = _final(fed.work / "ps"), _final(tmp_path / "sim")
    for name in simulated:
        np.testing.assert_array_equal(over_mqtt[name], simulated[name], err_msg=name)


# evaluation = "all" with sampled selection: two of four sites train each round; all four validate. With this step
# size round 3 scores best of 4, so every site's best slot must follow the PS back to round 3's model.
EVERY_SITE_ROUNDS, EVERY_SITE_TRAIN = 4, {**FAST_TRAIN, "lr": 0.05}
EVERY_SITE = {"selection": "fraction", "fraction": 0.5, "evaluation": "all"}


def _every_site_federation(cli_federation, name: str):
    sites = tuple(bundled_sites())
    assert len(sites) == 4
    return cli_federation(name, run_id="eq-evalall", rounds=EVERY_SITE_ROUNDS, sites=sites, train=EVERY_SITE_TRAIN,
                          model=BN_MODEL, ps_extra=EVERY_SITE)


def _assert_every_site_run_matches_simulation(fed, tmp_path) -> None:
    """The same weights, every round's trained sites, per-site scores (all four sites) and means, the same best
    round, the same best and final per-site metrics; each site not drawn logs its validation of the round."""
    import json

    sim = SimulationConfig(run_id="eq-evalall", rounds=EVERY_SITE_ROUNDS, seed=0, out_dir=tmp_path / "sim",
                           model=BN_MODEL, train=EVERY_SITE_TRAIN, **EVERY_SITE)
    sim_report = run_simulation(sim, progress=False)
    _assert_same_final_weights(fed.work / "ps", tmp_path / "sim")
    mqtt_report = json.loads((fed.work / "ps" / "report.json").read_text())
    for report in (mqtt_report, sim_report):
        assert [len(r["sites"]) for r in report["rounds"]] == [2] * EVERY_SITE_ROUNDS
        assert all(sorted(r["per_site"]) == sorted(fed.sites) for r in report["rounds"])
    assert [(r["sites"], r["per_site"], r["mean"]) for r in mqtt_report["rounds"]] == [
        (r["sites"], r["per_site"], r["mean"]) for r in sim_report["rounds"]]
    assert mqtt_report["best_round"] == sim_report["best_round"] and mqtt_report["best_round"]["round"] == 3
    assert mqtt_report["final"]["per_site"] == sim_report["final"]["per_site"]
    assert mqtt_report["best"]["per_site"] == sim_report["best"]["per_site"]
    assert {s["best_round"] for s in mqtt_report["best"]["per_site"].values()} == {3}
    for round_record in mqtt_report["rounds"]:
        for site in sorted(set(fed.sites) - set(round_record["sites"])):
            log = (fed.logs / f"{site}.log").read_text()
            assert f"round {round_record['round']}: validated model" in log, site


def test_every_site_validation_matches_mqtt_bit_for_bit(cli_federation, tmp_path) -> None:
    """evaluation = "all" over Mosquitto: each site not drawn to train validates the round's model when the PS
    asks (eval_task tagged "round"), and the run ends as the simulation does."""
    fed = _every_site_federation(cli_federation, "evalall")
    fed.run_to_completion(240)
    _assert_every_site_run_matches_simulation(fed, tmp_path)


def test_every_site_validation_after_a_resume_matches_simulation(cli_federation, tmp_path) -> None:
    """The PS SIGKILLed after round 1's checkpoint (before it sent round 2) and resumed: the resumed PS asks every
    site not drawn for its validation of round 2 again, and the run still ends as the simulation does."""
    fed = _every_site_federation(cli_federation, "evalall-resume")
    fed.start_broker()
    fed.start_killed_and_resumed()
    fed.wait_ps_done(240)
    assert "resuming from checkpoint of round 1" in fed.tail("ps", 400)
    _assert_every_site_run_matches_simulation(fed, tmp_path)
