"""A site's secure aggregation of one training round, message in, message out (docs/secure-aggregation.md).

Between the agent and the protocol's `SiteSession`: it turns the PS's wire messages (roster, inbox, unmasking
request) into this site's answers (shares, masked input, answer), keeps the round's secrets and every received
message in the site's state folder before answering (site_agent/secagg_store.py), and rebuilds itself from there
after a restart. No MQTT here: the agent (site_agent/agent.py) publishes what it returns.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedmqtt.secagg import messages as msg
from fedmqtt.secagg import wire as conv
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.site import SecAggRefused, SiteSecrets, SiteSession
from fedmqtt.secagg.skellam import SkellamPlan, change_vector, noise_key, reach_problem, site_noise
from fedmqtt.secagg.weighted import Layout, weighted_vector
from fedmqtt.transport.signing import Identity
from schemas import secagg as wire
from site_agent.distributed_dp import own_share
from site_agent.secagg_store import RoundRecord, SecAggStore, pack_message, unpack_message


class SiteRound:
    """This site's part in one try of round `round_no` of session `session`, under `terms`; `label_mask`: which
    labels it annotates (site_agent/label_set.py), needed when the layout sums output rows label by label."""

    def __init__(self, store: SecAggStore, identity: Identity, *, run_id: str, session: str, round_no: int,
                 terms: wire.SecAggTerms, layout: Layout, label_mask: np.ndarray | None = None,
                 min_noise_multiplier: float | None = None) -> None:
        if identity.private_key is None:
            raise ValueError(f"{identity.party!r} holds no signing key: it cannot advertise keys")
        self.store, self.site, self.session = store, identity.party, session
        self.ctx = RoundContext(run_id, round_no, terms.attempt)
        self.layout, self.weight_bound, self.work_bound = layout, terms.weight_bound, terms.work_bound
        self.label_mask = label_mask
        self.uniform = terms.uniform  # the rule needs the plain mean: this site weighs by 1, not by its count
        self.fixed = FixedPoint(terms.clip, terms.fraction_bits, terms.ring_bits, max_sites=terms.max_sites)
        self.dp_terms, self.fraction_bits = terms.distributed_dp, terms.fraction_bits
        self.min_noise_multiplier = min_noise_multiplier  # this site's policy: its share never carries less
        self.rostered: int | None = None  # the sites in the round's roster, once it is here
        record = store.load(session, round_no, terms.attempt)
        secrets = SiteSecrets.from_bytes(record.secrets) if record is not None else SiteSecrets.fresh()
        self.session_state = SiteSession(self.ctx, self.site, identity.private_key, identity.ring, self.fixed,
                                         layout.length, dropout=terms.dropout, secrets=secrets)
        self.record = record or RoundRecord(session=session, round=round_no, attempt=terms.attempt,
                                            secrets=secrets.to_bytes())
        if record is None:
            store.save(self.record)  # the secrets are on disk before the advertisement commits to them
        else:
            self._resume(record)

    def _resume(self, record: RoundRecord) -> None:
        roster = unpack_message(record.roster, wire.SecAggRoster)
        if roster is None:
            return
        inbox = unpack_message(record.inbox, wire.SecAggInbox)
        request = unpack_message(record.request, wire.SecAggUnmask)
        assert isinstance(roster, wire.SecAggRoster)
        self.rostered = len(roster.sites)
        self.session_state.resume(
            conv.roster_from_wire(roster),
            conv.inbox_from_wire(inbox) if isinstance(inbox, wire.SecAggInbox) else None,
            conv.unmask_from_wire(request) if isinstance(request, wire.SecAggUnmask) else None)

    @property
    def dp(self) -> SkellamPlan | None:
        """DP-FedAvg's noise added here, in the ring (fedmqtt/secagg/skellam.py): the PS's share, raised to what
        this site's policy demands of the sites in the round's roster (site_agent/distributed_dp.py, `own_share`);
        None without distributed DP. ValueError: terms no sampler can serve (the agent refuses the round with the
        reason)."""
        dp = self.dp_terms
        if dp is None:
            return None
        asked = SkellamPlan(dp.clip, dp.noise_multiplier, dp.expected_sites, self.fraction_bits, self.layout.floats,
                            dp.count_stddev)
        return own_share(asked, self.min_noise_multiplier, self.rostered)

    @property
    def stage(self) -> str:
        return self.session_state.stage

    def advert(self) -> wire.SecAggAdvert:
        """Step 0 (the same message again after a restart: Ed25519 signatures are deterministic)."""
        return conv.advert_to_wire(self.ctx, self.session_state.advertise())

    def on_roster(self, roster: wire.SecAggRoster) -> wire.SecAggShares | None:
        """Step 1: the sealed shares for the neighbours; None when this site's shares already went out (a PS
        that re-sent the roster): shares are made once, the PS holds them. SecAggRefused: leave the round."""
        if self.record.roster is not None:
            return None
        self._keep(roster=pack_message(roster))
        self.rostered = len(roster.sites)
        return conv.shares_to_wire(self.ctx, self.session_state.share(conv.roster_from_wire(roster)))

    def on_inbox(self, inbox: wire.SecAggInbox, tensors: Mapping[str, np.ndarray],
                 n_samples: int, variates: Mapping[str, np.ndarray] | None = None,
                 work: tuple[float, float, float] | None = None) -> wire.SecAggMasked:
        """Step 2: the masked weighted vector of this site's trained tensors (and, when the layout has them, its
        control-variate deltas); under distributed DP, `tensors` is the model change, which is clipped and gets
        this site's share of the noise (fedmqtt/secagg/skellam.py). Deterministic given the inbox and the tensors
        (the noise too: its key comes from the round's kept secret), so after a restart the same input gives the
        same bits (the PS ignores the copy)."""
        noise = None
        if self.dp is not None:  # `tensors` is the model change: clipped, then noised in the ring
            if problem := reach_problem(self.dp, self.fixed.max_sites, self.fixed.bits):
                raise SecAggRefused(msg.MALFORMED, problem)
            vector = change_vector(tensors, self.layout, self.dp.clip, count=bool(self.dp.count_stddev))
            key = noise_key(self.ctx, self.session_state.secrets.cipher_private, self.site)
            noise = site_noise(self.dp, key, self.layout)
        else:
            vector = weighted_vector(tensors, self.layout, 1 if self.uniform else n_samples, self.weight_bound,
                                     variates, work, self.label_mask)
        packed = pack_message(inbox)
        if self.record.inbox is None:
            self._keep(inbox=packed)
        elif packed != self.record.inbox:
            raise SecAggRefused(msg.EQUIVOCATION, "a second, different inbox for this round: masking again with it "
                                "could pair with other neighbours than the first masked input")
        elif self.stage == "masked":  # resumed past this step: the same inbox and tensors give the same bits
            self.session_state.stage = "shared"
        masked = self.session_state.mask(vector, conv.inbox_from_wire(inbox), noise)
        return conv.masked_to_wire(self.ctx, masked, self.fixed)

    def clipped(self, tensors: Mapping[str, np.ndarray], n_samples: int,
                variates: Mapping[str, np.ndarray] | None = None,
                work: tuple[float, float, float] | None = None) -> int:
        """How many coordinates of the vector `on_inbox` would mask (same arguments) lie outside the ring's
        [-clip, clip]: the encoding clips them, so the sum is then off by more than the encoding's bound."""
        if self.dp is not None:  # under distributed DP the masked vector is the clipped model change
            vector = change_vector(tensors, self.layout, self.dp.clip, count=bool(self.dp.count_stddev))
        else:
            vector = weighted_vector(tensors, self.layout, 1 if self.uniform else n_samples, self.weight_bound,
                                     variates, work, self.label_mask)
        return int(np.count_nonzero(np.abs(vector) > self.fixed.clip))

    def on_unmask(self, request: wire.SecAggUnmask) -> wire.SecAggAnswer:
        """Step 3: the shares asked for. The request is kept before the answer leaves, so after a restart only
        the same request is answered (SecAggRefused for another)."""
        if self.record.request is None:
            self._keep(request=pack_message(request))
        answer = self.session_state.unmask(conv.unmask_from_wire(request))
        return conv.answer_to_wire(self.ctx, answer)

    def _keep(self, **changes: bytes) -> None:
        self.record = self.record.model_copy(update=changes)
        self.store.save(self.record)
