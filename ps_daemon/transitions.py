"""The PS's phases as one table: for every phase and every kind of event, which handler of `Machine` runs, what
it does, and the phases it can leave the PS in.

`Machine.step` dispatches through this table and nothing else, and docs/design-notes.md renders it
(`python -m fedmqtt.docgen`), so the code and the description cannot drift apart.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass

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
from ps_daemon.state import Phase

PHASES: tuple[Phase, ...] = typing.get_args(Phase)
EVENTS: tuple[type[Event], ...] = typing.get_args(Event)


@dataclass(frozen=True)
class Transition:
    """What one kind of event does in one phase."""

    handler: str  # the `Machine` method that handles it: (state, event) -> (state, effects)
    does: str  # in words, for the docs
    next_phases: tuple[Phase, ...]  # every phase the PS can be in afterwards


# Rows that read the same in several phases and leave the phase as it is.
def _note_online(phase: Phase) -> Transition:
    return Transition("_note_online", "records the site online, with its row count and label histogram (a site "
                      "not in the PS config is ignored with a log)", (phase,))


def _online_in_round(phase: Phase) -> Transition:
    extra = ("; with `evaluation = \"all\"` a site seen for the first time in this run gets the open round's "
             "validation task and is waited for") if phase == "training" else ""
    return Transition("_online_in_round", "records the site online (as in `waiting_for_sites`); a selected site that "
                      "had not answered and was seen offline is waited for again, and the status says so" + extra,
                      (phase,))


def _note_offline(phase: Phase) -> Transition:
    return Transition("_note_offline", "records the site as seen offline", (phase,))


def _refuse_update(phase: Phase) -> Transition:
    return Transition("_refuse_update", "refused with a log: no round is open (stale or future round)", (phase,))


def _refuse_secagg(phase: Phase) -> Transition:
    return Transition("_refuse_secagg", "refused with a log: no round is open for secure aggregation", (phase,))


def _refuse_summary(phase: Phase) -> Transition:
    return Transition("_refuse_summary", "refused with a log: the federation's feature statistics are combined "
                      "before round 1 (a summary of a site whose summary is in them is dropped silently: a "
                      "retained copy replayed after a reconnect or a resume)", (phase,))


def _ignore_validation(phase: Phase) -> Transition:
    return Transition("_ignore", "ignored: every site's validation belongs to an open round", (phase,))


def _ignore_report(phase: Phase) -> Transition:
    return Transition("_ignore", "ignored: only the final evaluation takes reports", (phase,))


TRANSITIONS: Mapping[tuple[Phase, type[Event]], Transition] = {
    ("waiting_for_sites", Started): Transition(
        "_announce", "publishes `waiting for sites`", ("waiting_for_sites",)),
    ("waiting_for_sites", SiteOnline): Transition(
        "_online_while_waiting",
        "records the site and its privacy policy (one not in the PS config is ignored with a log); once `min_sites` "
        "of them are online, at least `quorum` of them would accept the run under their policies (else it waits, "
        "naming the refusing sites and the rule each would break), with `feature_statistics = \"federated\"` "
        "every online site has sent its feature summary (else it waits, naming the sites) and, with "
        "`selection = \"recruited\"`, recruitment chose at least `quorum`, selects the sites of round 1 and "
        "publishes the model and tasks (first the federation's feature statistics, combined from the summaries)",
        ("waiting_for_sites", "training")),
    ("waiting_for_sites", FeatureSummaryReceived): Transition(
        "_summary_while_waiting",
        "with `feature_statistics = \"federated\"`: holds the site's summary if it fits the ones held (same "
        "columns, grid and fixed columns; else refused with a log), then starts round 1 as a site coming online "
        "does once every online site has sent one", ("waiting_for_sites", "training")),
    ("waiting_for_sites", SiteOffline): Transition(
        "_offline_while_waiting",
        "records the site as seen offline; with `feature_statistics = \"federated\"` a site that goes before "
        "sending its feature summary is no longer waited for, and round 1 starts as a site coming online starts "
        "it if the online sites have all sent theirs", ("waiting_for_sites", "training")),
    ("waiting_for_sites", UpdateReceived): _refuse_update("waiting_for_sites"),
    ("waiting_for_sites", SecAggReceived): _refuse_secagg("waiting_for_sites"),
    ("waiting_for_sites", ReportReceived): _ignore_report("waiting_for_sites"),
    ("waiting_for_sites", RoundValidated): _ignore_validation("waiting_for_sites"),
    ("waiting_for_sites", Tick): Transition("_ignore", "nothing: no deadline runs", ("waiting_for_sites",)),

    ("training", Started): Transition(
        "_resume_round", "resumed from a checkpoint: new deadline, re-publishes the round's model and tasks",
        ("training",)),
    ("training", SiteOnline): _online_in_round("training"),
    ("training", SiteOffline): Transition(
        "_offline_in_round",
        "records the site; a selected site that had not answered is logged, and the round closes if every other "
        "selected site has answered and the quorum is met, else the status stops waiting for it and names it "
        "among the dropped sites; under secure aggregation the open stage closes if it waited only for it",
        ("training", "evaluating")),
    ("training", UpdateReceived): Transition(
        "_update_in_round",
        "admits the update (open round, selected site, first one, current model, matching layout) or refuses it "
        "with a log; the round closes once every selected site not seen offline has answered and the quorum is "
        "met: aggregate, checkpoint, round metrics, then the next round or the final evaluation; under secure "
        "aggregation the update carries no tensors (how the site trained, its metrics) and the round closes with "
        "the secure sum instead",
        ("training", "evaluating")),
    ("training", FeatureSummaryReceived): _refuse_summary("training"),
    ("training", ReportReceived): _ignore_report("training"),
    ("training", SecAggReceived): Transition(
        "_secagg_in_round",
        "under secure aggregation: the message joins the open stage (keys, shares, masked inputs, answers) or is "
        "refused with a log; once every site the stage waits for has answered or is seen offline, closes it and "
        "sends the next stage's rosters, inboxes or unmasking requests; after the answers, unmasks the sum and "
        "closes the round with it (a failed try: nothing aggregated, a new try with fresh keys)",
        ("training", "evaluating")),
    ("training", RoundValidated): Transition(
        "_validated_in_round",
        "with `evaluation = \"all\"`: keeps the validation metrics of the open round's model that a site not "
        "selected to train reported (its round-validation task's answer; another round's or model's, a second "
        "answer or one not asked for are dropped), which the best round is then chosen on; the round closes if "
        "every selected site has answered, every site not seen offline has validated and the quorum is met; "
        "refused with a log under `evaluation = \"selected\"`",
        ("training", "evaluating")),
    ("training", Tick): Transition(
        "_tick_in_round",
        "after `stall_s` without progress re-publishes the round for the sites still missing; at the deadline "
        "closes the round if the quorum is met, else extends the deadline and names the missing sites; under "
        "secure aggregation the open stage's deadline closes the stage with whoever answered (a failed try: "
        "nothing aggregated, a new try)",
        ("training", "evaluating")),

    ("evaluating", Started): Transition(
        "_resume_evaluation", "resumed from a checkpoint: new deadline, re-publishes the final model and eval tasks",
        ("evaluating",)),
    ("evaluating", SiteOnline): _online_in_round("evaluating"),
    ("evaluating", SiteOffline): Transition(
        "_offline_in_evaluation", "records the site; finishes if every other selected site has reported, else the "
        "status stops waiting for it and names it among the dropped sites", ("evaluating", "done")),
    ("evaluating", UpdateReceived): _refuse_update("evaluating"),
    ("evaluating", SecAggReceived): _refuse_secagg("evaluating"),
    ("evaluating", FeatureSummaryReceived): _refuse_summary("evaluating"),
    ("evaluating", ReportReceived): Transition(
        "_report_in_evaluation",
        "keeps the first `final` report of each selected site on the final model; finishes when every selected "
        "site not seen offline has reported",
        ("evaluating", "done")),
    ("evaluating", RoundValidated): _ignore_validation("evaluating"),
    ("evaluating", Tick): Transition(
        "_tick_in_evaluation",
        "after `stall_s` without progress re-publishes the eval tasks still missing; at the deadline finishes, "
        "naming the sites that did not report",
        ("evaluating", "done")),

    ("done", Started): Transition(
        "_announce", "publishes `waiting for sites` (never happens: no checkpoint holds a finished run)", ("done",)),
    ("done", SiteOnline): _note_online("done"),
    ("done", SiteOffline): _note_offline("done"),
    ("done", UpdateReceived): _refuse_update("done"),
    ("done", SecAggReceived): _refuse_secagg("done"),
    ("done", FeatureSummaryReceived): _refuse_summary("done"),
    ("done", ReportReceived): _ignore_report("done"),
    ("done", RoundValidated): _ignore_validation("done"),
    ("done", Tick): Transition("_ignore", "nothing: the run is over", ("done",)),
}
