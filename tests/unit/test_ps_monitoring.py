"""What the PS's metrics say, before Prometheus sees them: snapshots of its state and counters, labels bounded."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fedmqtt.transport.bulk import TransferStats
from fedmqtt.transport.channel import ChannelStats
from ps_daemon.config import DaemonConfig
from ps_daemon.monitoring import (
    KNOWN_REASONS,
    OTHER,
    ROUND_SECONDS_BUCKETS,
    DurationTally,
    PsSnapshot,
    SnapshotBuilder,
)
from ps_daemon.refusals import REFUSAL_CATEGORIES
from ps_daemon.state import DaemonState, RoundRecord

SITES = ("site-a", "site-b", "site-c")
REPO = Path(__file__).resolve().parents[2]


def config(**overrides: Any) -> DaemonConfig:
    return DaemonConfig.model_validate({"run_id": "r1", "sites": list(SITES), "rounds": 5,
                                        "model": {"name": "mlp", "args": {}}, "credentials": "creds.toml",
                                        **overrides})


def record(round_no: int, sites: tuple[str, ...], *, seconds: float, stragglers: tuple[str, ...] = (),
           skipped: dict[str, str] | None = None, auroc: float | None = 0.7) -> RoundRecord:
    return RoundRecord(round=round_no, sites=sites, stragglers=stragglers, per_site={}, mean={"auroc": auroc},
                       train_loss=0.5, n_samples={}, started_at=100.0, closed_at=100.0 + seconds,
                       skipped=skipped or {})


def state(*history: RoundRecord, **kw: Any) -> DaemonState:
    base: dict[str, Any] = {"phase": "training", "round": len(history) + 1, "weights": {}, "model_hash": "h",
                            "session": "s1", "history": tuple(history)}
    return DaemonState(**{**base, **kw})


def snapshot(builder: SnapshotBuilder, s: DaemonState, *, channel: ChannelStats | None = None,
             ps_refusals: dict[str, Counter[str]] | None = None) -> PsSnapshot:
    return builder.build(s, channel_stats=channel or ChannelStats(), transfers=TransferStats(),
                         ps_refusals=ps_refusals or {}, bytes_sent=10, bytes_received=20, broker_connected=True,
                         broker_connects=1, upload_turns=0, checkpoints=DurationTally())


def test_closed_rounds_count_accepted_updates_stragglers_and_durations() -> None:
    # Prepare: round 1 with every site, round 2 without site-c, whose answer in round 3 took no step
    history = (record(1, ("site-a", "site-b", "site-c"), seconds=3.0),
               record(2, ("site-a", "site-b"), seconds=45.0, stragglers=("site-c",)),
               record(3, ("site-a", "site-b"), seconds=50_000.0, skipped={"site-c": "no rows"}, auroc=0.9))
    # Execute
    snap = snapshot(SnapshotBuilder(config()), state(*history, online=frozenset({"site-a", "stranger"})))
    # Check
    assert snap.rounds_closed == 3 and snap.round == 4 and snap.phase == "training"
    assert snap.accepted == {"site-a": 3, "site-b": 3, "site-c": 1}
    assert snap.stragglers == {"site-c": 1} and snap.no_step == {"site-c": 1}
    assert snap.online == {"site-a"}  # a site outside the config is never a label
    bounds = ROUND_SECONDS_BUCKETS
    assert snap.round_seconds.cumulative[bounds.index(5)] == 1 and snap.round_seconds.cumulative[bounds.index(60)] == 2
    assert snap.round_seconds.cumulative[-1] == 2 and snap.round_seconds.count == 3  # 50 000 s: only in +Inf
    assert snap.round_seconds.total == pytest.approx(50_048.0)
    assert snap.last_round_seconds == pytest.approx(50_000.0) and snap.last_round_metric == pytest.approx(0.9)


def test_each_closed_round_is_counted_once_however_often_it_is_sampled() -> None:
    builder = SnapshotBuilder(config())
    first = record(1, ("site-a",), seconds=1.0)
    snapshot(builder, state(first))
    snapshot(builder, state(first))
    snap = snapshot(builder, state(first, record(2, ("site-a", "site-b"), seconds=1.0)))
    assert snap.accepted == {"site-a": 2, "site-b": 1} and snap.round_seconds.count == 2


def test_refusals_are_summed_under_bounded_site_and_reason_labels() -> None:
    # Prepare: the channel's and the PS's own counts, from known sites, a stranger, and an unparseable topic
    channel = ChannelStats()
    channel.count_rejection("site-a", "malformed")
    channel.count_rejection("site-a", "malformed")
    channel.count_rejection("mallory", "wrong sender")
    channel.count_rejection("?", "bad topic")
    ps_own = {"site-a": Counter({"wrong round": 1, "a category nobody knows": 2}), "site-b": Counter(malformed=1)}
    # Execute
    snap = snapshot(SnapshotBuilder(config()), state(), channel=channel, ps_refusals=ps_own)
    # Check
    assert snap.refused == {("site-a", "malformed"): 2, ("site-a", "wrong round"): 1, ("site-a", OTHER): 2,
                            ("site-b", "malformed"): 1, (OTHER, "wrong sender"): 1, (OTHER, "bad topic"): 1}
    assert {site for site, _ in snap.refused} <= {*SITES, OTHER}


def test_every_refusal_category_the_ps_uses_is_a_known_reason() -> None:
    """The categories of ps_daemon.refusals, and every literal one the PS passes to `refuse(...)`."""
    literals = set()
    for path in (REPO / "ps_daemon").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "refuse" and len(node.args) >= 2:
                if isinstance(node.args[1], ast.Constant):
                    literals.add(node.args[1].value)
    assert literals, "no refuse(site, category, ...) call found: has the PS's refusal hook moved?"
    assert literals | {label for _, label in REFUSAL_CATEGORIES} | {"refused"} <= KNOWN_REASONS


def test_waiting_ps_has_no_round_answers_best_round_or_epsilon() -> None:
    snap = snapshot(SnapshotBuilder(config()), state(phase="waiting_for_sites", round=0, last_progress=0.0))
    assert (snap.round, snap.round_answers, snap.rounds_closed) == (0, 0, 0)
    assert snap.best_round is None and snap.last_round_seconds is None and snap.last_progress is None
    assert snap.epsilon is None  # no privacy accountant yet: nothing to report, not a made-up number


def test_a_duration_tally_counts_only_blocks_that_finish() -> None:
    tally = DurationTally()
    with tally.measure():
        pass
    with pytest.raises(OSError), tally.measure():
        raise OSError("disk full")
    assert tally.count == 1 and tally.last_s is not None and tally.total_s == tally.last_s >= 0


def test_metrics_settings_are_off_by_default_on_loopback_and_do_not_change_the_run() -> None:
    """Turning the endpoint on or moving it must not stop a --resume (the config hash leaves it out)."""
    plain = config()
    watched = config(metrics={"port": 9464, "bind": "::1", "linger_s": 30})
    assert plain.metrics.port is None and plain.metrics.bind == "127.0.0.1"
    assert plain.config_hash() == watched.config_hash()
    for bad in ({"port": 0}, {"port": 70000}, {"bind": "1.2.3.4; rm"}, {"linger_s": -1}, {"prot": 1}):
        with pytest.raises(ValueError, match="metrics"):
            config(metrics=bad)


def test_privacy_spent_is_the_latest_participant_level_epsilon_and_none_without_a_dp_rule() -> None:
    from dataclasses import replace

    from ps_daemon.monitoring import privacy_spent

    dp_run = config(algorithm="dp-fedavg")
    plain = (record(1, ("site-a",), seconds=1.0), record(2, ("site-a",), seconds=1.0))
    assert privacy_spent(dp_run, state(*plain)) is None
    spending = {"delta": 1e-5, "clip": 1.0}
    dp = (replace(plain[0], server={**spending, "epsilon": 0.4, "epsilon_rounds": 1.0, "epsilon_rdp": 0.4}),
          replace(plain[1], server={**spending, "epsilon": 0.9, "epsilon_rounds": 2.0, "epsilon_prv": 0.9}))
    assert privacy_spent(dp_run, state(*dp)) == 0.9
    assert privacy_spent(dp_run, state(dp[0], plain[1])) == 0.4  # a round whose record lacks it keeps the last value
    assert privacy_spent(config(), state(*dp)) is None  # no DP server rule in the run: no gauge, as in ps/status
