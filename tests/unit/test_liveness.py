"""Which down-signals the PS believes (ps_daemon.liveness): a Will becomes SiteOffline only once it outlived its
grace on a connection that stayed up; signs of life, a lost connection and a bridge "1" void it; an echo of a
broker restart is given the time the sites need to reconnect."""

from __future__ import annotations

from ps_daemon.events import SiteOffline, SiteOnline
from ps_daemon.liveness import AGENT, BRIDGE, SiteLiveness

LIVE, REPLAY = 3.0, 45.0


def _liveness() -> SiteLiveness:
    return SiteLiveness(live_grace_s=LIVE, replay_grace_s=REPLAY)


def _up(site: str, now: float) -> SiteOnline:
    return SiteOnline(site, now, 120, (0.5, 0.5))


def test_a_will_is_believed_after_its_grace_on_a_steady_connection() -> None:
    live = _liveness()
    live.down("a", AGENT, 10.0, connection=1)
    assert live.believed(12.9, connection=1, connected=True) == []
    assert live.held() == {"a": 10.0}
    assert live.believed(13.0, connection=1, connected=True) == [SiteOffline("a", 13.0, since=10.0)]
    assert live.believed(20.0, connection=1, connected=True) == [] and live.held() == {}


def test_a_sign_of_life_voids_a_held_will() -> None:
    live = _liveness()
    live.down("a", AGENT, 10.0, connection=1)
    live.down("b", BRIDGE, 10.0, connection=1)
    live.status_up(_up("a", 11.0))
    live.heard_from("b")  # an accepted update crossed b's bridge: the link is up
    assert live.believed(60.0, connection=1, connected=True) == []


def test_wills_fired_by_a_broker_going_down_are_void_once_the_connection_drops() -> None:
    """SIGTERM: Mosquitto fires every Will it holds, then closes our connection."""
    live = _liveness()
    live.down("a", AGENT, 10.0, connection=1)
    live.down("b", BRIDGE, 10.0, connection=1)
    assert live.believed(14.0, connection=1, connected=False) == []  # the broker is away: decide nothing
    assert live.believed(20.0, connection=2, connected=True) == []  # reconnected: they were void
    assert live.held() == {}


def test_after_a_reconnect_a_replayed_will_gets_the_time_a_site_needs_to_reconnect() -> None:
    live = _liveness()
    live.believed(0.0, connection=1, connected=True)
    # the broker restarted: the PS is back on connection 2 at t=20 and the broker replays the Wills it saved
    live.down("b", BRIDGE, 21.0, connection=2)
    assert live.believed(21.0 + LIVE, connection=2, connected=True) == []
    assert live.bridge_up("b", 40.0) is None  # the bridge reconnected and said "1": the echo is void
    assert live.believed(21.0 + REPLAY, connection=2, connected=True) == []
    # a hospital that really stays down is believed once that time is over
    live.down("c", BRIDGE, 22.0, connection=2)
    assert live.believed(22.0 + REPLAY, connection=2, connected=True) == [SiteOffline("c", 67.0, since=22.0)]
    # and long after the reconnect, a Will is believed after the short grace again
    live.down("d", AGENT, 100.0, connection=2)
    assert live.believed(100.0 + LIVE, connection=2, connected=True) == [SiteOffline("d", 103.0, since=100.0)]


def test_a_bridge_up_brings_back_a_site_that_was_offline_for_its_bridge_only() -> None:
    live = _liveness()
    live.status_up(_up("a", 1.0))
    live.down("a", BRIDGE, 10.0, connection=1)
    assert live.believed(13.0, connection=1, connected=True) == [SiteOffline("a", 13.0, since=10.0)]
    assert live.bridge_up("a", 30.0) == _up("a", 30.0)  # with what its own last status said
    assert live.bridge_up("a", 31.0) is None  # up already


def test_a_bridge_up_does_not_revive_a_site_whose_agent_is_gone() -> None:
    live = _liveness()
    live.status_up(_up("a", 1.0))
    live.down("a", BRIDGE, 10.0, connection=1)
    live.down("a", AGENT, 10.5, connection=1)
    assert live.believed(14.0, connection=1, connected=True) == [SiteOffline("a", 14.0, since=10.0)]  # one event
    assert live.bridge_up("a", 30.0) is None  # the agent's own Will still says offline
    live.status_up(_up("a", 31.0))  # the agent is back (its status event goes to the machine as it is)
    live.down("a", BRIDGE, 40.0, connection=1)
    assert live.believed(43.0, connection=1, connected=True) == [SiteOffline("a", 43.0, since=40.0)]


def test_a_bridge_up_of_a_site_never_heard_from_brings_nothing() -> None:
    live = _liveness()
    live.down("a", BRIDGE, 10.0, connection=1)
    assert live.believed(13.0, connection=1, connected=True) == [SiteOffline("a", 13.0, since=10.0)]
    assert live.bridge_up("a", 20.0) is None  # no status of its own yet: the machine learns of it from one


def test_the_first_will_counts() -> None:
    live = _liveness()
    live.down("a", AGENT, 10.0, connection=1)
    live.down("a", AGENT, 12.0, connection=1)
    assert live.believed(13.0, connection=1, connected=True) == [SiteOffline("a", 13.0, since=10.0)]
    live.down("a", AGENT, 14.0, connection=1)  # believed already: nothing new
    assert live.believed(30.0, connection=1, connected=True) == []
