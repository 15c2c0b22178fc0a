"""The SecAgg+ round (fedmqtt/secagg/site.py, server.py) end to end in one process: the PS's sum equals the clear
sum within the encoding's bound, with sites lost at every stage, and hostile inputs are refused with a reason and
never aggregated."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from secagg_round import Inbox, Losses, Played, federation, play, site_ids

from fedmqtt.secagg import messages as msg
from fedmqtt.secagg.adverts import make_advert
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.server import ServerSession
from fedmqtt.secagg.site import SecAggRefused, SiteSession

LENGTH = 64


def assert_sum(played: Played, included: Iterable[str]) -> msg.RoundSum:
    outcome = played.outcome
    assert isinstance(outcome, msg.RoundSum), getattr(outcome, "reason", outcome)
    included = set(included)
    assert set(outcome.included) == included
    bound = played.server.fixed.sum_error_bound(len(included))
    assert np.max(np.abs(outcome.total - played.clear_sum(included))) <= bound
    return outcome


def category(refusal: msg.Refusal | None) -> str:
    assert refusal is not None, "accepted"
    return refusal.category


def categories(played: Played, party: str) -> set[str]:
    return {r.category for r in played.server.refusals if r.party == party}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 14), seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([32, 64]),
       lost=st.integers(0, 2))
def test_sum_equals_the_clear_sum_within_the_bound(n: int, seed: int, bits: int, lost: int) -> None:
    lost = min(lost, (n - 1) // 2 - 1) if n >= 6 else 0
    names = site_ids(n)
    gone = set(names[:lost])
    fixed = FixedPoint(clip=4.0, fraction_bits=16 if bits == 32 else 30, bits=bits, max_sites=n)
    played = play(n, LENGTH, seed=seed, fixed=fixed, losses=Losses(before_masked=gone))
    outcome = assert_sum(played, set(names) - gone)
    assert set(outcome.dropped_recovered) == gone


def test_every_site_present() -> None:
    played = play(10, 1000)
    outcome = assert_sum(played, site_ids(10))
    assert outcome.dropped_recovered == () and played.server.refusals == []


def test_sparse_graph_round_with_many_sites() -> None:
    names = site_ids(40)
    gone = {names[3], names[17]}
    played = play(40, 32, dropout=0.05, losses=Losses(before_masked=gone))
    assert not played.server._graph().params.complete
    outcome = assert_sum(played, set(names) - gone)
    assert set(outcome.dropped_recovered) == gone


def test_lost_before_keys_is_simply_not_in_the_round() -> None:
    names = site_ids(8)
    played = play(8, LENGTH, losses=Losses(before_keys={names[0]}))
    outcome = assert_sum(played, names[1:])
    assert outcome.dropped_recovered == ()


def test_lost_after_keys_nobody_pairs_with_it() -> None:
    names = site_ids(8)
    played = play(8, LENGTH, losses=Losses(before_shares={names[5]}))
    outcome = assert_sum(played, set(names) - {names[5]})
    assert outcome.dropped_recovered == ()
    assert all(names[5] not in m.paired_with for m in played.server.masked.values())


def test_lost_after_shares_its_pairwise_masks_are_removed_with_its_rebuilt_key() -> None:
    names = site_ids(9)
    gone = {names[1], names[6]}
    played = play(9, LENGTH, losses=Losses(before_masked=gone))
    outcome = assert_sum(played, set(names) - gone)
    assert set(outcome.dropped_recovered) == gone


def test_lost_after_masked_upload_is_still_in_the_sum() -> None:
    names = site_ids(9)
    played = play(9, LENGTH, losses=Losses(before_answer={names[2]}))
    assert_sum(played, names)  # its seed is rebuilt from its neighbours' shares


def test_withheld_answers_fail_safe_below_the_threshold() -> None:
    names = site_ids(9)  # complete graph, t = 5: 9 survivors, at most 3 others hold each seed after 5 withhold
    played = play(9, LENGTH, losses=Losses(before_answer=set(names[:5])))
    assert isinstance(played.outcome, msg.RoundFailed)
    assert "could not be rebuilt" in played.outcome.reason and "needed" in played.outcome.reason
    assert played.server.outcome is played.outcome and played.server.stage == "failed"


def test_too_many_lost_fails_safe_before_unmasking() -> None:
    names = site_ids(9)
    played = play(9, LENGTH, losses=Losses(before_masked=set(names[:5])))
    assert isinstance(played.outcome, msg.RoundFailed)
    assert "needed" in played.outcome.reason
    assert played.server.request is None  # nobody was asked to reveal anything


def test_fewer_than_three_sites_fails_safe() -> None:
    names = site_ids(4)
    played = play(4, LENGTH, losses=Losses(before_keys=set(names[:2])))
    assert isinstance(played.outcome, msg.RoundFailed) and "3 needed" in played.outcome.reason


# -- hostile inputs -----------------------------------------------------------------------------------------
def test_a_tampered_share_takes_its_sender_out_and_the_round_still_sums() -> None:
    names = site_ids(9)
    culprit, victim = names[4], names[0]

    def flip(inbox: Inbox) -> Inbox:
        inbox[victim] = [dataclasses.replace(s, ciphertext=bytes([s.ciphertext[0] ^ 1]) + s.ciphertext[1:])
                         if s.sender == culprit else s for s in inbox[victim]]
        return inbox

    played = play(9, LENGTH, on_inbox=flip)
    outcome = assert_sum(played, set(names) - {culprit})
    assert culprit in outcome.dropped_recovered
    assert msg.ACCUSED in categories(played, culprit)
    assert {r.category for r in played.sites[victim].refusals} == {msg.BAD_SHARE}


def test_a_share_delivered_twice_is_a_harmless_replay() -> None:
    names = site_ids(6)

    def twice(inbox: Inbox) -> Inbox:
        inbox[names[0]] = [*inbox[names[0]], inbox[names[0]][0]]
        return inbox

    played = play(6, LENGTH, on_inbox=twice)
    assert_sum(played, names)
    assert [r.category for r in played.sites[names[0]].refusals] == [msg.REPLAY]


def test_a_share_replayed_from_another_round_does_not_open() -> None:
    names = site_ids(6)
    earlier = play(6, LENGTH, round_no=1)
    old_share = next(s for s in earlier.server.bundles[names[2]].shares if s.receiver == names[0])

    def replay(inbox: Inbox) -> Inbox:
        inbox[names[0]] = [old_share if s.sender == names[2] else s for s in inbox[names[0]]]
        return inbox

    played = play(6, LENGTH, round_no=2, on_inbox=replay)
    assert msg.BAD_SHARE in {r.category for r in played.sites[names[0]].refusals}
    assert_sum(played, set(names) - {names[2]})


@pytest.mark.parametrize("kind", ["seed_shares", "mask_key_shares"])
def test_a_lying_unmask_answer_is_named_and_outvoted(kind: str) -> None:
    """A survivor answers with shares off the polynomial, of survivors' seeds or of a dropped site's mask-key seed:
    the PS still rebuilds the right secrets (checked against the commitment, or the advertised public key) from
    the others, and names it."""
    names = site_ids(10)
    liar, gone = names[0], names[9]  # names[0] is in the first subset tried for every owner it holds shares of

    def lie(answer: msg.UnmaskAnswer) -> msg.UnmaskAnswer:
        if answer.sender != liar:
            return answer
        shares: dict[str, tuple[int, bytes]] = getattr(answer, kind)
        bad = {o: (i, bytes(b ^ 0xFF for b in s)) for o, (i, s) in shares.items()}
        return dataclasses.replace(answer, **{kind: bad})

    played = play(10, LENGTH, losses=Losses(before_masked={gone}), on_answer=lie)
    outcome = assert_sum(played, set(names) - {gone})
    assert outcome.dropped_recovered == (gone,)
    assert msg.INCONSISTENT_SHARE in categories(played, liar)


def test_an_answer_with_a_wrong_index_or_missing_shares_is_refused() -> None:
    names = site_ids(7)

    def wrong(answer: msg.UnmaskAnswer) -> msg.UnmaskAnswer:
        if answer.sender == names[1]:
            owner, (index, share) = next(iter(answer.seed_shares.items()))
            return dataclasses.replace(answer, seed_shares={**answer.seed_shares, owner: (index + 1, share)})
        if answer.sender == names[2]:
            return dataclasses.replace(answer, seed_shares=dict(list(answer.seed_shares.items())[1:]))
        return answer

    played = play(7, LENGTH, on_answer=wrong)
    assert msg.MALFORMED in categories(played, names[1]) and msg.MALFORMED in categories(played, names[2])
    assert_sum(played, names)  # the other five answers are enough (t = 4)


def test_masked_inputs_of_the_wrong_shape_or_pairing_are_refused() -> None:
    names = site_ids(9)

    def spoil(masked: msg.MaskedInput) -> msg.MaskedInput:
        if masked.sender == names[0]:
            return dataclasses.replace(masked, masked=masked.masked.astype(np.uint64))
        if masked.sender == names[1]:
            return dataclasses.replace(masked, masked=masked.masked[:-1])
        if masked.sender == names[2]:
            return dataclasses.replace(masked, paired_with=(*masked.paired_with, "site-999"))
        return masked

    played = play(9, LENGTH, on_masked=spoil)
    for site in names[:3]:
        assert msg.MALFORMED in categories(played, site)
    outcome = assert_sum(played, names[3:])
    assert set(outcome.dropped_recovered) == set(names[:3])


def test_adverts_forged_replayed_or_equivocated_are_refused() -> None:
    n, keys = 5, federation("secagg-run", 5)
    ring = keys.identity("observer").ring
    names = site_ids(n)
    fixed = FixedPoint(clip=1.0, fraction_bits=8, max_sites=n)
    ctx, old_ctx = RoundContext("secagg-run", 7), RoundContext("secagg-run", 6)
    server = ServerSession(ctx, names, ring, fixed, 4, dropout=0.1)
    sessions = {s: SiteSession(ctx, s, keys.private[s], ring, fixed, 4, dropout=0.1) for s in names}
    old = SiteSession(old_ctx, names[0], keys.private[names[0]], ring, fixed, 4, dropout=0.1).advertise()
    forged = SiteSession(ctx, names[1], keys.private[names[2]], ring, fixed, 4, dropout=0.1).advertise()
    assert category(server.receive_advert(old)) == msg.BAD_SIGNATURE
    assert category(server.receive_advert(forged)) == msg.BAD_SIGNATURE
    swapped = dataclasses.replace(sessions[names[3]].advertise(), mask_public=sessions[names[4]].advert.mask_public)
    assert category(server.receive_advert(swapped)) == msg.BAD_SIGNATURE
    assert category(server.receive_advert(dataclasses.replace(old, site="site-999"))) == msg.UNKNOWN_PARTY
    # a site's own signature over a low-order point (u = 0): no neighbour could agree a key with it
    zero = bytes(32)
    low = make_advert(ctx, names[0], keys.private[names[0]], zero, sessions[names[0]].advert.mask_public, zero)
    assert category(server.receive_advert(low)) == msg.MALFORMED
    short = dataclasses.replace(sessions[names[1]].advertise(), seed_commitment=bytes(31))
    assert category(server.receive_advert(short)) == msg.MALFORMED
    for s in names:
        assert server.receive_advert(sessions[s].advertise()) is None
    assert category(server.receive_advert(sessions[names[0]].advertise())) == msg.REPLAY
    again = SiteSession(ctx, names[4], keys.private[names[4]], ring, fixed, 4, dropout=0.1).advertise()
    assert category(server.receive_advert(again)) == msg.EQUIVOCATION
    roster = server.close_adverts()
    assert isinstance(roster, dict) and set(roster) == set(names[:4])
    assert category(server.receive_advert(sessions[names[4]].advertise())) == msg.WRONG_STAGE


def test_a_site_refuses_a_roster_with_a_key_its_owner_did_not_sign() -> None:
    n, keys = 5, federation("secagg-run", 5)
    ring = keys.identity("observer").ring
    names, fixed, ctx = site_ids(n), FixedPoint(clip=1.0, fraction_bits=8), RoundContext("secagg-run", 8)
    sessions = {s: SiteSession(ctx, s, keys.private[s], ring, fixed, 4, dropout=0.1) for s in names}
    adverts = [sessions[s].advertise() for s in names]
    site = sessions[names[0]]
    swapped = [*adverts[:2], dataclasses.replace(adverts[2], cipher_public=adverts[3].cipher_public), *adverts[3:]]
    with pytest.raises(SecAggRefused, match="site-002") as refused:
        site.share(msg.Roster(tuple(names), tuple(swapped)))
    assert refused.value.category == msg.BAD_SIGNATURE
    for bad, match in ((msg.Roster(tuple(names), (*adverts, adverts[1])), "two advertisements"),
                       (msg.Roster(tuple(names), tuple(adverts[1:])), "own advertisement"),
                       (msg.Roster(tuple(names), tuple(adverts[:-1])), "exactly this site's neighbours"),
                       (msg.Roster((*names, names[1]), tuple(adverts)), "sorted, distinct"),
                       (msg.Roster(tuple(names[1:]), tuple(adverts)), "include this site")):
        with pytest.raises(SecAggRefused, match=match):
            site.share(bad)
    assert site.stage == "advertised"
    site.share(msg.Roster(tuple(names), tuple(adverts)))  # the complete graph: every other site is a neighbour


def test_a_sparse_roster_carries_only_the_neighbours_keys() -> None:
    played = play(40, 8, dropout=0.05)
    graph = played.server._graph()
    assert not graph.params.complete
    site = played.sites["site-007"]
    assert set(site.roster) == {"site-007", *graph.neighbours["site-007"]}
    assert len(site.roster) == graph.params.degree + 1 < 40


def test_a_site_never_reveals_both_secrets_of_a_neighbour() -> None:
    names = site_ids(7)
    gone = names[6]
    asked: dict[str, list[msg.UnmaskRequest]] = {}

    def record(site: str, request: msg.UnmaskRequest) -> msg.UnmaskRequest:
        asked.setdefault(site, []).append(request)
        return request

    played = play(7, LENGTH, losses=Losses(before_masked={gone}), on_request=record)
    assert_sum(played, names[:6])
    site = played.sites[names[0]]
    request = asked[names[0]][0]
    assert site.unmask(request) == site.unmask(request)  # the same request again: the same answer (a resumed PS)
    greedy = msg.UnmaskRequest(request.survivors, (*request.dropped, names[1]))
    with pytest.raises(SecAggRefused) as refused:
        site.unmask(greedy)
    assert refused.value.category == msg.REFUSED_REQUEST
    # A fresh site asked with a site in both lists, or without itself, or with too few survivors refuses too.
    for bad in (msg.UnmaskRequest(request.survivors, (names[1],)),
                msg.UnmaskRequest(tuple(s for s in request.survivors if s != names[0]), ()),
                msg.UnmaskRequest((names[0], names[1]), ())):
        fresh = play(7, LENGTH, seed=1, losses=Losses(before_answer=set(names)))
        with pytest.raises(SecAggRefused):
            fresh.sites[names[0]].unmask(bad)
    # what the PS was handed: for no owner both a seed share and a mask-key share
    for answer in played.server.answers.values():
        assert not set(answer.seed_shares) & set(answer.mask_key_shares)
    seeds = {o for a in played.server.answers.values() for o in a.seed_shares}
    keys_ = {o for a in played.server.answers.values() for o in a.mask_key_shares}
    assert seeds.isdisjoint(keys_) and keys_ == {gone}


def test_out_of_order_messages_are_refused_not_crashes() -> None:
    names = site_ids(5)
    played = play(5, LENGTH)
    server = played.server
    stray = played.sites[names[0]].advertise()
    assert category(server.receive_advert(stray)) == msg.WRONG_STAGE
    assert category(server.receive_shares(msg.ShareBundle(names[0], ()))) == msg.WRONG_STAGE
    assert category(server.receive_answer(msg.UnmaskAnswer(names[0], {}, {}))) == msg.WRONG_STAGE
    with pytest.raises(SecAggRefused, match="at 'answered'"):
        played.sites[names[0]].share([])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 12), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_any_pattern_of_losses_gives_the_clear_sum_or_fails_safe(n: int, seed: int, data: st.DataObject) -> None:
    """Sites lost at random stages: the round either sums exactly the sites it says it included (within the bound)
    or fails with a reason; it never returns a wrong sum, and its own account of who was in adds up."""
    names = site_ids(n)
    stage_of = data.draw(st.lists(st.sampled_from(["keys", "shares", "masked", "answer", None]), min_size=n,
                                  max_size=n))
    losses = Losses(*({s for s, stage in zip(names, stage_of, strict=True) if stage == key}
                      for key in ("keys", "shares", "masked", "answer")))
    played = play(n, 16, seed=seed, losses=losses)
    outcome = played.outcome
    if isinstance(outcome, msg.RoundFailed):
        assert outcome.reason
        return
    sent_masked = set(names) - losses.before_keys - losses.before_shares - losses.before_masked
    assert set(outcome.included) == sent_masked
    assert set(outcome.dropped_recovered) <= losses.before_masked
    assert_sum(played, outcome.included)


def test_a_replayed_or_equivocated_answer() -> None:
    names = site_ids(9)
    played = play(9, LENGTH, losses=Losses(before_answer=set(names)), finish=False)  # the PS waits for answers
    server = played.server
    assert category(server.receive_masked(server.masked[names[0]])) == msg.WRONG_STAGE
    answer = played.sites[names[1]].unmask(server._request())
    assert server.receive_answer(answer) is None
    assert category(server.receive_answer(answer)) == msg.REPLAY and names[1] in server.answers
    other = dataclasses.replace(answer, seed_shares=dict(list(answer.seed_shares.items())[:-1]))
    assert category(server.receive_answer(other)) == msg.EQUIVOCATION
    assert names[1] in server.banned and names[1] not in server.answers
    assert category(server.receive_answer(answer)) == msg.UNKNOWN_PARTY
    for site in names[2:]:
        assert server.receive_answer(played.sites[site].unmask(server._request())) is None
    outcome = server.finish()
    assert isinstance(outcome, msg.RoundSum)  # its update is in (others rebuild its seed); its answer is not used
    assert names[1] in outcome.included


def test_an_equivocated_masked_input_counts_as_dropped() -> None:
    names = site_ids(9)
    culprit = names[3]

    def twice(masked: msg.MaskedInput) -> list[msg.MaskedInput]:
        if masked.sender != culprit:
            return [masked]
        return [masked, dataclasses.replace(masked, masked=masked.masked + np.uint32(1))]

    played = play(9, LENGTH, on_masked=twice)
    outcome = assert_sum(played, set(names) - {culprit})
    assert culprit in outcome.dropped_recovered
    assert msg.EQUIVOCATION in categories(played, culprit)


def test_a_restarted_ps_resumes_by_replaying_what_it_had_accepted() -> None:
    """The PS's session is a pure function of the messages it accepted, in order: a new session fed the same
    messages (as a restarted PS would, from its spool) reaches the same stage and then the same sum, bit for bit,
    whichever stage the restart hit."""
    names = site_ids(9)
    played = play(9, LENGTH, losses=Losses(before_masked={names[2]}, before_answer={names[5]}))
    first = played.server
    assert isinstance(first.outcome, msg.RoundSum)
    steps = [
        (lambda s: [s.receive_advert(a) for a in first.adverts.values()], lambda s: s.close_adverts()),
        (lambda s: [s.receive_shares(b) for b in first.bundles.values()], lambda s: s.close_shares()),
        (lambda s: [s.receive_masked(m) for m in first.masked.values()], lambda s: s.close_masked()),
        (lambda s: [s.receive_answer(a) for a in first.answers.values()], lambda s: s.finish()),
    ]
    for restart_after in range(len(steps)):
        fresh = ServerSession(first.ctx, first.selected, first.verifier, first.fixed, first.length,
                              dropout=first.dropout)
        for receive, close in steps[: restart_after + 1]:  # replayed from the spool
            assert all(r is None for r in receive(fresh))
            close(fresh)
        assert fresh.stage == ("shares", "masked", "unmask", "done")[restart_after]
        for receive, close in steps[restart_after + 1:]:  # what arrives after the restart
            receive(fresh)
            close(fresh)
        assert isinstance(fresh.outcome, msg.RoundSum)
        assert np.array_equal(fresh.outcome.total, first.outcome.total)
        assert (fresh.outcome.included, fresh.outcome.dropped_recovered) == (first.outcome.included,
                                                                            first.outcome.dropped_recovered)
