"""evaluation = "all": every site validates every round's model and the best round is chosen on those scores,
apart from who trains (Flower's fraction_evaluate). A site not selected to train gets the round's validation task
(an EvalTask tagged "round", val split only) and answers with a report; a selected site's validation comes with its
update. The machine, the admission of those reports, and a simulation (the same messages, in process)."""

from __future__ import annotations

import json
from dataclasses import replace
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
from ps_daemon.admission import manifest_rejection, report_rejection
from ps_daemon.config import DaemonConfig
from ps_daemon.events import RoundValidated, SiteOffline, SiteOnline, Started, Tick, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.refusals import refusal_category
from ps_daemon.state import DaemonState
from schemas import messages as m
from schemas.chunks import ChunkManifest

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


def _validation_tasks(effects: list[fx.Effect]) -> dict[str, fx.PublishEvalTask]:
    return {e.site_id: e for e in effects if isinstance(e, fx.PublishEvalTask)}


def _run(evaluation: str) -> DaemonState:
    machine = Machine(_config(evaluation=evaluation), FedAvg(), hash_weights)
    state = _started(machine)
    effects: list[fx.Effect] = []
    for r in range(3):
        others = [s for s in SITES if s not in state.selected]
        if evaluation == "all":
            # Each site not selected to train was asked to validate the round's model, on its val split only, and
            # answers on its own (one event per report); the trained site scores with its update.
            if r:
                tasks = _validation_tasks(effects)
                assert sorted(tasks) == others
                assert {(t.tag, t.splits, t.round, t.model_hash) for t in tasks.values()} == {
                    (m.ROUND_VALIDATION_TAG, ("val",), state.round, state.model_hash)}
                assert {t.best_round for t in tasks.values()} == {state.best.round if state.best else None}
            for site in others:
                scores = {site: {"auroc": EVERY[r][site]}}
                state, effects = machine.step(state, RoundValidated(0.5, state.round, state.model_hash, scores))
                assert effects == [] and state.validated[site] == scores[site]
        else:
            assert _validation_tasks(effects) == {}
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
    assert state.validated == {}  # the closed round's scores went into its record


def test_a_round_does_not_close_before_every_site_validated_it() -> None:
    machine = Machine(_config(evaluation="all"), FedAvg(), hash_weights)
    state = _started(machine)
    site = state.selected[0]
    others = [s for s in SITES if s != site]
    state, effects = machine.step(state, _update(state, site, 0.6))
    assert state.round == 1 and site in state.updates and not any(isinstance(e, fx.PublishRoundMetrics)
                                                                  for e in effects)
    # Nothing waits in silence: ps/status names the sites whose validation is missing, now and at the deadline
    status = next(e for e in effects if isinstance(e, fx.PublishStatus))
    assert status.waiting_for == tuple(others) and all(s in status.detail for s in others)
    state, effects = machine.step(state, Tick(1000.0))
    assert state.round == 1
    assert any("has not arrived from" in getattr(e, "text", "") and others[0] in e.text for e in effects)
    # Another model's or round's scores are dropped, and so is a site's second answer
    stale = RoundValidated(2.0, state.round, "not-this-model", {s: {"auroc": 0.5} for s in SITES})
    assert machine.step(state, stale) == (state, [])
    assert machine.step(state, RoundValidated(2.0, 2, state.model_hash, {others[0]: {"auroc": 0.5}})) == (state, [])
    state, _ = machine.step(state, RoundValidated(2.0, 1, state.model_hash, {others[0]: {"auroc": 0.5}}))
    assert machine.step(state, RoundValidated(2.0, 1, state.model_hash, {others[0]: {"auroc": 0.9}})) == (state, [])
    # A site seen going offline is not waited for (as a selected one is not); the last one's answer closes it
    state, effects = machine.step(state, SiteOffline(others[1], now=3.0))
    assert state.round == 1 and others[1] not in next(e for e in effects
                                                      if isinstance(e, fx.PublishStatus)).waiting_for
    state, effects = machine.step(state, RoundValidated(4.0, 1, state.model_hash, {others[2]: {"auroc": 0.7}}))
    assert state.round == 2 and any(isinstance(e, fx.PublishRoundMetrics) for e in effects)
    assert sorted(state.history[0].per_site) == sorted([site, others[0], others[2]])


def test_a_resumed_or_stalled_round_asks_again_only_the_missing_sites() -> None:
    machine = Machine(_config(evaluation="all", stall_s=10.0), FedAvg(), hash_weights)
    state = _started(machine)
    others = [s for s in SITES if s not in state.selected]
    state, _ = machine.step(state, RoundValidated(1.0, 1, state.model_hash, {others[0]: {"auroc": 0.5}}))
    # Stalled: the round's tasks go out again to the sites still missing (new ids), not to one that answered
    _, effects = machine.step(state, Tick(11.5))
    assert sorted(_validation_tasks(effects)) == others[1:]
    assert [e.site_id for e in effects if isinstance(e, fx.PublishTrainTask)] == list(state.selected)
    # Resumed from the round's checkpoint (taken as it opened: no validation kept): every site is asked again
    resumed = replace(state, validated={})
    resumed, effects = machine.step(resumed, Started(now=20.0))
    assert sorted(_validation_tasks(effects)) == others


def test_a_site_that_does_not_train_is_asked_only_under_all() -> None:
    for evaluation, asked in (("selected", 0), ("all", 3)):
        machine = Machine(_config(evaluation=evaluation), FedAvg(), hash_weights)
        state = machine.initial_state({"fc.weight": np.zeros((2, 2), np.float32)})
        effects: list[fx.Effect] = []
        for site in SITES:
            state, effects = machine.step(state, SiteOnline(site, now=0.0))
        assert len(_validation_tasks(effects)) == asked


def _report(state: DaemonState, site: str, **changes: Any) -> m.EvalReport:
    fields: dict[str, Any] = dict(run_id="r1", sender=site, round=state.round, session=state.session,
                                  model_hash=state.model_hash, tag=m.ROUND_VALIDATION_TAG,
                                  metrics={"val": {"auroc": 0.5}}, n_samples={"val": 10})
    return m.EvalReport(**{**fields, **changes})


def test_a_validation_report_is_admitted_only_as_asked() -> None:
    """Hostile by default: every reply is judged before the machine sees it, each refusal with a counted label."""
    machine = Machine(_config(evaluation="all"), FedAvg(), hash_weights)
    state = replace(_started(machine), session="5e55")
    trained = state.selected[0]
    other = next(s for s in SITES if s != trained)
    asked = machine.validation_sites(state)
    assert trained not in asked and other in asked
    assert report_rejection(state, other, _report(state, other), asked) is None
    refused = {
        "wrong round": _report(state, other, round=2),
        "not asked": _report(state, trained),
        "wrong model version": _report(state, other, model_hash="f" * 64),
        "wrong session": _report(state, other, session="01d"),
        "wrong layout": _report(state, other, metrics={"val": {"auroc": 0.5}, "test": {"auroc": 0.9}}),
    }
    for label, report in refused.items():
        why = report_rejection(state, report.sender, report, asked)
        assert why is not None and refusal_category(why) == label, (label, why)
    assert refusal_category(report_rejection(state, "stranger", _report(state, "stranger"), asked) or "") == \
        "not asked"
    seen = replace(state, validated={other: {"auroc": 0.5}})
    assert refusal_category(report_rejection(seen, other, _report(seen, other), asked) or "") == "duplicate"
    # Under "selected" nobody is asked; a chunked report is judged the same way before a chunk is fetched
    plain = Machine(_config(), FedAvg(), hash_weights)
    assert refusal_category(report_rejection(state, other, _report(state, other), plain.validation_sites(state))
                            or "") == "not asked"
    manifest = ChunkManifest.model_construct(round=state.round, total_bytes=1000)
    assert manifest_rejection(machine, state, other, "report", manifest) is None
    assert manifest_rejection(machine, state, trained, "report", manifest) is not None
    # Values a schema cannot carry never reach the PS: NaN and Inf are refused when the report is parsed
    with pytest.raises(ValidationError):
        _report(state, other, metrics={"val": {"auroc": float("nan")}})


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


def test_a_rule_that_keeps_tensors_on_the_sites_is_refused_naming_the_fix(tmp_path: Path) -> None:
    bn = {"name": "mlp", "args": {"in_features": 15, "hidden": [16], "norm": "bn"}}
    cfg = SimulationConfig(rounds=1, algorithm="fedbn", model=bn, evaluation="all", out_dir=tmp_path)
    with pytest.raises(ConfigError, match="keeps tensors on the sites.*evaluation = \"selected\""):
        run_simulation(cfg, progress=False)


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


def test_the_ps_reminder_names_the_sites_whose_validation_is_missing(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing waits in silence: the PS's periodic log line names them too (as ps/status does)."""
    import logging

    from ps_daemon.status import Reminders
    from ps_daemon.turns import UploadTurns

    config = _config(evaluation="all")
    machine = Machine(config, FedAvg(), hash_weights)
    state = _started(machine)
    others = [s for s in SITES if s not in state.selected]
    state, _ = machine.step(state, RoundValidated(1.0, 1, state.model_hash, {others[0]: {"auroc": 0.5}}))
    reminders = Reminders(config, UploadTurns(1))
    reminders._reminded_at = -1e9  # due now
    with caplog.at_level(logging.INFO, logger="fedmqtt.ps"):
        reminders.remind(state)
    line = next(r.getMessage() for r in caplog.records if "validation of the round's model" in r.getMessage())
    assert all(s in line for s in others[1:]) and others[0] not in line and state.selected[0] not in line


def test_a_site_never_seen_does_not_hold_the_round_and_is_asked_as_it_joins() -> None:
    """A site named in the config but not started is not waited for (it would hold every round); once it comes
    online it gets the open round's validation task and the round waits for its answer."""
    machine = Machine(_config(evaluation="all", min_sites=3), FedAvg(), hash_weights)
    state = machine.initial_state({"fc.weight": np.zeros((2, 2), np.float32)})
    for site in SITES[:3]:
        state, _ = machine.step(state, SiteOnline(site, now=0.0))
    assert state.phase == "training" and "site-d" not in machine.validation_sites(state)
    late = "site-d"
    state, effects = machine.step(state, SiteOnline(late, now=1.0))
    assert list(_validation_tasks(effects)) == [late]
    assert late in next(e for e in effects if isinstance(e, fx.PublishStatus)).waiting_for
    for site in machine.validation_sites(state):
        if site != late:
            state, _ = machine.step(state, RoundValidated(2.0, 1, state.model_hash, {site: {"auroc": 0.5}}))
    state, effects = machine.step(state, _update(state, state.selected[0], 0.6))
    assert state.round == 1 and late in next(e for e in effects if isinstance(e, fx.PublishStatus)).waiting_for
    state, effects = machine.step(state, RoundValidated(3.0, 1, state.model_hash, {late: {"auroc": 0.5}}))
    assert state.round == 2 and sorted(state.history[0].per_site) == list(SITES)
