"""What arrives -> what happened: a checked message becomes at most one machine event, or a counted refusal."""

from __future__ import annotations

import logging
import time
from typing import Any

from fedmqtt.faults import crash_point
from fedmqtt.recruitment import histogram_vector
from fedmqtt.strategies import SiteUpdate
from fedmqtt.transport import topics
from fedmqtt.transport.channel import BridgeState, Channel, Inbound
from fedmqtt.transport.topics import ParsedTopic
from ps_daemon import feature_gate
from ps_daemon.admission import histogram_rejection, manifest_rejection, report_rejection, update_rejection
from ps_daemon.config import DaemonConfig
from ps_daemon.events import (
    Event,
    FeatureSummaryReceived,
    ReportReceived,
    RoundValidated,
    SecAggReceived,
    SiteOffline,
    SiteOnline,
    UpdateReceived,
)
from ps_daemon.liveness import AGENT, BRIDGE, SiteLiveness
from ps_daemon.machine import Machine
from ps_daemon.refusals import FEATURE_SUMMARY_REFUSED, refusal_category
from ps_daemon.spool import UpdateSpool
from ps_daemon.state import DaemonState
from ps_daemon.status import StatusBoard
from ps_daemon.turns import UploadTurns
from schemas import messages as m
from schemas import secagg as sw
from schemas.chunks import ChunkManifest
from schemas.feature_stats import FeatureSummary
from schemas.messages import ROUND_VALIDATION_TAG
from schemas.tensors import blobs_to_arrays

log = logging.getLogger("fedmqtt.ps")

# Whatever a message holds, the PS keeps serving: content it cannot use raises one of these while it is turned
# into an event or stepped, and is refused with the reason; the machine is pure, so the state stays as it was.
UNUSABLE_CONTENT = (KeyError, ValueError, TypeError, ArithmeticError, OverflowError)
SECAGG_FROM_SITES = (sw.SecAggAdvert, sw.SecAggShares, sw.SecAggMasked, sw.SecAggAnswer)


def _as_tuple(values: list[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(values)


def _update_extras(msg: m.ClientUpdate) -> dict[str, Any]:
    """What an update carries besides its tensors, as the strategies read it."""
    extras: dict[str, Any] = dict(msg.scalars)
    if msg.control_variates:
        extras["delta_c"] = blobs_to_arrays(msg.control_variates)
    if msg.label_histogram is not None:
        extras["label_histogram"] = dict(msg.label_histogram)
    if msg.label_set is not None:  # FedFBN surgical: the output rows its site annotates (admission checked them)
        extras["label_set"] = tuple(msg.label_set)
    if msg.layer_stats:
        flat = blobs_to_arrays(msg.layer_stats)
        layers = sorted({name.rsplit("/", 1)[0] for name in flat})
        try:
            extras["feature_stats"] = {k: (flat[f"{k}/mean"], flat[f"{k}/var"]) for k in layers}
        except KeyError as exc:
            raise ValueError(f"feature_stats lacks {exc.args[0]!r}") from None
    return extras


class InboundEvents:
    """Judges each arrived message against the current state; an accepted update's tensors go to the spool.

    `usage` and `update_bytes` (round -> site -> ...) are filled here for each accepted update and read by the
    round's metrics and the report."""

    def __init__(self, config: DaemonConfig, machine: Machine, channel: Channel, spool: UpdateSpool,
                 turns: UploadTurns, status: StatusBoard, *, usage: dict[int, dict[str, dict[str, Any]]],
                 update_bytes: dict[int, dict[str, int]]) -> None:
        self.config = config
        self.machine = machine
        self.channel = channel
        self.spool = spool
        self.turns = turns
        self.status = status
        self.usage = usage
        self.update_bytes = update_bytes
        self.liveness = SiteLiveness()  # which down-signals are still true (a broker restart replays old ones)

    def event_of(self, state: DaemonState, arrived: Inbound) -> Event | None:
        """One checked message -> at most one event (None: nothing to do, or refused)."""
        try:
            return self._to_event(state, arrived)
        except UNUSABLE_CONTENT as exc:
            self.refuse_unusable(arrived.topic.site_id or "?", arrived.topic, exc)
            return None

    def refuse_unusable(self, site: str, topic: object, exc: BaseException) -> None:
        # With its traceback: the checks let it through, yet the machine could not use it (a bug to look at). At
        # the bounded rate of every refusal, so a site that found such a message cannot flood the log with it.
        self.status.refuse(site, "unusable content", f"{type(exc).__name__}: {exc} (on {topic})", exc_info=exc)

    def believed_offline(self, now: float) -> list[SiteOffline]:
        """Down-signals that outlived their grace with the PS connected all along (ps_daemon.liveness)."""
        transport = self.channel.transport
        for ev in (found := self.liveness.believed(now, transport.connects, transport.connected)):
            log.warning("site %s: still down %.0f s after its Will: offline", ev.site_id, now - (ev.since or now))
        return found

    def admit_manifest(self, state: DaemonState, parsed: ParsedTopic, manifest: ChunkManifest) -> str | None:
        """The channel asks before fetching a chunked message; a reason refuses it (counted by the channel)."""
        site = parsed.site_id
        why = manifest_rejection(self.machine, state, site, parsed.kind, manifest)
        if why is not None and parsed.kind == "update" and site is not None and manifest.round == state.round:
            self.turns.forget(site)  # a refused upload ends its turn, as a refused update does
        return why

    def _to_event(self, state: DaemonState, arrived: Inbound) -> Event | None:
        msg, site, now = arrived.message, arrived.topic.site_id, time.time()
        if site is None:
            return None
        known = site in self.config.sites  # the liveness book is kept for the configured sites only
        if isinstance(msg, BridgeState):
            if msg.up:
                log.info("site %s: its hospital broker's bridge is up", site)
                return self.liveness.bridge_up(site, now) if known else None
            log.warning("site %s: its hospital broker or the link to it is down (bridge notification)", site)
            if not known:
                return SiteOffline(site, now)
            self._down(site, BRIDGE, now)
            return None
        if isinstance(msg, m.SiteStatus):
            return self._site_status_event(site, msg, now)
        if isinstance(msg, m.ClientUpdate):
            return self._update_event(state, site, msg, arrived, now)
        if isinstance(msg, SECAGG_FROM_SITES):
            if arrived.chunks:  # a chunked masked input: the PS holds it now, the broker need not
                self.channel.clear_received(topics.site_update_topic(self.config.run_id, site), arrived.chunks)
            if site in self.config.sites:
                self.liveness.heard_from(site)
            return SecAggReceived(site, now, msg.round, msg)
        if isinstance(msg, FeatureSummary):
            return self._summary_event(state, site, msg, now)
        if isinstance(msg, m.EvalReport):
            why = report_rejection(state, site, msg, self.machine.validation_sites(state))
            if why is not None:
                self.status.refuse(site, refusal_category(why), f"report for round {msg.round}: {why}")
                return None
            if msg.tag == ROUND_VALIDATION_TAG:  # evaluation = "all": a site's validation of the open round's model
                if site in self.config.sites:
                    self.liveness.heard_from(site)
                return RoundValidated(now, msg.round, msg.model_hash, {site: dict(msg.metrics["val"])})
            return ReportReceived(site, now, msg.round, msg.model_hash, msg.tag, msg.metrics, msg.n_samples,
                                  msg.undefined, msg.best_round)
        return None

    def _summary_event(self, state: DaemonState, site: str, msg: FeatureSummary, now: float) -> Event | None:
        """Judged before the machine sees it, so that every refusal is counted (a copy of a summary combined
        already is no refusal: the broker replays retained summaries after a reconnect)."""
        if state.feature_summaries.get(site) == msg or feature_gate.already_combined(state.feature_statistics, site):
            return None
        why = feature_gate.summary_rejection(self.config, state.feature_summaries, state.feature_statistics, site, msg)
        if why is not None:
            self.status.refuse(site, FEATURE_SUMMARY_REFUSED, f"feature summary: {why}")
            return None
        return FeatureSummaryReceived(site, now, msg)

    def _down(self, site: str, source: str, now: float) -> None:
        """Held until believed (`believed_offline`): it may be an echo of a broker restart."""
        self.liveness.down(site, source, now, self.channel.transport.connects)

    def _site_status_event(self, site: str, msg: m.SiteStatus, now: float) -> Event | None:
        known = site in self.config.sites
        if msg.state == "offline":
            self.turns.forget(site)
            if known:
                log.info("site %s: says it is offline (%s)", site, msg.detail[:200] or "its Will")
                self._down(site, AGENT, now)
                return None
            return SiteOffline(site, now)
        if msg.state == "update_ready":
            # the size only lengthens the grace of an unused turn: never beyond the largest update we take
            self.turns.announce(site, msg.round, min(msg.update_bytes, self.channel.max_bytes), now)
        if msg.state == "error":
            log.warning("site %s reports an error: %s", site, msg.detail[:500])
        if msg.label_histogram is not None and (why := histogram_rejection(msg.label_histogram)):
            self.status.refuse(site, "bad histogram", f"status: {why}")
            return None
        online = SiteOnline(site, now, msg.n_train, _as_tuple(histogram_vector(msg.label_histogram)),
                            msg.privacy_policy, error=(msg.detail or "error") if msg.state == "error" else "")
        if known:
            self.liveness.status_up(online)
        return online

    def _update_event(self, state: DaemonState, site: str, msg: m.ClientUpdate, arrived: Inbound,
                      now: float) -> Event | None:
        if msg.round == state.round:
            self.turns.forget(site)  # accepted or refused, its turn is over (an old round's copy changes nothing)
        why = update_rejection(self.machine, state, site, msg)
        if why is not None:  # judged before anything is stored: first wins, nothing on disk for other rounds
            self.status.refuse(site, refusal_category(why), f"update for round {msg.round}: {why}")
            return None
        extras = _update_extras(msg)
        if msg.usage is not None:
            self.usage.setdefault(msg.round, {})[site] = msg.usage.model_dump()
        self.update_bytes.setdefault(msg.round, {})[site] = arrived.size
        if msg.privacy is not None:
            self.status.epsilon[site] = msg.privacy
            log.info("site %s: record-level DP has spent epsilon %.3g at delta %g (%s accountant)", site,
                     msg.privacy.epsilon, msg.privacy.delta, msg.privacy.accountant)
        tensors = self.spool.put(msg.round, site, msg.tensors)  # accepted: stored atomically, message dropped
        if arrived.chunks:  # it came in an upload turn: the site keeps it on disk and answers a new turn
            self.channel.clear_received(topics.site_update_topic(self.config.run_id, site), arrived.chunks)
            crash_point("after_update_cleared", msg.round)
        update = SiteUpdate(site, tensors, msg.n_samples, msg.local_steps, extras)
        if site in self.config.sites:
            # Accepted: a sign of life. A refused message is none (whoever holds the site's credentials can send
            # those, also after saying "offline").
            self.liveness.heard_from(site)
        return UpdateReceived(site, now, msg.round, msg.base_model_hash, update, msg.train_loss,
                              msg.val_metrics, msg.undefined, msg.no_step_reason)
