"""Secure aggregation inside a training round (docs/secure-aggregation.md): its stages, their deadlines, what the
PS sends at each, and the protocol's ServerSession rebuilt from what the state holds. Pure: no I/O, no clock.

The state keeps, per try of the round, every message the session took (in order, with the points where a stage
was closed), never the session itself: `Sessions.of(state)` replays them into a ServerSession, which is a pure
function of that log (tests/unit/test_secagg_protocol.py replays at every stage). A cache makes that replay
incremental for the state the runner holds; a state from elsewhere (a test, an earlier step) is replayed in full.

Stages: keys (each selected site advertises as it starts training; waits round_timeout_s) -> shares (sent from
the roster while the site trains) -> masked inputs (after training) -> unmasking answers. The shares and masked
stages may include training, so each waits until the round's own deadline at least (`stage_deadline`); the
answers wait stage_timeout_s. After training only two exchanges remain: the masked input and the answer. A
stage closes once every site it waits for has answered or is seen offline (or answered the round without a
step), or at its deadline with whoever answered; the protocol then decides whether enough remain. A
failed try (too few sites, a secret that cannot be rebuilt) fails safe: nothing is aggregated, the PS says why and
starts a new try of the round with fresh keys everywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from pydantic import BaseModel

from fedmqtt.secagg import messages as msg
from fedmqtt.secagg import wire as conv
from fedmqtt.secagg.adverts import Verifier
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.server import ServerSession
from fedmqtt.secagg.weighted import Layout, layout_of
from fedmqtt.strategies import STRATEGIES
from fedmqtt.strategies.base import TensorSpec
from ps_daemon import distributed_dp
from ps_daemon.config import DaemonConfig
from schemas import secagg as wire

Stage = Literal["keys", "shares", "masked", "unmask"]
STAGES: tuple[Stage, ...] = ("keys", "shares", "masked", "unmask")
WAITS_FOR: Mapping[Stage, str] = {"keys": "key advertisements (sent as training starts)",
                                  "shares": "sealed shares (sent while training)",
                                  "masked": "masked inputs (after training)", "unmask": "unmasking answers"}
TRAINING_STAGES: frozenset[Stage] = frozenset({"shares", "masked"})  # may wait for the sites' local training
INBOUND_KIND: Mapping[str, Stage] = {"secagg_advert": "keys", "secagg_shares": "shares", "secagg_masked": "masked",
                                     "secagg_answer": "unmask"}
# What a replayed log entry is: a message the session took (by its stage), or the close of a stage.
Entry = tuple[str, object]


@dataclass(frozen=True)
class SecureRound:
    """One try of secure aggregation in the open round."""

    attempt: int
    stage: Stage
    deadline: float
    weight_bound: float
    work_bound: float = 1.0  # W: the most local work a selected site can report (FedNova's scalars are over it)
    label_rows: tuple[str, ...] = ()  # output tensors summed label by label (FedFBN surgical), one row per label
    log: tuple[Entry, ...] = ()
    sent: tuple[tuple[str, BaseModel], ...] = ()  # the open stage's messages to the sites (re-sent with the round)
    failures: tuple[str, ...] = ()  # why earlier tries of this round failed


def new_attempt(now: float, previous: int = 0) -> int:
    """A try number no earlier try of this run used: from the clock, so that a PS restarted from a checkpoint
    (which keeps no try) never reuses one whose secrets the sites already hold."""
    return max(previous + 1, int(now))


def weight_bound(enrolled: Mapping[str, int], selected: tuple[str, ...], *, uniform: bool = False) -> float:
    """B: the selected sites' enrolled sample counts together (at least 1), public to every site; for a rule that
    needs the plain mean (`uniform`), the number of selected sites (each weighs by 1)."""
    if uniform:
        return float(max(len(selected), 1))
    return float(max(sum(max(enrolled.get(s, 0), 0) for s in selected), 1))


def work_bound(config: DaemonConfig, enrolled: Mapping[str, int], selected: tuple[str, ...]) -> float:
    """W, public to every site: the most local work ||a_i||_1 a selected site can do this round, from the train
    settings and its enrolled rows (epochs x batches, each batch adding at most 1 / (1 - momentum) to ||a_i||_1),
    so that FedNova's scalars p_i a_i / W stay within [0, 1] (a site whose work exceeds it refuses to mask)."""
    train = config.train
    rho = float({**train.hyper, **config.hyper}.get("momentum", 0.0))
    most = max((max(enrolled.get(s, 0), 1) for s in selected), default=1)
    batches = -(-most // train.batch_size)
    if train.steps_per_epoch is not None:
        batches = min(batches, train.steps_per_epoch)
    return float(max(train.epochs * batches, 1)) / (1.0 - min(max(rho, 0.0), 0.999))


def stage_deadline(config: DaemonConfig, stage: Stage, now: float, round_started_at: float) -> float:
    """When the PS stops waiting for `stage`: stage_timeout_s from now, and for the stages that may wait for
    training (the sites advertise as they start it) not before the round's own deadline either."""
    soonest = now + config.secure_aggregation.stage_timeout_s
    if stage in TRAINING_STAGES:
        return max(soonest, round_started_at + config.round_timeout_s)
    return soonest


def context(config: DaemonConfig, round_no: int, sr: SecureRound) -> RoundContext:
    return RoundContext(config.run_id, round_no, sr.attempt)


def terms(config: DaemonConfig, sr: SecureRound, clip: float | None = None) -> wire.SecAggTerms:
    """The round's terms; `clip`: DP-FedAvg's current clip under distributed DP (adaptive clipping moves it)."""
    return config.secure_aggregation.terms(len(config.sites), attempt=sr.attempt, weight_bound=sr.weight_bound,
                                           variates=with_variates(config), normalised=with_normalised(config),
                                           work_bound=sr.work_bound, uniform=with_uniform(config),
                                           distributed_dp=distributed_dp.terms_of(config, clip),
                                           label_rows=sr.label_rows)


def with_variates(config: DaemonConfig) -> bool:
    """Whether the run's rule sums control-variate deltas next to the weighted model (SCAFFOLD)."""
    return bool(getattr(STRATEGIES[config.algorithm], "sums_variates", False))


def with_uniform(config: DaemonConfig) -> bool:
    """Whether the run's rule steps from the plain mean of the updates (FedFBN, FedDyn): each site weighs by 1."""
    return bool(getattr(STRATEGIES[config.algorithm], "sums_uniform", False))


def with_normalised(config: DaemonConfig) -> bool:
    """Whether the run's rule needs the updates over the sites' local work and its sums (FedNova)."""
    return bool(getattr(STRATEGIES[config.algorithm], "sums_normalised", False))


def label_rows(strategy: object, manifest: Mapping[str, TensorSpec], floats: Mapping[str, np.ndarray]
               ) -> tuple[str, ...]:
    """The shared float tensors a rule that averages its output rows label by label (`sums_label_rows`: FedFBN
    surgical) sums per label: the output layer (HEAD in the manifest), one row per label; () for another rule."""
    if not getattr(strategy, "sums_label_rows", False):
        return ()
    return tuple(sorted(n for n in floats if n in manifest and manifest[n].is_head and np.ndim(floats[n]) >= 1))


def layout_of_run(config: DaemonConfig, floats: Mapping[str, np.ndarray], rows: tuple[str, ...] = ()) -> Layout:
    """The masked vector's layout for this run's rule: the shared float tensors, and what the rule sums besides
    (`rows`: the tensors summed label by label, `SecureRound.label_rows`)."""
    return layout_of(floats, variates=with_variates(config), normalised=with_normalised(config), rows=rows)


def msg_id(*parts: object) -> str:
    """Same message, same id (as the PS's other messages): a re-sent roster is dropped by a site that has it."""
    return "sa-" + hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:29]


class Sessions:
    """The ServerSession of a state's open try, replayed from its log (see the module text)."""

    def __init__(self, config: DaemonConfig, verifier: Verifier | None) -> None:
        self.config, self.verifier = config, verifier
        self._key: tuple[object, ...] | None = None
        self._applied: tuple[Entry, ...] = ()
        self._session: ServerSession | None = None

    def of(self, state_session: str, round_no: int, selected: tuple[str, ...], layout: Layout,
           sr: SecureRound) -> ServerSession:
        if self.verifier is None:
            raise RuntimeError("secure aggregation needs the key list to check advertisements (Machine verifier)")
        key = (state_session, round_no, sr.attempt, selected, layout)
        done = self._applied
        fresh = (self._session is None or self._key != key or len(done) > len(sr.log)
                 or any(a is not b for a, b in zip(done, sr.log, strict=False)))
        if fresh:
            sa = self.config.secure_aggregation
            self._session = ServerSession(context(self.config, round_no, sr), selected, self.verifier,
                                          sa.fixed_point(len(self.config.sites)), layout.length, dropout=sa.dropout)
            self._key, done = key, ()
        session = self._session
        assert session is not None
        for entry in sr.log[len(done):]:
            apply(session, entry)
        self._applied = sr.log
        return session

    def feed(self, session: ServerSession, sr: SecureRound, entry: Entry) -> tuple[object, SecureRound]:
        """Apply `entry` to `session` (just returned by `of` for `sr`) and log it when it changed the session:
        taken, a stage closed, or a site banned for equivocation. Other refusals change nothing and stay out of
        the log (a hostile site cannot grow the state with them)."""
        result = apply(session, entry)
        if isinstance(result, msg.Refusal) and result.category != msg.EQUIVOCATION:
            return result, sr
        sr = replace(sr, log=(*sr.log, entry))
        self._applied = sr.log
        return result, sr


def apply(session: ServerSession, entry: Entry) -> object:
    """Feed one log entry to the session; what it returned (a refusal, a roster map, an inbox map, a request)."""
    what, record = entry
    if what == "keys":
        assert isinstance(record, msg.KeyAdvert)
        return session.receive_advert(record)
    if what == "shares":
        assert isinstance(record, msg.ShareBundle)
        return session.receive_shares(record)
    if what == "masked":
        assert isinstance(record, msg.MaskedInput)
        return session.receive_masked(record)
    if what == "unmask":
        assert isinstance(record, msg.UnmaskAnswer)
        return session.receive_answer(record)
    if record == "keys":
        return session.close_adverts()
    if record == "shares":
        return session.close_shares()
    if record == "masked":
        return session.close_masked()
    raise ValueError(f"unknown log entry {what!r}")


def record_of(message: BaseModel, fixed_session: ServerSession) -> tuple[Stage, object]:
    """The protocol record of a site's wire message, and the stage it belongs to (ValueError: unusable)."""
    if isinstance(message, wire.SecAggAdvert):
        return "keys", conv.advert_from_wire(message)
    if isinstance(message, wire.SecAggShares):
        return "shares", conv.shares_from_wire(message)
    if isinstance(message, wire.SecAggMasked):
        return "masked", conv.masked_from_wire(message, fixed_session.fixed)
    if isinstance(message, wire.SecAggAnswer):
        return "unmask", conv.answer_from_wire(message)
    raise ValueError(f"{type(message).__name__} is not a site's secure aggregation message")


def waiting(session: ServerSession, sr: SecureRound, selected: tuple[str, ...], offline: frozenset[str],
            skipped: frozenset[str]) -> tuple[str, ...]:
    """The sites the open stage still waits for: expected there, not answered, not seen offline, and not sites
    that answered the round without a training step (`skipped`: they will send no masked input)."""
    if sr.stage == "keys":
        expected, have = set(selected), set(session.adverts)
    elif sr.stage == "shares":
        expected, have = set(session.adverts), set(session.bundles)
    elif sr.stage == "masked":
        expected, have = set(session.sharing), set(session.masked)
    else:
        expected, have = set(session.paired), set(session.answers)
    return tuple(sorted(expected - have - offline - skipped - session.banned))


def out_messages(config: DaemonConfig, round_no: int, sr: SecureRound, session_id: str,
                 produced: object, now: float) -> list[tuple[str, BaseModel]]:
    """What the PS sends after closing a stage: a roster, an inbox or the unmasking request, to each site."""
    ctx = context(config, round_no, sr)
    out: list[tuple[str, BaseModel]] = []
    if isinstance(produced, msg.UnmaskRequest):
        for site in produced.survivors:
            out.append((site, conv.unmask_to_wire(ctx, site, produced)))
    elif isinstance(produced, dict):
        for site, item in sorted(produced.items()):
            if isinstance(item, msg.Roster):
                out.append((site, conv.roster_to_wire(ctx, site, item)))
            else:
                out.append((site, conv.inbox_to_wire(ctx, site, item)))
    return [(site, m.model_copy(update={"msg_id": msg_id(session_id, round_no, sr.attempt, type(m).__name__, site),
                                        "sent_at": now})) for site, m in out]
