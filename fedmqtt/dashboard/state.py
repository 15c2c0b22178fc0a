"""What the dashboard knows about one run, built from observer-readable MQTT messages or from report.json.

Pure: no network, no clock of its own (callers pass `now`), so it is unit-testable. Every payload is
validated by the same `check_message` the PS uses before anything is stored, its signature first (against the
observer's key list, which follows `federation/keys`); a bad or unsigned one is counted, never shown raw.
Because `ps/metrics` is retained with the last round only, rounds are accumulated here while the dashboard runs;
rounds that closed before it connected are reported as unavailable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fedmqtt.errors import FedMqttError
from fedmqtt.transport.channel import check_message
from fedmqtt.transport.signing import KeyRing
from schemas import messages as m
from schemas.signed import KeyList

MAX_SITES_SHOWN = 256  # the schema bounds names per message; this bounds how many distinct sites we keep


@dataclass
class SiteView:
    name: str
    state: str = "unknown"
    last_seen: float | None = None
    device: str = ""
    n_train: int = 0
    n_val: int = 0
    n_test: int = 0
    detail: str = ""
    rounds: set[int] = field(default_factory=set)
    usage: dict[str, float] = field(default_factory=dict)
    last_compute: dict[str, float] = field(default_factory=dict)  # the last round's wall/CPU s (J on a GPU)
    last_update_bytes: int | None = None  # size of the last accepted update (live, from ps/metrics)

    def as_json(self, rejected: dict[str, dict[str, int]]) -> dict[str, Any]:
        return {"name": self.name, "state": self.state, "last_seen": self.last_seen, "device": self.device,
                "n_train": self.n_train, "n_val": self.n_val, "n_test": self.n_test, "detail": self.detail,
                "rounds_participated": len(self.rounds), "rejected": rejected.get(self.name, {}),
                "usage": self.usage, "last_compute": self.last_compute,
                "last_update_bytes": self.last_update_bytes}


@dataclass
class RunView:
    """One run, live or finished. `snapshot()` is what the page renders (plain JSON, no credentials)."""

    run_id: str
    source: str = "live"  # "live" (broker) or "report" (a finished run directory)
    label: str = ""
    ps_state: str = "unknown"
    ps_detail: str = ""
    algorithm: str = ""
    round: int = 0
    rounds_total: int = 0
    sites_expected: tuple[str, ...] = ()
    sites_online: tuple[str, ...] = ()
    waiting_for: tuple[str, ...] = ()
    upload_turns: tuple[str, ...] = ()  # sites whose large update the PS takes now
    deadline: float | None = None
    quorum: int = 0
    min_sites: int = 0
    broker_connected: bool = True  # set by the listener; a lost broker makes the PS's state unknown
    messages: int = 0  # messages received for this run (what the dashboard costs the broker in deliveries)
    rejected: dict[str, dict[str, int]] = field(default_factory=dict)
    ps_last_seen: float | None = None
    sites: dict[str, SiteView] = field(default_factory=dict)
    rounds: dict[int, dict[str, Any]] = field(default_factory=dict)
    final: dict[str, Any] | None = None
    first_metrics_round: int | None = None
    best_round: dict[str, Any] | None = None
    recruitment: Any = None
    invalid: int = 0
    invalid_reasons: dict[str, int] = field(default_factory=dict)
    version: int = 0  # bumped on every change, so the server pushes only when something changed
    keys: KeyRing | None = None  # what live messages are verified against (a finished run's report needs none)

    # -- live input -------------------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes, *, now: float, max_bytes: int) -> bool:
        """Validate and apply one message; return True if the view changed. Never raises on bad input."""
        if not payload:
            return False  # a cleared retained topic
        self.messages += 1
        if self.keys is None:
            self._count_invalid("no key list to verify signatures")
            return True
        try:
            parsed, msg = check_message(topic, payload, run_id=self.run_id, max_bytes=max_bytes, keys=self.keys)
        except FedMqttError as exc:
            self._count_invalid(getattr(exc, "category", type(exc).__name__))
            return True
        if isinstance(msg, KeyList):
            self.keys.adopt(msg, bytes(payload))
            return False
        if isinstance(msg, m.DaemonStatus) and parsed.role == "ps":
            self._on_ps_status(msg, now)
        elif isinstance(msg, m.RoundMetrics) and parsed.role == "ps":
            self._on_metrics(msg)
        elif isinstance(msg, m.SiteStatus) and parsed.role == "site" and parsed.site_id == msg.sender:
            self._on_site_status(msg, now)
        else:
            self._count_invalid("unexpected kind on topic")
            return True
        self.version += 1
        return True

    def _count_invalid(self, reason: str) -> None:
        self.invalid += 1
        if reason in self.invalid_reasons or len(self.invalid_reasons) < 32:
            self.invalid_reasons[reason] = self.invalid_reasons.get(reason, 0) + 1
        self.version += 1

    def _site(self, name: str) -> SiteView | None:
        if name not in self.sites and len(self.sites) >= MAX_SITES_SHOWN:
            return None
        return self.sites.setdefault(name, SiteView(name))

    def _on_ps_status(self, msg: m.DaemonStatus, now: float) -> None:
        self.ps_state, self.ps_detail, self.algorithm = msg.state, msg.detail, msg.algorithm
        # The PS counts the final evaluation as round R + 1; show it as the last round, never "R + 1 of R".
        self.round, self.rounds_total = min(msg.round, msg.rounds_total or msg.round), msg.rounds_total
        self.sites_expected, self.sites_online = tuple(msg.sites_expected), tuple(msg.sites_online)
        self.waiting_for, self.deadline = tuple(msg.waiting_for), msg.deadline
        self.upload_turns = tuple(msg.upload_turns)
        self.quorum, self.min_sites = msg.quorum, msg.min_sites
        self.rejected = {s: dict(r) for s, r in msg.rejected.items()}
        self.ps_last_seen = now
        for name in msg.sites_expected:
            self._site(name)

    def _on_metrics(self, msg: m.RoundMetrics) -> None:
        if msg.phase == "final":
            self.final = {"sites": list(msg.sites), "per_site": _metrics(msg.per_site), "mean": dict(msg.mean)}
            return
        if self.first_metrics_round is None:
            self.first_metrics_round = msg.round
        self.rounds[msg.round] = {"round": msg.round, "sites": list(msg.sites), "stragglers": list(msg.stragglers),
                                  "per_site": _metrics(msg.per_site), "mean": dict(msg.mean),
                                  "train_loss": msg.train_loss, "duration_s": msg.duration_s}
        for name in msg.sites:
            site = self._site(name)
            if site is not None:
                site.rounds.add(msg.round)
                if (usage := msg.usage.get(name)) is not None:
                    site.last_compute = {k: v for k in ("wall_s", "cpu_s", "energy_j")
                                         if (v := getattr(usage, k)) is not None}
                if name in msg.update_bytes:
                    site.last_update_bytes = msg.update_bytes[name]

    def _on_site_status(self, msg: m.SiteStatus, now: float) -> None:
        site = self._site(msg.sender)
        if site is None:
            return
        site.state, site.device, site.detail = msg.state, msg.device, msg.detail
        site.n_train, site.n_val, site.n_test = msg.n_train, msg.n_val, msg.n_test
        site.last_seen = now

    # -- finished runs ------------------------------------------------------------------------------
    @classmethod
    def from_report(cls, report: dict[str, Any], *, label: str) -> RunView:
        """A finished run from its report.json (written by our PS; still read defensively)."""
        view = cls(run_id=str(report.get("run_id", "?")), source="report", label=label)
        view.algorithm = str(report.get("algorithm", ""))
        view.ps_state = "done"
        rounds = report.get("rounds") or []
        config = report.get("config") or {}
        view.rounds_total = int(config.get("rounds", len(rounds)) or len(rounds))
        view.quorum = int(config.get("quorum") or 0)
        view.min_sites = int(config.get("min_sites") or len(config.get("sites") or ()))
        for r in rounds:
            n = int(r["round"])
            view.rounds[n] = {"round": n, "sites": list(r.get("sites", [])),
                              "stragglers": list(r.get("stragglers", [])),
                              "per_site": {s: dict(v) for s, v in (r.get("per_site") or {}).items()},
                              "mean": dict(r.get("mean") or {}), "train_loss": r.get("train_loss"),
                              "duration_s": r.get("duration_s")}
            for name in r.get("sites", []):
                view._site(str(name)).rounds.add(n)  # type: ignore[union-attr]
        view.round = max(view.rounds, default=0)
        view.first_metrics_round = min(view.rounds, default=None)
        final = report.get("final") or {}
        for name in final.get("per_site") or {}:
            view._site(str(name))
        view.final = {"per_site": {s: (v.get("metrics") or {}).get("test", {})
                                   for s, v in (final.get("per_site") or {}).items()},
                      "mean": (final.get("mean") or {}).get("test", {}) if isinstance(final.get("mean"), dict) else {}}
        view.best_round = report.get("best_round")
        view.recruitment = report.get("recruitment")
        for name, total in ((report.get("usage") or {}).get("per_site_total") or {}).items():
            site = view._site(str(name))
            if site is not None:
                site.usage = {k: float(v) for k, v in total.items() if isinstance(v, (int, float))}
        per_round = (report.get("usage") or {}).get("per_round") or {}
        for site in view.sites.values():
            site.state = "finished"
            if site.rounds:
                last = (per_round.get(str(max(site.rounds))) or {}).get(site.name) or {}
                site.last_compute = {k: float(last[k]) for k in ("wall_s", "cpu_s")
                                     if isinstance(last.get(k), (int, float))}
            missing = ((final.get("per_site") or {}).get(site.name) or {}).get("missing")
            if missing:  # it left the run (killed, offline, past the deadline): say so, not "finished"
                site.state, site.detail = "offline", str(missing)
        view.sites_expected = tuple(sorted(str(s) for s in (config.get("sites") or view.sites)))
        return view

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

    def snapshot(self, *, now: float) -> dict[str, Any]:
        rounds = [self.rounds[n] for n in sorted(self.rounds)]
        durations = [r["duration_s"] for r in rounds
                     if isinstance(r.get("duration_s"), (int, float)) and r["duration_s"] > 0]
        per_round = sum(durations) / len(durations) if durations else None
        left = max(self.rounds_total - self.round, 0) if self.rounds_total else None
        eta = None if per_round is None or left is None or self.ps_state == "done" else per_round * left
        missing_before = None
        if self.source == "live" and self.first_metrics_round is not None and self.first_metrics_round > 1:
            missing_before = self.first_metrics_round
        return {
            "run_id": self.run_id, "source": self.source, "label": self.label or self.run_id,
            "status": self.status(), "messages": self.messages,
            "ps": {"state": self.ps_state, "detail": self.ps_detail, "last_seen": self.ps_last_seen},
            "algorithm": self.algorithm, "round": self.round, "rounds_total": self.rounds_total,
            "sites_expected": list(self.sites_expected), "sites_online": list(self.sites_online),
            "waiting_for": list(self.waiting_for), "upload_turns": list(self.upload_turns),
            "deadline": self.deadline,
            "quorum": self.quorum, "min_sites": self.min_sites,
            "seconds_per_round": per_round, "eta_s": eta,
            "history_missing_before": missing_before,
            "sites": [self.sites[n].as_json(self.rejected) for n in sorted(self.sites)],
            "rounds": rounds, "final": self.final, "best_round": self.best_round or _best_round(rounds),
            "recruitment": self.recruitment, "invalid": self.invalid, "invalid_reasons": dict(self.invalid_reasons),
            "now": now,
        }


def _metrics(per_site: Any) -> dict[str, dict[str, Any]]:
    return {str(s): dict(v) for s, v in per_site.items()}


def _best_round(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Live best round: lowest mean validation loss so far (the report names the PS's own choice when open)."""
    scored = [(r["mean"].get("loss"), r["round"]) for r in rounds
              if isinstance(r["mean"].get("loss"), (int, float)) and math.isfinite(r["mean"]["loss"])]
    if not scored:
        return None
    loss, n = min(scored)
    return {"round": n, "score": loss, "metric": "val loss (lowest so far)"}
