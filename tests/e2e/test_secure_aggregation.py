"""Secure aggregation with real processes (broker, PS and four heart-disease sites through the CLI): the final
model of a FedAvg round under SecAgg+ (and of SCAFFOLD and FedNova rounds, whose sites also mask their
control-variate deltas or normalised sums) equals the clear run's within the ring's stated bound, and a site
killed right after sending its masked input is still in the sum (its self-mask seed rebuilt from its
neighbours)."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
from harness import FAST_TRAIN, wait_until
from safetensors.numpy import load_file

from fedmqtt.demo import DEMO_MODEL
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.weighted import mean_error_bound
from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SITES = ("cleveland", "hungary", "switzerland", "va")
SECURE = {"enabled": True, "ring_bits": 64, "fraction_bits": 30, "clip": 8.0, "stage_timeout_s": 8.0}


def _clear(tmp_path, run_id: str, rounds: int, sites: tuple[str, ...], algorithm: str = "fedavg",  # noqa: ANN001
           train: dict | None = None) -> dict[str, np.ndarray]:
    sim = SimulationConfig(run_id=run_id, algorithm=algorithm, rounds=rounds, seed=0, out_dir=tmp_path / "sim",
                           model=DEMO_MODEL, train=train or FAST_TRAIN,
                           sites={s: d for s, d in bundled_sites().items() if s in sites})
    run_simulation(sim, progress=False)
    return load_file(str(tmp_path / "sim" / "final_model.safetensors"))


def _bound(expected: dict[str, np.ndarray]) -> float:
    """One round's bound (fedmqtt/secagg/weighted.py) at total weight 1 (B is the sites' sample counts), with
    float32's own rounding of the mean on top."""
    fixed = FixedPoint(SECURE["clip"], SECURE["fraction_bits"], SECURE["ring_bits"], max_sites=len(SITES))
    largest = max(float(np.max(np.abs(v))) for v in expected.values() if v.dtype.kind == "f")
    return mean_error_bound(fixed, len(SITES), 1.0, largest) + largest * 2.0**-23


def test_a_secure_fedavg_round_equals_the_clear_one_within_the_bound(cli_federation, tmp_path) -> None:  # noqa: ANN001
    fed = cli_federation("secure", run_id="e2e-secure", rounds=1, sites=SITES, ps_extra={"secure_aggregation": SECURE})
    fed.run_to_completion(300)
    expected, got = _clear(tmp_path, "e2e-secure", 1, SITES), fed.final_weights()
    assert sorted(got) == sorted(expected)
    bound = _bound(expected)
    assert bound < 1e-6
    moved = 0.0
    for name, value in expected.items():
        diff = np.abs(got[name].astype(np.float64) - value.astype(np.float64))
        assert float(np.max(diff)) <= bound, (name, float(np.max(diff)), bound)
        moved = max(moved, float(np.max(np.abs(value.astype(np.float64)))))
    assert moved > 100 * bound  # the comparison can fail: the weights are far larger than the bound
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert report["rounds"][0]["secure"]["included"] == sorted(SITES)
    for site in SITES:
        assert "Traceback" not in fed.tail(site, 2000)
        assert "the update leaves only masked" in fed.tail(site, 2000)


def test_a_secure_scaffold_round_masks_the_variates_and_equals_the_clear_one(cli_federation, tmp_path) -> None:  # noqa: ANN001
    """SCAFFOLD: each site masks p_i delta_c_i after its weighted model (a vector twice as long, which the PS's
    session must expect, else the round fails); the round's model equals SCAFFOLD's in the clear within the
    bound. (c itself is compared with the clear rule's in tests/unit/test_machine_secagg.py.)"""
    sgd = {**FAST_TRAIN, "optimizer": "sgd", "lr": 0.05}
    fed = cli_federation("secure-scaffold", run_id="e2e-secure-scaffold", rounds=1, sites=SITES, algorithm="scaffold",
                         train=sgd, ps_extra={"secure_aggregation": SECURE})
    fed.run_to_completion(300)
    expected, got = _clear(tmp_path, "e2e-secure-scaffold", 1, SITES, "scaffold", sgd), fed.final_weights()
    assert sorted(got) == sorted(expected)
    bound = _bound(expected)
    for name, value in expected.items():
        diff = np.abs(got[name].astype(np.float64) - value.astype(np.float64))
        assert float(np.max(diff)) <= bound, (name, float(np.max(diff)), bound)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert report["rounds"][0]["secure"]["included"] == sorted(SITES)
    for site in SITES:
        assert "Traceback" not in fed.tail(site, 2000)
        assert "refused" not in fed.tail(site, 2000)


def test_a_secure_fednova_round_steps_as_the_clear_one(cli_federation, tmp_path) -> None:  # noqa: ANN001
    """FedNova: each site masks its normalised sums with its real local work (a_i from its optimiser); the round's
    model equals FedNova's in the clear within 1e-6 plus float32's rounding (the sums' bound at 30 fraction bits
    is far below that: docs/secure-aggregation.md, "Normalised sums")."""
    sgd = {**FAST_TRAIN, "optimizer": "sgd", "lr": 0.05}
    fed = cli_federation("secure-fednova", run_id="e2e-secure-fednova", rounds=1, sites=SITES, algorithm="fednova",
                         train=sgd, ps_extra={"secure_aggregation": SECURE})
    fed.run_to_completion(300)
    expected, got = _clear(tmp_path, "e2e-secure-fednova", 1, SITES, "fednova", sgd), fed.final_weights()
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        want = value.astype(np.float64)
        diff = np.abs(got[name].astype(np.float64) - want)
        assert (diff <= 1e-6 + np.abs(want) * 2.0**-23).all(), (name, float(np.max(diff)))
    for site in SITES:
        assert "Traceback" not in fed.tail(site, 2000)
        assert "refused" not in fed.tail(site, 2000)


def test_a_site_killed_after_its_masked_input_is_recovered(cli_federation, tmp_path) -> None:  # noqa: ANN001
    fed = cli_federation("killed", run_id="e2e-secure-kill", rounds=1, sites=SITES,
                         ps_extra={"secure_aggregation": SECURE})
    fed.start_broker()
    fed.start_ps()
    for site in SITES:
        fed.start_site(site, fault="site_after_masked:1" if site == "va" else None)
    wait_until(lambda: fed.procs["va"].poll() is not None, 240, "va killed after its masked input")
    fed.wait_ps_done(240)
    expected, got = _clear(tmp_path, "e2e-secure-kill", 1, SITES), fed.final_weights()
    bound = _bound(expected)
    for name, value in expected.items():
        assert float(np.max(np.abs(got[name].astype(np.float64) - value))) <= bound, name
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert report["rounds"][0]["secure"]["included"] == sorted(SITES)  # va's update is in the sum
    assert report["secure_aggregation"] == {"enabled": True, "per_round": [
        {"round": 1, "included": 4, "dropped": 0, "recovered": 0, "tries": 1, "clipped": 0}]}
    assert "## Secure aggregation" in (fed.work / "ps" / "report.md").read_text()
    assert "fault injection: SIGKILL at site_after_masked of round 1" in fed.tail("va", 200)
    ps_log = fed.tail("ps", 400)
    assert "site va went offline during round 1" in ps_log and "masked inputs (after training) closed" in ps_log


def test_a_ps_killed_mid_round_resumes_with_a_new_try(cli_federation, tmp_path) -> None:  # noqa: ANN001
    """The PS is SIGKILLed in round 2 once the sites' sealed shares are in, and started with --resume: it resumes
    round 2 from round 1's checkpoint under a new try (the sites re-offer their stored updates under fresh keys,
    without training again) and ends with the clear run's model. Two rounds: round 2's sites train from a model
    within the ring's bound of the clear one, so the comparison allows float32 training noise on top (1e-5)."""
    fed = cli_federation("ps-killed", run_id="e2e-secure-ps", rounds=2, sites=SITES,
                         ps_extra={"secure_aggregation": SECURE})
    fed.start_broker()
    fed.start_ps(fault="ps_before_inbox:2")  # SIGKILLed once round 2's shares are in, before any is routed
    for site in SITES:
        fed.start_site(site)
    assert fed.procs["ps"].wait(240) == -signal.SIGKILL, fed.tail("ps")
    fed.start_ps(resume=True)
    fed.wait_ps_done(240)
    expected, got = _clear(tmp_path, "e2e-secure-ps", 2, SITES), fed.final_weights()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name].astype(np.float64), value.astype(np.float64), rtol=0, atol=1e-5,
                                   err_msg=name)
    ps_log = fed.tail("ps", 4000)
    assert "resuming from checkpoint of round 1" in ps_log
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["secure"]["included"] for r in report["rounds"]] == [sorted(SITES)] * 2
    for site in SITES:
        assert "trained before; secure aggregation try" in fed.tail(site, 2000)  # round 2 not trained twice


def test_a_secure_surgical_fedfbn_round_equals_the_clear_one(cli_federation, tmp_path) -> None:  # noqa: ANN001
    """FedFBN with its default surgical output layer: the tasks name the output tensors (`per_label_tensors`), each site
    masks its output rows by the labels it annotates and appends those per-label weights (the heart-disease sites
    annotate their one label: every row is theirs), and the PS reads the rows from the per-label sums; the round's
    model equals FedFBN's in the clear within the bound (per-label masks that differ between sites are checked
    against the clear rule in tests/unit/test_secagg_surgical.py)."""
    fed = cli_federation("secure-fedfbn", run_id="e2e-secure-fedfbn", rounds=1, sites=SITES, algorithm="fedfbn",
                         ps_extra={"secure_aggregation": SECURE})
    fed.run_to_completion(300)
    expected, got = _clear(tmp_path, "e2e-secure-fedfbn", 1, SITES, "fedfbn"), fed.final_weights()
    assert sorted(got) == sorted(expected)
    bound = _bound(expected)  # B = the four sites, each weighing 1: the total weight and each label's are 1
    for name, value in expected.items():
        diff = np.abs(got[name].astype(np.float64) - value.astype(np.float64))
        assert float(np.max(diff)) <= bound, (name, float(np.max(diff)), bound)
    assert any(name.startswith("head.") for name in expected)
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert report["rounds"][0]["secure"]["included"] == sorted(SITES)
    for site in SITES:
        assert "Traceback" not in fed.tail(site, 2000)
        assert "refused" not in fed.tail(site, 2000)
        assert "output rows summed label by label; this site annotates 1 of 1 labels" in fed.tail(site, 4000)
