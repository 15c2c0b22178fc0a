"""Recruitment and per-round sampling inside the PS state machine (pure: events in, effects out)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedmqtt.strategies import FedAvg, SiteUpdate
from ps_daemon import effects as fx
from ps_daemon.checkpoint import checkpoint_to_state, state_to_checkpoint
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOnline, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights

# The worked example of docs/algorithms.md 15: ranking b, a, d, c.
HIST = {"a": (30, 30, 20, 10, 5, 5, 0, 0, 0, 0), "b": (40, 40, 30, 20, 20, 10, 10, 10, 10, 10),
        "c": (0, 0, 0, 0, 0, 0, 0, 0, 5, 20), "d": (16, 16, 16, 16, 0, 0, 0, 0, 0, 0)}
SIZES = {"a": 100, "b": 200, "c": 25, "d": 64}


def _machine(**overrides: Any) -> Machine:
    raw = {"run_id": "r1", "sites": sorted(HIST), "rounds": 3, "model": {"name": "mlp", "args": {}},
           "credentials": "creds.toml", **overrides}
    return Machine(DaemonConfig.model_validate(raw), FedAvg(), hash_weights)


def _start(machine: Machine, histograms: dict[str, Any] = HIST):
    state = machine.initial_state({"w": np.zeros(2, np.float32)})
    effects: list[fx.Effect] = []
    for site in sorted(histograms):
        state, effects = machine.step(state, SiteOnline(site, 0.0, SIZES[site], histograms[site]))
    return state, effects


def _finish_round(machine: Machine, state):
    for site in state.selected:
        update = SiteUpdate(site, {"w": np.ones(2, np.float32)}, SIZES[site], 1)
        state, effects = machine.step(state, UpdateReceived(site, 1.0, state.round, state.model_hash, update))
    return state, effects


def test_recruitment_tells_every_candidate_and_trains_only_the_recruited() -> None:
    """gamma_th 0.3 recruits b, a, d; c learns its score and rank and never gets a task."""
    # Prepare
    machine = _machine(selection="recruited", recruitment={"gamma_th": 0.3})
    # Execute
    state, effects = _start(machine)
    # Assert
    verdicts = {e.site_id: e for e in effects if isinstance(e, fx.PublishRecruitment)}
    assert set(verdicts) == {"a", "b", "c", "d"}
    assert not verdicts["c"].recruited and verdicts["c"].detail == "not recruited: score 0.9843, rank 4 of 4"
    assert verdicts["b"].recruited and verdicts["b"].rank == 1
    assert state.recruited == ("b", "a", "d") and state.selected == ("a", "b", "d")
    tasks = [e.site_id for e in effects if isinstance(e, fx.PublishTrainTask)]
    assert tasks == ["a", "b", "d"]
    assert state.recruitment["threshold"] > 0
    assert [r["site"] for r in state.recruitment["ranking"]] == ["b", "a", "d", "c"]


def test_a_site_without_a_histogram_is_not_rankable() -> None:
    """A site whose egress policy keeps its histogram is told it cannot be ranked, and is not recruited."""
    # Prepare / Execute
    state, effects = _start(_machine(selection="recruited", recruitment={"gamma_th": 1.0}), {**HIST, "c": None})
    # Assert
    verdict = next(e for e in effects if isinstance(e, fx.PublishRecruitment) and e.site_id == "c")
    assert not verdict.recruited and "cannot be ranked" in verdict.detail
    assert "c" not in state.selected


def test_fraction_sampling_is_seeded_and_survives_a_resume() -> None:
    """A fraction draws the same sites per round after a checkpoint round trip, and different ones across rounds."""
    # Prepare
    machine = _machine(selection="fraction", fraction=0.5, seed=3)
    state, _ = _start(machine)
    drawn = [state.selected]
    # Execute: two rounds, checkpointing and restoring the state between them
    for _ in range(2):
        state, _ = _finish_round(machine, state)
        state = checkpoint_to_state(state_to_checkpoint(state, run_id="r1", config_hash="x"))
        drawn.append(state.selected)
    # Assert
    assert all(len(d) == 2 for d in drawn)
    replay = _machine(selection="fraction", fraction=0.5, seed=3)
    again, _ = _start(replay)
    assert again.selected == drawn[0]
    assert len(set(drawn)) > 1  # not the same pair every round


def test_a_returning_site_completes_a_round_whose_quorum_needs_it() -> None:
    """Quorum 2 of 2, one site drops out: the deadline says why it waits, and the site's return closes it."""
    # Prepare: sites a and b, quorum 2
    machine = _machine(sites=["a", "b"], quorum=2, round_timeout_s=10.0)
    state, _ = _start(machine, {"a": HIST["a"], "b": HIST["b"]})
    update_b = SiteUpdate("b", {"w": np.ones(2, np.float32)}, 200, 1)
    state, _ = machine.step(state, UpdateReceived("b", 1.0, 1, state.model_hash, update_b))
    # Execute: a disappears, the deadline passes, a comes back and answers
    from ps_daemon.events import SiteOffline, Tick

    state, _ = machine.step(state, SiteOffline("a", 2.0))
    state, effects = machine.step(state, Tick(100.0))
    waiting = next(e for e in effects if isinstance(e, fx.PublishStatus))
    state, _ = machine.step(state, SiteOnline("a", 101.0, 100, HIST["a"]))
    update_a = SiteUpdate("a", {"w": np.ones(2, np.float32)}, 100, 1)
    state, effects = machine.step(state, UpdateReceived("a", 102.0, 1, state.model_hash, update_a))
    # Assert
    # a, offline, is not among the sites the round waits for: ps/status names it as dropped, with why
    assert "only 1 can still answer" in waiting.detail and waiting.waiting_for == ()
    assert waiting.dropped == {"a": "offline since 1970-01-01T00:00:02Z"}
    assert state.round == 2 and any(isinstance(e, fx.SaveCheckpoint) for e in effects)
    assert state.selected == ("a", "b")
