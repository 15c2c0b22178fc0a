"""What the dashboard knows about one run, built from observer-readable MQTT messages or from report.json.

Pure: no network, no clock of its own (callers pass `now`), so it is unit-testable. Every payload is
validated by the same `check_message` the PS uses before anything is stored, its signature first (against the
observer's key list, which follows `federation/keys`); a bad or unsigned one is counted with its sender (the
topic's site) and reason, never shown raw. Because `ps/metrics` is retained with the last round only, rounds are
accumulated here while the dashboard runs; rounds that closed before it connected are reported as unavailable.

Snapshots can be incremental (`snapshot(since=cursor)`): rounds changed and timeline events added after the
cursor, everything else whole (it is small: the sites' rows and the PS's status).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmqtt.dashboard.timeline import Kind, Timeline, classify_detail, refusal_events
from fedmqtt.errors import FedMqttError
from fedmqtt.means import best_round, direction_of
from fedmqtt.transport.channel import check_message
from fedmqtt.transport.signing import KeyRing
from schemas import messages as m
from schemas.signed import KeyList

MAX_SITES_SHOWN = 256  # the schema bounds names per message; this bounds how many distinct sites we keep
MAX_INVALID_KINDS = 64  # distinct (sender, reason) pairs of dropped messages kept
INVALID_EVENT_EVERY_S = 10.0  # a flood of bad messages from one sender adds one timeline event per this
REASON_CHARS = 300
Cursor = tuple[int, int]  # (round changes, timeline events) already sent


@dataclass
class SiteView:
    name: str
    state: str = "unknown"
    last_seen: float | None = None
    device: str = ""
    n_train: int = 0
    n_val: int = 0
    n_test: int = 0
    label_histogram: dict[str, int] | None = None
    detail: str = ""
    rounds: set[int] = field(default_factory=set)
    usage: dict[str, float] = field(default_factory=dict)
    last_compute: dict[str, float] = field(default_factory=dict)  # the last round's wall/CPU s (J on a GPU)
    last_update_bytes: int | None = None  # size of the last accepted update (live, from ps/metrics)
    # Record-level DP: what the site's training records have spent (epsilon at delta, by its accountant), as the
    # PS last showed it (ps/status `epsilon`) or its report recorded it
    epsilon: dict[str, Any] | None = None

    def as_json(self, rejected: dict[str, dict[str, int]]) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "last_seen": self.last_seen, "device": self.device,
                "n_train": self.n_train, "n_val": self.n_val, "n_test": self.n_test,
                "label_histogram": self.label_histogram, "detail": self.detail,
                "rounds_participated": len(self.rounds), "rejected": rejected.get(self.name, {}),
                "usage": self.usage, "last_compute": self.last_compute,
                "last_update_bytes": self.last_update_bytes, "epsilon": self.epsilon}


@dataclass
class Dropped:
    """Messages this dashboard dropped from one sender for one reason."""

    sender: str
    topic: str
    reason: str
    count: int = 0
    last: str = ""  # the last one's full reason (bounded)
    shown_count: int = 0  # how many of them the timeline has reported
    shown_at: float = float("-inf")


@dataclass
class RunView:
    """One run, live or finished. `snapshot()` is what the page renders (plain JSON, no credentials)."""

    run_id: str
    source: str = "live"  # "live" (broker) or "report" (a finished run directory)
    label: str = ""
    directory: Path | None = None  # a finished run's folder: where its downloads come from
    ps_state: str = "unknown"
    ps_detail: str = ""
    algorithm: str = ""
    selection_metric: str = ""  # "" while unknown (no ps/status yet, or a PS that does not say it)
    round: int = 0
    rounds_total: int = 0
    sites_expected: tuple[str, ...] = ()
    sites_online: tuple[str, ...] = ()
    waiting_for: tuple[str, ...] = ()
    # Selected sites the PS goes on without, each with why (ps/status `dropped`: offline since when, no step
    # possible, no final report); never among `waiting_for`
    sites_dropped: dict[str, str] = field(default_factory=dict)
    upload_turns: tuple[str, ...] = ()  # sites whose large update the PS takes now
    deadline: float | None = None
    quorum: int = 0
    min_sites: int = 0
    broker_connected: bool = True  # set by the listener; a lost broker makes the PS's state unknown
    messages: int = 0  # messages received for this run (what the dashboard costs the broker in deliveries)
    rejected: dict[str, dict[str, int]] = field(default_factory=dict)
    ps_last_seen: float | None = None
    ps_seen: bool = False
    sites: dict[str, SiteView] = field(default_factory=dict)
    rounds: dict[int, dict[str, Any]] = field(default_factory=dict)
    round_changed: dict[int, int] = field(default_factory=dict)  # round -> its change number
    round_changes: int = 0
    final: dict[str, Any] | None = None
    first_metrics_round: int | None = None
    best_round: dict[str, Any] | None = None  # a finished run: the report's own; live: derived (see snapshot)
    recruitment: Any = None
    # Secure aggregation (docs/secure-aggregation.md): on for the run (the PS saw only sums), and how the last
    # closed round's sum went (each round's own is in its entry of `rounds`, "secure").
    secure_aggregation: bool = False
    secure_last_round: dict[str, int] | None = None
    # Participant-level DP (DP-FedAvg): what the released models have cost so far (epsilon at delta, accountant,
    # rounds charged), from ps/status and ps/metrics live or the report's privacy.participant_level; the newest
    # round's wins, and a status without it (the PS's Last Will) leaves it standing.
    participant_dp: dict[str, Any] | None = None
    results: dict[str, Any] | None = None  # a finished run's results panel (results.py)
    files: list[dict[str, Any]] = field(default_factory=list)  # its downloads (rundir.py)
    timeline: Timeline = field(default_factory=Timeline)
    timeline_note: str = ""
    finished_at: float | None = None
    invalid: int = 0
    dropped: dict[tuple[str, str], Dropped] = field(default_factory=dict)
    version: int = 0  # bumped on every change, so the server pushes only when something changed
    keys: KeyRing | None = None  # what live messages are verified against (a finished run's report needs none)

    # -- live input -------------------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes, *, now: float, max_bytes: int) -> bool:
        """Validate and apply one message; return True if the view changed. Never raises on bad input."""
        if not payload:
            return False  # a cleared retained topic
        self.messages += 1
        if self.keys is None:
            self._drop(topic, "unverifiable", "no key list to verify signatures", now)
            return True
        try:
            parsed, msg = check_message(topic, payload, run_id=self.run_id, max_bytes=max_bytes, keys=self.keys)
        except FedMqttError as exc:
            self._drop(topic, getattr(exc, "category", type(exc).__name__), str(exc), now)
            return True
        if isinstance(msg, KeyList):
            self.keys.adopt(msg, bytes(payload))
            return False
        if isinstance(msg, m.DaemonStatus) and parsed.role == "ps":
            self._on_ps_status(msg, now)
        elif isinstance(msg, m.RoundMetrics) and parsed.role == "ps":
            self._on_metrics(msg, now)
        elif isinstance(msg, m.SiteStatus) and parsed.role == "site" and parsed.site_id == msg.sender:
            self._on_site_status(msg, now)
        else:
            self._drop(topic, "unexpected kind on topic", f"a {msg.kind} on {topic}", now)
            return True
        self.version += 1
        return True

    def _drop(self, topic: str, reason: str, detail: str, now: float) -> None:
        """Count a message this dashboard refused, by sender (the topic's site: the broker's ACL lets each login
        publish on its own topics only) and reason; the timeline reports each pair, a flood in batches."""
        self.invalid += 1
        sender = _sender_of(topic, self.run_id)
        key = (sender, reason[:64])
        entry = self.dropped.get(key)
        if entry is None:
            if len(self.dropped) >= MAX_INVALID_KINDS:
                key = ("?", "other")
                entry = self.dropped.setdefault(key, Dropped("?", "", "other"))
            else:
                entry = self.dropped[key] = Dropped(sender, topic[:200], reason[:64])
        entry.count += 1
        entry.last = detail[:REASON_CHARS]
        if now - entry.shown_at >= INVALID_EVENT_EVERY_S:
            new = entry.count - entry.shown_count
            self.timeline.add(now, "invalid", f"dropped {new} message{'s' * (new > 1)} from {entry.sender}: "
                              f"{entry.reason}: {entry.last}", site=entry.sender, reason=entry.reason, count=new)
            entry.shown_count, entry.shown_at = entry.count, now
        self.version += 1

    def _site(self, name: str) -> SiteView | None:
        if name not in self.sites and len(self.sites) >= MAX_SITES_SHOWN:
            return None
        return self.sites.setdefault(name, SiteView(name))

    def _on_ps_status(self, msg: m.DaemonStatus, now: float) -> None:
        before = (self.ps_state, self.round, self.ps_detail)
        rejected_before, first = self.rejected, not self.ps_seen
        self.ps_state, self.ps_detail, self.algorithm = msg.state, msg.detail, msg.algorithm
        self.selection_metric = msg.selection_metric or self.selection_metric
        # The PS counts the final evaluation as round R + 1; show it as the last round, never "R + 1 of R".
        self.round, self.rounds_total = min(msg.round, msg.rounds_total or msg.round), msg.rounds_total
        self.sites_expected, self.sites_online = tuple(msg.sites_expected), tuple(msg.sites_online)
        self.waiting_for, self.deadline = tuple(msg.waiting_for), msg.deadline
        dropped_before, self.sites_dropped = self.sites_dropped, dict(msg.dropped)
        self.upload_turns = tuple(msg.upload_turns)
        self.quorum, self.min_sites = msg.quorum, msg.min_sites
        self.rejected = {s: dict(r) for s, r in msg.rejected.items()}
        self.ps_last_seen, self.ps_seen = now, True
        self.secure_aggregation = msg.secure_aggregation
        if msg.secure_last_round is not None:
            self._note_secure(secure_view(msg.secure_last_round))
        if msg.participant_dp is not None:
            self.note_participant(msg.participant_dp)
        for name in msg.sites_expected:
            self._site(name)
        for name, spent in msg.epsilon.items():
            if (site := self._site(name)) is not None:
                site.epsilon = privacy_spent_view(spent)
        self._ps_events(before, msg, now)
        for name in sorted(set(self.sites_dropped) - set(dropped_before)):
            self.timeline.add(now, "offline", f"PS goes on without {name}: {self.sites_dropped[name]}", site=name,
                              round_no=self.round)
        refusal_events(self.timeline, {} if first else rejected_before, self.rejected, t=now, round_no=self.round,
                       first=first)

    def _ps_events(self, before: tuple[str, int, str], msg: m.DaemonStatus, now: float) -> None:
        state, round_no, detail = before
        if (state, round_no) != (msg.state, self.round):
            text = {"waiting_for_sites": f"PS waiting for sites ({len(msg.sites_online)} of "
                                         f"{len(msg.sites_expected)} online, {msg.min_sites} needed)",
                    "training": f"round {self.round} started"
                                + (f": {msg.detail.removeprefix(f'round {msg.round}: ')}" if msg.detail else ""),
                    "evaluating": "final evaluation started",
                    "done": f"run finished ({msg.detail})" if msg.detail != "done" else "run finished",
                    "offline": f"PS offline: {msg.detail or 'its Last Will'}",
                    "error": f"PS stopped on an error: {msg.detail}"}.get(msg.state, f"PS {msg.state}")
            ended = msg.state in ("offline", "error")
            kind: Kind = "round" if msg.state == "training" else "offline" if ended else "run"
            # The page shows the deadline in the reader's own time zone.
            deadline = msg.deadline if msg.state in ("training", "evaluating") else None
            self.timeline.add(now, kind, text, round_no=self.round, deadline=deadline)
        elif msg.detail != detail and (noted := classify_detail(msg.detail)) is not None:
            self.timeline.add(now, noted, msg.detail, round_no=self.round)

    def _on_metrics(self, msg: m.RoundMetrics, now: float) -> None:
        if msg.phase == "final":
            self.final = {"sites": list(msg.sites), "per_site": _metrics(msg.per_site), "mean": dict(msg.mean)}
            return
        if self.first_metrics_round is None:
            self.first_metrics_round = msg.round
        known = msg.round in self.rounds
        self.rounds[msg.round] = {"round": msg.round, "sites": list(msg.sites), "stragglers": list(msg.stragglers),
                                  "per_site": _metrics(msg.per_site), "mean": dict(msg.mean),
                                  "train_loss": msg.train_loss, "duration_s": msg.duration_s, "closed_at": now,
                                  "secure": None}
        self.round_changes += 1
        self.round_changed[msg.round] = self.round_changes
        if msg.secure is not None:
            self._note_secure(secure_view(msg.secure))
        if msg.participant_dp is not None:
            self.note_participant(msg.participant_dp)
        if not known:  # the retained metrics again (a reconnect) is the same round, not a new event
            self.timeline.add(now, "round", f"round {msg.round} closed in {msg.duration_s:.1f} s: "
                              f"{len(msg.sites)} update{'s' * (len(msg.sites) != 1)}", round_no=msg.round,
                              duration_s=msg.duration_s)
            if msg.stragglers:
                # A round closes early only when every missing site was seen going offline; else at its deadline.
                offline = all(self.sites.get(s, SiteView(s)).state in ("offline", "error") for s in msg.stragglers)
                missing = ", ".join(msg.stragglers)
                self.timeline.add(now, "offline" if offline else "deadline",
                                  f"round {msg.round} closed without {missing} (offline)" if offline else
                                  f"round {msg.round} closed at its deadline without {missing}", round_no=msg.round)
        for name in msg.sites:
            site = self._site(name)
            if site is not None:
                site.rounds.add(msg.round)
                if (usage := msg.usage.get(name)) is not None:
                    site.last_compute = {k: v for k in ("wall_s", "cpu_s", "energy_j")
                                         if (v := getattr(usage, k)) is not None}
                if name in msg.update_bytes:
                    site.last_update_bytes = msg.update_bytes[name]

    def _note_secure(self, note: dict[str, int]) -> None:
        """A closed round's secure sum (from ps/metrics or ps/status): on its round, and the latest shown apart."""
        if self.secure_last_round is None or note["round"] >= self.secure_last_round["round"]:
            self.secure_last_round = note
        entry = self.rounds.get(note["round"])
        if entry is not None and entry.get("secure") != note:
            entry["secure"] = note
            self.round_changes += 1
            self.round_changed[note["round"]] = self.round_changes

    def note_participant(self, spent: m.ParticipantSpent) -> None:
        """Participant-level DP after a closed round (validated already): kept unless an older round's."""
        if self.participant_dp is None or spent.round >= self.participant_dp["round"]:
            self.participant_dp = participant_spent_view(spent)

    def _on_site_status(self, msg: m.SiteStatus, now: float) -> None:
        site = self._site(msg.sender)
        if site is None:
            return
        was = site.state
        site.state, site.device, site.detail = msg.state, msg.device, msg.detail
        site.n_train, site.n_val, site.n_test = msg.n_train, msg.n_val, msg.n_test
        site.label_histogram = dict(msg.label_histogram) if msg.label_histogram is not None else None
        site.last_seen = now
        if msg.state == was:
            return
        if msg.state in ("offline", "error"):
            self.timeline.add(now, "offline", f"{msg.sender} {msg.state}" + (f": {msg.detail}" if msg.detail else ""),
                              site=msg.sender, round_no=self.round)
        elif was in ("offline", "error"):
            self.timeline.add(now, "back", f"{msg.sender} back ({msg.state})", site=msg.sender, round_no=self.round)
        elif was == "unknown":
            self.timeline.add(now, "site", f"{msg.sender} seen ({msg.state})", site=msg.sender, round_no=self.round)


    # -- what the page gets ---------------------------------------------------------------------------
    def status(self) -> str:
        """One word for the run: live (the PS is running), finished, offline (the PS is gone before the end),
        error (the PS stopped on an error), waiting (no PS status yet) or unknown (the broker is unreachable)."""
        if self.source == "report" or self.ps_state == "done":
            return "finished"
        if not self.broker_connected:
            return "unknown"
        if self.ps_state in ("offline", "error"):
            return self.ps_state
        if self.ps_state == "unknown":
            return "waiting"
        return "live"

    def cursor(self) -> Cursor:
        return self.round_changes, self.timeline.seq

    def best(self, rounds: list[dict[str, Any]], missing_before: int | None) -> dict[str, Any] | None:
        """The best round: the report's own for a finished run; live, the PS's rule on the rounds seen."""
        if self.best_round is not None:
            return self.best_round
        found = best_round_of(rounds, self.selection_metric)
        if found is not None and missing_before:
            found["note"] = f"best of the rounds this page saw (from round {missing_before})"
        return found

    def snapshot(self, *, now: float, since: Cursor | None = None) -> dict[str, Any]:
        """The page's view; with `since` (a cursor of an earlier snapshot), only the rounds changed and the
        timeline events added after it ("delta": true), everything else whole."""
        rounds = [self.rounds[n] for n in sorted(self.rounds)]
        durations = [r["duration_s"] for r in rounds
                     if isinstance(r.get("duration_s"), (int, float)) and r["duration_s"] > 0]
        per_round = sum(durations) / len(durations) if durations else None
        left = max(self.rounds_total - self.round, 0) if self.rounds_total else None
        eta = None if per_round is None or left is None or self.ps_state == "done" else per_round * left
        missing_before = None
        if self.source == "live" and self.first_metrics_round is not None and self.first_metrics_round > 1:
            missing_before = self.first_metrics_round
        best = self.best(rounds, missing_before)
        sent_rounds, sent_events = since if since is not None else (0, 0)
        return {
            "run_id": self.run_id, "source": self.source, "label": self.label or self.run_id,
            "status": self.status(), "messages": self.messages,
            "ps": {"state": self.ps_state, "detail": self.ps_detail, "last_seen": self.ps_last_seen},
            "algorithm": self.algorithm, "selection_metric": self.selection_metric,
            "round": self.round, "rounds_total": self.rounds_total,
            "sites_expected": list(self.sites_expected), "sites_online": list(self.sites_online),
            "waiting_for": list(self.waiting_for),
            "sites_dropped": [{"site": s, "why": w} for s, w in sorted(self.sites_dropped.items())],
            "upload_turns": list(self.upload_turns),
            "deadline": self.deadline,
            "quorum": self.quorum, "min_sites": self.min_sites,
            "seconds_per_round": per_round, "eta_s": eta, "finished_at": self.finished_at,
            "history_missing_before": missing_before,
            "sites": [self.sites[n].as_json(self.rejected) for n in sorted(self.sites)],
            "delta": since is not None,
            "rounds": [r for r in rounds if self.round_changed.get(r["round"], 0) > sent_rounds],
            "events": self.timeline.since(sent_events), "events_dropped": self.timeline.dropped,
            "timeline_note": self.timeline_note,
            "final": self.final, "best_round": best, "results": self.results, "files": self.files,
            "recruitment": self.recruitment, "invalid": self.invalid,
            "secure_aggregation": self.secure_aggregation, "secure_last_round": self.secure_last_round,
            "participant_dp": self.participant_dp,
            "dropped": [{"sender": d.sender, "topic": d.topic, "reason": d.reason, "count": d.count, "last": d.last}
                        for d in self.dropped.values()],
            "now": now,
        }


def secure_view(note: m.SecureRoundNote) -> dict[str, int]:
    """What the page shows of one round's secure sum: sites in it, selected sites left out, those among them
    whose masks were removed with rebuilt keys, and the tries the round took."""
    return {"round": note.round, "included": note.included, "dropped": note.dropped, "recovered": note.recovered,
            "tries": note.tries}


def privacy_spent_view(spent: m.PrivacySpent) -> dict[str, Any]:
    """What the page shows of a site's record-level DP spending."""
    return {"epsilon": spent.epsilon, "delta": spent.delta, "accountant": spent.accountant, "steps": spent.steps,
            "noise_multiplier": spent.noise_multiplier}


def participant_spent_view(spent: m.ParticipantSpent) -> dict[str, Any]:
    """What the page shows of the run's participant-level DP spending."""
    return {"epsilon": spent.epsilon, "delta": spent.delta, "accountant": spent.accountant, "rounds": spent.rounds,
            "round": spent.round}


def _metrics(per_site: Any) -> dict[str, dict[str, Any]]:
    return {str(s): dict(v) for s, v in per_site.items()}


def _sender_of(topic: str, run_id: str) -> str:
    """Who published on `topic`: the site of `.../site/<id>/...`, "ps" for `.../ps/...`, else the topic."""
    parts = topic.split("/")
    if len(parts) >= 5 and parts[2] == run_id:
        if parts[3] == "site":
            return parts[4][:64]
        if parts[3] == "ps":
            return "ps"
    return f"topic {topic[:120]}"


def best_round_of(rounds: list[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The PS's rule (ps_daemon/machine.py `_better_best`, docs/algorithms.md 17.1) on what ps/metrics carries:
    the round whose mean validation `metric` is best (lowest for loss-type metrics, else highest); ties keep the
    earlier round. The round mean is the same number the PS compares (`RoundRecord.mean`)."""
    if not metric:
        return None
    found = best_round({r["round"]: {"mean": r.get("mean") or {}} for r in rounds}, metric)
    if found is None:
        return None
    direction = "lowest" if direction_of(metric) == "min" else "highest"
    return {"round": found[0], "score": found[1], "metric": f"val {metric}", "rule": f"{direction} mean val {metric}"}
