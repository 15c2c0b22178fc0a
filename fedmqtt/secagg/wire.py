"""Between the protocol's records (fedmqtt/secagg/messages.py) and their message kinds (schemas/secagg.py).

`*_to_wire` builds the kind a party publishes; `*_from_wire` turns a validated kind back into the record the state
objects take. Whatever the schema cannot see (that a roster's advertisements are a neighbourhood, that shares go
to neighbours, that a masked vector has the model's length) the state objects check.
"""

from __future__ import annotations

import numpy as np

from fedmqtt.secagg import messages as msg
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.ring import FixedPoint
from schemas import secagg as wire
from schemas.tensors import TensorBlob

PS = "ps"
MASKED_TENSOR = "masked"


def _advert(advert: msg.KeyAdvert) -> wire.KeyAdvertBody:
    return wire.KeyAdvertBody(site=advert.site, cipher_public=advert.cipher_public, mask_public=advert.mask_public,
                              seed_commitment=advert.seed_commitment, signature=advert.signature)


def _from_advert(body: wire.KeyAdvertBody) -> msg.KeyAdvert:
    return msg.KeyAdvert(body.site, body.cipher_public, body.mask_public, body.seed_commitment, body.signature)


def advert_to_wire(ctx: RoundContext, advert: msg.KeyAdvert) -> wire.SecAggAdvert:
    return wire.SecAggAdvert(run_id=ctx.run_id, round=ctx.round_no, attempt=ctx.attempt, sender=advert.site,
                             advert=_advert(advert))


def advert_from_wire(message: wire.SecAggAdvert) -> msg.KeyAdvert:
    return _from_advert(message.advert)


def roster_to_wire(ctx: RoundContext, site: str, roster: msg.Roster) -> wire.SecAggRoster:
    return wire.SecAggRoster(run_id=ctx.run_id, round=ctx.round_no, attempt=ctx.attempt, sender=PS, site_id=site,
                             sites=roster.sites,
                             adverts=tuple(_advert(a) for a in sorted(roster.adverts, key=lambda a: a.site)))


def roster_from_wire(message: wire.SecAggRoster) -> msg.Roster:
    return msg.Roster(message.sites, tuple(_from_advert(a) for a in message.adverts))


def shares_to_wire(ctx: RoundContext, bundle: msg.ShareBundle) -> wire.SecAggShares:
    return wire.SecAggShares(run_id=ctx.run_id, round=ctx.round_no, attempt=ctx.attempt, sender=bundle.sender,
                             shares=tuple(wire.SealedShare(peer=s.receiver, sealed=s.ciphertext)
                                          for s in sorted(bundle.shares, key=lambda s: s.receiver)))


def shares_from_wire(message: wire.SecAggShares) -> msg.ShareBundle:
    return msg.ShareBundle(message.sender, tuple(msg.EncryptedShare(message.sender, s.peer, s.sealed)
                                                 for s in message.shares))


def inbox_to_wire(ctx: RoundContext, site: str, inbox: list[msg.EncryptedShare]) -> wire.SecAggInbox:
    return wire.SecAggInbox(run_id=ctx.run_id, round=ctx.round_no, attempt=ctx.attempt, sender=PS, site_id=site,
                            shares=tuple(wire.SealedShare(peer=s.sender, sealed=s.ciphertext)
                                         for s in sorted(inbox, key=lambda s: s.sender)))


def inbox_from_wire(message: wire.SecAggInbox) -> list[msg.EncryptedShare]:
    return [msg.EncryptedShare(s.peer, message.site_id, s.sealed) for s in message.shares]


def masked_to_wire(ctx: RoundContext, masked: msg.MaskedInput, fixed: FixedPoint) -> wire.SecAggMasked:
    signed = masked.masked.view(np.int32 if fixed.bits == 32 else np.int64)  # the same bits, a wire dtype
    return wire.SecAggMasked(run_id=ctx.run_id, round=ctx.round_no, attempt=ctx.attempt, sender=masked.sender,
                             ring_bits=fixed.bits,
                             fraction_bits=fixed.fraction_bits, clip=fixed.clip,
                             masked=TensorBlob.from_numpy(MASKED_TENSOR, signed), paired_with=masked.paired_with)


def masked_from_wire(message: wire.SecAggMasked, fixed: FixedPoint) -> msg.MaskedInput:
    """The record, if the sender used this round's ring (ValueError otherwise: it cannot be added to the others)."""
    if (message.ring_bits, message.fraction_bits, message.clip) != (fixed.bits, fixed.fraction_bits, fixed.clip):
        raise ValueError(f"{message.sender} encoded with ring ({message.ring_bits}, {message.fraction_bits}, "
                         f"{message.clip}), the round's is ({fixed.bits}, {fixed.fraction_bits}, {fixed.clip})")
    vector = message.masked.to_numpy().view(fixed.dtype).copy()
    return msg.MaskedInput(message.sender, vector, message.paired_with)


def unmask_to_wire(ctx: RoundContext, site: str, request: msg.UnmaskRequest) -> wire.SecAggUnmask:
    return wire.SecAggUnmask(run_id=ctx.run_id, round=ctx.round_no, attempt=ctx.attempt, sender=PS, site_id=site,
                             survivors=request.survivors,
                             dropped=request.dropped)


def unmask_from_wire(message: wire.SecAggUnmask) -> msg.UnmaskRequest:
    return msg.UnmaskRequest(message.survivors, message.dropped)


def _answers(shares: dict[str, tuple[int, bytes]]) -> tuple[wire.ShareAnswer, ...]:
    return tuple(wire.ShareAnswer(owner=o, index=x, share=s) for o, (x, s) in sorted(shares.items()))


def answer_to_wire(ctx: RoundContext, answer: msg.UnmaskAnswer) -> wire.SecAggAnswer:
    return wire.SecAggAnswer(run_id=ctx.run_id, round=ctx.round_no, attempt=ctx.attempt, sender=answer.sender,
                             seed_shares=_answers(answer.seed_shares),
                             mask_key_shares=_answers(answer.mask_key_shares))


def answer_from_wire(message: wire.SecAggAnswer) -> msg.UnmaskAnswer:
    return msg.UnmaskAnswer(message.sender, {a.owner: (a.index, a.share) for a in message.seed_shares},
                            {a.owner: (a.index, a.share) for a in message.mask_key_shares})
