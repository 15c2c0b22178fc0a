"""Which of a site's down-signals the PS believes: only those still true after a grace, so that a broker fault
can delay a run but never drop a site that is up from a round.

Two retained signals say a site is gone: its own Last Will ("offline" on site/<id>/status, fired by the broker
that held the agent's connection) and, for a hospital behind its own bridged broker, the bridge's Will "0" on
site/<id>/bridge (fired by the central broker when the hospital broker or its link dies). Both can be untrue by
the time the PS reads them:
- Mosquitto fires every Will it holds when it shuts down (SIGTERM), keeps them retained in its database and, after
  its restart, replays them to the reconnected PS while the sites are still reconnecting (a bridge retries with a
  backoff of up to 30 s, a site agent of up to 15 s).
- The Wills fired on the broker's way down reach the PS just before its own connection drops.
So a down-signal is held, not acted on: for LIVE_GRACE_S, or REPLAY_GRACE_S when it arrives soon after the PS
reconnected (it may be such an echo). A sign of life from the site meanwhile (a status that is not "offline", an
accepted update, a bridge "1") voids it, and so does the PS losing its connection (the broker replays what is
still true after the reconnect). Only a signal that outlives its grace becomes a SiteOffline. A bridge "1" brings
back a site that was offline only because of its bridge, with what the site's own last status said.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ps_daemon.events import SiteOffline, SiteOnline

AGENT, BRIDGE = "agent", "bridge"  # who said the site is down: its own Will, or its hospital broker's bridge
LIVE_GRACE_S = 3.0  # longer than a broker takes to close our connection after firing the Wills on shutdown
# Longer than a bridge's reconnect backoff (`restart_timeout 2 30` in broker/bridge.py) and a site's (15 s).
REPLAY_GRACE_S = 45.0


@dataclass(frozen=True)
class _Held:
    since: float  # when the signal arrived
    due: float  # when it becomes a SiteOffline, if nothing voided it
    connection: int  # the PS's connection it arrived on (the transport's connect count)


class SiteLiveness:
    """Holds down-signals until they are believed; remembers each site's own last status to bring it back.

    `connection` is the transport's connect count at the moment of each call: it changes with every reconnect."""

    def __init__(self, *, live_grace_s: float = LIVE_GRACE_S, replay_grace_s: float = REPLAY_GRACE_S) -> None:
        self.live_grace_s = live_grace_s
        self.replay_grace_s = replay_grace_s
        self._held: dict[tuple[str, str], _Held] = {}
        self._down: dict[str, set[str]] = {}  # believed: site -> who said so (AGENT, BRIDGE)
        self._last_up: dict[str, SiteOnline] = {}  # the site's own last status, when it said it was up
        self._connection = 0
        self._reconnected_at: float | None = None

    def held(self) -> dict[str, float]:
        """Sites with a down-signal not believed yet -> when it arrived."""
        return {site: h.since for (site, _), h in sorted(self._held.items())}

    def down(self, site: str, source: str, now: float, connection: int) -> None:
        """A Will said `site` is down (`source`: AGENT or BRIDGE): hold it."""
        self._sync(connection, now)
        if (site, source) in self._held or source in self._down.get(site, ()):
            return  # the first one counts
        echo = self._reconnected_at is not None and now - self._reconnected_at < self.replay_grace_s
        grace = self.replay_grace_s if echo else self.live_grace_s
        self._held[(site, source)] = _Held(now, now + grace, connection)

    def status_up(self, ev: SiteOnline) -> None:
        """The site's own status says it is up; it came across its bridge, if any, so that link is up too."""
        self._last_up[ev.site_id] = ev
        self._clear(ev.site_id, AGENT, BRIDGE)

    def heard_from(self, site: str) -> None:
        """An accepted update: the site and its link were up when it sent it."""
        for source in (AGENT, BRIDGE):
            self._held.pop((site, source), None)

    def bridge_up(self, site: str, now: float) -> SiteOnline | None:
        """The bridge says "1": void its held "0"; a site that was offline only for its bridge is back (with
        the row count and histogram of its own last status), if that status said it was up."""
        was_down = BRIDGE in self._down.get(site, ())
        self._clear(site, BRIDGE)
        last = self._last_up.get(site)
        if was_down and not self._down.get(site) and last is not None:
            return replace(last, now=now)
        return None

    def believed(self, now: float, connection: int, connected: bool) -> list[SiteOffline]:
        """The held signals that outlived their grace on a connection that stayed up: now SiteOffline events."""
        self._sync(connection, now)
        if not connected:
            return []  # the broker may be going down, firing Wills of sites that are up: decide after it is back
        out: list[SiteOffline] = []
        for (site, source), held in sorted(self._held.items(), key=lambda kv: (kv[1].since, kv[0])):  # first first
            if held.due <= now:
                del self._held[(site, source)]
                if not self._down.get(site):
                    out.append(SiteOffline(site, now, since=held.since))
                self._down.setdefault(site, set()).add(source)
        return out

    def _sync(self, connection: int, now: float) -> None:
        """A new connection of the PS: what was held arrived before the broker may have gone down and is void
        (the broker replays what is still true); what arrives in the next REPLAY_GRACE_S may be an echo."""
        if connection != self._connection:
            if self._connection:
                self._reconnected_at = now
            self._connection = connection
            self._held.clear()

    def _clear(self, site: str, *sources: str) -> None:
        for source in sources:
            self._held.pop((site, source), None)
            self._down.get(site, set()).discard(source)
        if not self._down.get(site):
            self._down.pop(site, None)
