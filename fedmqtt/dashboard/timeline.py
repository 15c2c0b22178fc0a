"""The run's timeline: what happened when (rounds and their durations, sites going offline and back, stalls,
deadlines, refused messages), as a bounded list of events the page shows in order.

Live, the events are derived from changes between successive observer messages (ps/status, ps/metrics,
site/+/status); for a finished run, from report.json and the PS's audit log. Each event has a sequence number,
so the server can send a browser only the events it has not seen yet. Pure: callers pass the times.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_EVENTS = 1000  # the newest ones are kept; the page says how many older ones were dropped
MAX_TEXT = 2400  # a PS detail is at most 2,000 characters; the text around it is short

Kind = Literal["run", "round", "deadline", "stall", "offline", "back", "site", "refused", "invalid", "skipped", "note"]

# Progress the PS says within a phase ("round 3: 2/4 updates"): shown live on the page, not kept as events.
_PROGRESS = re.compile(r"^(round \d+: (\d+/\d+ updates|training on \d+ sites)|\d+/\d+ sites online|"
                       r"waiting for sites|evaluating the final model|done)$")
_STALL = "nothing arrived for"
STARTS = {"run-start": "PS started", "run-resume": "PS resumed (--resume)",
          "run-force-restart": "PS started over (--force)"}
_DEADLINE = "deadline passed"


def classify_detail(detail: str) -> Kind | None:
    """What a new ps/status detail is worth on the timeline: None for routine progress."""
    if not detail or _PROGRESS.match(detail):
        return None
    if _STALL in detail:
        return "stall"
    if _DEADLINE in detail:
        return "deadline"
    return "note"


@dataclass
class Timeline:
    """Events in the order they were seen (for a finished run: sorted by time)."""

    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    dropped: int = 0  # older events pushed out by MAX_EVENTS
    seq: int = 0

    def add(self, t: float | None, kind: Kind, text: str, *, round_no: int | None = None,
            site: str | None = None, **extra: Any) -> int:
        self.seq += 1
        if len(self.events) == self.events.maxlen:
            self.dropped += 1
        self.events.append({"seq": self.seq, "t": t, "kind": kind, "round": round_no, "site": site,
                            "text": text[:MAX_TEXT], **extra})
        return self.seq

    def since(self, seq: int) -> list[dict[str, Any]]:
        return [e for e in self.events if e["seq"] > seq]


def refusal_events(timeline: Timeline, before: dict[str, dict[str, int]], now_counts: dict[str, dict[str, int]],
                   *, t: float, round_no: int, first: bool) -> None:
    """An event per site and reason whose count of refused messages grew since the last ps/status.

    The PS counts refusals by the sending site (the topic it used, which the broker's ACL binds to that site's
    login) and a short reason category; the full reason is in the PS's log, not on the wire. A count that went
    down means the PS restarted (its counters start again): nothing is shown for it.
    """
    for site in sorted(now_counts):
        for reason, count in sorted(now_counts[site].items()):
            grew = count - before.get(site, {}).get(reason, 0)
            if grew <= 0:
                continue
            when = " (counted before this page connected)" if first else ""
            timeline.add(t, "refused", f"PS refused {grew} message{'s' if grew > 1 else ''} from {site}: "
                         f"{reason}{when}", round_no=round_no, site=site, reason=reason, count=grew)


def events_from_report(report: dict[str, Any], audit: list[dict[str, Any]]) -> Timeline:
    """A finished run's timeline: its rounds (start, close, duration, who was missing or skipped), the final
    evaluation and, from the PS's audit log, starts, resumes, stops and refused messages per round."""
    found: list[tuple[float, int, Kind, str, dict[str, Any]]] = []  # (time, order, kind, text, extra)

    def add(t: Any, kind: Kind, text: str, **extra: Any) -> None:
        if isinstance(t, (int, float)):
            found.append((float(t), len(found), kind, text, extra))

    timeout = (report.get("config") or {}).get("round_timeout_s")
    for r in report.get("rounds") or []:
        n = r.get("round")
        sites, missing = list(r.get("sites") or []), list(r.get("stragglers") or [])
        add(r.get("started_at"), "round", f"round {n} started", round_no=n)
        duration = r.get("duration_s")
        took = f" in {duration:.1f} s" if isinstance(duration, (int, float)) else ""
        add(r.get("closed_at"), "round", f"round {n} closed{took}: {len(sites)} update{'s' * (len(sites) != 1)}",
            round_no=n, duration_s=duration)
        if missing:  # before the deadline only when every missing site was seen going offline (the PS's rule)
            early = isinstance(duration, (int, float)) and isinstance(timeout, (int, float)) and duration < timeout
            add(r.get("closed_at"), "offline" if early else "deadline",
                f"round {n} closed without {', '.join(missing)} (offline)" if early else
                f"round {n} closed at its deadline without {', '.join(missing)}", round_no=n)
        for site, why in sorted((r.get("skipped") or {}).items()):
            add(r.get("closed_at"), "skipped", f"{site} took no training step in round {n}: {why}", round_no=n,
                site=site)
    for record in audit:
        event, details, t = record.get("event"), record.get("details") or {}, record.get("t")
        if event == "round-close":
            refused = details.get("refused") or {}
            if refused:
                counts = ", ".join(f"{reason} ×{count}" for reason, count in sorted(refused.items()))
                add(t, "refused", f"round {details.get('round')}: the PS refused {counts} (the audit log counts "
                    "by reason only: the senders are in the PS's log)", round_no=details.get("round"))
        elif event in STARTS:
            where = f" at round {details['round']}" if "round" in details else ""
            add(t, "run", f"{STARTS[event]}{where} (session {details.get('session', '?')})")
        elif event == "run-stop":
            add(t, "offline", f"PS stopped in round {details.get('round')} ({details.get('cause', '?')})",
                round_no=details.get("round"))
    timings = report.get("timings") or {}
    final = report.get("final") or {}
    for site, entry in sorted((final.get("per_site") or {}).items()):
        if isinstance(entry, dict) and entry.get("missing"):
            add(timings.get("finished_at"), "offline", f"no final evaluation from {site}: {entry['missing']}",
                site=site)
    best = report.get("best_round") or {}
    chosen = f"; best round {best.get('round')} by {best.get('metric')}" if best else ""
    add(timings.get("finished_at"), "run", f"run finished{chosen}")
    timeline = Timeline()
    for t, _, kind, text, extra in sorted(found, key=lambda e: (e[0], e[1])):
        timeline.add(t, kind, text, **extra)
    return timeline
