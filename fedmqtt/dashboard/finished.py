"""A finished run's view from its report.json (and its directory's downloads): `run_view_from_report`.

The report is written by our PS but still read defensively: a section an older version lacks is left empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedmqtt.dashboard.results import results
from fedmqtt.dashboard.rundir import available
from fedmqtt.dashboard.state import RunView, privacy_spent_view
from fedmqtt.dashboard.timeline import events_from_report
from schemas import messages as m

NO_SITE_EVENTS = ("A report does not record when sites went offline or came back, nor who sent a refused message "
                  "(the audit log counts refusals by reason per round); the live page shows both as they happen.")


def run_view_from_report(report: dict[str, Any], *, label: str, directory: Path | None = None,
                         audit: list[dict[str, Any]] | None = None) -> RunView:
    """A finished run from its report.json (written by our PS; still read defensively)."""
    view = RunView(run_id=str(report.get("run_id", "?")), source="report", label=label, directory=directory)
    fill_from_report(view, report, audit or [])
    view.timeline = events_from_report(report, audit or [])
    return view


def fill_from_report(view: RunView, report: dict[str, Any], audit: list[dict[str, Any]]) -> None:
    view.algorithm = str(report.get("algorithm", ""))
    view.ps_state = "done"
    rounds = report.get("rounds") or []
    config = report.get("config") or {}
    view.selection_metric = str(config.get("selection_metric") or "")
    view.rounds_total = int(config.get("rounds", len(rounds)) or len(rounds))
    view.quorum = int(config.get("quorum") or 0)
    view.min_sites = int(config.get("min_sites") or len(config.get("sites") or ()))
    for r in rounds:
        n = int(r["round"])
        view.rounds[n] = {"round": n, "sites": list(r.get("sites", [])),
                          "stragglers": list(r.get("stragglers", [])),
                          "per_site": {s: dict(v) for s, v in (r.get("per_site") or {}).items()},
                          "mean": dict(r.get("mean") or {}), "train_loss": r.get("train_loss"),
                          "duration_s": r.get("duration_s"), "closed_at": r.get("closed_at"), "secure": None}
        view.round_changes += 1
        view.round_changed[n] = view.round_changes
        for name in r.get("sites", []):
            site = view._site(str(name))
            if site is not None:
                site.rounds.add(n)
                if isinstance(count := (r.get("n_samples") or {}).get(name), int):
                    site.n_train = count  # the training rows it weighed in with (its last round's)
    secure = report.get("secure_aggregation") or {}
    view.secure_aggregation = bool(secure.get("enabled", False))
    for entry in secure.get("per_round") or []:
        note = {k: entry.get(k) for k in ("round", "included", "dropped", "recovered", "tries")}
        if all(isinstance(v, int) and not isinstance(v, bool) for v in note.values()):
            view._note_secure({k: int(v) for k, v in note.items()})
    view.round = max(view.rounds, default=0)
    view.first_metrics_round = min(view.rounds, default=None)
    final = report.get("final") or {}
    for name, entry in (final.get("per_site") or {}).items():
        site = view._site(str(name))
        if site is not None and isinstance(entry, dict):
            samples = entry.get("n_samples") or {}
            site.n_val, site.n_test = int(samples.get("val") or 0), int(samples.get("test") or 0)
    view.final = {"per_site": {s: (v.get("metrics") or {}).get("test", {})
                               for s, v in (final.get("per_site") or {}).items()},
                  "mean": (final.get("mean") or {}).get("test", {}) if isinstance(final.get("mean"), dict) else {}}
    view.best_round = report.get("best_round")
    view.recruitment = report.get("recruitment")
    _usage(view, report)
    _privacy(view, report)
    for site in view.sites.values():
        missing = ((final.get("per_site") or {}).get(site.name) or {}).get("missing")
        if missing:  # it left the run (killed, offline, past the deadline): say so, not "finished"
            site.state, site.detail = "offline", str(missing)
    view.sites_expected = tuple(sorted(str(s) for s in (config.get("sites") or view.sites)))
    view.finished_at = (report.get("timings") or {}).get("finished_at")
    view.results = results(report)
    view.files = available(view.directory) if view.directory is not None else []
    view.timeline_note = NO_SITE_EVENTS + ("" if audit else " This run directory has no audit log (audit/ps.jsonl).")


def _privacy(view: RunView, report: dict[str, Any]) -> None:
    """Each site's record-level DP spending from `privacy.record_level`, validated as the wire's PrivacySpent (the
    report is a file another party wrote), and the run's participant-level spending from
    `privacy.participant_level.final`, validated as ParticipantSpent: an entry that does not validate is left out."""
    privacy = report.get("privacy")
    spent = privacy.get("record_level") if isinstance(privacy, dict) else None
    for name, entry in (spent.items() if isinstance(spent, dict) else ()):
        site = view._site(str(name))
        try:
            checked = m.PrivacySpent.model_validate(entry)
        except ValidationError:
            continue
        if site is not None:
            site.epsilon = privacy_spent_view(checked)
    participant = privacy.get("participant_level") if isinstance(privacy, dict) else None
    final = participant.get("final") if isinstance(participant, dict) else None
    if final is not None:  # validated as the wire's ParticipantSpent: one that does not is left out
        try:
            view.note_participant(m.ParticipantSpent.model_validate(final))
        except ValidationError:
            pass


def _usage(view: RunView, report: dict[str, Any]) -> None:
    """Each site's total CPU (and GPU energy), its last round's compute and its device, from `usage`."""
    usage = report.get("usage") or {}
    for name, total in (usage.get("per_site_total") or {}).items():
        site = view._site(str(name))
        if site is not None:
            site.usage = {k: float(v) for k, v in total.items() if isinstance(v, (int, float))}
    per_round = usage.get("per_round") or {}
    for site in view.sites.values():
        site.state = "finished"
        if site.rounds:
            last = (per_round.get(str(max(site.rounds))) or {}).get(site.name) or {}
            site.last_compute = {k: float(last[k]) for k in ("wall_s", "cpu_s")
                                 if isinstance(last.get(k), (int, float))}
            site.device = str(last.get("device") or "")
