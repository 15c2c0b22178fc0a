"""The PS machine's secure-aggregation steps (docs/secure-aggregation.md): the handlers the transition table
names for its messages, and how a round's stages advance, fail and close with the unmasked sum. Pure, as the
rest of the machine: `Machine` (ps_daemon/machine.py) inherits them, so `step` dispatches to them through
ps_daemon/transitions.py like to any other handler; the protocol's bookkeeping is ps_daemon/secure_round.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from fedmqtt.secagg import messages as smsg
from fedmqtt.secagg.weighted import (
    label_sums_from_sum,
    mean_from_sum,
    normalised_from_sum,
    split,
    variates_from_sum,
)
from fedmqtt.strategies.base import AggregateResult, RoundInput, Strategy, Weights
from fedmqtt.strategies.sums import (
    LabelSums,
    NormalisedSums,
    aggregate_from_label_sums,
    aggregate_from_mean,
    aggregate_from_sums,
    aggregate_from_uniform_mean,
)
from ps_daemon import effects as fx
from ps_daemon import secure_round as sec
from ps_daemon.config import DaemonConfig
from ps_daemon.distributed_dp import aggregate_noised
from ps_daemon.events import SecAggReceived, UpdateReceived
from ps_daemon.naming import named
from ps_daemon.state import DaemonState, RoundRecord
from schemas.secagg import CLIPPED_SCALAR

Result = tuple[DaemonState, list[fx.Effect]]


class SecureSteps:
    """Mixed into `Machine`: what it needs from the machine is declared here and defined there."""

    config: DaemonConfig
    strategy: Strategy
    secure_on: bool  # config.secure_aggregation.enabled
    sessions: sec.Sessions

    def shared_model(self, state: DaemonState) -> Weights:
        raise NotImplementedError  # Machine's

    def _close_round(self, state: DaemonState, now: float, secure_sum: smsg.RoundSum | None = None) -> Result:
        raise NotImplementedError  # Machine's

    def _round_effects(self, state: DaemonState, why: str = "") -> list[fx.Effect]:
        raise NotImplementedError  # Machine's

    def _status(self, state: DaemonState, detail: str) -> fx.PublishStatus:
        raise NotImplementedError  # Machine's

    def _secure_start(self, state: DaemonState, now: float, *, previous_attempt: int = 0,
                      failures: tuple[str, ...] = ()) -> DaemonState:
        """A new try of secure aggregation for the open round (nothing in the clear)."""
        if not self.secure_on:
            return state
        attempt = sec.new_attempt(now, previous_attempt)
        floats = split(self.shared_model(state))[0]
        return replace(state, secure=sec.SecureRound(
            attempt=attempt, stage="keys", deadline=now + self.config.round_timeout_s,
            weight_bound=sec.weight_bound(state.enrolled, state.selected, uniform=sec.with_uniform(self.config)),
            failures=failures,
            work_bound=sec.work_bound(self.config, state.enrolled, state.selected),
            label_rows=(sec.label_rows(self.strategy, state.manifest, floats)
                        if self.config.secure_aggregation.distributed_dp == "off" else ())))

    def _secure_session(self, state: DaemonState) -> tuple[sec.SecureRound, sec.ServerSession]:
        sr = state.secure
        assert sr is not None
        layout = sec.layout_of_run(self.config, split(self.shared_model(state))[0], sr.label_rows)
        return sr, self.sessions.of(state.session, state.round, state.selected, layout, sr)

    def _secure_waiting(self, state: DaemonState) -> tuple[str, ...]:
        """Who the open stage of the protocol still waits for (a site that took no step sends no keys)."""
        sr, session = self._secure_session(state)
        skipped = frozenset(s for s, u in state.updates.items() if u.no_step_reason)
        return sec.waiting(session, sr, state.selected, state.offline, skipped)

    def _secure_update_problem(self, state: DaemonState, ev: UpdateReceived) -> str | None:
        """An update under secure aggregation says how its site trained: no tensors (they travel masked), and of
        the scalars only how many coordinates the ring clipped, an integer from 0 to the masked vector's length."""
        if ev.update.tensors:
            return "under secure aggregation an update carries no tensors"
        clipped = ev.update.extras.get(CLIPPED_SCALAR)
        if clipped is None:
            return None
        rows = state.secure.label_rows if state.secure is not None else ()
        length = sec.layout_of_run(self.config, split(self.shared_model(state))[0], rows).length
        if not (isinstance(clipped, float | int) and float(clipped).is_integer() and 0 <= clipped <= length):
            return f"{CLIPPED_SCALAR} must be a whole number from 0 to {length}, not {clipped!r}"
        return None

    def _clip_warning(self, state: DaemonState, ev: UpdateReceived) -> list[fx.Effect]:
        clipped = clipped_count(ev.update.extras)
        if not clipped:
            return []
        clip = self.config.secure_aggregation.clip
        return [fx.Log("warning", f"round {state.round}: site {ev.site_id}: {clipped} coordinates of its weighted "
                                  f"update lie outside the ring's range [-{clip:g}, {clip:g}] and were clipped: the "
                                  "sum is off by more than the encoding's bound (raise secure_aggregation.clip)")]

    def _refuse_secagg(self, state: DaemonState, ev: SecAggReceived) -> Result:
        return state, [fx.Log("warning", f"secure aggregation message from {ev.site_id} for round {ev.round} "
                                         f"ignored: no round is open (PS is in {state.phase} round {state.round})")]

    def _secagg_in_round(self, state: DaemonState, ev: SecAggReceived) -> Result:
        if state.secure is None:
            return state, [fx.Log("warning", f"secure aggregation message from {ev.site_id} ignored: this run "
                                             "aggregates in the clear")]
        sr, session = self._secure_session(state)
        attempt = getattr(ev.message, "attempt", None)
        if ev.round != state.round or attempt != sr.attempt:
            return state, [fx.Log("warning", f"{ev.message.__class__.__name__} from {ev.site_id} ignored: it is for "
                                             f"round {ev.round} try {attempt}, the open one is round {state.round} "
                                             f"try {sr.attempt}")]
        stage, record = sec.record_of(ev.message, session)
        refusal, sr = self.sessions.feed(session, sr, (stage, record))
        state = replace(state, secure=sr)
        effects: list[fx.Effect] = []
        if isinstance(refusal, smsg.Refusal) and refusal.category != smsg.REPLAY:
            effects.append(fx.Log("warning", f"secure aggregation, round {state.round}: {refusal.party}: "
                                             f"{refusal.category}: {refusal.reason}"))
        if refusal is None:
            state = replace(state, last_progress=ev.now)
        state, more = self._secure_progress(state, ev.now)
        return state, [*effects, *more]

    def _secure_progress(self, state: DaemonState, now: float, *, deadline_passed: bool = False) -> Result:
        """Close the open stage once nobody it waits for can still answer (or at its deadline), then the next."""
        effects: list[fx.Effect] = []
        for _ in sec.STAGES:  # a stage closed with nobody left to wait for may let the next one close at once
            sr, session = self._secure_session(state)
            missing = self._secure_waiting(state)
            head = f"round {state.round}: secure aggregation (try {sr.attempt})"
            if missing and not deadline_passed:
                return state, [*effects, self._status(state, f"{head}: waiting for {sec.WAITS_FOR[sr.stage]} from "
                                                             f"{named(missing)}")]
            if missing:
                effects.append(fx.Log("warning", f"{head}: deadline passed; going on without the "
                                                 f"{sec.WAITS_FOR[sr.stage]} of {named(missing)}"))
            deadline_passed = False
            if sr.stage == "unmask":
                outcome = session.finish()
                if isinstance(outcome, smsg.RoundFailed):
                    state, more = self._secure_failed(state, now, outcome.reason)
                    return state, [*effects, *more]
                state, more = self._close_round(state, now, secure_sum=outcome)
                return state, [*effects, *more]
            produced, sr = self.sessions.feed(session, sr, ("close", sr.stage))
            if isinstance(produced, smsg.RoundFailed):
                state, more = self._secure_failed(state, now, produced.reason)
                return state, [*effects, *more]
            nxt = sec.STAGES[sec.STAGES.index(sr.stage) + 1]
            sent = tuple(sec.out_messages(self.config, state.round, sr, state.session, produced, now))
            sr = replace(sr, stage=nxt, deadline=sec.stage_deadline(self.config, nxt, now, state.round_started_at),
                         sent=sent)
            state = replace(state, secure=sr, last_progress=now)
            effects.append(fx.Log("info", f"{head}: {sec.WAITS_FOR[sec.STAGES[sec.STAGES.index(nxt) - 1]]} closed; "
                                          f"sent {len(sent)} site(s) what the {nxt} stage needs"))
            effects.extend(fx.PublishSecAgg(site, message) for site, message in sent)
        return state, effects

    def _secure_failed(self, state: DaemonState, now: float, reason: str) -> Result:
        """Fail safe: nothing of this try is aggregated; a new try with fresh keys at every site."""
        sr = state.secure
        assert sr is not None
        why = (f"round {state.round}: secure aggregation try {sr.attempt} failed ({reason}); nothing aggregated; "
               "starting a new try with fresh keys")
        state = self._secure_start(state, now, previous_attempt=sr.attempt, failures=(*sr.failures, reason))
        state = replace(state, last_progress=now)
        return state, [fx.Log("warning", why), *self._round_effects(state, why)]

    def _aggregate_secure(self, state: DaemonState, total: smsg.RoundSum) -> AggregateResult:
        """The rule's aggregate from the unmasked sum: the weighted mean of the float tensors; integer buffers
        (BatchNorm's step counters, which a sum cannot give as a maximum) keep the server's value."""
        sr = state.secure
        assert sr is not None
        shared = self.shared_model(state)
        floats, rest = split(shared)
        layout = sec.layout_of_run(self.config, floats, sr.label_rows)
        inp = RoundInput(round_no=state.round, current=dict(state.weights), updates=[], enrolled=dict(state.enrolled),
                         manifest=state.manifest)
        if self.config.secure_aggregation.distributed_dp != "off":  # a noised sum of clipped changes, no weights
            return aggregate_noised(self.strategy, self.config, inp, total.total, layout, total.included)
        mean, n_total = mean_from_sum(total.total, layout, sr.weight_bound)
        mean.update(rest)
        if layout.normalised:
            return aggregate_from_sums(self.strategy, inp, mean, NormalisedSums(*normalised_from_sum(
                total.total, layout, sr.work_bound)))
        if layout.labels:  # the plain mean, and the output rows label by label (FedFBN surgical)
            weight, rows = label_sums_from_sum(total.total, layout)
            holders = np.rint(weight * sr.weight_bound).astype(np.int64)
            return aggregate_from_label_sums(self.strategy, inp, mean, n_total, LabelSums(weight, holders, rows))
        if sec.with_uniform(self.config):  # the plain mean; n_total is then how many sites are in the sum
            return aggregate_from_uniform_mean(self.strategy, inp, mean, n_total)
        variates = variates_from_sum(total.total, layout, sr.weight_bound) if layout.variates else None
        return aggregate_from_mean(self.strategy, inp, mean, n_total, variates, total.included)

    @staticmethod
    def _secure_note(state: DaemonState, total: smsg.RoundSum | None) -> dict[str, object]:
        if total is None or state.secure is None:
            return {}
        clipped = {s: n for s in total.included if s in state.updates
                   and (n := clipped_count(state.updates[s].update.extras))}
        return {"included": list(total.included),
                "dropped": sorted(set(state.selected) - set(total.included)), "clipped": clipped,
                "recovered": list(total.dropped_recovered), "attempt": state.secure.attempt,
                "tries": len(state.secure.failures) + 1}


def clipped_count(extras: object) -> int:
    """How many coordinates a site's update says the ring clipped (0 when it says nothing; admitted values only)."""
    value = extras.get(CLIPPED_SCALAR, 0) if isinstance(extras, Mapping) else 0
    return int(value) if isinstance(value, float | int) else 0


def secure_attempt(record: RoundRecord) -> int:
    attempt = record.secure.get("attempt", 0)
    return attempt if isinstance(attempt, int) else 0
