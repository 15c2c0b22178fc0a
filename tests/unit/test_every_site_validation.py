"""evaluation = "all": every site validates every round's model and the best round is chosen on those scores,
apart from who trains (Flower's fraction_evaluate). Simulation only; a deployed PS refuses it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from fedmqtt.errors import ConfigError
from fedmqtt.means import mean_defined
from fedmqtt.simulation import SimulationConfig, run_simulation
from fedmqtt.strategies import FedAvg, SiteUpdate
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.events import RoundValidated, SiteOnline, Tick, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.runner import DaemonRunner
from ps_daemon.state import DaemonState

SITES = ("site-a", "site-b", "site-c", "site-d")


def _config(**overrides: Any) -> DaemonConfig:
    raw = {"run_id": "r1", "sites": list(SITES), "rounds": 3, "quorum": 1, "round_timeout_s": 100.0,
           "selection": "fraction", "fraction": 0.25, "model": {"name": "mlp", "args": {}},
           "credentials": "creds.toml", **overrides}
    return DaemonConfig.model_validate(raw)


def _started(machine: Machine) -> DaemonState:
    state = machine.initial_state({"fc.weight": np.zeros((2, 2), np.float32)})
    for site in SITES:
        state, _ = machine.step(state, SiteOnline(site, now=0.0))
    assert state.phase == "training" and len(state.selected) == 1  # one site of four trains each round
    return state


def _update(state: DaemonState, site: str, auroc: float) -> UpdateReceived:
    update = SiteUpdate(site, {"fc.weight": np.full((2, 2), float(state.round), np.float32)}, 10, 3)
    return UpdateReceived(site_id=site, now=1.0, round=state.round, base_model_hash=state.model_hash, update=update,
                          val_metrics={"auroc": auroc})


# Each round: the trained site's own validation AUROC (what "selected" scores) and every site's (what "all" does).
# Round 2 looks best on its one sampled site; round 3 is best over all four sites.
OWN = (0.60, 0.95, 0.70)
EVERY = ({"site-a": 0.5, "site-b": 0.5, "site-c": 0.5, "site-d": 0.6},
         {"site-a": 0.95, "site-b": 0.4, "site-c": 0.4, "site-d": 0.4},
         {"site-a": 0.7, "site-b": 0.7, "site-c": 0.7, "site-d": 0.7})


def _run(evaluation: str) -> DaemonState:
    machine = Machine(_config(evaluation=evaluation), FedAvg(), hash_weights)
    state = _started(machine)
    for r in range(3):
        if evaluation == "all":
            scores = {s: {"auroc": v} for s, v in {**EVERY[r], state.selected[0]: OWN[r]}.items()}  # the trained
            # site scores the model as it did before training
            state, effects = machine.step(state, RoundValidated(0.5, state.round, state.model_hash, scores))
            assert effects == [] and state.validated == scores
        state, effects = machine.step(state, _update(state, state.selected[0], OWN[r]))
        assert any(isinstance(e, fx.PublishRoundMetrics) for e in effects)
    return state


def test_selected_picks_the_round_whose_one_sampled_site_scored_best() -> None:
    state = _run("selected")
    assert state.best is not None and state.best.round == 2


def test_all_picks_the_round_best_over_every_site_and_records_every_site() -> None:
    state = _run("all")
    assert state.best is not None and state.best.round == 3
    for record in state.history:
        assert set(record.per_site) == set(SITES) and len(record.sites) == 1  # one trained, four validated
        assert record.mean["auroc"] == mean_defined([record.per_site[s]["auroc"] for s in SITES])
    assert state.validated is None  # the closed round's scores went into its record


def test_a_round_does_not_close_before_every_site_validated_it() -> None:
    machine = Machine(_config(evaluation="all"), FedAvg(), hash_weights)
    state = _started(machine)
    site = state.selected[0]
    state, effects = machine.step(state, _update(state, site, 0.6))
    assert state.round == 1 and site in state.updates and not any(isinstance(e, fx.PublishRoundMetrics)
                                                                  for e in effects)
    # Past the deadline with the quorum met it still waits, and says for what
    state, effects = machine.step(state, Tick(1000.0))
    assert state.round == 1 and any("has not arrived" in getattr(e, "text", "") for e in effects)
    # Another model's or round's scores are dropped
    stale = RoundValidated(2.0, state.round, "not-this-model", {s: {"auroc": 0.5} for s in SITES})
    assert machine.step(state, stale) == (state, [])
    state, effects = machine.step(state, RoundValidated(2.0, 1, state.model_hash, {s: {"auroc": 0.5} for s in SITES}))
    assert state.round == 2 and any(isinstance(e, fx.PublishRoundMetrics) for e in effects)


def test_selected_ignores_every_site_validation_with_a_log() -> None:
    machine = Machine(_config(), FedAvg(), hash_weights)
    state = _started(machine)
    new, effects = machine.step(state, RoundValidated(1.0, 1, state.model_hash, {s: {"auroc": 0.5} for s in SITES}))
    assert new == state and len(effects) == 1 and "evaluation = \"selected\"" in effects[0].text


def test_config_checks() -> None:
    assert _config().evaluation == "selected"
    # The default leaves the resume hash as it was: checkpoints of earlier runs still resume
    assert _config().config_hash() == _config(evaluation="selected").config_hash() != _config(
        evaluation="all").config_hash()
    with pytest.raises(ValidationError, match="evaluation"):
        _config(evaluation="some")
    with pytest.raises(ValidationError, match="not built for secure aggregation"):
        _config(evaluation="all", selection="all", secure_aggregation={"enabled": True})
    with pytest.raises(ValidationError):
        SimulationConfig(evaluation="every")
    assert SimulationConfig(evaluation="all").daemon_config().evaluation == "all"
    assert "evaluation" not in SimulationConfig().daemon_config().model_fields_set  # the default is not passed


def test_deployed_ps_refuses_all_naming_the_fix(tmp_path: Path) -> None:
    config = _config(evaluation="all", out_dir=tmp_path)
    with pytest.raises(ConfigError, match="fedmqtt simulate.*evaluation = \"selected\"|evaluation = \"selected\""):
        DaemonRunner(config, transport_factory=lambda **kw: None)


def test_simulation_validates_on_every_site_trains_the_same(tmp_path: Path) -> None:
    """Training is the same bits; only the best round's choice (and each round's validation record) changes:
    each site's scores of a round it trained in are the ones it sent with its update, and every site's best
    slot follows the PS's best round."""
    reports = {}
    for evaluation in ("selected", "all"):
        cfg = SimulationConfig(rounds=6, seed=1, selection="fraction", fraction=0.5, evaluation=evaluation,
                               out_dir=tmp_path / evaluation)
        reports[evaluation] = run_simulation(cfg, progress=False)
    sel, every = reports["selected"], reports["all"]
    assert (tmp_path / "selected" / "final_model.safetensors").read_bytes() == (
        tmp_path / "all" / "final_model.safetensors").read_bytes()
    sites = sorted(SimulationConfig().sites)
    for a, b in zip(sel["rounds"], every["rounds"], strict=True):
        assert a["sites"] == b["sites"] and sorted(b["per_site"]) == sites
        for site in a["sites"]:
            assert b["per_site"][site] == a["per_site"][site]
    scores = [r["mean"]["auroc"] for r in every["rounds"]]
    assert every["best_round"]["round"] == 1 + int(np.argmax(scores))  # highest mean over every site
    assert every["best_round"]["round"] != sel["best_round"]["round"]  # this seed: the two rules disagree
    assert {s["best_round"] for s in every["best"]["per_site"].values()} == {every["best_round"]["round"]}
    assert json.loads((tmp_path / "all" / "report.json").read_text())["config"]["evaluation"] == "all"
