"""A site's round over the wire kinds with its secrets on disk (site_agent/secagg_round.py, secagg_store.py): four
sites and the PS's ServerSession exchange encoded messages; sites restarted after their shares and after their
masked input resume from their state folder; FedAvg from the unmasked mean equals FedAvg in the clear."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest
from secagg_round import federation, site_ids

from fedmqtt.secagg import messages as msg
from fedmqtt.secagg import wire as conv
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.server import ServerSession
from fedmqtt.secagg.site import SecAggRefused
from fedmqtt.secagg.weighted import layout_of, mean_error_bound, mean_from_sum, site_weight
from fedmqtt.strategies import build_strategy
from fedmqtt.strategies.base import RoundInput, SiteUpdate
from fedmqtt.strategies.sums import aggregate_from_mean
from schemas import secagg as wire
from schemas.codec import decode, encode
from site_agent.secagg_round import SiteRound
from site_agent.secagg_store import SecAggRecordError, SecAggStore

RUN, SESSION, ROUND = "secagg-site-run", "ab12", 2
TERMS = wire.SecAggTerms(ring_bits=64, fraction_bits=24, clip=8.0, max_sites=4, dropout=0.1, attempt=3)
N = 4


def trip(message: object) -> object:
    """Through the codec, as the channel would carry it (validated again on the way in)."""
    return decode(encode(message))


class Federation:
    """Four sites' drivers, each with its own state folder, and the PS's ServerSession."""

    def __init__(self, tmp: Path, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.keys = federation(RUN, N)
        self.names = site_ids(N)
        self.current = {"w": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
        self.trained = {s: {k: v + rng.normal(scale=0.2, size=v.shape).astype(np.float32)
                            for k, v in self.current.items()} for s in self.names}
        self.counts = {s: int(rng.integers(30, 300)) for s in self.names}
        self.bound = float(sum(self.counts.values()))
        self.terms = TERMS.model_copy(update={"weight_bound": self.bound})
        self.layout = layout_of(self.current)
        self.tmp = tmp
        fixed = FixedPoint(TERMS.clip, TERMS.fraction_bits, TERMS.ring_bits, max_sites=TERMS.max_sites)
        self.server = ServerSession(RoundContext(RUN, ROUND, TERMS.attempt), self.names,
                                    self.keys.identity("observer").ring, fixed, self.layout.length,
                                    dropout=TERMS.dropout)
        self.sites = {s: self.site(s) for s in self.names}

    def site(self, name: str) -> SiteRound:
        """A (re)started site: its driver built from its state folder."""
        return SiteRound(SecAggStore(self.tmp / name / "secagg"), self.keys.identity(name), run_id=RUN,
                         session=SESSION, round_no=ROUND, terms=self.terms, layout=self.layout)


def _play(tmp: Path, *, restart_after_shares: str = "", restart_after_masked: str = "") -> tuple[Federation, object]:
    fed = Federation(tmp)
    ctx = RoundContext(RUN, ROUND, TERMS.attempt)
    for s in fed.names:
        advert = trip(fed.sites[s].advert())
        assert isinstance(advert, wire.SecAggAdvert)
        assert fed.server.receive_advert(conv.advert_from_wire(advert)) is None
    rosters = fed.server.close_adverts()
    assert not isinstance(rosters, msg.RoundFailed)
    for s in fed.names:
        roster = trip(conv.roster_to_wire(ctx, s, rosters[s]))
        assert isinstance(roster, wire.SecAggRoster)
        shares = fed.sites[s].on_roster(roster)
        assert shares is not None and fed.sites[s].on_roster(roster) is None  # a re-sent roster: shares made once
        assert fed.server.receive_shares(conv.shares_from_wire(trip(shares))) is None  # type: ignore[arg-type]
    if restart_after_shares:
        fed.sites[restart_after_shares] = fed.site(restart_after_shares)
        assert fed.sites[restart_after_shares].stage == "shared"
    inboxes = fed.server.close_shares()
    assert not isinstance(inboxes, msg.RoundFailed)
    for s in fed.names:
        inbox = trip(conv.inbox_to_wire(ctx, s, inboxes[s]))
        assert isinstance(inbox, wire.SecAggInbox)
        masked = trip(fed.sites[s].on_inbox(inbox, fed.trained[s], fed.counts[s]))
        assert isinstance(masked, wire.SecAggMasked)
        assert fed.server.receive_masked(conv.masked_from_wire(masked, fed.server.fixed)) is None
    if restart_after_masked:
        fed.sites[restart_after_masked] = fed.site(restart_after_masked)
        assert fed.sites[restart_after_masked].stage == "masked"
    request = fed.server.close_masked()
    assert isinstance(request, msg.UnmaskRequest)
    for s in request.survivors:
        unmask = trip(conv.unmask_to_wire(ctx, s, request))
        assert isinstance(unmask, wire.SecAggUnmask)
        answer = trip(fed.sites[s].on_unmask(unmask))
        assert fed.server.receive_answer(conv.answer_from_wire(answer)) is None  # type: ignore[arg-type]
    return fed, fed.server.finish()


def _check_fedavg(fed: Federation, outcome: object) -> None:
    assert isinstance(outcome, msg.RoundSum) and set(outcome.included) == set(fed.names)
    mean, n_total = mean_from_sum(outcome.total, fed.layout, fed.bound)
    inp = RoundInput(round_no=ROUND, current=fed.current, updates=[], enrolled=fed.counts, manifest={})
    secure = aggregate_from_mean(build_strategy("fedavg", {}), inp, mean, n_total).weights
    clear = build_strategy("fedavg", {}).aggregate_train(RoundInput(
        round_no=ROUND, current=fed.current, enrolled=fed.counts, manifest={},
        updates=[SiteUpdate(s, fed.trained[s], fed.counts[s], 1) for s in fed.names])).weights
    largest = max(float(np.max(np.abs(v))) for v in clear.values())
    weight = sum(site_weight(n, fed.bound) for n in fed.counts.values())
    bound = mean_error_bound(fed.server.fixed, N, weight, largest) + largest * 2.0**-23  # float32 cast
    for name in clear:
        assert np.max(np.abs(secure[name].astype(np.float64) - clear[name])) <= bound, name


def test_a_round_through_the_wire_gives_fedavgs_result(tmp_path: Path) -> None:
    fed, outcome = _play(tmp_path)
    _check_fedavg(fed, outcome)


def test_a_site_restarted_after_its_shares_masks_and_answers_from_its_state_folder(tmp_path: Path) -> None:
    fed, outcome = _play(tmp_path, restart_after_shares="site-001")
    _check_fedavg(fed, outcome)


def test_a_site_restarted_after_its_masked_input_answers_the_same_request_only(tmp_path: Path) -> None:
    fed, outcome = _play(tmp_path, restart_after_masked="site-002")
    _check_fedavg(fed, outcome)
    request = fed.server.request
    assert request is not None
    again = fed.site("site-002")  # once more, after it answered: the same request, the same answer
    same = conv.unmask_to_wire(RoundContext(RUN, ROUND, TERMS.attempt), "site-002", request)
    first, second = again.on_unmask(same), fed.sites["site-002"].on_unmask(same)
    assert (first.seed_shares, first.mask_key_shares) == (second.seed_shares, second.mask_key_shares)
    assert first.seed_shares  # it holds its survivors' seed shares
    other = same.model_copy(update={"survivors": tuple(s for s in same.survivors if s != "site-003"),
                                    "dropped": ("site-003",)})
    with pytest.raises(SecAggRefused, match="different unmasking request"):
        again.on_unmask(other)


def test_the_state_folder_is_private_and_a_damaged_record_is_refused(tmp_path: Path) -> None:
    fed = Federation(tmp_path)
    store = fed.sites["site-000"].store
    path = store.path(SESSION, ROUND, TERMS.attempt)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(store.folder.stat().st_mode) == 0o700
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(SecAggRecordError, match="not a readable round record"):
        fed.site("site-000")
    path.write_bytes(b"\x00" * 10)
    with pytest.raises(SecAggRecordError):
        fed.site("site-000")


def test_a_second_different_inbox_is_refused(tmp_path: Path) -> None:
    fed = Federation(tmp_path)
    ctx = RoundContext(RUN, ROUND, TERMS.attempt)
    for s in fed.names:
        fed.server.receive_advert(conv.advert_from_wire(fed.sites[s].advert()))
    rosters = fed.server.close_adverts()
    assert not isinstance(rosters, msg.RoundFailed)
    for s in fed.names:
        shares = fed.sites[s].on_roster(conv.roster_to_wire(ctx, s, rosters[s]))
        assert shares is not None
        fed.server.receive_shares(conv.shares_from_wire(shares))
    inboxes = fed.server.close_shares()
    assert not isinstance(inboxes, msg.RoundFailed)
    site = fed.sites["site-000"]
    site.on_inbox(conv.inbox_to_wire(ctx, "site-000", inboxes["site-000"]), fed.trained["site-000"], 10)
    fewer = conv.inbox_to_wire(ctx, "site-000", inboxes["site-000"][1:])
    with pytest.raises(SecAggRefused, match="different inbox"):
        site.on_inbox(fewer, fed.trained["site-000"], 10)
