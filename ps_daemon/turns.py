"""Upload turns: how many large updates the sites may put on the broker at once.

Why (docs/design-notes.md, "Broker memory"): a chunked update stays retained at the broker until the PS has
fetched it, and N sites that finish a round together would otherwise make the broker hold N models beside the
one it serves them. A site whose update is too large for one message announces it (`update_ready`, retained on
its status topic) and uploads only when the PS grants it a turn (on ps/turn/<site>); the PS grants at most `slots`
turns at once, and a second or later one only while the updates holding turns declare at most `max_bytes` in all,
and removes each update from the broker as soon as it has accepted it. The broker then holds the model plus at
most `slots` updates, and with a large model only one (a 1 GB model and two turns would be three models at the
broker), whatever the number of sites.

Nothing here needs to survive the PS: the site keeps its update on disk and its `update_ready` status stays
retained, so a resumed PS learns again who is ready and grants them turns to send what it no longer holds.
Transport flow control, not federated-learning state: it lives beside the pure machine, not in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

TURN_GRACE_S = 60.0  # a granted site that has not started its upload by then loses the turn to the next one
# ... plus its update's size at this rate: a site publishes every chunk before the manifest the PS sees, so a
# large update over a hospital's uplink needs that long before the PS knows the upload is under way.
TURN_MIN_RATE_BYTES_PER_S = 1_000_000


@dataclass
class _Ready:
    round: int
    nbytes: int
    since: float  # when it announced itself (or lost a turn): the queue is served oldest first


@dataclass
class _Turn:
    grant: int
    since: float


class UploadTurns:
    def __init__(self, slots: int, *, grace_s: float = TURN_GRACE_S, first_grant: int = 1,
                 max_bytes: int | None = None) -> None:
        """`first_grant`: numbers of this PS process start here (a time stamp, so a resumed PS never reuses one).
        `max_bytes`: what the updates holding turns may declare in all before no further turn is granted (the
        first is always granted); None: no such bound."""
        self.slots = slots
        self.max_bytes = max_bytes
        self.grace_s = grace_s
        self.ready: dict[str, _Ready] = {}
        self.granted: dict[str, _Turn] = {}
        self._next_grant = first_grant

    def announce(self, site: str, round_no: int, nbytes: int, now: float) -> None:
        """`site` says its update of `round_no` waits for a turn (a repeated announcement keeps its place)."""
        known = self.ready.get(site)
        if known is None or known.round != round_no:
            self.ready[site] = _Ready(round_no, nbytes, now)
            self.granted.pop(site, None)

    def forget(self, site: str) -> None:
        """Its update arrived (accepted or refused), or it went offline: its turn, if any, is free."""
        self.ready.pop(site, None)
        self.granted.pop(site, None)

    def update(self, now: float, *, round_no: int, wanted: Iterable[str], uploading: Callable[[str], bool]) -> bool:
        """Drop what the open round no longer needs, take back turns not used within `grace_s`, and grant free
        turns, oldest announcement first. `uploading(site)`: its transfer is queued or under way at the PS.
        True when the granted turns changed (the new ones go out now)."""
        wanted = set(wanted)
        before = {site: turn.grant for site, turn in self.granted.items()}
        for site in [s for s, r in self.ready.items() if r.round != round_no or s not in wanted]:
            self.forget(site)
        for site, turn in list(self.granted.items()):
            grace = self.grace_s + self.ready[site].nbytes / TURN_MIN_RATE_BYTES_PER_S
            if not uploading(site) and now - turn.since > grace:
                del self.granted[site]  # to the back of the queue: a site that is slow to start waits for the others
                self.ready[site].since = now
        for site in self.waiting():
            if not self._fits(self.ready[site].nbytes):
                break  # oldest first: a large update is not overtaken by smaller ones
            self.granted[site] = _Turn(self._next_grant, now)
            self._next_grant += 1
        return before != {site: turn.grant for site, turn in self.granted.items()}

    def _fits(self, nbytes: int) -> bool:
        """A free slot, and within `max_bytes` with the updates already holding turns (or no turn granted)."""
        if len(self.granted) >= self.slots:
            return False
        if not self.granted or self.max_bytes is None:
            return True
        return sum(self.ready[site].nbytes for site in self.granted) + nbytes <= self.max_bytes

    def view(self) -> dict[str, int]:
        """The turns now: site -> grant number (ps/status lists them for observers)."""
        return {site: turn.grant for site, turn in sorted(self.granted.items())}

    def waiting(self) -> list[str]:
        """Sites ready but not yet granted a turn, in the order they will be served."""
        return [site for _, site in sorted((r.since, s) for s, r in self.ready.items() if s not in self.granted)]


__all__ = ["TURN_GRACE_S", "TURN_MIN_RATE_BYTES_PER_S", "UploadTurns"]
