"""The PS state machine: feed it events, assert its effects (types and order) and its state."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from fedmqtt.strategies import FedAvg, SiteUpdate
from ps_daemon import effects as fx
from ps_daemon.checkpoint import checkpoint_to_state, state_to_checkpoint
from ps_daemon.config import DaemonConfig
from ps_daemon.events import ReportReceived, SiteOffline, SiteOnline, Started, Tick, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.state import DaemonState

SITES = ("site-a", "site-b", "site-c")
TIMEOUT = 100.0


def _machine(**overrides: Any) -> Machine:
    raw = {
        "run_id": "r1",
        "sites": list(SITES),
        "rounds": 2,
        "quorum": 1,
        "round_timeout_s": TIMEOUT,
        "model": {"name": "mlp", "args": {}},
        "credentials": "creds.toml",
        **overrides,
    }
    return Machine(DaemonConfig.model_validate(raw), FedAvg(), hash_weights)


def _initial_weights() -> dict[str, np.ndarray]:
    return {"fc.weight": np.zeros((2, 2), np.float32), "bn.num_batches_tracked": np.array(0, np.int64)}


def _site_weights(value: float, steps: int = 5) -> dict[str, np.ndarray]:
    return {
        "fc.weight": np.full((2, 2), value, np.float32),
        "bn.num_batches_tracked": np.array(steps, np.int64),
    }


def _update(
    state: DaemonState,
    site: str,
    *,
    value: float = 1.0,
    n: int = 10,
    now: float = 1.0,
    auroc: float | None = 0.5,
    round_no: int | None = None,
    base: str | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> UpdateReceived:
    update = SiteUpdate(site, tensors if tensors is not None else _site_weights(value), n, 3)
    return UpdateReceived(
        site_id=site,
        now=now,
        round=state.round if round_no is None else round_no,
        base_model_hash=state.model_hash if base is None else base,
        update=update,
        train_loss=0.25,
        val_metrics={"auroc": auroc, "accuracy": 0.5},
    )


def _start(machine: Machine, order: tuple[str, ...] = SITES, now: float = 0.0) -> tuple[DaemonState, list]:
    state = machine.initial_state(_initial_weights())
    effects: list = []
    for site in order:
        state, effects = machine.step(state, SiteOnline(site, now=now))
    return state, effects


def _assert_unchanged(new: DaemonState, old: DaemonState) -> None:
    """Field by field (numpy weights compared by value), so a failure reads well."""
    for f in dataclasses.fields(DaemonState):
        if f.name == "weights":
            assert new.weights.keys() == old.weights.keys()
            for name in old.weights:
                np.testing.assert_array_equal(new.weights[name], old.weights[name])
        else:
            assert getattr(new, f.name) == getattr(old, f.name), f.name


def _types(effects: list) -> list[type]:
    return [type(e) for e in effects]


def _run_round(
    machine: Machine, state: DaemonState, aurocs: dict[str, float | None], now: float = 1.0
) -> tuple[DaemonState, list]:
    effects: list = []
    for site, auroc in aurocs.items():
        state, effects = machine.step(state, _update(state, site, auroc=auroc, now=now))
    return state, effects


# -- starting ----------------------------------------------------------------------------------------
def test_waits_until_every_site_is_online() -> None:
    """Before all sites are online the PS only publishes a status naming who it is waiting for."""
    # Prepare
    machine = _machine()
    state = machine.initial_state(_initial_weights())
    # Execute
    state, started = machine.step(state, Started(now=0.0))
    state, effects = machine.step(state, SiteOnline("site-b", now=1.0))
    # Assert
    assert state.phase == "waiting_for_sites" and state.round == 0
    assert _types(started) == [fx.PublishStatus]
    assert _types(effects) == [fx.PublishStatus]
    assert effects[0].state == "waiting_for_sites"
    assert effects[0].waiting_for == ("site-a", "site-c")
    assert "1/3 sites online" in effects[0].detail


def test_all_sites_online_starts_round_one() -> None:
    """The last SiteOnline gives Log, PublishModel(1), a PublishTrainTask per site (sorted), PublishStatus."""
    # Prepare
    machine = _machine()
    # Execute
    state, effects = _start(machine, order=("site-c", "site-a", "site-b"), now=5.0)
    # Assert
    assert state.phase == "training" and state.round == 1
    assert state.selected == SITES
    assert state.deadline == 5.0 + TIMEOUT
    assert _types(effects) == [
        fx.Log,
        fx.PublishModel,
        fx.PublishTrainTask,
        fx.PublishTrainTask,
        fx.PublishTrainTask,
        fx.PublishStatus,
    ]
    model = effects[1]
    assert model.round == 1 and model.model_hash == hash_weights(_initial_weights())
    tasks = effects[2:5]
    assert [t.site_id for t in tasks] == list(SITES)
    assert all(
        t.round == 1 and t.model_hash == model.model_hash and t.deadline == 5.0 + TIMEOUT for t in tasks
    )
    assert all(t.accepted_round is None for t in tasks)
    assert effects[-1].state == "training" and effects[-1].waiting_for == SITES


def test_min_sites_starts_with_the_sites_that_are_online() -> None:
    """With min_sites=2 round 1 starts once two sites are online; the third still gets its (retained) task."""
    machine = _machine(min_sites=2)
    state, effects = _start(machine, order=("site-b", "site-a"))
    assert state.phase == "training"
    assert state.selected == ("site-a", "site-b", "site-c")
    assert [e.site_id for e in effects if isinstance(e, fx.PublishTrainTask)] == ["site-a", "site-b", "site-c"]


def test_unknown_site_is_ignored_with_a_log() -> None:
    """A SiteOnline from a site not in the config changes nothing and logs a warning naming it."""
    machine = _machine()
    state = machine.initial_state(_initial_weights())
    new, effects = machine.step(state, SiteOnline("site-x", now=0.0))
    _assert_unchanged(new, state)
    assert _types(effects) == [fx.Log]
    assert effects[0].level == "warning" and "site-x" in effects[0].text


# -- rejected updates --------------------------------------------------------------------------------
def _bad_update(kind: str, state: DaemonState, machine: Machine) -> tuple[DaemonState, UpdateReceived]:
    if kind == "stale-round":
        return state, _update(state, "site-a", round_no=state.round - 1)
    if kind == "future-round":
        return state, _update(state, "site-a", round_no=state.round + 1)
    if kind == "unselected-site":  # e.g. not drawn this round under fractional sampling
        return dataclasses.replace(state, selected=("site-a", "site-b")), _update(state, "site-c")
    if kind == "unknown-site":
        return state, _update(state, "site-x")
    if kind == "wrong-base-hash":
        return state, _update(state, "site-a", base="0" * 64)
    if kind == "wrong-shapes":
        return state, _update(
            state,
            "site-a",
            tensors={
                "fc.weight": np.zeros((3, 2), np.float32),
                "bn.num_batches_tracked": np.array(0, np.int64),
            },
        )
    if kind == "missing-tensor":
        return state, _update(state, "site-a", tensors={"fc.weight": np.zeros((2, 2), np.float32)})
    if kind == "duplicate":
        state, _ = machine.step(state, _update(state, "site-a"))
        return state, _update(state, "site-a", value=7.0)
    raise AssertionError(kind)


REJECTS = [
    ("stale-round", "stale or future round"),
    ("future-round", "stale or future round"),
    ("unselected-site", "not selected for this round"),
    ("unknown-site", "not selected for this round"),
    ("wrong-base-hash", "different model version"),
    ("wrong-shapes", "tensor 'fc.weight': float32[3, 2] != global float32[2, 2]"),
    ("missing-tensor", "missing ['bn.num_batches_tracked']"),
    ("duplicate", "duplicate update"),
]


@pytest.mark.parametrize(("kind", "reason"), REJECTS, ids=[r[0] for r in REJECTS])
def test_bad_update_is_ignored_with_a_log_naming_why(kind: str, reason: str) -> None:
    """A stale, unselected, foreign-base, misshapen or duplicate update changes nothing and logs why."""
    # Prepare: site-a and site-b selected (min_sites=2); site-c is known but not selected
    machine = _machine(min_sites=2, rounds=3)
    state, _ = _start(machine, order=("site-a", "site-b"))
    state, event = _bad_update(kind, state, machine)
    # Execute
    new, effects = machine.step(state, event)
    # Assert
    _assert_unchanged(new, state)
    assert _types(effects) == [fx.Log]
    assert effects[0].level == "warning"
    assert reason in effects[0].text and event.site_id in effects[0].text


def test_update_outside_training_is_ignored() -> None:
    """An update while waiting for sites is refused as stale, with a log."""
    machine = _machine()
    state = machine.initial_state(_initial_weights())
    new, effects = machine.step(state, _update(state, "site-a", round_no=0))
    _assert_unchanged(new, state)
    assert _types(effects) == [fx.Log]
    assert "waiting_for_sites" in effects[0].text


# -- closing rounds ----------------------------------------------------------------------------------
def test_partial_updates_publish_progress_only() -> None:
    """Until every selected site answered, each accepted update yields one status naming the missing sites."""
    machine = _machine()
    state, _ = _start(machine)
    state, effects = machine.step(state, _update(state, "site-b"))
    assert state.round == 1 and set(state.updates) == {"site-b"}
    assert _types(effects) == [fx.PublishStatus]
    assert effects[0].waiting_for == ("site-a", "site-c")
    assert "1/3 updates" in effects[0].detail


def test_last_update_closes_the_round_checkpoint_first() -> None:
    """All updates in: SaveCheckpoint, then PublishRoundMetrics, PublishModel(2), round-2 tasks, a status."""
    # Prepare
    machine = _machine(rounds=3)
    state, _ = _start(machine)
    counts = {"site-a": 1, "site-b": 1, "site-c": 2}
    values = {"site-a": 1.0, "site-b": 2.0, "site-c": 3.0}
    # Execute
    for site in ("site-c", "site-a", "site-b"):
        state, effects = machine.step(
            state, _update(state, site, value=values[site], n=counts[site], now=7.0)
        )
    # Assert
    assert _types(effects) == [
        fx.SaveCheckpoint,
        fx.PublishRoundMetrics,
        fx.PublishModel,
        fx.PublishTrainTask,
        fx.PublishTrainTask,
        fx.PublishTrainTask,
        fx.PublishStatus,
    ]
    assert effects[0].state is state
    assert state.phase == "training" and state.round == 2 and state.updates == {}
    np.testing.assert_array_equal(state.weights["fc.weight"], np.full((2, 2), 2.25, np.float32))
    assert state.weights["bn.num_batches_tracked"].dtype == np.int64
    assert state.model_hash == hash_weights(state.weights)
    record = effects[1].record
    assert record.round == 1 and record.sites == SITES and record.stragglers == ()
    assert record.n_samples == counts and record.closed_at == 7.0
    assert effects[2].round == 2 and effects[2].model_hash == state.model_hash
    assert state.deadline == 7.0 + TIMEOUT


def test_round_two_tasks_tell_participants_their_update_was_used() -> None:
    """accepted_round is 1 for sites aggregated in round 1 and None for the straggler."""
    # Prepare: quorum 2, site-c never answers, the deadline closes the round
    machine = _machine(quorum=2)
    state, _ = _start(machine)
    state, _ = _run_round(machine, state, {"site-a": 0.5, "site-b": 0.5})
    # Execute
    state, effects = machine.step(state, Tick(now=TIMEOUT + 1))
    # Assert
    tasks = {e.site_id: e.accepted_round for e in effects if isinstance(e, fx.PublishTrainTask)}
    assert tasks == {"site-a": 1, "site-b": 1, "site-c": None}
    assert state.accepted_rounds == {"site-a": 1, "site-b": 1}
    assert effects[1].record.stragglers == ("site-c",)


def test_site_going_offline_mid_round_closes_it_as_straggler() -> None:
    """The others reported and the last one's Will arrives: the round closes with it as straggler."""
    # Prepare
    machine = _machine()
    state, _ = _start(machine)
    state, _ = _run_round(machine, state, {"site-a": 0.5, "site-c": 0.5})
    # Execute
    state, effects = machine.step(state, SiteOffline("site-b", now=3.0))
    # Assert
    assert _types(effects)[:3] == [fx.Log, fx.SaveCheckpoint, fx.PublishRoundMetrics]
    assert "site-b went offline" in effects[0].text
    record = effects[2].record
    assert record.sites == ("site-a", "site-c") and record.stragglers == ("site-b",)
    # Next round: every site is selected again; site-b gets its retained task when it comes back,
    # and being seen offline it does not hold the round up meanwhile.
    assert state.round == 2 and state.selected == ("site-a", "site-b", "site-c")
    assert [e.site_id for e in effects if isinstance(e, fx.PublishTrainTask)] == ["site-a", "site-b", "site-c"]


def test_offline_before_quorum_waits() -> None:
    """A site going offline when nobody has reported yet does not close the round; the status stops waiting for it."""
    machine = _machine()
    state, _ = _start(machine)
    state, effects = machine.step(state, SiteOffline("site-a", now=1.0))
    assert state.round == 1 and _types(effects) == [fx.Log, fx.PublishStatus]
    assert "site-a" in state.offline and "site-a" not in state.online
    assert effects[1].waiting_for == ("site-b", "site-c") and set(effects[1].dropped) == {"site-a"}


def test_tick_before_the_deadline_does_nothing() -> None:
    """A Tick before the deadline leaves state and effects alone."""
    machine = _machine(quorum=2)
    state, _ = _start(machine)
    new, effects = machine.step(state, Tick(now=TIMEOUT - 1))
    _assert_unchanged(new, state)
    assert effects == []


def test_deadline_with_quorum_closes_the_round() -> None:
    """At the deadline, with the quorum met, the round closes on the sites that answered."""
    machine = _machine(quorum=2)
    state, _ = _start(machine)
    state, _ = _run_round(machine, state, {"site-a": 0.5, "site-c": 0.5})
    state, effects = machine.step(state, Tick(now=TIMEOUT))
    assert _types(effects)[:2] == [fx.SaveCheckpoint, fx.PublishRoundMetrics]
    assert effects[1].record.sites == ("site-a", "site-c") and effects[1].record.stragglers == ("site-b",)
    assert state.round == 2


def test_deadline_without_quorum_extends_and_names_the_missing_sites() -> None:
    """Quorum not met at the deadline: the deadline moves on and a status names who is missing."""
    # Prepare
    machine = _machine(quorum=2)
    state, _ = _start(machine)
    state, _ = _run_round(machine, state, {"site-b": 0.5})
    # Execute
    state, effects = machine.step(state, Tick(now=TIMEOUT + 5))
    # Assert
    assert state.round == 1 and state.phase == "training"
    assert state.deadline == TIMEOUT + 5 + TIMEOUT
    assert _types(effects) == [fx.Log, fx.PublishStatus]
    status = effects[1]
    assert status.waiting_for == ("site-a", "site-c")
    assert status.deadline == state.deadline
    assert "site-a, site-c" in status.detail and "quorum 2" in status.detail
    assert effects[0].level == "warning"


# -- evaluation and the end ---------------------------------------------------------------------------
def _report(
    state: DaemonState, site: str, *, tag: str = "final", model_hash: str | None = None
) -> ReportReceived:
    return ReportReceived(
        site_id=site,
        now=9.0,
        round=state.round,
        model_hash=model_hash or state.model_hash,
        tag=tag,
        metrics={"val": {"auroc": 0.7}, "test": {"auroc": None}},
        n_samples={"val": 10, "test": 10},
    )


def test_last_round_moves_to_evaluation_and_reports_finish() -> None:
    """After the last round: evaluating with an EvalTask per site; all final reports give Finish."""
    # Prepare
    machine = _machine(rounds=1)
    state, _ = _start(machine)
    # Execute
    state, effects = _run_round(machine, state, {"site-c": 0.5, "site-a": 0.5, "site-b": 0.5})
    # Assert
    assert state.phase == "evaluating" and state.round == 2
    assert _types(effects) == [
        fx.SaveCheckpoint,
        fx.PublishRoundMetrics,
        fx.PublishModel,
        fx.PublishEvalTask,
        fx.PublishEvalTask,
        fx.PublishEvalTask,
        fx.PublishStatus,
    ]
    assert effects[0].state.phase == "evaluating"
    assert [e.site_id for e in effects if isinstance(e, fx.PublishEvalTask)] == list(SITES)
    assert all(e.model_hash == state.model_hash for e in effects if isinstance(e, fx.PublishEvalTask))
    assert effects[-1].state == "evaluating"

    # Execute: reports for another model or tag are ignored, the real ones finish the run
    ignored, none = machine.step(state, _report(state, "site-a", model_hash="0" * 64))
    assert none == []
    _assert_unchanged(ignored, state)
    ignored, none = machine.step(state, _report(state, "site-a", tag="best"))
    assert none == []
    _assert_unchanged(ignored, state)
    for site in SITES:
        state, effects = machine.step(state, _report(state, site))
    # Assert
    assert _types(effects) == [fx.PublishStatus, fx.Finish]
    assert state.phase == "done" and state.deadline is None
    assert effects[0].state == "done" and effects[0].detail == "done"
    assert effects[1].state is state
    assert set(state.final_reports) == set(SITES)


def test_evaluation_deadline_finishes_naming_missing_reports() -> None:
    """At the evaluation deadline the run finishes and the status names the sites without a report."""
    machine = _machine(rounds=1)
    state, _ = _start(machine)
    state, _ = _run_round(machine, state, {s: 0.5 for s in SITES}, now=1.0)
    state, _ = machine.step(state, _report(state, "site-a"))
    state, effects = machine.step(state, Tick(now=1.0 + TIMEOUT))
    assert _types(effects) == [fx.PublishStatus, fx.Finish]
    assert "no final report from site-b, site-c" in effects[0].detail


def test_best_round_is_the_highest_mean_val_auroc_ties_keep_the_earlier() -> None:
    """Best round: highest mean auroc over defined sites; all-None rounds skipped; a tie keeps the earlier."""
    # Prepare: two sites; per-round aurocs (a, b)
    machine = _machine(sites=["site-a", "site-b"], rounds=4)
    state, _ = _start(machine, order=("site-a", "site-b"))
    rounds = [
        {"site-a": 0.6, "site-b": 0.8},  # mean 0.7 -> best
        {"site-a": None, "site-b": None},  # undefined everywhere: not eligible
        {"site-a": 0.9, "site-b": None},  # None left out: mean 0.9 -> best
        {"site-a": 0.8, "site-b": 1.0},  # mean 0.9: a tie keeps round 3
    ]
    expected_best = [1, 1, 3, 3]
    sent: dict[int, tuple[str, dict[str, np.ndarray]]] = {1: (state.model_hash, state.weights)}
    # Execute / Assert round by round
    for r, (aurocs, best_round) in enumerate(zip(rounds, expected_best, strict=True), start=1):
        state, _ = _run_round(machine, state, aurocs)
        sent[r + 1] = (state.model_hash, state.weights)
        assert state.best is not None and state.best.round == best_round
    record3 = state.history[2]
    assert record3.mean["auroc"] == pytest.approx(0.9)
    assert record3.per_site["site-b"]["auroc"] is None
    assert state.history[1].mean["auroc"] is None
    assert state.history[3].mean["auroc"] == record3.mean["auroc"]  # an exact tie, kept by round 3
    assert state.best.score == pytest.approx(0.9)
    # The best model is the one the sites received (and evaluated) at the start of round 3
    assert state.best.model_hash == sent[3][0]
    for name, array in sent[3][1].items():
        np.testing.assert_array_equal(state.best.weights[name], array)


# -- resume ------------------------------------------------------------------------------------------
def _resumed(machine: Machine) -> DaemonState:
    """A state as a restarted PS has it: round 2 of training, nobody online yet (through a checkpoint)."""
    state, _ = _start(machine)
    state, _ = _run_round(machine, state, {s: 0.5 for s in SITES})
    ckpt = state_to_checkpoint(state, run_id="r1", config_hash=machine.config.config_hash())
    return checkpoint_to_state(ckpt)


def test_resumed_round_is_resent_on_start() -> None:
    """Started on a resumed training state re-publishes the model and the tasks of the current round."""
    machine = _machine(rounds=3)
    state = _resumed(machine)
    assert state.phase == "training" and state.round == 2 and state.online == frozenset()
    state, effects = machine.step(state, Started(now=50.0))
    assert _types(effects) == [
        fx.PublishModel,
        fx.PublishTrainTask,
        fx.PublishTrainTask,
        fx.PublishTrainTask,
        fx.PublishStatus,
    ]
    assert all(e.accepted_round == 1 for e in effects if isinstance(e, fx.PublishTrainTask))
    assert state.deadline == 50.0 + TIMEOUT
    assert "resumed" in effects[-1].detail


def test_resumed_state_waits_for_sites_not_seen_offline() -> None:
    """After a resume the first retained update does not close the round, although it meets the quorum."""
    # Prepare
    machine = _machine(rounds=3, quorum=1)
    state = _resumed(machine)
    state, _ = machine.step(state, Started(now=50.0))
    # Execute
    state, effects = machine.step(state, _update(state, "site-b", now=51.0))
    # Assert
    assert state.round == 2 and set(state.updates) == {"site-b"}
    assert _types(effects) == [fx.PublishStatus]
    assert effects[0].waiting_for == ("site-a", "site-c")
    # ...and the round does close once the others are in
    state, _ = machine.step(state, _update(state, "site-a", now=52.0))
    state, effects = machine.step(state, _update(state, "site-c", now=53.0))
    assert state.round == 3 and fx.SaveCheckpoint in _types(effects)
