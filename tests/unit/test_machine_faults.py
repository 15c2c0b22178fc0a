"""The PS machine under faults: a stalled round is re-published, a reconnect re-sends the open round, an aggregate
that is not finite is refused, and a recruitment that cannot reach the quorum says why."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedmqtt.strategies import SiteUpdate, build_strategy
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOffline, SiteOnline, Tick, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights

SITES = ("site-a", "site-b")
WEIGHTS = {"fc.weight": np.zeros((2, 2), np.float32)}


def _machine(**overrides: Any) -> Machine:
    raw = {"run_id": "r1", "sites": list(SITES), "rounds": 2, "quorum": 1, "round_timeout_s": 100.0,
           "stall_s": 10.0, "model": {"name": "mlp"}, "credentials": "c.toml", **overrides}
    config = DaemonConfig.model_validate(raw)
    return Machine(config, build_strategy(config.algorithm, config.strategy_params()), hash_weights)


def _training(machine: Machine) -> Any:
    state = machine.initial_state(dict(WEIGHTS), session="ab")
    for site in SITES:
        state, _ = machine.step(state, SiteOnline(site, now=0.0))
    return state


def _update(state: Any, site: str, value: float) -> UpdateReceived:
    return UpdateReceived(site, 1.0, state.round, state.model_hash,
                          SiteUpdate(site, {"fc.weight": np.full((2, 2), value, np.float32)}, 10, 2))


def test_a_round_without_progress_is_republished_for_the_missing_sites_only() -> None:
    machine = _machine()
    state = _training(machine)
    state, _ = machine.step(state, _update(state, "site-a", 1.0))
    state, effects = machine.step(state, Tick(5.0))
    assert effects == [] and state.attempt == 0
    state, effects = machine.step(state, Tick(11.5))
    assert state.attempt == 1
    tasks = [e for e in effects if isinstance(e, fx.PublishTrainTask)]
    assert [t.site_id for t in tasks] == ["site-b"]
    assert any(isinstance(e, fx.PublishModel) for e in effects)
    status = [e for e in effects if isinstance(e, fx.PublishStatus)][-1]
    assert "nothing arrived for 10 s" in status.detail and "site-b" in status.detail
    # Progress resets the clock: the next re-publish comes stall_s after the last one.
    state, effects = machine.step(state, Tick(15.0))
    assert effects == []


def test_stall_zero_turns_republishing_off() -> None:
    machine = _machine(stall_s=0)
    state = _training(machine)
    state, effects = machine.step(state, Tick(99.0))
    assert effects == [] and state.attempt == 0


def test_resend_restores_everything_the_open_round_needs() -> None:
    machine = _machine()
    state = _training(machine)
    effects = machine.resend(state, "reconnected")
    assert [type(e) for e in effects] == [fx.PublishModel, fx.PublishTrainTask, fx.PublishTrainTask, fx.PublishStatus]
    waiting = machine.resend(machine.initial_state(dict(WEIGHTS)), "reconnected")
    assert [type(e) for e in waiting] == [fx.PublishStatus]


def test_an_aggregate_that_is_not_finite_is_refused_and_the_state_kept() -> None:
    """Finite, in-range updates can still combine into Inf under an adaptive server rule (here a huge server
    learning rate): the PS must neither publish nor checkpoint that model, which would crash-loop it on resume."""
    machine = _machine(quorum=2, algorithm="fedadam", hyper={"eta_g": 1e40})
    state = _training(machine)
    state, _ = machine.step(state, _update(state, "site-a", 3e38))
    round_before, weights_before = state.round, dict(state.weights)
    state, effects = machine.step(state, _update(state, "site-b", 3e38))
    assert state.round == round_before and state.updates == {}
    np.testing.assert_array_equal(state.weights["fc.weight"], weights_before["fc.weight"])
    assert not any(isinstance(e, (fx.SaveCheckpoint, fx.PublishModel)) for e in effects)
    assert any(isinstance(e, fx.PublishStatus) and "could not aggregate" in e.detail for e in effects)


def test_recruitment_that_cannot_reach_the_quorum_waits_and_names_the_fix() -> None:
    machine = _machine(selection="recruited", quorum=2)
    state = machine.initial_state(dict(WEIGHTS))
    for site in SITES:
        state, effects = machine.step(state, SiteOnline(site, now=0.0))  # no histograms
    assert state.phase == "waiting_for_sites"
    status = [e for e in effects if isinstance(e, fx.PublishStatus)][-1]
    assert "share_label_histogram = true" in status.detail and "site-a" in status.detail


def test_a_stalled_round_asks_every_site_that_has_not_answered_offline_or_not() -> None:
    """An offline site may be back by now: its retained task must be there when it reconnects."""
    machine = _machine()
    state = _training(machine)
    state, _ = machine.step(state, SiteOffline("site-b", 2.0))
    state, effects = machine.step(state, Tick(20.0))
    assert {e.site_id for e in effects if isinstance(e, fx.PublishTrainTask)} == {"site-a", "site-b"}
