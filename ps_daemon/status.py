"""What the PS says about itself: ps/status (throttled), the refusals it counts there, and its reminders."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Literal

from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from ps_daemon.config import DaemonConfig
from ps_daemon.machine import dropped, missing_validation
from ps_daemon.state import DaemonState, Phase, RoundRecord
from ps_daemon.turns import UploadTurns
from schemas import messages as m

log = logging.getLogger("fedmqtt.ps")
PS = "ps"  # the sender of every message the PS publishes
REMIND_S = 30.0  # a waiting PS says what it waits for at least this often
STATUS_REFRESH_S = 5.0  # new rejection counts reach ps/status at most this often (a flood must not echo)
# Progress within one phase and round ("k/N updates") reaches ps/status at most this often: every site and
# observer receives each status, so one per update would cost N^2 messages a round (500 sites: 250,000).
# A change of phase or round goes out at once; the newest progress follows within this time.
STATUS_PROGRESS_S = 1.0
MAX_REASONS_SHOWN = 8  # per site in ps/status

StatusState = Phase | Literal["offline", "error"]  # what ps/status may say the PS is doing


def few_sites(sites: list[str], shown: int = 8) -> str:
    """A bounded list of site names for a log line (hundreds of sites may wait)."""
    more = f" and {len(sites) - shown} more" if len(sites) > shown else ""
    return (", ".join(sites[:shown]) or "nobody") + more


def status_message(config: DaemonConfig, state: StatusState, round_no: int = 0, *, session: str,
                   rejected: dict[str, dict[str, int]], **kw: Any) -> m.DaemonStatus:
    c = config
    return m.DaemonStatus(run_id=c.run_id, sender=PS, round=round_no, state=state, algorithm=c.algorithm,
                          rounds_total=c.rounds, sites_expected=c.sorted_sites, session=session,
                          selection_metric=c.selection_metric, quorum=c.quorum, min_sites=c.start_sites,
                          rejected=rejected, secure_aggregation=c.secure_aggregation.enabled, **kw)


def secure_note(record: RoundRecord | None) -> m.SecureRoundNote | None:
    """A closed round's secure aggregation in numbers (None in the clear)."""
    if record is None or not record.secure:
        return None
    s = record.secure
    return m.SecureRoundNote(round=record.round, included=len(s.get("included", ())),
                             dropped=len(s.get("dropped", ())), recovered=len(s.get("recovered", ())),
                             tries=int(s.get("tries", 1)), clipped=len(s.get("clipped", ())))


class StatusBoard:
    """Publishes ps/status: a change of phase or round at once, progress and new refusal counts at a bounded
    pace; counts the PS's own refusals beside the channel's."""

    def __init__(self, config: DaemonConfig, channel: Channel, turns: UploadTurns) -> None:
        self.config = config
        self.channel = channel
        self.turns = turns
        self.rejections: dict[str, Counter[str]] = {}  # site -> reason -> count, refused by the PS itself
        self._shown_rejections: dict[str, dict[str, int]] = {}
        self._refreshed_at = 0.0
        self._last: m.DaemonStatus | None = None
        self._sent_at = 0.0
        self._held: m.DaemonStatus | None = None  # progress held back by STATUS_PROGRESS_S
        # Record-level DP: what each site reported with its newest accepted update (shown on every status).
        self.epsilon: dict[str, m.PrivacySpent] = {}

    def message(self, state: StatusState, round_no: int = 0, *, session: str, **kw: Any) -> m.DaemonStatus:
        return status_message(self.config, state, round_no, session=session, rejected=self.rejection_summary(),
                              **kw)

    def refuse(self, site: str, category: str, detail: str, *, exc_info: BaseException | None = None) -> None:
        """Count one refused message (the state is left exactly as it was) and log it at the bounded rate of the
        channel's refusals (`fedmqtt.logs.RefusalLog`), so one summary per site covers both."""
        self.rejections.setdefault(site, Counter())[category] += 1
        self.channel.refusals.refused(site, category, log, "refused a message from %s: %s", site, detail[:300],
                                      exc_info=exc_info)

    def rejection_summary(self) -> dict[str, dict[str, int]]:
        """Refused messages per site and reason: the channel's (malformed, spoofed, ...) and the PS's own
        (wrong round, duplicate, wrong layout, ...). Only the most frequent reasons per site, so it stays small."""
        merged: dict[str, Counter[str]] = {}
        for source in (self.channel.stats.rejected_by_site, self.rejections):
            for site, reasons in source.items():
                merged.setdefault(site, Counter()).update(reasons)
        return {site: dict(c.most_common(MAX_REASONS_SHOWN)) for site, c in sorted(merged.items())}

    def publish(self, msg: m.DaemonStatus) -> None:
        """Publish a change of phase or round, or a newly dropped site, now; hold progress within the same phase
        and round back to one status per STATUS_PROGRESS_S (the newest one wins, see send_held)."""
        last = self._last
        # A site newly left out of the round (offline, refused by its policy) is news, not progress: it goes out at
        # once, so a round that closes within the hold still shows who it went on without. Bounded by the sites.
        progress = last is not None and (last.state, last.round) == (msg.state, msg.round) and \
            set(msg.dropped) <= set(last.dropped)
        if progress and time.monotonic() - self._sent_at < STATUS_PROGRESS_S:
            self._held = msg
            return
        self._send(msg)

    def send_held(self) -> None:
        if self._held is not None and time.monotonic() - self._sent_at >= STATUS_PROGRESS_S:
            self._send(self._held)

    def republish(self) -> None:
        """The newest status again, now (throttled as progress): the upload turns it lists have changed."""
        base = self._held or self._last
        if base is not None:
            self.publish(base.model_copy(update={"sent_at": time.time()}))

    def refresh_rejections(self) -> None:
        """Publish new rejection counts (at most every STATUS_REFRESH_S), so operators see who sends what."""
        now = time.monotonic()
        if self._last is None or now - self._refreshed_at < STATUS_REFRESH_S:
            return
        summary = self.rejection_summary()
        if summary == self._shown_rejections:
            return
        status = self._last.model_copy(update={"rejected": summary, "sent_at": time.time()})
        self.channel.send(topics.ps_status_topic(self.config.run_id), status)
        self._last, self._shown_rejections, self._refreshed_at = status, summary, now

    def _send(self, msg: m.DaemonStatus) -> None:
        msg = msg.model_copy(update={"upload_turns": self.turns.view(), "epsilon": dict(sorted(self.epsilon.items()))})
        self.channel.send(topics.ps_status_topic(self.config.run_id), msg)
        self._last, self._held, self._sent_at = msg, None, time.monotonic()


class Reminders:
    """Nothing waits in silence: every REMIND_S the PS logs what it waits for and who is missing."""

    def __init__(self, config: DaemonConfig, turns: UploadTurns) -> None:
        self.config = config
        self.turns = turns
        self._reminded_at = time.monotonic()

    def remind(self, s: DaemonState) -> None:
        now = time.monotonic()
        if now - self._reminded_at < REMIND_S:
            return
        self._reminded_at = now
        c = self.config
        online = sorted(s.online)
        if s.phase == "waiting_for_sites":
            missing = [x for x in c.sorted_sites if x not in s.online]
            log.info("waiting for sites: %d/%d online (need %d to start); missing: %s", len(online),
                     len(c.sites), c.start_sites, ", ".join(missing) or "none")
            return
        answered = s.updates if s.phase == "training" else s.final_reports
        # the same truth as ps/status: a site seen going offline is not waited for, it is dropped (with why)
        missing = [x for x in s.selected if x not in answered and x not in s.offline]
        away = dropped(s)
        left = f"{s.deadline - time.time():.0f} s" if s.deadline else "none"
        what = f"round {s.round}/{c.rounds}" if s.phase == "training" else "the final evaluation"
        log.info("%s: %d/%d answers; waiting for %s (not heard from: %s); dropped: %s; deadline in %s", what,
                 len(answered), len(answered) + len(missing), few_sites(missing),
                 few_sites([x for x in missing if x not in s.online]),
                 few_sites([f"{x} ({why})" for x, why in sorted(away.items())]), left)
        if unvalidated := [x for x in missing_validation(c, s) if x not in s.selected]:
            log.info("round %d/%d: waiting for the validation of the round's model (evaluation = \"all\") from %s",
                     s.round, c.rounds, few_sites(unvalidated))
        if self.turns.ready:
            log.info("upload turns: %s; waiting for a turn: %s", ", ".join(self.turns.view()) or "none",
                     few_sites(self.turns.waiting()))
