"""One secure aggregation round played in one process (every site and the PS), for the unit tests and the bench:
each stage can lose sites or let a test change what crosses the PS before it is delivered."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from fedmqtt.secagg import messages as msg
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.server import ServerSession
from fedmqtt.secagg.site import SecAggRefused, SiteSession
from fedmqtt.transport.signing import FederationKeys

Inbox = dict[str, list[msg.EncryptedShare]]


@dataclass
class Losses:
    """Which sites stop at which stage (they send nothing from that stage on)."""

    before_keys: set[str] = field(default_factory=set)
    before_shares: set[str] = field(default_factory=set)
    before_masked: set[str] = field(default_factory=set)
    before_answer: set[str] = field(default_factory=set)


@dataclass
class Played:
    server: ServerSession
    sites: dict[str, SiteSession]
    updates: dict[str, np.ndarray]
    outcome: msg.RoundSum | msg.RoundFailed
    site_refusals: dict[str, SecAggRefused] = field(default_factory=dict)

    def clear_sum(self, included: Iterable[str]) -> np.ndarray:
        clip = self.server.fixed.clip
        return np.sum([np.clip(self.updates[s].astype(np.float64), -clip, clip) for s in included], axis=0)


_KEYS: dict[tuple[str, int], FederationKeys] = {}


def federation(run_id: str, n: int) -> FederationKeys:
    """One federation of `n` sites (site-000 ...) per run id, kept for the session (key generation is not free)."""
    if (run_id, n) not in _KEYS:
        _KEYS[(run_id, n)] = FederationKeys(run_id, ["ps", *site_ids(n)])
    return _KEYS[(run_id, n)]


def site_ids(n: int) -> list[str]:
    return [f"site-{i:03d}" for i in range(n)]


def play(n: int, length: int, *, seed: int = 0, round_no: int = 1, run_id: str = "secagg-run", dropout: float = 0.1,
         fixed: FixedPoint | None = None, losses: Losses | None = None,
         on_inbox: Callable[[Inbox], Inbox] | None = None,
         on_masked: Callable[[msg.MaskedInput], msg.MaskedInput | list[msg.MaskedInput]] | None = None,
         on_request: Callable[[str, msg.UnmaskRequest], msg.UnmaskRequest] | None = None,
         on_answer: Callable[[msg.UnmaskAnswer], msg.UnmaskAnswer] | None = None,
         updates: dict[str, np.ndarray] | None = None, finish: bool = True,
         noise: Callable[[SiteSession], np.ndarray] | None = None) -> Played:
    """Play one round (`finish=False`: stop before the PS rebuilds the sum, so a test can go on by hand;
    `noise`: what each site adds in the ring after encoding, distributed DP's share)."""
    keys = federation(run_id, n)
    ring = keys.identity("observer").ring
    ctx = RoundContext(run_id, round_no)
    fixed = fixed or FixedPoint(clip=4.0, fraction_bits=16, bits=32, max_sites=max(n, 2))
    losses = losses or Losses()
    rng = np.random.default_rng(seed)
    names = site_ids(n)
    updates = updates or {s: rng.normal(scale=2.0, size=length).astype(np.float32) for s in names}
    sites = {s: SiteSession(ctx, s, keys.private[s], ring, fixed, length, dropout=dropout) for s in names}
    server = ServerSession(ctx, names, ring, fixed, length, dropout=dropout)
    played = Played(server, sites, updates, msg.RoundFailed("not finished", ()))
    alive = [s for s in names if s not in losses.before_keys]
    for s in alive:
        server.receive_advert(sites[s].advertise())
    roster = server.close_adverts()
    if isinstance(roster, msg.RoundFailed):
        played.outcome = roster
        return played
    alive = [s for s in alive if s not in losses.before_shares]
    for s in alive:
        _step(played, s, lambda s=s: server.receive_shares(sites[s].share(roster[s])))
    inbox = server.close_shares()
    if isinstance(inbox, msg.RoundFailed):
        played.outcome = inbox
        return played
    inbox = on_inbox(inbox) if on_inbox else inbox
    alive = [s for s in alive if s not in losses.before_masked and s in inbox]
    for s in alive:
        def send_masked(s: str = s) -> None:
            masked = sites[s].mask(updates[s], inbox[s], noise(sites[s]) if noise else None)
            changed = on_masked(masked) if on_masked else masked
            for message in changed if isinstance(changed, list) else [changed]:  # a list: sent one after another
                server.receive_masked(message)
        _step(played, s, send_masked)
    request = server.close_masked()
    if isinstance(request, msg.RoundFailed):
        played.outcome = request
        return played
    for s in request.survivors:
        if s in losses.before_answer or s in played.site_refusals:
            continue
        def send_answer(s: str = s, request: msg.UnmaskRequest = request) -> None:
            answer = sites[s].unmask(on_request(s, request) if on_request else request)
            server.receive_answer(on_answer(answer) if on_answer else answer)
        _step(played, s, send_answer)
    if finish:
        played.outcome = server.finish()
    return played


def _step(played: Played, site: str, action: Callable[[], object]) -> None:
    try:
        action()
    except SecAggRefused as exc:
        played.site_refusals[site] = exc
