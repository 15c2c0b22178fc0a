"""The PS state machine under secure aggregation, with four sites played by the site driver
(site_agent/secagg_round.py) over the wire kinds: stages close as the sites answer or at their deadlines, the
round closes with FedAvg of the unmasked mean (equal to FedAvg in the clear within the ring's bound), a site lost
after its masked input is recovered, nothing waits in silence, and a failed try starts a new one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from secagg_round import federation, site_ids

from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.weighted import layout_of, mean_error_bound, site_weight, split
from fedmqtt.strategies import FedAvg, SiteUpdate
from fedmqtt.strategies.base import RoundInput, Strategy
from fedmqtt.strategies.feddyn import FedDyn
from fedmqtt.strategies.fednova import FedNova
from fedmqtt.strategies.scaffold import Scaffold
from fedmqtt.transport.bulk import split as split_payload
from ps_daemon import effects as fx
from ps_daemon.admission import masked_manifest_rejection
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SecAggReceived, SiteOffline, SiteOnline, Tick, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights
from ps_daemon.state import DaemonState
from ps_daemon.status import secure_note, status_message
from schemas import secagg as wire
from schemas.codec import decode, encode
from schemas.messages import SecureRoundNote
from schemas.secagg import CLIPPED_SCALAR
from site_agent.secagg_round import SiteRound
from site_agent.secagg_store import SecAggStore

RUN = "secagg-machine"
N = 4
SITES = tuple(site_ids(N))
TIMEOUT, STAGE = 100.0, 10.0


def _machine(strategy: Strategy | None = None, **overrides: Any) -> Machine:
    raw = {"run_id": RUN, "sites": list(SITES), "rounds": 2, "quorum": 1, "round_timeout_s": TIMEOUT,
           "model": {"name": "mlp", "args": {}}, "credentials": "creds.toml",
           "secure_aggregation": {"enabled": True, "stage_timeout_s": STAGE, "fraction_bits": 20, "clip": 4.0},
           **overrides}
    config = DaemonConfig.model_validate(raw)
    return Machine(config, strategy or FedAvg(), hash_weights, verifier=federation(RUN, N).identity("observer").ring)


def _weights() -> dict[str, np.ndarray]:
    return {"fc.weight": np.zeros((2, 3), np.float32), "fc.bias": np.zeros(2, np.float32),
            "bn.num_batches_tracked": np.array(0, np.int64)}


class Sites:
    """The four sites: each trains (a fixed update), then plays its secure aggregation part."""

    def __init__(self, tmp: Path, machine: Machine) -> None:
        rng = np.random.default_rng(3)
        self.machine, self.tmp = machine, tmp
        self.counts = {s: int(rng.integers(20, 100)) for s in SITES}
        self.trained = {s: {"fc.weight": rng.normal(size=(2, 3)).astype(np.float32),
                            "fc.bias": rng.normal(size=2).astype(np.float32)} for s in SITES}
        self.rounds: dict[str, SiteRound] = {}
        self.keys = federation(RUN, N)
        self.delta_c: dict[str, dict[str, np.ndarray]] = {}  # SCAFFOLD's control-variate deltas, when it runs
        self.work: dict[str, tuple[float, float]] = {}  # FedNova's (a_i, tau_i), when it runs

    def driver(self, site: str, state: DaemonState, task: fx.PublishTrainTask) -> SiteRound:
        assert task.secure is not None
        floats, _ = split(self.machine.shared_model(state))
        return SiteRound(SecAggStore(self.tmp / site), self.keys.identity(site), run_id=RUN, session=state.session,
                         round_no=state.round, terms=task.secure,
                         layout=layout_of(floats, variates=task.secure.variates, normalised=task.secure.normalised))


def _trip(message: object) -> Any:
    return decode(encode(message))


def _start(machine: Machine) -> tuple[DaemonState, list[fx.Effect]]:
    state = machine.initial_state(_weights(), session="ab12")
    effects: list[fx.Effect] = []
    for site in SITES:
        state, effects = machine.step(state, SiteOnline(site, now=0.0, n_train=50))
    return state, effects


def _train_and_advertise(machine: Machine, sites: Sites, state: DaemonState, effects: list[fx.Effect],
                         skip: tuple[str, ...] = ()) -> tuple[DaemonState, list[fx.Effect]]:
    tasks = {e.site_id: e for e in effects if isinstance(e, fx.PublishTrainTask)}
    assert set(tasks) == set(SITES) and all(t.secure is not None for t in tasks.values())
    out: list[fx.Effect] = []
    for site in SITES:
        if site in skip:
            continue
        sites.rounds[site] = sites.driver(site, state, tasks[site])
        meta = SiteUpdate(site, {}, sites.counts[site], 3)
        state, out = machine.step(state, UpdateReceived(site, 1.0, state.round, state.model_hash, meta, 0.3,
                                                        {"auroc": 0.7}))
        state, out = machine.step(state, SecAggReceived(site, 1.0, state.round, _trip(sites.rounds[site].advert())))
    return state, out


def _answer(machine: Machine, sites: Sites, state: DaemonState, effects: list[fx.Effect], *,
            silent: tuple[str, ...] = ()) -> tuple[DaemonState, list[fx.Effect]]:
    """Each site answers what the PS sent it (sites in `silent` answer nothing)."""
    out = effects
    for e in [e for e in effects if isinstance(e, fx.PublishSecAgg)]:
        if e.site_id in silent:
            continue
        message, site = _trip(e.message), sites.rounds[e.site_id]
        if isinstance(message, wire.SecAggRoster):
            reply: Any = site.on_roster(message)
        elif isinstance(message, wire.SecAggInbox):
            work = sites.work.get(e.site_id)
            reply = site.on_inbox(message, sites.trained[e.site_id], sites.counts[e.site_id],
                                  sites.delta_c.get(e.site_id), (*work, site.work_bound) if work else None)
        else:
            reply = site.on_unmask(message)
        state, out = machine.step(state, SecAggReceived(e.site_id, 2.0, state.round, _trip(reply)))
    return state, out


def _clear_fedavg(sites: Sites, included: tuple[str, ...]) -> dict[str, np.ndarray]:
    updates = [SiteUpdate(s, {**sites.trained[s], "bn.num_batches_tracked": np.array(0, np.int64)},
                          sites.counts[s], 3) for s in sorted(included)]
    return FedAvg().aggregate_train(RoundInput(1, _weights(), updates, {}, {})).weights


def _bound(machine: Machine, sites: Sites, included: tuple[str, ...], clear: dict[str, np.ndarray]) -> float:
    sa = machine.config.secure_aggregation
    fixed = FixedPoint(sa.clip, sa.fraction_bits, sa.ring_bits, max_sites=N)
    total = float(sum(sites.counts[s] for s in SITES))
    weight = sum(site_weight(sites.counts[s], total) for s in included)
    largest = max(float(np.max(np.abs(v))) for v in clear.values())
    return mean_error_bound(fixed, len(included), weight, largest) + largest * 2.0**-23


def _run_round(tmp: Path, *, silent_at_unmask: tuple[str, ...] = (), machine: Machine | None = None,
               delta_c: dict[str, dict[str, np.ndarray]] | None = None,
               work: dict[str, tuple[float, float]] | None = None) -> tuple[Machine, Sites, DaemonState, list]:
    machine = machine or _machine()
    sites = Sites(tmp, machine)
    sites.delta_c, sites.work = delta_c or {}, work or {}
    state, effects = _start(machine)
    state, effects = _train_and_advertise(machine, sites, state, effects)
    assert state.secure is not None and state.secure.stage == "shares"  # every advert in: rosters went out
    state, effects = _answer(machine, sites, state, effects)  # shares -> inboxes
    assert state.secure is not None and state.secure.stage == "masked"
    state, effects = _answer(machine, sites, state, effects)  # masked inputs -> unmasking requests
    assert state.secure is not None and state.secure.stage == "unmask"
    state, effects = _answer(machine, sites, state, effects, silent=silent_at_unmask)
    if silent_at_unmask:
        assert state.round == 1 and any(isinstance(e, fx.PublishStatus) and "unmasking answers from "
                                        + silent_at_unmask[0] in e.detail for e in effects)
        state, effects = machine.step(state, Tick(2.0 + STAGE))  # the stage's deadline: go on without them
    return machine, sites, state, effects


def test_a_round_closes_with_fedavg_of_the_secure_sum(tmp_path: Path) -> None:
    machine, sites, state, effects = _run_round(tmp_path)
    assert state.round == 2 and state.secure is not None and state.secure.stage == "keys"  # round 2's first try
    record = state.history[-1]
    assert record.sites == SITES and record.secure["dropped"] == [] and record.secure["tries"] == 1
    assert record.mean["auroc"] == pytest.approx(0.7)  # the sites' metrics still reach the report
    clear = _clear_fedavg(sites, SITES)
    bound = _bound(machine, sites, SITES, clear)
    for name in ("fc.weight", "fc.bias"):
        assert np.max(np.abs(state.weights[name].astype(np.float64) - clear[name])) <= bound, name
    assert any(isinstance(e, fx.SaveCheckpoint) for e in effects)
    assert all(t.secure is not None and t.secure.attempt == state.secure.attempt
               for t in effects if isinstance(t, fx.PublishTrainTask))


def test_scaffold_round_moves_the_model_and_c_as_in_the_clear(tmp_path: Path) -> None:
    """SCAFFOLD through the PS: the tasks ask for the variates, each site masks p_i delta_c_i after its weighted
    model, and the round's model and server control variate c equal SCAFFOLD in the clear within the ring's
    bound (c: B / n times the sum's rounding, B = n here since every enrolled site is selected)."""
    rng = np.random.default_rng(5)
    delta_c = {s: {"fc.weight": rng.normal(size=(2, 3)).astype(np.float32),
                   "fc.bias": rng.normal(size=2).astype(np.float32)} for s in SITES}
    machine = _machine(Scaffold(), algorithm="scaffold", train={"optimizer": "sgd"})
    machine, sites, state, _ = _run_round(tmp_path, machine=machine, delta_c=delta_c)
    assert state.round == 2 and state.history[-1].sites == SITES
    updates = [SiteUpdate(s, {**sites.trained[s], "bn.num_batches_tracked": np.array(0, np.int64)},
                          sites.counts[s], 3, extras={"delta_c": delta_c[s]}) for s in SITES]
    clear_rule = Scaffold()
    # The PS weighs c by the enrolled counts (n_train = 50 each): the sites' own counts stand in for them here.
    clear = clear_rule.aggregate_train(RoundInput(1, _weights(), updates, dict(sites.counts), {}))
    bound = _bound(machine, sites, SITES, clear.weights)
    for name in ("fc.weight", "fc.bias"):
        assert np.max(np.abs(state.weights[name].astype(np.float64) - clear.weights[name])) <= bound, name
    sa = machine.config.secure_aggregation
    c_error = FixedPoint(sa.clip, sa.fraction_bits, sa.ring_bits, max_sites=N).sum_error_bound(N)
    secure_c = state.strategy_state["c"]
    for name in ("fc.weight", "fc.bias"):
        assert np.max(np.abs(secure_c[name] - clear_rule.c[name])) <= c_error, name
        assert np.max(np.abs(clear_rule.c[name])) > 100 * c_error  # the comparison can fail


def test_fednova_round_steps_as_in_the_clear(tmp_path: Path) -> None:
    """FedNova through the PS: the tasks ask for normalised sums with a work bound W from the train settings, each
    site masks them with its (a_i, tau_i), and the round's model equals FedNova in the clear within 1e-4 (the
    unit test of the sums, tests/unit/test_secagg_mean_rules.py, states the bound; 20 fraction bits here)."""
    work = dict(zip(SITES, ((3.4, 2.0), (5.1, 3.0), (1.7, 1.0), (6.8, 4.0)), strict=True))
    machine = _machine(FedNova(), algorithm="fednova", train={"optimizer": "sgd", "epochs": 2, "batch_size": 16})
    machine, sites, state, effects = _run_round(tmp_path, machine=machine, work=work)
    assert state.round == 2 and state.history[-1].sites == SITES
    # the tasks say how much work a site may report: 2 epochs of ceil(50 / 16) batches
    told = [e.secure for e in effects if isinstance(e, fx.PublishTrainTask)]
    assert told and all(t is not None and t.normalised and t.work_bound == 8.0 for t in told)
    updates = [SiteUpdate(s, {**sites.trained[s], "bn.num_batches_tracked": np.array(0, np.int64)},
                          sites.counts[s], int(work[s][1]), extras={"a_norm": work[s][0]}) for s in SITES]
    clear = FedNova().aggregate_train(RoundInput(1, _weights(), updates, dict(sites.counts), {})).weights
    for name in ("fc.weight", "fc.bias"):
        assert np.max(np.abs(state.weights[name].astype(np.float64) - clear[name])) <= 1e-4, name
        assert np.max(np.abs(clear[name])) > 0.1  # the step is far larger than the allowance


def test_a_site_silent_after_its_masked_input_is_still_in_the_sum(tmp_path: Path) -> None:
    """site-001 sends its masked input, then never answers the unmasking request: at the stage's deadline the PS
    rebuilds its seed from its neighbours' answers; its update is in the sum."""
    machine, sites, state, _ = _run_round(tmp_path, silent_at_unmask=("site-001",))
    assert state.round == 2
    record = state.history[-1]
    assert "site-001" in record.sites and record.secure["dropped"] == []
    clear = _clear_fedavg(sites, SITES)
    for name in ("fc.weight", "fc.bias"):
        assert np.max(np.abs(state.weights[name].astype(np.float64) - clear[name])) <= _bound(
            machine, sites, SITES, clear)


def test_a_site_offline_before_its_masked_input_is_recovered_and_left_out(tmp_path: Path) -> None:
    """site-003 shares its keys and goes offline: the masked-input stage closes without it, its pairwise masks
    are removed with its rebuilt key, and the round is FedAvg of the other three."""
    machine = _machine()
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    state, effects = _train_and_advertise(machine, sites, state, effects)
    state, effects = _answer(machine, sites, state, effects)  # shares
    state, effects = _answer(machine, sites, state, effects, silent=("site-003",))
    assert state.secure is not None and state.secure.stage == "masked"
    assert any(isinstance(e, fx.PublishStatus) and "masked inputs (after training) from site-003" in e.detail
               and e.waiting_for == ("site-003",) for e in effects)  # ps/status names whom the stage waits for
    state, effects = machine.step(state, SiteOffline("site-003", now=3.0))
    assert state.secure is not None and state.secure.stage == "unmask"
    state, effects = _answer(machine, sites, state, effects)
    assert state.round == 2
    record = state.history[-1]
    assert record.sites == SITES[:3] and record.secure["dropped"] == ["site-003"]
    assert record.secure["recovered"] == ["site-003"]
    clear = _clear_fedavg(sites, SITES[:3])
    for name in ("fc.weight", "fc.bias"):
        assert np.max(np.abs(state.weights[name].astype(np.float64) - clear[name])) <= _bound(
            machine, sites, SITES[:3], clear)


def test_too_few_advertisements_fail_safe_and_a_new_try_starts(tmp_path: Path) -> None:
    """Only two sites advertise by the keys deadline: nothing is aggregated, the tasks go out again under a new
    try, with the reason."""
    machine = _machine()
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    state, effects = _train_and_advertise(machine, sites, state, effects, skip=("site-002", "site-003"))
    assert state.secure is not None
    first = state.secure.attempt
    state, effects = machine.step(state, Tick(TIMEOUT + 1))
    assert state.round == 1 and state.secure is not None and state.secure.attempt > first
    assert state.secure.failures and "2 sites advertised keys, 3 needed" in state.secure.failures[0]
    assert any(isinstance(e, fx.Log) and "failed" in e.text and "nothing aggregated" in e.text for e in effects)
    tasks = [e for e in effects if isinstance(e, fx.PublishTrainTask)]
    assert len(tasks) == N and all(t.secure is not None and t.secure.attempt == state.secure.attempt for t in tasks)


def test_a_message_of_an_earlier_try_or_round_is_ignored(tmp_path: Path) -> None:
    machine = _machine()
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    task = next(e for e in effects if isinstance(e, fx.PublishTrainTask))
    advert = sites.driver(task.site_id, state, task).advert()
    stale = advert.model_copy(update={"attempt": advert.attempt - 1})
    after, out = machine.step(state, SecAggReceived(task.site_id, 1.0, state.round, stale))
    assert after.secure == state.secure and any(isinstance(e, fx.Log) and "ignored" in e.text for e in out)


def test_an_update_with_tensors_is_refused_under_secure_aggregation(tmp_path: Path) -> None:
    machine = _machine()
    state, _ = _start(machine)
    update = SiteUpdate("site-000", {"fc.weight": np.ones((2, 3), np.float32)}, 10, 3)
    after, out = machine.step(state, UpdateReceived("site-000", 1.0, state.round, state.model_hash, update))
    assert "site-000" not in after.updates
    assert any(isinstance(e, fx.Log) and "carries no tensors" in e.text for e in out)


def test_the_last_rounds_sum_starts_the_final_evaluation(tmp_path: Path) -> None:
    """The transition table's exit training -> evaluating on a secure aggregation message: the last answer of the
    last round unmasks the sum, closes the round and starts the final evaluation."""
    machine = _machine(rounds=1)
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    state, effects = _train_and_advertise(machine, sites, state, effects)
    for _ in range(3):  # shares, masked inputs, answers
        state, effects = _answer(machine, sites, state, effects)
    assert state.phase == "evaluating" and state.secure is None
    assert any(isinstance(e, fx.PublishEvalTask) for e in effects)


def test_status_and_round_metrics_say_how_secure_aggregation_went(tmp_path: Path) -> None:
    """ps/status says secure aggregation is on and how the last round went; the round's record holds the names."""
    machine = _machine()
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    state, effects = _train_and_advertise(machine, sites, state, effects)
    state, effects = _answer(machine, sites, state, effects)
    state, effects = _answer(machine, sites, state, effects, silent=("site-003",))
    state, effects = machine.step(state, SiteOffline("site-003", now=3.0))
    state, effects = _answer(machine, sites, state, effects)
    note = secure_note(state.history[-1])
    assert note == SecureRoundNote(round=1, included=3, dropped=1, recovered=1, tries=1)
    status = status_message(machine.config, "training", 2, session="ab12", rejected={}, secure_last_round=note)
    assert status.secure_aggregation and status.secure_last_round == note
    assert secure_note(None) is None


def test_a_chunked_masked_input_is_admitted_only_as_the_round_expects_it(tmp_path: Path) -> None:
    """The manifest of a large masked input declares its one ring vector; the PS takes it in the masked stage
    only, with the model's float coordinates plus one, and refuses another layout before fetching a chunk."""
    machine = _machine()
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    state, effects = _train_and_advertise(machine, sites, state, effects)
    state, effects = _answer(machine, sites, state, effects)  # shares -> the masked stage
    inbox = next(e.message for e in effects if isinstance(e, fx.PublishSecAgg) and e.site_id == "site-000")
    masked = sites.rounds["site-000"].on_inbox(_trip(inbox), sites.trained["site-000"], 10)
    manifest, _ = split_payload(encode(masked), masked, chunk_bytes=1024)
    assert [(t.name, t.dtype, t.shape) for t in manifest.tensor_index] == [("masked", "int32", (2 * 3 + 2 + 1,))]
    assert masked_manifest_rejection(machine, state, "site-000", manifest) is None
    wrong = manifest.model_copy(update={"tensor_index": (manifest.tensor_index[0].model_copy(
        update={"shape": (5,)}),)})
    assert "one int32 vector of 9 coordinates" in (masked_manifest_rejection(machine, state, "site-000", wrong) or "")
    early, _ = _start(_machine())
    why = masked_manifest_rejection(machine, early, "site-000", manifest)  # round 1 still at its keys stage
    assert why is not None and "keys stage" in why


def test_keys_and_shares_before_training_leave_two_exchanges_after_it(tmp_path: Path) -> None:
    """The sites advertise as they start training and seal their shares from the roster while they train: the
    PS takes both before any update, the masked-input stage then waits for training until the round's own
    deadline (not stage_timeout_s), and after training only the masked input and the answer remain. A site that
    shared and then took no training step is not waited for: its masks are removed with its rebuilt key."""
    machine = _machine()
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    tasks = {e.site_id: e for e in effects if isinstance(e, fx.PublishTrainTask)}
    for site in SITES:  # keys as training starts: no update yet
        sites.rounds[site] = sites.driver(site, state, tasks[site])
        state, effects = machine.step(state, SecAggReceived(site, 0.5, state.round, _trip(sites.rounds[site].advert())))
    assert state.secure is not None and state.secure.stage == "shares" and not state.updates
    state, effects = _answer(machine, sites, state, effects)  # the shares, still training
    assert state.secure is not None and state.secure.stage == "masked" and not state.updates
    assert state.secure.deadline == TIMEOUT  # the round's deadline (it started at 0): training is in this stage
    inboxes = effects
    state, out = machine.step(state, Tick(2.0 + STAGE))  # stage_timeout_s after the inboxes: still training
    assert state.secure is not None and state.secure.stage == "masked"
    for site in SITES[:3]:  # trained: how (no tensors), then the masked input
        meta = SiteUpdate(site, {}, sites.counts[site], 3)
        state, out = machine.step(state, UpdateReceived(site, 20.0, state.round, state.model_hash, meta, 0.3))
    assert state.secure is not None and state.secure.stage == "masked"
    state, out = _answer(machine, sites, state, [e for e in inboxes if getattr(e, "site_id", "") != "site-003"])
    assert state.secure is not None and state.secure.stage == "masked"  # site-003 still trains
    state, out = machine.step(state, UpdateReceived("site-003", 21.0, state.round, state.model_hash,
                                                    SiteUpdate("site-003", {}, 0, 0), no_step_reason="too few rows"))
    assert state.secure is not None and state.secure.stage == "unmask"  # not waited for: it took no step
    state, out = _answer(machine, sites, state, out)
    assert state.round == 2
    record = state.history[-1]
    assert record.sites == SITES[:3] and record.secure["recovered"] == ["site-003"]
    clear = _clear_fedavg(sites, SITES[:3])
    for name in ("fc.weight", "fc.bias"):
        assert np.max(np.abs(state.weights[name].astype(np.float64) - clear[name])) <= _bound(
            machine, sites, SITES[:3], clear)


def test_a_site_whose_values_the_ring_clipped_is_warned_about_and_reported(tmp_path: Path) -> None:
    """site-002's update has a coordinate far outside the ring's range: its driver counts it, its update says so
    (the one scalar allowed), the PS logs a warning and the round's record, ps/status and report name it; a count
    that no masked vector can have is refused."""
    machine = _machine()
    sites = Sites(tmp_path, machine)
    sites.trained["site-002"]["fc.bias"][0] = 1e4  # times p_i (about 1/4) is still far beyond clip 4
    state, effects = _start(machine)
    tasks = {e.site_id: e for e in effects if isinstance(e, fx.PublishTrainTask)}
    warned: list[str] = []
    for site in SITES:
        sites.rounds[site] = sites.driver(site, state, tasks[site])
        clipped = sites.rounds[site].clipped(sites.trained[site], sites.counts[site])
        assert clipped == (1 if site == "site-002" else 0)
        if site == "site-002":
            bad = SiteUpdate(site, {}, sites.counts[site], 3, extras={CLIPPED_SCALAR: 10.0})  # 9 coordinates
            after, out = machine.step(state, UpdateReceived(site, 1.0, state.round, state.model_hash, bad))
            assert site not in after.updates and any("secagg_clipped must be a whole number from 0 to 9" in e.text
                                                     for e in out if isinstance(e, fx.Log))
        meta = SiteUpdate(site, {}, sites.counts[site], 3, extras={CLIPPED_SCALAR: float(clipped)})
        state, out = machine.step(state, UpdateReceived(site, 1.0, state.round, state.model_hash, meta, 0.3))
        warned += [e.text for e in out if isinstance(e, fx.Log) and e.level == "warning"]
        state, effects = machine.step(state, SecAggReceived(site, 1.0, state.round,
                                                            _trip(sites.rounds[site].advert())))
    assert len(warned) == 1 and "site site-002: 1 coordinates" in warned[0] and "clipped" in warned[0]
    for _ in range(3):  # shares, masked inputs, answers
        state, effects = _answer(machine, sites, state, effects)
    assert state.round == 2
    assert state.history[-1].secure["clipped"] == {"site-002": 1}
    note = secure_note(state.history[-1])
    assert note is not None and note.clipped == 1


def test_feddyn_round_through_the_ps_is_feddyn_in_the_clear(tmp_path: Path) -> None:
    """FedDyn through the PS: the tasks say `uniform` with B = the four selected sites, each site weighs by 1, and
    the round's theta_send and evaluated theta_avg equal FedDyn's on the sites' own models within 1e-4."""
    machine = _machine(FedDyn(), algorithm="feddyn")
    machine, sites, state, effects = _run_round(tmp_path, machine=machine)
    told = [e.secure for e in effects if isinstance(e, fx.PublishTrainTask)]
    assert told and all(t is not None and t.uniform and t.weight_bound == N for t in told)
    assert state.round == 2 and state.history[-1].sites == SITES
    updates = [SiteUpdate(s, {**sites.trained[s], "bn.num_batches_tracked": np.array(0, np.int64)},
                          sites.counts[s], 3) for s in SITES]
    clear = FedDyn().aggregate_train(RoundInput(1, _weights(), updates, {s: 50 for s in SITES}, {}))
    assert clear.eval_weights is not None
    for name in ("fc.weight", "fc.bias"):
        assert np.max(np.abs(state.weights[name].astype(np.float64) - clear.weights[name])) <= 1e-4, name
        assert np.max(np.abs(state.extras["eval"][name].astype(np.float64) - clear.eval_weights[name])) <= 1e-4
        assert np.max(np.abs(clear.weights[name])) > 0.1
