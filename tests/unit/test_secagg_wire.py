"""Secure aggregation's message kinds (schemas/secagg.py) and their conversion to and from the protocol's records
(fedmqtt/secagg/wire.py): a whole round survives the trip through msgpack and validation, and what the schema
can see to be wrong is refused there."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest
from pydantic import BaseModel, ValidationError
from secagg_examples import secagg_examples
from secagg_round import Inbox, Losses, play, site_ids
from signed_wire import ring, signed

from fedmqtt.errors import SchemaError
from fedmqtt.secagg import messages as msg
from fedmqtt.secagg import wire as conv
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.transport import topics
from fedmqtt.transport.channel import check_message
from schemas import secagg as wire
from schemas.codec import encode

CTX = RoundContext("secagg-run", 1)


def through_wire(message: BaseModel) -> Any:
    """Encode as the codec does, parse the msgpack back and validate it as its own kind."""
    return type(message).model_validate(msgpack.unpackb(encode(message), raw=False))


def test_a_whole_round_travels_through_the_wire_kinds() -> None:
    """Every message of a round with one site lost goes through its kind; the sum is still the clear sum."""
    fixed = FixedPoint(clip=4.0, fraction_bits=16, bits=32, max_sites=7)

    def inbox_trip(inbox: Inbox) -> Inbox:
        return {s: conv.inbox_from_wire(through_wire(conv.inbox_to_wire(CTX, s, shares)))
                for s, shares in inbox.items()}

    def masked_trip(masked: msg.MaskedInput) -> msg.MaskedInput:
        back = conv.masked_from_wire(through_wire(conv.masked_to_wire(CTX, masked, fixed)), fixed)
        assert np.array_equal(back.masked, masked.masked) and back.masked.dtype == masked.masked.dtype
        return back

    def request_trip(site: str, request: msg.UnmaskRequest) -> msg.UnmaskRequest:
        return conv.unmask_from_wire(through_wire(conv.unmask_to_wire(CTX, site, request)))

    def answer_trip(answer: msg.UnmaskAnswer) -> msg.UnmaskAnswer:
        return conv.answer_from_wire(through_wire(conv.answer_to_wire(CTX, answer)))

    played = play(7, 50, fixed=fixed, losses=Losses(before_masked={"site-004"}),
                  on_inbox=inbox_trip, on_masked=masked_trip, on_request=request_trip, on_answer=answer_trip)
    assert isinstance(played.outcome, msg.RoundSum), played.outcome
    included = set(site_ids(7)) - {"site-004"}
    assert np.max(np.abs(played.outcome.total - played.clear_sum(included))) <= fixed.sum_error_bound(6)
    # the first two steps, converted after the fact: the same records come back
    for site, session in played.sites.items():
        assert conv.advert_from_wire(through_wire(conv.advert_to_wire(CTX, session.advert))) == session.advert
        bundle = played.server.bundles.get(site)
        if bundle is not None:
            assert conv.shares_from_wire(through_wire(conv.shares_to_wire(CTX, bundle))) == bundle
    roster = msg.Roster(tuple(sorted(played.sites)), tuple(played.sites[s].advert for s in sorted(played.sites)))
    assert conv.roster_from_wire(through_wire(conv.roster_to_wire(CTX, "site-000", roster))) == roster


@pytest.fixture(scope="module")
def round_messages() -> dict[str, BaseModel]:
    played = play(5, 8)
    site = played.sites["site-000"]
    bundle = played.server.bundles["site-000"]
    masked = played.server.masked["site-000"]
    request = played.server.request
    assert request is not None
    return {
        "advert": conv.advert_to_wire(CTX, site.advert),
        "roster": conv.roster_to_wire(CTX, "site-000", msg.Roster(tuple(sorted(played.sites)), tuple(
            played.sites[s].advert for s in sorted(played.sites)))),
        "shares": conv.shares_to_wire(CTX, bundle),
        "masked": conv.masked_to_wire(CTX, masked, played.server.fixed),
        "unmask": conv.unmask_to_wire(CTX, "site-000", request),
        "answer": conv.answer_to_wire(CTX, played.server.answers["site-000"]),
    }


def refused(model: BaseModel, **changes: Any) -> str:
    data = model.model_dump(mode="python")
    data.update(changes)
    with pytest.raises(ValidationError) as exc:
        type(model).model_validate(data)
    return str(exc.value)


def test_keys_of_the_wrong_length_or_someone_elses_advert_are_refused(round_messages: dict[str, BaseModel]) -> None:
    advert = round_messages["advert"]
    body = advert.model_dump(mode="python")["advert"]
    assert "at least 32" in refused(advert, advert={**body, "mask_public": bytes(31)})
    assert "at most 32" in refused(advert, advert={**body, "seed_commitment": bytes(33)})
    assert "own keys" in refused(advert, sender="site-001")
    other = {**body["signature"], "signer": "site-001"}
    assert "signed by its own site" in refused(advert, advert={**body, "signature": other})
    assert "pattern" in refused(advert, advert={**body, "site": "Site 0"})


def test_a_roster_must_be_sorted_and_carry_its_receiver(round_messages: dict[str, BaseModel]) -> None:
    roster = round_messages["roster"]
    data = roster.model_dump(mode="python")
    assert "sorted and distinct" in refused(roster, sites=tuple(reversed(data["sites"])))
    assert "sorted and distinct" in refused(roster, adverts=(*data["adverts"], data["adverts"][0]))
    assert "receiver's advertisement" in refused(roster, site_id="site-999")
    assert "receiver's advertisement" in refused(roster, sites=data["sites"][:-1])


def test_sealed_shares_have_one_length_and_distinct_receivers(round_messages: dict[str, BaseModel]) -> None:
    shares = round_messages["shares"]
    data = shares.model_dump(mode="python")["shares"]
    assert "at least 50" in refused(shares, shares=({**data[0], "sealed": data[0]["sealed"][:-1]}, *data[1:]))
    assert "sorted and distinct" in refused(shares, shares=(data[0], *data))
    assert "not with itself" in refused(shares, shares=({**data[0], "peer": "site-000"},))
    assert "at least 1" in refused(shares, shares=())


def test_a_masked_vector_is_a_flat_signed_integer_tensor(round_messages: dict[str, BaseModel]) -> None:
    masked = round_messages["masked"]
    blob = masked.model_dump(mode="python")["masked"]
    # zero bits: the masked bits read as float32 could hold a NaN, which the tensor check refuses first
    assert "flat int32" in refused(masked, masked={**blob, "dtype": "float32", "data": bytes(len(blob["data"]))})
    assert "flat int32" in refused(masked, masked={**blob, "shape": (2, 4)})
    assert "flat int64" in refused(masked, ring_bits=64)
    assert "sorted and distinct" in refused(masked, paired_with=("site-002", "site-001"))
    assert "Input should be 32 or 64" in refused(masked, ring_bits=16)
    assert isinstance(masked, wire.SecAggMasked)
    with pytest.raises(ValueError, match="ring"):
        conv.masked_from_wire(masked, FixedPoint(clip=4.0, fraction_bits=12, bits=32, max_sites=5))


def test_an_unmasking_request_never_names_a_site_twice(round_messages: dict[str, BaseModel]) -> None:
    unmask = round_messages["unmask"]
    survivors = unmask.model_dump(mode="python")["survivors"]
    assert "both a survivor and dropped" in refused(unmask, dropped=survivors[:1])
    assert "sorted and distinct" in refused(unmask, survivors=(*survivors, survivors[0]))


def test_an_answer_never_holds_both_shares_of_a_site(round_messages: dict[str, BaseModel]) -> None:
    answer = round_messages["answer"]
    seeds = answer.model_dump(mode="python")["seed_shares"]
    assert "never both" in refused(answer, mask_key_shares=seeds[:1])
    assert "greater than or equal to 1" in refused(answer, seed_shares=({**seeds[0], "index": 0}, *seeds[1:]))
    assert "at least 16" in refused(answer, seed_shares=({**seeds[0], "share": b""}, *seeds[1:]))
    assert isinstance(answer, wire.SecAggAnswer)
    assert dataclasses.asdict(conv.answer_from_wire(answer))["sender"] == "site-000"


# -- on the wire: topics and signatures ---------------------------------------------------------------------------
SIGNED_RUN = "secagg-signed"


def _home(message: BaseModel) -> str:
    """The topic each kind travels on (fedmqtt/transport/channel.py, KINDS_BY_TOPIC)."""
    kind, sender = message.kind, message.sender  # type: ignore[attr-defined]
    if sender == "ps":
        return topics.ps_task_topic(SIGNED_RUN, message.site_id)  # type: ignore[attr-defined]
    return (topics.site_update_topic if kind == "secagg_masked" else topics.site_secagg_topic)(SIGNED_RUN, sender)


@pytest.mark.parametrize("message", secagg_examples(SIGNED_RUN), ids=lambda m: m.kind)
def test_each_kind_is_accepted_on_its_topic_signed_by_its_owner(message: BaseModel) -> None:
    """Every kind passes the channel's checks on its own topic, signed by the topic's owner, and comes back equal."""
    topic = _home(message)
    _, back = check_message(topic, signed(SIGNED_RUN, topic, encode(message)), run_id=SIGNED_RUN, max_bytes=1 << 20,
                            keys=ring(SIGNED_RUN))
    assert back == message


@pytest.mark.parametrize("message", secagg_examples(SIGNED_RUN), ids=lambda m: m.kind)
def test_each_kind_is_refused_off_its_topic_or_signed_by_another_party(message: BaseModel) -> None:
    """The same bytes signed by another party, or put on a topic the kind does not belong to, are refused."""
    topic = _home(message)
    wrong_signer = "site-c" if message.sender == "ps" else "ps"  # type: ignore[attr-defined]
    with pytest.raises(SchemaError):
        check_message(topic, signed(SIGNED_RUN, topic, encode(message), signer=wrong_signer), run_id=SIGNED_RUN,
                      max_bytes=1 << 20, keys=ring(SIGNED_RUN))
    elsewhere = (topics.ps_model_topic(SIGNED_RUN) if message.sender == "ps"  # type: ignore[attr-defined]
                 else topics.site_report_topic(SIGNED_RUN, message.sender))  # type: ignore[attr-defined]
    with pytest.raises(SchemaError) as info:
        check_message(elsewhere, signed(SIGNED_RUN, elsewhere, encode(message)), run_id=SIGNED_RUN,
                      max_bytes=1 << 20, keys=ring(SIGNED_RUN))
    assert "does not belong on this topic" in str(info.value)


def test_a_site_cannot_publish_secure_aggregation_messages_as_another_site() -> None:
    """site-b's advert on site-a's topic, even signed with site-b's own key, is another identity than the topic's."""
    advert = next(m for m in secagg_examples(SIGNED_RUN, "site-b", "site-c") if m.kind == "secagg_advert")
    topic = topics.site_secagg_topic(SIGNED_RUN, "site-a")
    with pytest.raises(SchemaError):
        check_message(topic, signed(SIGNED_RUN, topic, encode(advert), signer="site-a"), run_id=SIGNED_RUN,
                      max_bytes=1 << 20, keys=ring(SIGNED_RUN))
