"""One logging format for every role, so the broker, PS and site logs read alike; refusals logged at a bounded rate."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

# A refused message is logged in full only the first few times per party and reason within an interval; the rest
# are counted and summarised once per interval per party. One party's flood of junk (2,000 messages a second)
# would otherwise write a line each, about 1 GB of log an hour. The counters in ps/status count every refusal.
REFUSALS_VERBATIM = 5  # per party and reason category, per interval
REFUSAL_SUMMARY_S = 60.0
MAX_REFUSING_PARTIES = 1024  # beyond this many distinct parties in one interval, they are counted together
OTHER_PARTIES = "other"
_SUMMARY_CATEGORIES = 8  # named per summary line; the rest are "... and N more"


def setup_logging(verbose: bool = False, *, tag: str | None = None) -> None:
    """`tag`: written in every line (e.g. the site id where several sites share one log, site_agent/launcher.py);
    it replaces a setup made earlier in this process (a forked site's, inherited from its parent)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        # Milliseconds: a round's steps (model out, updates in, turns) take tens of ms; merged PS and site logs
        # then sort into the order in which they happened.
        format="%(asctime)s.%(msecs)03d %(levelname)-7s " + (f"[{tag}] " if tag else "") + "%(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        force=tag is not None,
    )


@dataclass
class _Window:
    """One party's refusals since `opened`: how many of each category were logged and how many held back."""

    opened: float
    shown: Counter[str] = field(default_factory=Counter)
    held_back: Counter[str] = field(default_factory=Counter)


class RefusalLog:
    """Refusals of messages, logged at a bounded rate whatever a sender does.

    Within each interval (REFUSAL_SUMMARY_S, starting at a party's first refusal) the first REFUSALS_VERBATIM
    refusals per party and category are logged as they come; later ones are counted, and when the interval ends
    one line per party says how many were held back, by category:
    "site-a: 1,987 more refusals (wrong layout: 1,900, too large: 87) in the last 60 s". So a flood costs at most
    (categories x REFUSALS_VERBATIM + 1) lines per party and interval. `flush` writes the summaries that are due
    (call it from a loop); `close` writes all that remain.
    """

    def __init__(self, logger: logging.Logger, *, verbatim: int = REFUSALS_VERBATIM,
                 interval_s: float = REFUSAL_SUMMARY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger  # where the summaries go
        self.verbatim = verbatim
        self.interval_s = interval_s
        self.clock = clock
        self._windows: dict[str, _Window] = {}
        self._next_due = float("inf")
        self._lock = threading.Lock()  # refusals may come from more than one thread (e.g. transfer timeouts)

    def refused(self, party: str, category: str, logger: logging.Logger, msg: str, *args: object,
                exc_info: bool | BaseException | None = None) -> None:
        """Log one refusal of `party`'s message (`msg % args` on `logger`) unless this interval already showed
        enough of its category; either way it is accounted for in the party's summary."""
        self.flush()  # summaries that are due come first, so the log stays in time order
        with self._lock:
            now = self.clock()
            if party not in self._windows and len(self._windows) >= MAX_REFUSING_PARTIES:
                party = OTHER_PARTIES
            window = self._windows.get(party)
            if window is None:
                window = self._windows[party] = _Window(now)
                self._next_due = min(self._next_due, now + self.interval_s)
            show = window.shown[category] < self.verbatim
            if show:
                window.shown[category] += 1
            else:
                window.held_back[category] += 1
        if show:
            logger.warning(msg, *args, exc_info=exc_info)

    def flush(self) -> None:
        """Write the summary of every party whose interval has ended, and start afresh for it."""
        if self.clock() < self._next_due:
            return
        self._summarise(lambda window, now: now - window.opened >= self.interval_s)

    def close(self) -> None:
        """Write every summary still open (a process that stops says what it held back)."""
        self._summarise(lambda _window, _now: True)

    def _summarise(self, due: Callable[[_Window, float], bool]) -> None:
        lines = []
        with self._lock:
            now = self.clock()
            for party in [p for p, w in self._windows.items() if due(w, now)]:
                window = self._windows.pop(party)
                if window.held_back:
                    lines.append(summary_line(party, window.held_back, max(1.0, now - window.opened)))
            self._next_due = min((w.opened + self.interval_s for w in self._windows.values()), default=float("inf"))
        for line in lines:
            self.logger.warning("%s", line)


def summary_line(party: str, held_back: Counter[str], seconds: float) -> str:
    """'site-a: 1,987 more refusals (wrong layout: 1,900, too large: 87) in the last 60 s'."""
    ranked = held_back.most_common()
    named = ", ".join(f"{category}: {count:,}" for category, count in ranked[:_SUMMARY_CATEGORIES])
    if len(ranked) > _SUMMARY_CATEGORIES:
        named += f" and {len(ranked) - _SUMMARY_CATEGORIES} more reasons"
    total = sum(held_back.values())
    return f"{party}: {total:,} more refusal{'s' if total != 1 else ''} ({named}) in the last {seconds:.0f} s"
