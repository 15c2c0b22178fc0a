"""The machine's waiting list follows the rule that closes rounds: a site seen going offline is not waited for,
not counted in "training on N sites", and the status names it among the dropped sites with why (offline since
when, no step possible, no final report by the deadline); a site that comes back is waited for again."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedmqtt.strategies import SiteUpdate, build_strategy
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.events import ReportReceived, SiteOffline, SiteOnline, Tick, UpdateReceived
from ps_daemon.machine import MAX_DROPPED_SHOWN, Machine, dropped
from ps_daemon.model_init import hash_weights
from ps_daemon.state import DaemonState

SITES = ("site-a", "site-b", "site-c")
WEIGHTS = {"fc.weight": np.zeros((2, 2), np.float32)}
TIMEOUT = 100.0
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def _machine(sites: tuple[str, ...] = SITES, **overrides: Any) -> Machine:
    raw = {"run_id": "r1", "sites": list(sites), "rounds": 2, "quorum": 1, "round_timeout_s": TIMEOUT,
           "model": {"name": "mlp"}, "credentials": "c.toml", **overrides}
    config = DaemonConfig.model_validate(raw)
    return Machine(config, build_strategy(config.algorithm, config.strategy_params()), hash_weights)


def _training(machine: Machine) -> DaemonState:
    state = machine.initial_state(dict(WEIGHTS))
    for site in machine.config.sorted_sites:
        state, _ = machine.step(state, SiteOnline(site, now=T0))
    assert state.phase == "training"
    return state


def _update(state: DaemonState, site: str, *, no_step: str = "") -> UpdateReceived:
    return UpdateReceived(site, T0 + 2, state.round, state.model_hash,
                          SiteUpdate(site, {"fc.weight": np.ones((2, 2), np.float32)}, 10, 0 if no_step else 2),
                          no_step_reason=no_step)


def _status(effects: list[fx.Effect]) -> fx.PublishStatus:
    found = [e for e in effects if isinstance(e, fx.PublishStatus)]
    assert len(found) == 1, effects
    return found[0]


def test_a_site_that_dies_mid_round_leaves_the_waiting_list_at_once() -> None:
    # Prepare
    machine = _machine()
    state = _training(machine)
    # Execute: c's Will arrives (held 3 s by the runner: it arrived at T0 + 1, believed at T0 + 4)
    state, effects = machine.step(state, SiteOffline("site-c", T0 + 4, since=T0 + 1))
    # Assert
    status = _status(effects)
    assert status.waiting_for == ("site-a", "site-b")
    assert status.dropped == {"site-c": "offline since 2027-01-15T08:00:01Z"}
    assert status.detail == "site site-c went offline during round 1: round 1: 0/2 updates (1 offline, not waited for)"
    assert state.offline_since == {"site-c": T0 + 1}


def test_progress_counts_only_the_sites_that_can_still_answer() -> None:
    machine = _machine()
    state = _training(machine)
    state, _ = machine.step(state, SiteOffline("site-c", T0 + 1))
    state, effects = machine.step(state, _update(state, "site-a"))
    status = _status(effects)
    assert status.detail == "round 1: 1/2 updates (1 offline, not waited for)"
    assert status.waiting_for == ("site-b",) and set(status.dropped) == {"site-c"}


def test_the_next_round_trains_on_the_sites_that_can_answer() -> None:
    """The dead site is still selected (its retained task waits for it), but "training on" does not count it."""
    machine = _machine()
    state = _training(machine)
    state, _ = machine.step(state, SiteOffline("site-c", T0 + 1))
    state, _ = machine.step(state, _update(state, "site-a"))
    state, effects = machine.step(state, _update(state, "site-b"))
    assert state.round == 2 and state.selected == SITES
    status = _status(effects)
    assert status.detail == "round 2: training on 2 sites (1 offline, not waited for)"
    assert status.waiting_for == ("site-a", "site-b") and set(status.dropped) == {"site-c"}


def test_a_site_that_comes_back_is_waited_for_again() -> None:
    machine = _machine()
    state = _training(machine)
    state, _ = machine.step(state, SiteOffline("site-c", T0 + 1))
    # Execute
    state, effects = machine.step(state, SiteOnline("site-c", T0 + 5))
    # Assert
    status = _status(effects)
    assert status.waiting_for == SITES and status.dropped == {}
    assert status.detail == "site site-c is back: round 1: 0/3 updates"
    assert state.offline_since == {}
    # a status of a site that never left changes nothing on ps/status (every site sends many)
    _, effects = machine.step(state, SiteOnline("site-a", T0 + 6))
    assert effects == []


def test_a_second_will_of_a_dropped_site_says_nothing_new() -> None:
    machine = _machine()
    state = _training(machine)
    state, _ = machine.step(state, SiteOffline("site-c", T0 + 1))
    state, effects = machine.step(state, SiteOffline("site-c", T0 + 9))
    assert effects == [] and state.offline_since == {"site-c": T0 + 1}  # since the first one


def test_an_answer_without_a_step_is_dropped_from_the_aggregate_with_why() -> None:
    machine = _machine()
    state = _training(machine)
    state, effects = machine.step(state, _update(state, "site-b", no_step="no labelled training row"))
    status = _status(effects)
    assert status.dropped == {"site-b": "no step possible: no labelled training row"}
    assert status.waiting_for == ("site-a", "site-c")


def test_the_deadline_names_offline_sites_apart_from_those_it_waits_for() -> None:
    machine = _machine(quorum=3)
    state = _training(machine)
    state, _ = machine.step(state, _update(state, "site-a"))
    state, _ = machine.step(state, SiteOffline("site-c", T0 + 1))
    state, effects = machine.step(state, Tick(T0 + TIMEOUT + 1))
    status = _status(effects)
    assert status.waiting_for == ("site-b",) and set(status.dropped) == {"site-c"}
    assert status.detail == ("round 1: deadline passed with 1 updates, quorum 3; still waiting for site-b; offline: "
                             "site-c (only 2 can still answer: the quorum needs offline sites back)")


def test_the_final_status_names_the_sites_without_a_report_and_why() -> None:
    machine = _machine(rounds=1)
    state = _training(machine)
    for site in SITES:
        state, _ = machine.step(state, _update(state, site))
    assert state.phase == "evaluating"
    state, effects = machine.step(state, SiteOffline("site-b", T0 + 3))
    assert _status(effects).dropped == {"site-b": "offline since 2027-01-15T08:00:03Z"}
    assert _status(effects).waiting_for == ("site-a", "site-c")
    state, _ = machine.step(state, ReportReceived("site-a", T0 + 4, state.round, state.model_hash, "final", {}))
    state, effects = machine.step(state, Tick(T0 + 2 + TIMEOUT + 1))
    assert state.phase == "done"
    status = _status(effects)
    assert status.waiting_for == ()
    assert status.dropped == {"site-b": "offline since 2027-01-15T08:00:03Z",
                              "site-c": "deadline missed: no final report"}


def test_the_dropped_list_on_ps_status_is_bounded() -> None:
    sites = tuple(f"s{i:03d}" for i in range(MAX_DROPPED_SHOWN + 36))
    machine = _machine(sites)
    state = _training(machine)
    for site in sites[1:]:
        state, effects = machine.step(state, SiteOffline(site, T0 + 1))
    assert len(dropped(state)) == len(sites) - 1
    status = _status(effects)
    assert len(status.dropped) == MAX_DROPPED_SHOWN and status.waiting_for == ("s000",)
    assert status.detail.endswith(f"({len(sites) - 1} offline, not waited for)")
