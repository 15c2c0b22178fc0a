"""Stateful rules (SCAFFOLD c_i, FedDyn s_i) survive a SIGKILLed site or PS, bit for bit."""

from __future__ import annotations

import json
import signal
from typing import Any

import numpy as np
import pytest
from harness import CliFederation, wait_until
from safetensors.numpy import load_file

from fedmqtt.simulation import SimulationConfig, bundled_sites, run_simulation
from schemas import messages as m

ROUNDS = 3
SITES = ("cleveland", "switzerland")
KILLED = "cleveland"
OTHER = "switzerland"
BN_MODEL = {"name": "mlp", "args": {"in_features": 15, "hidden": [16], "norm": "bn"}}
SGD = {"epochs": 1, "batch_size": 32, "lr": 0.05, "optimizer": "sgd"}
ALGORITHMS = ("scaffold", "feddyn")
REPUBLISHED = "re-publishing the stored update"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`reference(algorithm)`: final weights and report of `run_simulation` (cached per module)."""
    cache: dict[str, tuple[dict[str, np.ndarray], dict[str, Any]]] = {}

    def get(algorithm: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if algorithm not in cache:
            out = tmp_path_factory.mktemp(f"sim-{algorithm}")
            sim = SimulationConfig(run_id=f"restart-{algorithm}", algorithm=algorithm, rounds=ROUNDS, seed=0,
                                   out_dir=out, model=BN_MODEL, train=SGD,
                                   sites={s: d for s, d in bundled_sites().items() if s in SITES})
            report = run_simulation(sim, progress=False)
            cache[algorithm] = (load_file(str(out / "final_model.safetensors")), report)
        return cache[algorithm]

    return get


def _federation(cli_federation: Any, name: str, algorithm: str) -> CliFederation:
    """Both sites required in every round (quorum 2), so a dead site is waited for, never dropped."""
    fed: CliFederation = cli_federation(name, run_id=f"restart-{algorithm}", rounds=ROUNDS, sites=SITES,
                                        algorithm=algorithm, hyper={}, train=SGD, model=BN_MODEL)
    text = fed.ps_config.read_text()
    assert "quorum = 1\n" in text
    fed.ps_config.write_text(text.replace("quorum = 1\n", f"quorum = {len(SITES)}\n"))
    return fed


def _log_size(fed: CliFederation, name: str) -> int:
    path = fed.logs / f"{name}.log"
    return path.stat().st_size if path.exists() else 0


def _log_since(fed: CliFederation, name: str, offset: int) -> str:
    return (fed.logs / f"{name}.log").read_bytes()[offset:].decode(errors="replace")


Reference = tuple[dict[str, np.ndarray], dict[str, Any]]


def _assert_matches_reference(fed: CliFederation, reference: Reference) -> None:
    weights, report = reference
    over_mqtt = fed.final_weights()
    assert sorted(over_mqtt) == sorted(weights)
    for name in weights:
        np.testing.assert_array_equal(over_mqtt[name], weights[name], err_msg=name)
    mqtt_report = json.loads((fed.work / "ps" / "report.json").read_text())
    assert [r["round"] for r in mqtt_report["rounds"]] == list(range(1, ROUNDS + 1))
    assert all(r["sites"] == sorted(SITES) for r in mqtt_report["rounds"])  # nobody was dropped
    assert mqtt_report["final"]["per_site"] == report["final"]["per_site"]
    assert [r["per_site"] for r in mqtt_report["rounds"]] == [r["per_site"] for r in report["rounds"]]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_site_killed_before_publishing_republishes_its_stored_update(cli_federation: Any, reference: Any,
                                                                     algorithm: str) -> None:
    """A site SIGKILLed between storing and publishing its round-2 update re-sends the stored bytes."""
    # Prepare
    fed = _federation(cli_federation, "before", algorithm)
    fed.start_broker()
    fed.start_ps()
    fed.start_site(OTHER)
    fed.start_site(KILLED, fault="site_before_publish:2")
    # Execute
    rc = fed.procs[KILLED].wait(180)
    offset = _log_size(fed, KILLED)
    fed.start_site(KILLED)
    fed.wait_ps_done(240)
    # Assert
    assert rc == -signal.SIGKILL, fed.tail(KILLED)
    restarted = _log_since(fed, KILLED, offset)
    assert f"round 2: {REPUBLISHED}" in restarted, restarted
    assert "round 2: trained" not in restarted  # never trains a round twice
    _assert_matches_reference(fed, reference(algorithm))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_site_killed_after_publishing_republishes_its_stored_update(cli_federation: Any, reference: Any,
                                                                    algorithm: str) -> None:
    """A site SIGKILLed right after publishing round 1, restarted while round 1 is open, only re-sends it."""
    # Prepare: the other site online, then paused, so round 1 stays open until the killed site is back.
    fed = _federation(cli_federation, "after", algorithm)
    fed.start_broker()
    fed.start_ps()
    fed.start_site(OTHER)
    fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and msg.state == "waiting_for_sites"
                     and msg.waiting_for == (KILLED,), 120, f"the PS to see {OTHER} online")
    fed.procs[OTHER].send_signal(signal.SIGSTOP)
    try:
        fed.start_site(KILLED, fault="site_after_publish:1")
        # Execute
        rc = fed.procs[KILLED].wait(180)
        offset = _log_size(fed, KILLED)
        fed.start_site(KILLED)
        wait_until(lambda: REPUBLISHED in _log_since(fed, KILLED, offset), 120, f"{KILLED} to re-publish")
    finally:
        fed.procs[OTHER].send_signal(signal.SIGCONT)
    fed.wait_ps_done(240)
    # Assert
    assert rc == -signal.SIGKILL, fed.tail(KILLED)
    restarted = _log_since(fed, KILLED, offset)
    assert f"round 1: {REPUBLISHED}" in restarted, restarted
    assert "round 1: trained" not in restarted
    _assert_matches_reference(fed, reference(algorithm))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ps_killed_after_checkpoint_resumes_to_the_reference(cli_federation: Any, reference: Any,
                                                             algorithm: str) -> None:
    """A PS SIGKILLed after round 1's checkpoint and started with --resume ends as the uninterrupted run."""
    # Prepare
    fed = _federation(cli_federation, "ps", algorithm)
    fed.start_broker()
    # Execute
    fed.start_killed_and_resumed(SITES)
    fed.wait_ps_done(240)
    # Assert
    assert "resuming from checkpoint of round 1" in fed.tail("ps", 400)
    _assert_matches_reference(fed, reference(algorithm))
