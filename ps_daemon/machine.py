"""The PS core: `step(state, event) -> (state, effects)`. Pure: no I/O, no clock, no random.

Phases: WAITING_FOR_SITES -> TRAINING(r) -> ... -> TRAINING(R) -> EVALUATING(final) -> DONE. Which handler
runs for which event in which phase, and where it can lead, is the table in `ps_daemon.transitions`.
A round closes when every selected site that is still online has answered and the quorum is
met, or at its deadline if the quorum is met; otherwise the deadline is extended and the
stragglers are named in the status (never a silent hang).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime, timezone

import numpy as np

from fedmqtt.errors import SchemaError
from fedmqtt.means import direction_of, mean_defined
from fedmqtt.secagg import messages as smsg
from fedmqtt.secagg.adverts import Verifier
from fedmqtt.strategies.aggregate import check_update_shapes
from fedmqtt.strategies.base import Manifest, RoundInput, Strategy, Weights
from fedmqtt.strategies.dp_fedavg import DPFedAvg
from ps_daemon import effects as fx
from ps_daemon import feature_gate, policy_quorum, selection
from ps_daemon import secure_round as sec
from ps_daemon.config import DaemonConfig
from ps_daemon.events import (
    Event,
    FeatureSummaryReceived,
    ReportReceived,
    RoundValidated,
    SiteOffline,
    SiteOnline,
    Started,
    Tick,
    UpdateReceived,
)
from ps_daemon.machine_secagg import Result, SecureSteps, secure_attempt
from ps_daemon.naming import named
from ps_daemon.participant_spent import spent_in_run
from ps_daemon.state import BestRound, DaemonState, FinalReport, ReceivedUpdate, RoundRecord
from ps_daemon.transitions import TRANSITIONS
from schemas.base import MAX_DETAIL
from schemas.messages import ROUND_VALIDATION_TAG

MAX_DROPPED_SHOWN = 64  # sites named with a reason in one status: it reaches every site and observer
MAX_REASON_CHARS = 200


class Machine(SecureSteps):
    """Binds the configuration and the strategy; `step` is the only entry point. The secure-aggregation handlers
    are inherited from `SecureSteps` (ps_daemon/machine_secagg.py)."""

    def __init__(self, config: DaemonConfig, strategy: Strategy, hash_weights: Callable[[Weights], str], *,
                 verifier: Verifier | None = None) -> None:
        """`verifier`: the key list that signs the sites' key advertisements (needed under secure aggregation)."""
        self.config = config
        self.strategy = strategy
        self.hash_weights = hash_weights
        self.secure_on = config.secure_aggregation.enabled
        # Replays the open try's log into the protocol's ServerSession (a cache: the result depends on the state)
        self.sessions = sec.Sessions(config, verifier)

    def initial_state(self, weights: Weights, manifest: Manifest | None = None,
                      extras: dict[str, Weights] | None = None, session: str = "") -> DaemonState:
        """Round 1 sends every tensor (all sites start identical); later rounds only the shared ones.
        `extras` go out with the round-1 model (AdaFed's pretrained model). `session` names this start."""
        state = DaemonState(phase="waiting_for_sites", round=0, weights=weights, model_hash="",
                            manifest=manifest or {}, extras=extras or {}, session=session)
        return replace(state, model_hash=self.hash_weights(self.published(state)))

    def shared_names(self, state: DaemonState) -> list[str]:
        if not state.manifest:  # no manifest: everything is shared
            return sorted(state.weights)
        return self.strategy.shared_names(state.manifest)

    def published(self, state: DaemonState) -> Weights:
        """The tensors on ps/model this round: all of them in round 1, then the shared ones."""
        if state.round <= 1:
            return dict(state.weights)
        return {n: state.weights[n] for n in self.shared_names(state) if n in state.weights}

    def published_extras(self, state: DaemonState) -> dict[str, Weights]:
        shared = set(self.shared_names(state))
        return {k: {n: v for n, v in w.items() if k != "eval" or n in shared} for k, w in state.extras.items()}

    def step(self, state: DaemonState, event: Event) -> Result:
        """The handler the transition table names for this phase and kind of event (ps_daemon.transitions)."""
        transition = TRANSITIONS.get((state.phase, type(event)))
        if transition is None:
            raise TypeError(f"unknown event {event!r}")
        handler: Callable[[DaemonState, Event], Result] = getattr(self, transition.handler)
        return handler(state, event)

    def resend(self, state: DaemonState, why: str) -> list[fx.Effect]:
        """Everything the open round needs at the broker, again (same message ids: a receiver that has it drops
        the copy). After a broker restart that lost retained messages, a restarted site still finds its work."""
        if state.phase == "training":
            return [*self._statistics_effects(state), *self._round_effects(state, why)]
        if state.phase == "evaluating":
            return [*self._statistics_effects(state), *self._eval_effects(state, why)]
        return [*self._statistics_effects(state), self._status(state, why)]

    # -- handlers, one per row of the transition table ------------------------------------------
    def _announce(self, state: DaemonState, ev: Started) -> Result:
        return state, [*self._statistics_effects(state), self._status(state, "waiting for sites")]

    def _resume_round(self, state: DaemonState, ev: Started) -> Result:
        """Resumed from a checkpoint in the middle of the run: re-send the round."""
        state = replace(state, round_started_at=ev.now, deadline=ev.now + self.config.round_timeout_s,
                        last_progress=ev.now)
        state = self._secure_start(state, ev.now)  # a new try: the checkpoint keeps none
        why = f"resumed from checkpoint at round {state.round}"
        return state, [*self._statistics_effects(state), *self._round_effects(state, why)]

    def _resume_evaluation(self, state: DaemonState, ev: Started) -> Result:
        state = replace(state, deadline=ev.now + self.config.round_timeout_s, last_progress=ev.now)
        why = "resumed from checkpoint: evaluating the final model"
        return state, [*self._statistics_effects(state), *self._eval_effects(state, why)]

    def _ignore(self, state: DaemonState, ev: Event) -> Result:
        return state, []

    def _note_online(self, state: DaemonState, ev: SiteOnline) -> Result:
        if ev.site_id not in self.config.sites:
            return state, [fx.Log("warning", f"ignoring unknown site {ev.site_id!r} (not in the PS config)")]
        return self._with_online(state, ev), []

    def _online_while_waiting(self, state: DaemonState, ev: SiteOnline) -> Result:
        if ev.site_id not in self.config.sites:
            return self._note_online(state, ev)
        return self._try_start(self._with_online(state, ev), ev.now)

    def _summary_while_waiting(self, state: DaemonState, ev: FeatureSummaryReceived) -> Result:
        """Held if it fits the ones held (ps_daemon.feature_gate), then round 1 starts if everything is there."""
        if feature_gate.already_combined(state.feature_statistics, ev.site_id):
            return state, []  # resumed before round 1 with the kept statistics
        why = feature_gate.summary_rejection(self.config, state.feature_summaries, state.feature_statistics,
                                             ev.site_id, ev.summary)
        if why is not None:
            return state, [self._summary_ignored(ev, why)]
        if ev.site_id in state.feature_summaries:  # the same one again: nothing new
            return state, []
        state = replace(state, feature_summaries={**state.feature_summaries, ev.site_id: ev.summary})
        return self._try_start(state, ev.now)

    def _offline_while_waiting(self, state: DaemonState, ev: SiteOffline) -> Result:
        """Recorded; a site that goes before sending its feature summary is no longer waited for."""
        state = self._with_offline(state, ev)
        if not feature_gate.wanted(self.config) or state.feature_statistics is not None \
                or ev.site_id in state.feature_summaries or ev.site_id not in self.config.sites:
            return state, []
        return self._try_start(state, ev.now)

    def _refuse_summary(self, state: DaemonState, ev: FeatureSummaryReceived) -> Result:
        if feature_gate.already_combined(state.feature_statistics, ev.site_id):
            return state, []  # a retained copy replayed after a reconnect or a resume: nothing to combine
        why = ("this run standardises with each site's own statistics (feature_statistics = \"site\")"
               if not feature_gate.wanted(self.config) else "the federation's statistics are combined already")
        return state, [self._summary_ignored(ev, why)]

    @staticmethod
    def _summary_ignored(ev: FeatureSummaryReceived, why: str) -> fx.Log:
        return fx.Log("warning", f"feature summary from {ev.site_id} ignored: {why}")

    def _try_start(self, state: DaemonState, now: float) -> Result:
        """Round 1 starts once enough sites are online, their policies allow it, the federation's feature
        statistics are combined (with feature_statistics = "federated") and recruitment chose enough."""
        ready = sorted(state.online & set(self.config.sites))
        if len(ready) < self.config.start_sites:
            return state, [self._status(state, f"{len(ready)}/{self.config.start_sites} sites online")]
        shared = {n: state.weights[n] for n in self.shared_names(state) if n in state.weights}
        refusers = policy_quorum.refusing_sites(self.config, state.policies, state.enrolled, ready, shared)
        if why_not := policy_quorum.quorum_refusal(self.config, refusers, ready):
            return state, [fx.Log("warning", why_not), self._status(state, why_not)]
        effects: list[fx.Effect] = []
        if feature_gate.wanted(self.config) and state.feature_statistics is None:
            if waiting := feature_gate.missing(state.feature_summaries, ready):
                line = feature_gate.waiting_line(waiting, state.site_errors)
                return state, [fx.Log("info", line), self._status(state, line[:MAX_DETAIL])]
            try:
                stats = feature_gate.combined(self.config, state.feature_summaries, ready, state.session)
            except (ValueError, SchemaError) as exc:  # held summaries all fit each other: the sums' own limits
                line = f"could not combine the feature summaries of {named(ready)}: {exc}"
                return state, [fx.Log("warning", line), self._status(state, line[:MAX_DETAIL])]
            state = replace(state, feature_statistics=stats)
            effects += [fx.Log("info", f"feature statistics combined from {len(ready)} sites ({named(ready)}) "
                                       f"over {len(stats.columns)} columns: published on ps/features"),
                        *self._statistics_effects(state)]
        if refusers:  # enough sites accept; the others will refuse their tasks, each with its reason
            effects.append(fx.Log("warning", "starting although the privacy policies of some sites refuse this run "
                                  f"(they will answer without updates): {policy_quorum.describe(refusers)}"))
        if self.config.selection == "recruited":
            recruited, summary, told = selection.run_recruitment(self.config, state, ready)
            effects = [*effects, *told]
            if len(recruited) < self.config.quorum:
                blind = [s for s in ready if state.histograms.get(s) is None]
                why = (f"recruitment chose {len(recruited)} site(s), fewer than quorum {self.config.quorum}: no round "
                       "could close")
                if blind:
                    why += (f"; {', '.join(blind)} share no label histogram, which selection = \"recruited\" needs "
                            "(set share_label_histogram = true in those sites' configs and restart them)")
                return state, [*effects, fx.Log("warning", why), self._status(state, why)]
            state = replace(state, recruited=recruited, recruitment=summary)
        chosen = selection.select(self.config, state, 1)
        state = replace(
            state, phase="training", round=1, selected=chosen,
            round_started_at=now, deadline=now + self.config.round_timeout_s, last_progress=now,
        )
        state = self._secure_start(state, now)
        started = fx.Log("info", f"starting round 1 with {', '.join(chosen)}")
        return state, [*effects, started, *self._round_effects(state)]

    def _note_offline(self, state: DaemonState, ev: SiteOffline) -> Result:
        return self._with_offline(state, ev), []

    def _offline_in_round(self, state: DaemonState, ev: SiteOffline) -> Result:
        was_offline = ev.site_id in state.offline
        state = self._with_offline(state, ev)
        if ev.site_id not in state.selected and not was_offline and state.secure is None \
                and ev.site_id in self.validation_sites(state) and ev.site_id not in state.validated:
            # evaluation = "all": the round no longer waits for its validation; it may close now
            if self._all_answered(state) and len(state.updates) >= self.config.quorum:
                return self._close_round(state, ev.now)
            return state, [self._status(state, f"site {ev.site_id} went offline: {self._progress(state)}")]
        if ev.site_id not in state.selected or was_offline or (ev.site_id in state.updates
                                                                  and state.secure is None):
            return state, []
        went = f"site {ev.site_id} went offline during round {state.round}"
        effects: list[fx.Effect] = [fx.Log("warning", went)]
        if state.secure is not None:  # the open stage may now have everything it waits for
            state, more = self._secure_progress(state, ev.now)
            return state, [*effects, *more]
        if self._all_answered(state) and len(state.updates) >= self.config.quorum:
            state, more = self._close_round(state, ev.now)
            return state, [*effects, *more]
        # The round no longer waits for it: ps/status says so now, not at the next update.
        return state, [*effects, self._status(state, f"{went}: {self._progress(state)}")]

    def _offline_in_evaluation(self, state: DaemonState, ev: SiteOffline) -> Result:
        was_offline = ev.site_id in state.offline
        state = self._with_offline(state, ev)
        if self._all_reported(state):
            return self._finish(state)
        if ev.site_id not in state.selected or ev.site_id in state.final_reports or was_offline:
            return state, []
        return state, [self._status(state, f"evaluating the final model: site {ev.site_id} went offline")]

    def _online_in_round(self, state: DaemonState, ev: SiteOnline) -> Result:
        """A selected site that had not answered and comes back is waited for again: ps/status says so."""
        was_offline = ev.site_id in state.offline
        first_seen = ev.site_id not in state.enrolled
        state, effects = self._note_online(state, ev)
        if first_seen and ev.site_id in self.validation_sites(state):  # evaluation = "all": a site that joined late
            return state, [*effects, self._validation_task(state, ev.site_id),
                           self._status(state, f"site {ev.site_id} joined: {self._progress(state)}")]
        answered = state.updates if state.phase == "training" else state.final_reports
        if not was_offline or ev.site_id not in state.selected or ev.site_id in answered:
            return state, effects
        what = self._progress(state) if state.phase == "training" else "evaluating the final model"
        return state, [*effects, self._status(state, f"site {ev.site_id} is back: {what}")]

    def _refuse_update(self, state: DaemonState, ev: UpdateReceived) -> Result:
        """No round is open: `admit_update` says why (the phase and round the PS is in)."""
        return state, [self._update_ignored(ev, self._reject_update_reason(state, ev))]

    def _update_in_round(self, state: DaemonState, ev: UpdateReceived) -> Result:
        reason = self._reject_update_reason(state, ev)
        if reason is not None:
            return state, [self._update_ignored(ev, reason)]
        received = ReceivedUpdate(ev.update, ev.train_loss, dict(ev.val_metrics), dict(ev.undefined), ev.no_step_reason)
        state = replace(state, updates={**state.updates, ev.site_id: received}, last_progress=ev.now)
        # A site that could not take a step has answered (for closing and for the quorum: waiting cannot bring
        # its update) but is left out of the aggregate (S_t), and the round record names it with the reason.
        said: list[fx.Effect] = [fx.Log("warning", f"site {ev.site_id} took no training step in round {state.round}: "
                                        f"{ev.no_step_reason}; the round goes on without its update")
                                 ] if ev.no_step_reason else []
        if state.secure is not None:  # the round closes with the secure sum, not with the updates
            said.extend(self._clip_warning(state, ev))
            state, more = self._secure_progress(state, ev.now)
            return state, [*said, *more]
        if self._all_answered(state) and len(state.updates) >= self.config.quorum:
            state, effects = self._close_round(state, ev.now)
            return state, [*said, *effects]
        return state, [*said, self._status(state, self._progress(state))]

    def _report_in_evaluation(self, state: DaemonState, ev: ReportReceived) -> Result:
        if ev.tag != "final" or ev.model_hash != state.model_hash:
            return state, []
        if ev.site_id not in state.selected or ev.site_id in state.final_reports:
            return state, []
        report = FinalReport(dict(ev.metrics), dict(ev.n_samples), dict(ev.undefined), ev.best_round)
        state = replace(state, final_reports={**state.final_reports, ev.site_id: report}, last_progress=ev.now)
        if self._all_reported(state):
            return self._finish(state)
        return state, []

    def _validated_in_round(self, state: DaemonState, ev: RoundValidated) -> Result:
        """evaluation = "all": sites' validation of the open round's model (a site's round-validation report, one
        site at a time over the wire), kept for the round's record and the best round; the round may now close
        (it waited for every site's)."""
        if self.config.evaluation != "all":
            return state, [fx.Log("warning", f"every site's validation of round {ev.round} ignored: this run's best "
                                             "round is chosen on the selected sites' (evaluation = \"selected\")")]
        if ev.round != state.round or ev.model_hash != state.model_hash:
            return state, []  # another round's or model's
        asked = self.validation_sites(state)  # a selected site validates with its update
        new = {s: dict(m) for s, m in ev.per_site.items() if s in asked and s not in state.validated}
        if not new:
            return state, []  # the open round's again
        state = replace(state, validated=dict(sorted({**state.validated, **new}.items())), last_progress=ev.now)
        if state.secure is None and self._all_answered(state) and len(state.updates) >= self.config.quorum:
            return self._close_round(state, ev.now)
        return state, []

    def _tick_in_round(self, state: DaemonState, ev: Tick) -> Result:
        if self._stalled(state, ev.now):
            return self._republish_stalled(state, ev.now)
        if state.secure is not None:  # the stages' own deadlines drive the round
            if ev.now < state.secure.deadline:
                return state, []
            return self._secure_progress(state, ev.now, deadline_passed=True)
        if state.deadline is None or ev.now < state.deadline:
            return state, []
        if len(state.updates) >= self.config.quorum and self._validated(state):
            return self._close_round(state, ev.now)
        waiting = self._can_answer(state, state.updates)
        away = [s for s in state.selected if s not in state.updates and s in state.offline]
        state = replace(state, deadline=ev.now + self.config.round_timeout_s)
        text = (f"round {state.round}: deadline passed with {len(state.updates)} updates, quorum "
                f"{self.config.quorum}; still waiting for {named(waiting) or 'no site that is online'}")
        if away:
            text += f"; offline: {named(away)}"
        reachable = len(state.updates) + len(waiting)
        if reachable < self.config.quorum:
            text += f" (only {reachable} can still answer: the quorum needs offline sites back)"
        if unvalidated := self._unvalidated(state):
            text += (f"; the validation of the round's model (evaluation = \"all\") has not arrived from "
                     f"{named(unvalidated)}")
        return state, [fx.Log("warning", text), self._status(state, text)]

    def _tick_in_evaluation(self, state: DaemonState, ev: Tick) -> Result:
        if self._stalled(state, ev.now):
            return self._republish_stalled(state, ev.now)
        if state.deadline is None or ev.now < state.deadline:
            return state, []
        return self._finish(state)

    # -- what the handlers share ----------------------------------------------------------------
    def _with_online(self, state: DaemonState, ev: SiteOnline) -> DaemonState:
        since = {s: t for s, t in state.offline_since.items() if s != ev.site_id}
        return replace(state, online=state.online | {ev.site_id}, offline=state.offline - {ev.site_id},
                       offline_since=since,
                       enrolled={**state.enrolled, ev.site_id: ev.n_train},
                       histograms={**state.histograms, ev.site_id: ev.histogram},
                       policies={**state.policies, ev.site_id: ev.policy},
                       site_errors={**{s: e for s, e in state.site_errors.items() if s != ev.site_id},
                                    **({ev.site_id: ev.error} if ev.error else {})})

    @staticmethod
    def _with_offline(state: DaemonState, ev: SiteOffline) -> DaemonState:
        first = ev.now if ev.since is None else ev.since
        since = {**state.offline_since, ev.site_id: state.offline_since.get(ev.site_id, first)}  # the first Will
        return replace(state, online=state.online - {ev.site_id}, offline=state.offline | {ev.site_id},
                       offline_since=since)

    @staticmethod
    def _update_ignored(ev: UpdateReceived, reason: str | None) -> fx.Log:
        return fx.Log("warning", f"update from {ev.site_id} for round {ev.round} ignored: {reason}")

    def _stalled(self, state: DaemonState, now: float) -> bool:
        """Nothing arrived for the open round for `stall_s` (0: never), and its deadline has not passed yet."""
        stall = self.config.stall_s
        return bool(stall and now - state.last_progress >= stall and (state.deadline is None or now < state.deadline))

    def _republish_stalled(self, state: DaemonState, now: float) -> Result:
        """Nothing arrived for `stall_s`: the broker may have lost the round's retained messages or a site's
        uplink. Re-publish under new message ids (a site that already answered re-sends its stored update)."""
        state = replace(state, attempt=state.attempt + 1, last_progress=now)
        answered = state.updates if state.phase == "training" else state.final_reports
        missing = (*(s for s in state.selected if s not in answered),
                   *(s for s in self.validation_sites(state) if s not in state.validated))
        why = (f"round {state.round}: nothing arrived for {self.config.stall_s:.0f} s; re-published the model and "
               f"the tasks of {', '.join(missing) or 'no site'} (attempt {state.attempt})")
        effects = self._round_effects(state, why) if state.phase == "training" else self._eval_effects(state, why)
        keep = [e for e in effects
                if not isinstance(e, (fx.PublishTrainTask, fx.PublishEvalTask)) or e.site_id in missing]
        return state, [fx.Log("warning", why), *keep]

    # -- helpers --------------------------------------------------------------------------------
    def admit_update(self, state: DaemonState, site: str, round_no: int, base_model_hash: str) -> str | None:
        """Why an update cannot be accepted now, judged before its tensors are stored (None: admissible).
        First wins: exactly one accepted update per site and round; only the open round is admissible."""
        if state.phase != "training" or round_no != state.round:
            return f"stale or future round (PS is in {state.phase} round {state.round})"
        if site not in state.selected:
            return "site was not selected for this round"
        if site in state.updates:
            return "duplicate update (the first one for this round was accepted)"
        if base_model_hash != state.model_hash:
            return "trained from a different model version"
        return None

    def clear_label_rows(self, state: DaemonState) -> tuple[str, ...]:
        """In the clear, the output tensors the rule averages label by label (FedFBN surgical): each train task
        names them and each update must name the labels its site annotates (its label set). () for another rule
        and under secure aggregation, whose terms carry them (the PS then learns per-label counts, not sets)."""
        return () if self.secure_on else sec.label_rows(self.strategy, state.manifest, self.shared_model(state))

    def shared_model(self, state: DaemonState) -> Weights:
        """The tensors every update of the open round must match by name, dtype and shape."""
        return {n: state.weights[n] for n in self.shared_names(state) if n in state.weights}

    def _reject_update_reason(self, state: DaemonState, ev: UpdateReceived) -> str | None:
        reason = self.admit_update(state, ev.site_id, ev.round, ev.base_model_hash)
        if reason is not None or ev.no_step_reason:  # an answer without an update carries no tensors to check
            return reason
        if self.secure_on:  # what it trained to travels masked: the update says how it trained, with no tensors
            return self._secure_update_problem(state, ev)
        return check_update_shapes(ev.update, self.shared_model(state))

    def _all_answered(self, state: DaemonState) -> bool:
        # Only a site seen going offline is skipped: after a resume, a site not yet heard from may
        # still answer (its retained status and update can arrive in any order).
        return self._validated(state) and all(s in state.updates or s in state.offline for s in state.selected)

    def _validated(self, state: DaemonState) -> bool:
        """Whether the open round has the validation its best-round rule reads: the selected sites' (in their
        updates) or, with evaluation = "all", every site's not seen going offline."""
        return not self._unvalidated(state)

    def _unvalidated(self, state: DaemonState) -> tuple[str, ...]:
        """evaluation = "all": the configured sites whose validation of the open round's model the round still
        waits for. A selected site validates with its update (its val_metrics, the received model's scores before
        training); every other site answers the round's validation task. A site seen going offline is not waited
        for (as a selected one is not)."""
        return missing_validation(self.config, state)

    def validation_sites(self, state: DaemonState) -> tuple[str, ...]:
        """evaluation = "all": the sites that get the open round's validation task, every configured site not
        selected to train (a selected one validates the received model before it trains) that has been seen in
        this run (a site configured but never started would otherwise hold every round; it is asked as it
        joins); () otherwise."""
        return validation_sites(self.config, state)

    def _all_reported(self, state: DaemonState) -> bool:
        return all(s in state.final_reports or s in state.offline for s in state.selected)

    def _close_round(self, state: DaemonState, now: float, secure_sum: smsg.RoundSum | None = None) -> Result:
        # sorted: sums do not depend on arrival order; a site that took no step has no update to aggregate
        participants = tuple(sorted(s for s, u in state.updates.items() if not u.no_step_reason))
        if secure_sum is not None:
            participants = tuple(sorted(secure_sum.included))
        self.strategy.load_state_dict(dict(state.strategy_state))
        try:
            # Overflow is judged below (a non-finite result is refused), not warned about mid-sum.
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                if secure_sum is not None:
                    result = self._aggregate_secure(state, secure_sum)
                else:
                    self._observe(state, participants)
                    result = self.strategy.aggregate_train(RoundInput(
                        round_no=state.round, current=dict(state.weights),
                        updates=[state.updates[s].update for s in participants], enrolled=dict(state.enrolled),
                        manifest=state.manifest,
                    ))
        # A strategy's protocol check (e.g. SCAFFOLD's delta_c for every tensor).
        except (ValueError, FloatingPointError) as exc:
            return self._refuse_aggregate(state, now, f"the strategy refused them: {exc}")
        broken = [n for w in (result.weights, result.eval_weights or {}, *result.personal.values(),
                              *result.extras.values()) for n in _non_finite(w)]
        if broken:
            return self._refuse_aggregate(state, now, f"non-finite values in {', '.join(broken[:3])}")
        extras = dict(result.extras)
        if result.eval_weights is not None:
            extras["eval"] = result.eval_weights
        record = replace(self._record(state, participants, now), server=dict(result.diagnostics),
                         secure=self._secure_note(state, secure_sum))
        best = self._better_best(state, record)
        nxt = state.round + 1
        chosen = selection.pool(self.config, state) if nxt > self.config.rounds else selection.select(
            self.config, state, nxt)  # the final evaluation goes to the whole pool
        state = replace(
            state, round=nxt, weights=dict(result.weights), personal={**state.personal, **result.personal},
            extras=extras, selected=chosen, updates={},
            history=(*state.history, record), best=best, strategy_state=self.strategy.state_dict(),
            accepted_rounds={**state.accepted_rounds, **{s: state.round for s in participants}},
            round_started_at=now, deadline=now + self.config.round_timeout_s, attempt=0, last_progress=now,
            secure=None, validated={},
        )
        state = replace(state, model_hash=self.hash_weights(self.published(state)))
        if nxt <= self.config.rounds:
            state = self._secure_start(state, now, previous_attempt=secure_attempt(record))
        head: list[fx.Effect] = [fx.PublishRoundMetrics(record)]
        if "epsilon" in record.server:  # a DP server rule: what the released models have cost so far
            head.append(fx.Log("info", f"round {record.round}: participant-level DP has spent epsilon "
                                       f"{record.server['epsilon']:.3g} at delta {record.server.get('delta', 0):g}"))
        if record.server.get("sites_in_sum", math.inf) < record.server.get("noise_calibrated_for", 0):
            head.append(fx.Log("warning", f"round {record.round}: distributed DP: only "
                                          f"{record.server['sites_in_sum']:g} sites' noise in the sum, calibrated for "
                                          f"{record.server['noise_calibrated_for']:g}: less noise, more epsilon"))
        if nxt > self.config.rounds:
            state = replace(state, phase="evaluating")
            return state, [fx.SaveCheckpoint(state), *head, *self._eval_effects(state)]
        return state, [fx.SaveCheckpoint(state), *head, *self._round_effects(state)]

    def _refuse_aggregate(self, state: DaemonState, now: float, problem: str) -> Result:
        """Valid-looking updates (finite, in range) can still combine into Inf/NaN, e.g. huge values under an
        adaptive server rule. Publishing or checkpointing that would fail and crash-loop the PS on every resume;
        instead the round's updates are dropped and the round is re-published (a run is delayed, never broken)."""
        why = (f"round {state.round}: could not aggregate the updates of {', '.join(sorted(state.updates))} "
               f"({problem}); discarded them; the round's tasks go out again after stall_s "
               f"({self.config.stall_s:.0f} s) without progress")
        # No immediate re-publish: the same stored updates would come straight back and fail again.
        state = replace(state, updates={}, last_progress=now, deadline=now + self.config.round_timeout_s)
        return state, [fx.Log("warning", why), self._status(state, why)]

    def _record(self, state: DaemonState, participants: tuple[str, ...], now: float) -> RoundRecord:
        # Under secure aggregation a site in the sum may not have sent how it trained (metrics): it has none here.
        told = tuple(s for s in participants if s in state.updates)
        per_site = {s: dict(state.updates[s].val_metrics) for s in told}
        if self.config.evaluation == "all":  # every site that validated the round's model: with its update or not
            per_site = dict(sorted({**{s: dict(u.val_metrics) for s, u in state.updates.items() if u.val_metrics},
                                    **{s: dict(m) for s, m in state.validated.items()}}.items()))
        names = sorted({k for m in per_site.values() for k in m})
        mean = {k: mean_defined([m.get(k) for m in per_site.values()]) for k in names}
        losses = [state.updates[s].train_loss for s in told]
        return RoundRecord(
            round=state.round, sites=participants,
            stragglers=tuple(s for s in state.selected if s not in state.updates and s not in participants),
            per_site=per_site, mean=mean, train_loss=mean_defined(losses),
            n_samples={s: state.updates[s].update.n_samples for s in told},
            started_at=state.round_started_at, closed_at=now, model_hash=state.model_hash,
            skipped={s: u.no_step_reason for s, u in sorted(state.updates.items()) if u.no_step_reason},
        )

    def _better_best(self, state: DaemonState, record: RoundRecord) -> BestRound | None:
        metric = self.config.selection_metric
        score = record.mean.get(metric)
        sign = 1.0 if direction_of(metric) == "max" else -1.0
        if score is None or (state.best is not None and sign * score <= sign * state.best.score):
            return state.best  # ties keep the earlier round (docs/algorithms.md 17.1)
        evaluated = {**state.weights, **state.extras.get("eval", {})}  # FedDyn validates theta_avg
        return BestRound(record.round, score, evaluated, state.model_hash)

    def _round_effects(self, state: DaemonState, why: str = "") -> list[fx.Effect]:
        out: list[fx.Effect] = [self._model_effect(state)]
        clip = self.strategy.clip if isinstance(self.strategy, DPFedAvg) else None  # adaptive clipping moves it
        for site in state.selected:
            out.append(fx.PublishTrainTask(
                site, state.round, state.model_hash, state.deadline or 0.0, self._accepted(state, site),
                dict(state.personal.get(site, {})), self._site_hyper(state, site),
                tuple(self.shared_names(state)), state.best.round if state.best else None,
                sec.terms(self.config, state.secure, clip) if state.secure is not None else None,
                self.clear_label_rows(state)))
        if state.secure is not None:  # the open stage's messages, again (the same ids: a site that has them drops them)
            out.extend(fx.PublishSecAgg(site, message) for site, message in state.secure.sent)
        out.extend(self._validation_task(state, site) for site in self.validation_sites(state)
                   if site not in state.validated)
        out.append(self._status(state, why or self._training_on(state)))
        return out

    def _validation_task(self, state: DaemonState, site: str) -> fx.PublishEvalTask:
        """evaluation = "all": ask a site not selected to validate the open round's model (val split), naming the
        best round so far, so that its best slot follows the PS's as a training site's does."""
        return fx.PublishEvalTask(site, state.round, state.model_hash, self._accepted(state, site), {},
                                  state.best.round if state.best else None, tag=ROUND_VALIDATION_TAG, splits=("val",))

    def _eval_effects(self, state: DaemonState, why: str = "") -> list[fx.Effect]:
        out: list[fx.Effect] = [self._model_effect(state)]
        best = state.best.round if state.best else None
        out.extend(fx.PublishEvalTask(site, state.round, state.model_hash, self._accepted(state, site),
                                      dict(state.personal.get(site, {})), best) for site in state.selected)
        out.append(self._status(state, why or "evaluating the final model"))
        return out

    def _observe(self, state: DaemonState, participants: tuple[str, ...]) -> None:
        """Hand the strategy the feature statistics that came with the updates (most rounds: none)."""
        stats = {s: state.updates[s].update.extras["feature_stats"] for s in participants
                 if "feature_stats" in state.updates[s].update.extras}
        self.strategy.observe_round(state.round, stats)

    def _site_hyper(self, state: DaemonState, site: str) -> dict[str, float]:
        hyper = dict(self.strategy.site_hyper(site, dict(state.enrolled)))
        wanted = self.strategy.round_requirements(state.round).feature_stats
        if wanted is not None:
            hyper["feature_stats"] = float(wanted)
        return hyper

    @staticmethod
    def _statistics_effects(state: DaemonState) -> list[fx.Effect]:
        """The federation's feature statistics, once combined: sent again wherever the round is sent again."""
        return [] if state.feature_statistics is None else [fx.PublishFeatureStatistics(state.feature_statistics)]

    def _model_effect(self, state: DaemonState) -> fx.PublishModel:
        return fx.PublishModel(state.round, self.published(state), state.model_hash, self.published_extras(state))

    @staticmethod
    def _accepted(state: DaemonState, site: str) -> int | None:
        """The commit rule's answer (docs/algorithms.md 0.6): the round of this site's last aggregated update.

        A round number rather than a yes/no for "the previous round": under sampling a site's last
        update may be many rounds old, and it must still be committed if it was aggregated."""
        return state.accepted_rounds.get(site)

    def _finish(self, state: DaemonState) -> Result:
        state = replace(state, phase="done", deadline=None)
        missing = [s for s in state.selected if s not in state.final_reports]
        detail = "done" + (f"; no final report from {', '.join(missing)}" if missing else "")
        return state, [self._status(state, detail), fx.Finish(state)]

    def _status(self, state: DaemonState, detail: str) -> fx.PublishStatus:
        if state.phase == "training" and state.secure is not None:  # who the open stage of the protocol waits for
            waiting = self._secure_waiting(state)
        elif state.phase == "training":
            waiting = (*self._can_answer(state, state.updates),
                       *(s for s in self._unvalidated(state) if s not in state.selected))
        elif state.phase == "evaluating":
            waiting = self._can_answer(state, state.final_reports)
        elif state.phase == "waiting_for_sites":
            waiting = tuple(s for s in self.config.sorted_sites if s not in state.online)
        else:
            waiting = ()
        spent = spent_in_run(self.config, state.history)  # the Prometheus gauge reads the same (monitoring.py)
        return fx.PublishStatus(state.phase, state.round, waiting, state.deadline, detail, _shown(dropped(state)),
                                spent)

    @staticmethod
    def _can_answer(state: DaemonState, answered: Mapping[str, object]) -> tuple[str, ...]:
        """The selected sites the open round still waits for: not answered, not seen going offline (the same rule
        that closes a round, `_all_answered`)."""
        return tuple(s for s in state.selected if s not in answered and s not in state.offline)

    def _progress(self, state: DaemonState) -> str:
        """'round r: k/N updates', N counting only the sites that answered or can still answer."""
        expected = len(state.updates) + len(self._can_answer(state, state.updates))
        text = f"round {state.round}: {len(state.updates)}/{expected} updates" + _offline_note(state, state.updates)
        if unvalidated := [s for s in self._unvalidated(state) if s not in state.selected]:
            text += f"; validation of the round's model missing from {named(unvalidated)}"
        return text

    def _training_on(self, state: DaemonState) -> str:
        return (f"round {state.round}: training on {len(self._can_answer(state, state.updates))} sites"
                + _offline_note(state, state.updates))


def validation_sites(config: DaemonConfig, state: DaemonState) -> tuple[str, ...]:
    """evaluation = "all": the sites asked to validate the open round's model (Machine.validation_sites)."""
    if config.evaluation != "all" or state.phase != "training":
        return ()
    return tuple(s for s in config.sorted_sites if s not in state.selected and s in state.enrolled)


def missing_validation(config: DaemonConfig, state: DaemonState) -> tuple[str, ...]:
    """evaluation = "all": the sites whose validation of the open round's model has not arrived: a selected one
    without its update, or one asked (validation_sites) without its report, not counting a site seen going
    offline (ps/status and the PS's reminders name them); () otherwise."""
    if config.evaluation != "all" or state.phase != "training":
        return ()
    asked = set(validation_sites(config, state))
    return tuple(s for s in config.sorted_sites if s not in state.offline and (
        (s in state.selected and s not in state.updates) or (s in asked and s not in state.validated)))


def dropped(state: DaemonState) -> dict[str, str]:
    """The selected sites the open round (or the final evaluation) goes on without, each with why: seen going
    offline (since when), answered that it could take no step, or, once the run is done, no final report."""
    if state.phase == "training":
        why = {s: f"no step possible: {u.no_step_reason}" for s, u in state.updates.items() if u.no_step_reason}
        answered: Mapping[str, object] = state.updates
    elif state.phase in ("evaluating", "done"):
        why, answered = {}, state.final_reports
    else:
        return {}
    for site in state.selected:
        if site in answered:
            continue
        if site in state.offline:
            why[site] = f"offline since {_utc(state.offline_since[site])}" if site in state.offline_since else "offline"
        elif state.phase == "done":
            why[site] = "deadline missed: no final report"
    return why


def _shown(why: Mapping[str, str]) -> dict[str, str]:
    """At most MAX_DROPPED_SHOWN of them, reasons clipped: ps/status stays small with thousands of sites."""
    return {s: why[s][:MAX_REASON_CHARS] for s in sorted(why)[:MAX_DROPPED_SHOWN]}


def _offline_note(state: DaemonState, answered: Mapping[str, object]) -> str:
    away = sum(1 for s in state.selected if s not in answered and s in state.offline)
    return f" ({away} offline, not waited for)" if away else ""


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _non_finite(weights: Weights) -> list[str]:
    """Names of floating-point tensors holding NaN or Inf."""
    return [n for n, v in sorted(weights.items())
            if np.asarray(v).dtype.kind == "f" and not np.isfinite(np.asarray(v)).all()]
