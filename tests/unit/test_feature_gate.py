"""Before round 1, with feature_statistics = "federated", the PS waits for every online site's feature summary,
refuses summaries that cannot be added to the others, combines them, publishes the federation's statistics and
only then sends round 1 (ps_daemon.feature_gate and the machine's steps; pure, no broker)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from fedmqtt.data.feature_stats import column_grid, summarise
from fedmqtt.data.feature_wire import combine_messages, summary_message
from fedmqtt.strategies import FedAvg
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.events import FeatureSummaryReceived, SiteOffline, SiteOnline, Started
from ps_daemon.feature_gate import summary_rejection
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.state import DaemonState
from schemas.feature_stats import FeatureSummary

SITES = ("site-a", "site-b", "site-c")
NAMES = ("age", "ph", "flag")
RANGES = {"age": (0.0, 120.0), "ph": (6.5, 8.0)}


def _config(**overrides: Any) -> DaemonConfig:
    raw = {"run_id": "r1", "sites": list(SITES), "rounds": 3, "quorum": 2, "model": {"name": "mlp", "args": {}},
           "credentials": "creds.toml", "feature_statistics": "federated", **overrides}
    return DaemonConfig.model_validate(raw)


def _summary(site: str, n: int, seed: int, names: tuple[str, ...] = NAMES) -> FeatureSummary:
    rng = np.random.default_rng(seed)
    x = np.column_stack([rng.uniform(20, 90, n), rng.normal(7.4, 0.05, n), rng.integers(0, 2, n)])[:, :len(names)]
    grid = column_grid(names, RANGES)
    return summary_message(summarise(x, grid), grid, names, run_id="r1", sender=site)


def _start(machine: Machine) -> DaemonState:
    state = machine.initial_state({"w": np.zeros(2, np.float32)}, session="5e55")
    for site in SITES:
        state, _ = machine.step(state, SiteOnline(site, now=1.0, n_train=50))
    return state


def _logs(effects: list[fx.Effect]) -> list[str]:
    return [e.text for e in effects if isinstance(e, fx.Log)]


def test_round_1_waits_for_every_summary_then_publishes_the_statistics_first() -> None:
    machine = Machine(_config(), FedAvg(), hash_weights)
    state = _start(machine)
    assert state.phase == "waiting_for_sites"
    summaries = {s: _summary(s, 40 + 30 * k, k) for k, s in enumerate(SITES)}
    state, effects = machine.step(state, FeatureSummaryReceived("site-b", 2.0, summaries["site-b"]))
    status = [e for e in effects if isinstance(e, fx.PublishStatus)][-1]
    assert status.detail == "waiting for feature summaries from sites site-a, site-c"
    assert "waiting for feature summaries from sites site-a, site-c" in _logs(effects)
    state, _ = machine.step(state, FeatureSummaryReceived("site-a", 3.0, summaries["site-a"]))
    assert state.phase == "waiting_for_sites" and state.feature_statistics is None
    state, effects = machine.step(state, FeatureSummaryReceived("site-c", 4.0, summaries["site-c"]))
    assert state.phase == "training" and state.round == 1
    kinds = [type(e) for e in effects]
    assert kinds.index(fx.PublishFeatureStatistics) < kinds.index(fx.PublishModel) < kinds.index(fx.PublishTrainTask)
    published = next(e for e in effects if isinstance(e, fx.PublishFeatureStatistics)).message
    want = combine_messages(list(summaries.values()), run_id="r1", session="5e55")
    assert published.model_dump(exclude={"msg_id", "sent_at"}) == want.model_dump(exclude={"msg_id", "sent_at"})
    assert published.sites == SITES and state.feature_statistics == published


def test_site_statistics_run_starts_at_once_and_refuses_summaries() -> None:
    machine = Machine(_config(feature_statistics="site"), FedAvg(), hash_weights)
    state = machine.initial_state({"w": np.zeros(2, np.float32)})
    state, _ = machine.step(state, FeatureSummaryReceived("site-a", 1.0, _summary("site-a", 30, 0)))
    assert state.feature_summaries == {}
    for site in SITES:
        state, effects = machine.step(state, SiteOnline(site, now=1.0, n_train=50))
    assert state.phase == "training"
    assert not any(isinstance(e, fx.PublishFeatureStatistics) for e in effects)


def test_summaries_that_do_not_fit_are_refused_and_change_nothing() -> None:
    machine = Machine(_config(), FedAvg(), hash_weights)
    state = _start(machine)
    first = _summary("site-a", 50, 1)
    state, _ = machine.step(state, FeatureSummaryReceived("site-a", 2.0, first))
    hostile = {
        "other columns": _summary("site-b", 50, 2, names=("age", "ph")),
        "another grid": summary_message(*_grid_other(), run_id="r1", sender="site-b"),
        "other fixed columns": first.model_copy(update={"sender": "site-b", "fixed": (2,)}),
    }
    for why, summary in hostile.items():
        after, effects = machine.step(state, FeatureSummaryReceived("site-b", 3.0, summary))
        assert after == state, why
        assert any(why in line and "site-b ignored" in line for line in _logs(effects)), (why, _logs(effects))
    # A second, different summary of a site is refused; the same one again is dropped without a word
    after, effects = machine.step(state, FeatureSummaryReceived("site-a", 3.0, _summary("site-a", 51, 1)))
    assert after == state and "a second, different summary" in _logs(effects)[0]
    assert machine.step(state, FeatureSummaryReceived("site-a", 3.0, first)) == (state, [])
    # An unknown site is refused before anything is held
    assert summary_rejection(machine.config, state.feature_summaries, None, "site-x", _summary("site-x", 9, 3)) \
        == "site not in the PS config"


def _grid_other() -> tuple[Any, Any, tuple[str, ...]]:
    rng = np.random.default_rng(7)
    x = np.column_stack([rng.uniform(20, 90, 30), rng.normal(7.4, 0.05, 30), rng.integers(0, 2, 30)])
    grid = column_grid(NAMES, {})
    return summarise(x, grid), grid, NAMES


def test_a_summary_after_round_1_started_is_refused_unless_its_site_is_in_the_statistics() -> None:
    machine = Machine(_config(min_sites=2), FedAvg(), hash_weights)
    state = machine.initial_state({"w": np.zeros(2, np.float32)})
    for k, site in enumerate(SITES[:2]):
        state, _ = machine.step(state, SiteOnline(site, now=1.0, n_train=50))
        state, _ = machine.step(state, FeatureSummaryReceived(site, 2.0, _summary(site, 30, k)))
    assert state.phase == "training" and state.feature_statistics is not None
    assert state.feature_statistics.sites == SITES[:2]
    # site-c comes late: the statistics are fixed, its summary is refused with the reason
    after, effects = machine.step(state, FeatureSummaryReceived("site-c", 5.0, _summary("site-c", 99, 9)))
    assert after == state and "combined already" in _logs(effects)[0]
    # site-a's summary again (a retained copy replayed after a reconnect or a resume): nothing to say
    assert machine.step(state, FeatureSummaryReceived("site-a", 5.0, _summary("site-a", 30, 0))) == (state, [])


def test_kept_statistics_are_sent_again_and_not_asked_again() -> None:
    """What the runner loads from out_dir on --resume: the PS starts round 1 without waiting for summaries, and a
    resumed round re-publishes the statistics with the round."""
    machine = Machine(_config(), FedAvg(), hash_weights)
    stats = combine_messages([_summary(s, 40, k) for k, s in enumerate(SITES)], run_id="r1")
    state = replace(machine.initial_state({"w": np.zeros(2, np.float32)}), feature_statistics=stats)
    state, effects = machine.step(state, Started(0.0))
    assert [e.message for e in effects if isinstance(e, fx.PublishFeatureStatistics)] == [stats]
    for site in SITES:
        state, effects = machine.step(state, SiteOnline(site, now=1.0, n_train=50))
    assert state.phase == "training" and not any("waiting for feature" in line for line in _logs(effects))
    _, effects = machine.step(state, Started(9.0))
    assert isinstance(effects[0], fx.PublishFeatureStatistics)
    assert any(isinstance(e, fx.PublishFeatureStatistics) for e in machine.resend(state, "reconnected"))


def test_a_site_that_goes_before_sending_its_summary_is_not_waited_for() -> None:
    machine = Machine(_config(min_sites=2), FedAvg(), hash_weights)
    state = _start(machine)
    for k, site in enumerate(SITES[:2]):
        state, effects = machine.step(state, FeatureSummaryReceived(site, 2.0, _summary(site, 30, k)))
    assert state.phase == "waiting_for_sites" and "from sites site-c" in _logs(effects)[0]
    state, _ = machine.step(state, SiteOffline("site-c", 3.0))
    assert state.phase == "training" and state.feature_statistics is not None
    assert state.feature_statistics.sites == SITES[:2]


def test_the_wait_for_summaries_names_what_a_site_reports_and_forgets_it_once_fixed() -> None:
    """A site whose status says "error" (e.g. its data have no columns to summarise) is named with its reason in
    the PS's status while the PS waits for its summary; a later status without the error clears the reason."""
    machine = Machine(_config(), FedAvg(), hash_weights)
    state = machine.initial_state({"w": np.zeros(2, np.float32)}, session="5e55")
    why = "cannot take part in federated feature statistics: not image data; set feature_statistics = \"site\""
    state, _ = machine.step(state, SiteOnline("site-a", now=1.0, n_train=50))
    state, _ = machine.step(state, SiteOnline("site-b", now=1.0, n_train=50, error=why))
    state, effects = machine.step(state, SiteOnline("site-c", now=1.0, n_train=50, error="x" * 5000))
    status = [e for e in effects if isinstance(e, fx.PublishStatus)][-1]
    assert status.detail.startswith("waiting for feature summaries from sites site-a, site-b, site-c; "
                                    f"site-b reports: {why}; site-c reports: xxx")
    assert len(status.detail) <= 2000  # a site's long reason cannot make the PS's status invalid
    state, effects = machine.step(state, SiteOnline("site-b", now=2.0, n_train=50))
    state, effects = machine.step(state, SiteOnline("site-c", now=2.0, n_train=50))
    status = [e for e in effects if isinstance(e, fx.PublishStatus)][-1]
    assert status.detail == "waiting for feature summaries from sites site-a, site-b, site-c"
    assert state.site_errors == {}
