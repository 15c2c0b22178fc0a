"""The transition table (ps_daemon.transitions): complete, the only dispatch of `Machine.step`, and true about
where each handler can lead; and the strategy's round hooks, which the machine calls without knowing the rule."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from secagg_examples import secagg_examples

from fedmqtt.data.feature_stats import column_grid, summarise
from fedmqtt.data.feature_wire import summary_message
from fedmqtt.strategies import FeatureStatistics, FedAvg, LayerStats, RoundRequirements, SiteUpdate, build_strategy
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.events import (
    Event,
    FeatureSummaryReceived,
    ReportReceived,
    RoundValidated,
    SecAggReceived,
    SiteOffline,
    SiteOnline,
    Started,
    Tick,
    UpdateReceived,
)
from ps_daemon.machine import Machine
from ps_daemon.runner import hash_weights
from ps_daemon.state import DaemonState, Phase
from ps_daemon.transitions import EVENTS, PHASES, TRANSITIONS

SITES = ("site-a", "site-b", "site-c")
TIMEOUT, STALL = 100.0, 30.0
ADVERT = secagg_examples("r1")[0]  # a site's key advertisement (these runs aggregate in the clear: it is refused)
# Exits only a run under secure aggregation takes, with real keys: tests/unit/test_machine_secagg.py takes them
# (test_the_last_rounds_sum_starts_the_final_evaluation).
SECURE_ONLY_EXITS = {("training", SecAggReceived): {"evaluating"}}


def _config(**overrides: Any) -> DaemonConfig:
    return DaemonConfig.model_validate({
        "run_id": "r1", "sites": list(SITES), "rounds": 2, "quorum": 2, "round_timeout_s": TIMEOUT,
        "stall_s": STALL, "model": {"name": "mlp", "args": {}}, "credentials": "creds.toml", **overrides})


def _summary(site: str) -> Any:
    """A site's feature summary (two columns of made-up training values)."""
    x = np.random.default_rng(len(site)).uniform(0, 1, (20, 2))
    grid = column_grid(("a", "b"), {})
    return summary_message(summarise(x, grid), grid, ("a", "b"), run_id="r1", sender=site)


SUMMARIES = {site: _summary(site) for site in (*SITES, "stranger")}


def _weights(value: float = 0.0) -> dict[str, np.ndarray]:
    return {"fc.weight": np.full((2, 2), value, np.float32)}


def _one_of_each(now: float = 1.0) -> dict[type, Event]:
    update = SiteUpdate("site-a", _weights(1.0), 10, 3)
    return {Started: Started(now), SiteOnline: SiteOnline("site-a", now, 10), SiteOffline: SiteOffline("site-a", now),
            UpdateReceived: UpdateReceived("site-a", now, 1, "", update),
            ReportReceived: ReportReceived("site-a", now, 3, "", "final", {}), Tick: Tick(now),
            SecAggReceived: SecAggReceived("site-a", now, 1, ADVERT),
            FeatureSummaryReceived: FeatureSummaryReceived("site-a", now, SUMMARIES["site-a"]),
            RoundValidated: RoundValidated(now, 1, "", {"site-a": {"auroc": 0.5}})}


def test_every_phase_and_event_has_one_row() -> None:
    assert set(PHASES) == {"waiting_for_sites", "training", "evaluating", "done"}
    assert set(EVENTS) == set(_one_of_each())
    assert set(TRANSITIONS) == set(itertools.product(PHASES, EVENTS))


@pytest.mark.parametrize("key", list(TRANSITIONS), ids=lambda k: f"{k[0]}-{k[1].__name__}")
def test_each_row_names_a_handler_of_the_machine_and_known_phases(key: tuple[Phase, type]) -> None:
    transition = TRANSITIONS[key]
    assert callable(getattr(Machine, transition.handler, None)), transition.handler  # its own or SecureSteps'
    assert transition.next_phases and set(transition.next_phases) <= set(PHASES)
    assert transition.does.strip()


@pytest.mark.parametrize("key", list(TRANSITIONS), ids=lambda k: f"{k[0]}-{k[1].__name__}")
def test_step_runs_the_handler_its_row_names(key: tuple[Phase, type]) -> None:
    # Prepare: the named handler replaced by a recorder on this machine only
    phase, event_type = key
    machine = Machine(_config(), FedAvg(), hash_weights)
    state = dataclasses.replace(machine.initial_state(_weights()), phase=phase)
    event = _one_of_each()[event_type]
    calls: list[tuple[DaemonState, Event]] = []

    def recorder(st: DaemonState, ev: Event) -> tuple[DaemonState, list[fx.Effect]]:
        calls.append((st, ev))
        return st, []

    setattr(machine, TRANSITIONS[key].handler, recorder)
    # Execute
    machine.step(state, event)
    # Assert
    assert calls == [(state, event)]


def test_an_unknown_event_is_a_type_error() -> None:
    machine = Machine(_config(), FedAvg(), hash_weights)
    with pytest.raises(TypeError, match="unknown event"):
        machine.step(machine.initial_state(_weights()), "site-a went online")  # type: ignore[arg-type]


# -- the table is true: random runs only ever move along its rows ----------------------------------------
def _random_event(rng: random.Random, state: DaemonState, now: float) -> Event:
    site = rng.choice([*SITES, "stranger"])
    kind = rng.choice(["started", "online", "offline", "update", "update", "update", "report", "report", "tick",
                       "secagg", "features", "validated", "validated"])
    if kind == "started":
        return Started(now)
    if kind == "online":
        return SiteOnline(site, now, 10)
    if kind == "offline":
        return SiteOffline(site, now)
    if kind == "update":
        stale = rng.random() < 0.1
        return UpdateReceived(site, now, state.round - stale, state.model_hash,
                              SiteUpdate(site, _weights(rng.random()), 10, 3), 0.5, {"auroc": rng.random()})
    if kind == "report":
        return ReportReceived(site, now, state.round, state.model_hash, "final", {"test": {"auroc": 0.5}})
    if kind == "secagg":
        return SecAggReceived(site, now, state.round, ADVERT)
    if kind == "features":
        return FeatureSummaryReceived(site, now, SUMMARIES[site])
    if kind == "validated":  # a site's validation (evaluation = "all"), now and then of another round
        return RoundValidated(now, state.round - (rng.random() < 0.1), state.model_hash,
                              {site: {"auroc": rng.random()}})
    return Tick(now)


def test_random_runs_move_only_along_the_rows_and_use_every_exit() -> None:
    """Thousands of random events from a fresh PS: each step ends in a phase its row lists, and every phase a
    row lists is reached by some step (the table neither forbids nor promises too much)."""
    seen: dict[tuple[Phase, type], set[Phase]] = {key: set() for key in TRANSITIONS}
    for seed in range(300):
        rng = random.Random(seed)
        # With a draw of two sites of three, one site each round validates without training (evaluation = "all")
        sampled = {"selection": "fraction", "fraction": 0.67} if rng.random() < 0.5 else {}
        machine = Machine(_config(min_sites=rng.choice([1, 2, 3]), feature_statistics=rng.choice(["site", "federated"]),
                                  evaluation=rng.choice(["selected", "all"]), **sampled), FedAvg(), hash_weights)
        state, now = machine.initial_state(_weights()), 0.0
        for _ in range(80):
            now += rng.choice([0.0, 1.0, STALL, TIMEOUT])
            event = _random_event(rng, state, now)
            before = state.phase
            state, _ = machine.step(state, event)
            seen[before, type(event)].add(state.phase)
            assert state.phase in TRANSITIONS[before, type(event)].next_phases, (before, event, state.phase)
    unused = {f"{p}/{e.__name__}": sorted(set(t.next_phases) - seen[p, e] - SECURE_ONLY_EXITS.get((p, e), set()))
              for (p, e), t in TRANSITIONS.items()
              if set(t.next_phases) - seen[p, e] - SECURE_ONLY_EXITS.get((p, e), set())}
    assert not unused, f"exits no random run took: {unused}"


# -- the strategy's round hooks ------------------------------------------------------------------------------
class _WantsStatistics(FedAvg):
    """A rule the machine has never heard of: statistics with round 2's updates, and a log of what it saw."""

    name = "wants-statistics"

    def __init__(self) -> None:
        super().__init__()
        self.observed: list[tuple[int, dict[str, LayerStats]]] = []

    def round_requirements(self, round_no: int) -> RoundRequirements:
        return RoundRequirements(FeatureStatistics.PENULTIMATE if round_no == 2 else None)

    def observe_round(self, round_no: int, feature_stats: Mapping[str, LayerStats]) -> None:
        self.observed.append((round_no, dict(feature_stats)))


def _stats(k: int) -> LayerStats:
    return {"head": (np.array([float(k), 0.0]), np.array([1.0, 1.0 + k]))}


def _run_round(machine: Machine, state: DaemonState, now: float, *, with_stats: bool) -> tuple[DaemonState, list]:
    effects: list = []
    for k, site in enumerate(SITES):
        extras = {"feature_stats": _stats(k)} if with_stats else {}
        update = SiteUpdate(site, _weights(float(k)), 10, 3, extras)
        state, effects = machine.step(state, UpdateReceived(site, now, state.round, state.model_hash, update, 0.5,
                                                            {"auroc": 0.5}))
    return state, effects


def _started(machine: Machine) -> tuple[DaemonState, list]:
    state = machine.initial_state(_weights())
    effects: list[fx.Effect] = []
    for site in SITES:
        state, effects = machine.step(state, SiteOnline(site, 0.0, 10))
    return state, effects


def _asked(effects: list) -> dict[str, float | None]:
    return {e.site_id: e.hyper.get("feature_stats") for e in effects if isinstance(e, fx.PublishTrainTask)}


def test_tasks_carry_what_the_rule_requires_and_the_rule_observes_what_came_back() -> None:
    # Prepare
    rule = _WantsStatistics()
    machine = Machine(_config(rounds=3), rule, hash_weights)
    state, effects = _started(machine)
    asked = [_asked(effects)]
    # Execute: round 1 without statistics, round 2 with them, round 3 without
    for with_stats in (False, True, False):
        state, effects = _run_round(machine, state, float(state.round), with_stats=with_stats)
        asked.append(_asked(effects))
    # Assert: only round 2's tasks ask (code 2: penultimate features); every round's statistics are handed over
    assert asked[:3] == [dict.fromkeys(SITES), dict.fromkeys(SITES, 2.0), dict.fromkeys(SITES)]
    assert [r for r, _ in rule.observed] == [1, 2, 3]
    assert rule.observed[0][1] == {} and rule.observed[2][1] == {}
    assert sorted(rule.observed[1][1]) == list(SITES)
    np.testing.assert_array_equal(rule.observed[1][1]["site-b"]["head"][1], [1.0, 2.0])


def test_f_adafed_asks_at_the_end_of_its_warmup_and_fixes_w_from_those_statistics() -> None:
    # Prepare
    config = _config(algorithm="f-adafed", rounds=3, hyper={"warmup_rounds": 2})
    machine = Machine(config, build_strategy(config.algorithm, config.strategy_params()), hash_weights)
    state, effects = _started(machine)
    asked = [_asked(effects)]
    # Execute
    for with_stats in (False, True):
        state, effects = _run_round(machine, state, float(state.round), with_stats=with_stats)
        asked.append(_asked(effects))
    # Assert: round 2's tasks ask for the BN running statistics (code 3); after it, W is fixed
    assert asked == [dict.fromkeys(SITES), dict.fromkeys(SITES, 3.0), dict.fromkeys(SITES)]
    assert state.strategy_state["sites"] == list(SITES) and state.strategy_state["distances"].shape == (3, 3)
