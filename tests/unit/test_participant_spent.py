"""Participant-level DP in ps/status, ps/metrics and the report (ps_daemon/participant_spent.py): after every
DP-FedAvg round the status carries the epsilon of the round's record, by the accountant that gave it, with the
rounds charged; a PS resumed from its checkpoint says the same; a run without DP-FedAvg carries none; a record
whose values are out of the wire's range is never shown and never stops the PS."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmqtt.participant_dp import best_gaussian_epsilon
from fedmqtt.strategies import FedAvg, SiteUpdate
from fedmqtt.strategies.base import Strategy
from fedmqtt.strategies.dp_fedavg import DPFedAvg
from ps_daemon import effects as fx
from ps_daemon.checkpoint import CheckpointStore, checkpoint_to_state, state_to_checkpoint
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOnline, Started, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.participant_spent import ACCOUNTANTS, spent_after, spent_so_far
from ps_daemon.report import build_report, render_markdown
from ps_daemon.state import DaemonState, RoundRecord
from schemas import messages as m
from schemas.codec import decode, encode

SITES = ("site-a", "site-b", "site-c")
HYPER = {"clip_norm": 0.5, "noise_multiplier": 1.2, "noise_seed": 7}


def _machine(strategy: Strategy, **overrides: Any) -> Machine:
    raw = {"run_id": "pdp", "sites": list(SITES), "rounds": 4, "quorum": 1, "round_timeout_s": 100.0,
           "model": {"name": "mlp", "args": {}}, "credentials": "creds.toml", **overrides}
    return Machine(DaemonConfig.model_validate(raw), strategy, hash_weights)


def _dp_machine() -> Machine:
    return _machine(DPFedAvg(HYPER), algorithm="dp-fedavg", hyper=HYPER)


def _start(machine: Machine) -> DaemonState:
    state = machine.initial_state({"fc.weight": np.zeros((2, 2), np.float32)})
    for site in SITES:
        state, _ = machine.step(state, SiteOnline(site, now=0.0))
    assert state.phase == "training"
    return state


def _round(machine: Machine, state: DaemonState, now: float) -> tuple[DaemonState, list[fx.Effect]]:
    effects: list[fx.Effect] = []
    for i, site in enumerate(SITES):
        update = SiteUpdate(site, {"fc.weight": np.full((2, 2), 0.3 * (i + 1), np.float32)}, 10, 3)
        state, effects = machine.step(state, UpdateReceived(site_id=site, now=now, round=state.round,
                                                            base_model_hash=state.model_hash, update=update,
                                                            train_loss=0.2, val_metrics={"auroc": 0.6}))
    return state, effects


def _statuses(effects: list[fx.Effect]) -> list[fx.PublishStatus]:
    return [e for e in effects if isinstance(e, fx.PublishStatus)]


def test_the_status_after_every_dp_fedavg_round_carries_the_rounds_epsilon() -> None:
    machine = _dp_machine()
    state = _start(machine)
    for r in range(1, 5):
        state, effects = _round(machine, state, now=float(r))
        record = state.history[-1]
        assert record.round == r
        status = _statuses(effects)[-1]
        spent = status.participant_dp
        assert spent is not None
        assert spent.epsilon == record.server["epsilon"] and spent.delta == record.server["delta"] == 1e-5
        eps, accountant = best_gaussian_epsilon(HYPER["noise_multiplier"], r, 1e-5)
        assert (spent.epsilon, spent.accountant, spent.rounds, spent.round) == (pytest.approx(eps), accountant, r, r)
        # ps/metrics of the round says the same
        metrics = [e for e in effects if isinstance(e, fx.PublishRoundMetrics)]
        assert spent_after(metrics[0].record) == spent
    assert state.phase == "evaluating"


def test_a_resumed_ps_says_the_epsilon_it_had_before_it_stopped(tmp_path: Path) -> None:
    """Through a checkpoint file (msgpack, as a restarted PS reads it), not from the strategy's memory."""
    machine = _dp_machine()
    state = _start(machine)
    for r in (1, 2):
        state, effects = _round(machine, state, now=float(r))
    before = _statuses(effects)[-1].participant_dp
    assert before is not None and before.rounds == 2
    store = CheckpointStore(tmp_path)
    store.save(state_to_checkpoint(state, run_id="pdp", config_hash=machine.config.config_hash()))
    ckpt = store.load_latest(run_id="pdp", config_hash=machine.config.config_hash())
    fresh = _dp_machine()  # a new process: a new strategy object that has spent nothing yet
    resumed = checkpoint_to_state(ckpt, tmp_path)
    resumed, effects = fresh.step(resumed, Started(now=50.0))
    assert _statuses(effects)[-1].participant_dp == before
    resumed, effects = _round(fresh, resumed, now=51.0)  # and the accountant goes on from 2 rounds
    after = _statuses(effects)[-1].participant_dp
    assert after is not None and after.rounds == 3 and after.epsilon > before.epsilon


def _gauge(machine: Machine, state: DaemonState) -> float | None:
    """The Prometheus endpoint's epsilon (fedmqtt_ps_privacy_epsilon) for this state, as the PS builds it."""
    from fedmqtt.transport.bulk import TransferStats
    from fedmqtt.transport.channel import ChannelStats
    from ps_daemon.monitoring import DurationTally, SnapshotBuilder

    return SnapshotBuilder(machine.config).build(
        state, channel_stats=ChannelStats(), transfers=TransferStats(), ps_refusals={}, bytes_sent=0,
        bytes_received=0, broker_connected=True, broker_connects=1, upload_turns=0,
        checkpoints=DurationTally()).epsilon


def _older(record: RoundRecord) -> RoundRecord:
    """The record as a version before `epsilon_<accountant>` wrote it: epsilon without whose bound it is."""
    return replace(record, server={k: v for k, v in record.server.items()
                                   if k not in {f"epsilon_{a}" for a in ACCOUNTANTS}})


@pytest.mark.parametrize("kept", ["as written", "older records", "last epsilon out of range"])
def test_ps_status_and_the_prometheus_gauge_agree_after_a_resume(tmp_path: Path, kept: str) -> None:
    """Both read the checkpointed round records through one function: whatever the records hold, the gauge shows
    the epsilon ps/status shows, or nothing where ps/status shows none."""
    # Prepare: two DP-FedAvg rounds, their records as the checkpoint keeps them
    machine = _dp_machine()
    state = _start(machine)
    for r in (1, 2):
        state, _ = _round(machine, state, now=float(r))
    history = state.history
    if kept == "older records":
        history = tuple(_older(r) for r in history)
    elif kept == "last epsilon out of range":
        history = (*history[:-1], replace(history[-1], server={**history[-1].server, "epsilon": 1e10}))
    store = CheckpointStore(tmp_path)
    store.save(state_to_checkpoint(replace(state, history=history), run_id="pdp",
                                   config_hash=machine.config.config_hash()))
    # Execute: a new PS process resumes from the file
    fresh = _dp_machine()
    resumed = checkpoint_to_state(store.load_latest(run_id="pdp", config_hash=fresh.config.config_hash()), tmp_path)
    resumed, effects = fresh.step(resumed, Started(now=50.0))
    status = _statuses(effects)[-1].participant_dp
    gauge = _gauge(fresh, resumed)
    # Assert
    assert gauge == (None if status is None else status.epsilon)
    if kept == "as written":
        assert status is not None and status.rounds == 2 and gauge == history[-1].server["epsilon"]
    elif kept == "older records":
        assert status is None and gauge is None  # no accountant named: neither shows a number
    else:
        assert status is not None and status.round == 1 and gauge == history[0].server["epsilon"]


def test_without_dp_fedavg_no_status_carries_participant_level_epsilon() -> None:
    machine = _machine(FedAvg(), rounds=2)
    state = machine.initial_state({"fc.weight": np.zeros((2, 2), np.float32)})
    seen: list[fx.PublishStatus] = []
    for site in SITES:
        state, effects = machine.step(state, SiteOnline(site, now=0.0))
        seen += _statuses(effects)
    for r in (1, 2):
        state, effects = _round(machine, state, now=float(r))
        seen += _statuses(effects)
    assert len(seen) >= 4 and all(s.participant_dp is None for s in seen)
    assert all(spent_after(record) is None for record in state.history)


def test_the_wire_carries_it_in_ps_status_and_ps_metrics() -> None:
    spent = m.ParticipantSpent(epsilon=2.31, delta=1e-5, accountant="prv", rounds=7, round=7)
    status = m.DaemonStatus(run_id="pdp", sender="ps", round=8, state="training", participant_dp=spent)
    assert decode(encode(status)) == status
    metrics = m.RoundMetrics(run_id="pdp", sender="ps", round=7, sites=SITES, per_site={}, mean={},
                             participant_dp=spent)
    assert decode(encode(metrics)) == metrics
    for bad in ({"epsilon": math.inf}, {"epsilon": -0.1}, {"delta": 1.0}, {"accountant": "moments"},
                {"rounds": -1}, {"epsilon": 1e10}):
        with pytest.raises(ValueError):
            m.ParticipantSpent.model_validate({**spent.model_dump(), **bad})


def _record(round_no: int, server: dict[str, float]) -> RoundRecord:
    return RoundRecord(round=round_no, sites=SITES, stragglers=(), per_site={}, mean={}, train_loss=None,
                       n_samples={}, started_at=0.0, closed_at=1.0, server=server)


GOOD = {"epsilon": 1.5, "delta": 1e-5, "epsilon_rounds": 3.0, "epsilon_rdp": 1.5, "clip_norm": 0.5}


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["epsilon", "delta", "epsilon_rounds", "epsilon_rdp", "epsilon_prv",
                                        "epsilon_skellam", "clip_norm"]),
                       st.floats(allow_nan=True, allow_infinity=True) | st.integers(-2**70, 2**70)))
def test_a_record_out_of_the_wires_range_is_never_shown_and_never_raises(server: dict[str, float]) -> None:
    spent = spent_after(_record(3, server))
    if spent is None:
        return
    # Shown only when it is exactly what the record says, in range
    assert spent.epsilon == server["epsilon"] and 0 <= spent.epsilon <= 1e9
    assert spent.delta == server["delta"] and 0 < spent.delta < 1
    assert spent.rounds == server["epsilon_rounds"] and f"epsilon_{spent.accountant}" in server


def test_the_newest_charged_round_stands_and_two_accountants_in_one_record_are_refused() -> None:
    older, newer = _record(1, GOOD), _record(2, {**GOOD, "epsilon": 2.0, "epsilon_rounds": 4.0})
    uncharged = _record(3, {"clip_norm": 0.5})  # no update in it: nothing released
    spent = spent_so_far([older, newer, uncharged])
    assert spent is not None and (spent.epsilon, spent.rounds, spent.round) == (2.0, 4, 2)
    assert spent_after(_record(1, {**GOOD, "epsilon_prv": 1.5})) is None
    assert spent_after(_record(1, {"epsilon": 1.0, "delta": 1e-5})) is None  # an older record: no accountant named
    assert spent_so_far([]) is None


def test_the_report_shows_it_per_round_and_final_beside_the_record_level_one() -> None:
    machine = _dp_machine()
    state = _start(machine)
    for r in range(1, 5):
        state, _ = _round(machine, state, now=float(r))
    record_level = {"site-a": m.PrivacySpent(epsilon=0.75, delta=1e-5, noise_multiplier=1.1, sample_rate=0.1,
                                             steps=40).model_dump()}
    report = build_report(machine.config, state, timings={"total_s": 1.0}, traffic={}, models={},
                          privacy=record_level)
    section = report["privacy"]["participant_level"]
    assert [p["round"] for p in section["per_round"]] == [1, 2, 3, 4]
    assert section["final"] == section["per_round"][-1]
    assert section["final"]["epsilon"] == state.history[-1].server["epsilon"]
    md = render_markdown(report)
    final = section["final"]
    assert (f"Participant-level DP (each hospital's whole data, in every released model): epsilon "
            f"{final['epsilon']:.3g} at delta 1e-05 after 4 charged rounds ({final['accountant']} accountant).") in md
    assert f"| 2 | {section['per_round'][1]['epsilon']:.3g} | 1e-05 | " in md
    assert "| site-a | 0.75 | 1e-05 | rdp | 40 |" in md
    plain = _machine(FedAvg(), rounds=1)
    state = _start(plain)
    state, _ = _round(plain, state, now=1.0)
    report = build_report(plain.config, state, timings={"total_s": 1.0}, traffic={}, models={})
    assert report["privacy"]["participant_level"] is None
    assert "Differential privacy" not in render_markdown(report)


def test_fedmqtt_report_lists_each_runs_final_epsilons_and_refuses_invalid_ones(tmp_path: Path) -> None:
    from fedmqtt.experiments.privacy import privacy_markdown, privacy_rows, privacy_text
    from fedmqtt.experiments.runs import RunRecord

    spent = m.ParticipantSpent(epsilon=2.31, delta=1e-5, accountant="prv", rounds=7, round=7).model_dump()
    site = m.PrivacySpent(epsilon=0.75, delta=1e-5, noise_multiplier=1.1, sample_rate=0.1, steps=40).model_dump()
    two_sites = {"a": site, "b": {**site, "epsilon": 0.5}}
    privacy = {"dp": {"participant_level": {"final": spent}, "record_level": two_sites},
               "plain": {"participant_level": None, "record_level": {}},
               "bad": {"participant_level": {"final": {**spent, "epsilon": -1}}, "record_level": {"a": "x"}}}
    records = []
    for name, section in privacy.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps({"privacy": section}))
        records.append(RunRecord(path=tmp_path / name, algorithm="dp-fedavg", norm="none", seed=3, partition="",
                                 sites=(), final_test={}, best_test=None, best_round=None, curve=()))
    rows = privacy_rows(records)
    assert rows[1:] == [["dp", "dp-fedavg", "3", "2.31 at 1e-05 after 7 rounds (prv)", "0.75 at 1e-05 (2 sites)"],
                        ["bad", "dp-fedavg", "3", "invalid", "invalid"]]
    assert "| dp | dp-fedavg | 3 | 2.31 at 1e-05 after 7 rounds (prv) |" in privacy_markdown(records)
    assert privacy_text(records[1:2]) == "" and privacy_markdown(records[1:2]) == ""
