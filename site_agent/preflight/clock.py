"""Is this host's clock close to the federation's? Compared with the PS's clock, the one reference a site may
read: every message carries `sent_at`, and the site's ACL lets it read `ps/status` (Mosquitto's `$SYS` topics
are not readable by sites, and say the broker's uptime, not its time).

A status delivered live (not a retained replay) was sent a moment ago: received_at - sent_at is the offset of the
two clocks plus the network delay, which only adds. A retained status may be old (the PS publishes on changes):
it proves this clock behind the PS's when it lies in our future, and shows agreement when it is from just now;
an older one bounds the offset from one side only, and the check says it has no current reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from site_agent.preflight.findings import Finding, failed, passed, warned

CLOCK = "clock"
AGREE_S = 5.0  # a status may be held up to a second before it is sent, and the network adds its delay
# broker/certs.py issues certificates valid from 5 minutes before their making: a clock further behind refuses a
# fresh certificate ("not yet valid"), and timestamps in logs, status and the audit trail stop lining up.
FAIL_S = 300.0
SYNC_FIX = ("Turn on time synchronisation on this host (`timedatectl set-ntp true`, or chrony/ntpd pointed at the "
            "hospital's time server); `timedatectl` must then say 'System clock synchronized: yes'.")


@dataclass(frozen=True)
class StatusSample:
    sent_at: float  # by the PS's clock
    received_at: float  # by this host's clock
    live: bool  # delivered as it was published (not a retained replay)


def assess_clock(samples: list[StatusSample]) -> Finding:
    live = [s for s in samples if s.live]
    if live:
        offset = min(s.received_at - s.sent_at for s in live)  # the delay only adds: the smallest is closest
        return _verdict(offset, "live ps/status", exact=True)
    if not samples:
        return warned(CLOCK, "no reference: no status of the PS to compare with",
                      f"{SYNC_FIX} Run the check again once the PS is up to measure.", reference=None)
    newest = max(samples, key=lambda s: s.sent_at)
    delta = newest.received_at - newest.sent_at
    if delta < -AGREE_S:  # sent in our future: this clock is behind by at least that much
        return _verdict(delta, "retained ps/status", exact=False)
    if delta <= AGREE_S:
        return _verdict(delta, "retained ps/status from just now", exact=True)
    return warned(CLOCK, f"no current reference: the PS's newest status was sent {_duration(delta)} ago by this "
                  "clock (the PS publishes on changes), so the clocks agree only to within that",
                  f"{SYNC_FIX} Run the check again while the PS is running a round to measure.",
                  reference="retained ps/status", age_s=round(delta, 3))


def _verdict(offset: float, reference: str, *, exact: bool) -> Finding:
    """offset > 0: this host's clock is ahead of the PS's."""
    bound = "" if exact else "at least "
    side = "ahead of" if offset > 0 else "behind"
    facts = {"reference": reference, "offset_s": round(offset, 3), "exact": exact}
    if abs(offset) <= AGREE_S:
        return passed(CLOCK, f"within {AGREE_S:.0f} s of the PS's clock ({offset:+.1f} s, {reference})", **facts)
    found = f"this host's clock is {bound}{_duration(abs(offset))} {side} the PS's ({reference})"
    if abs(offset) <= FAIL_S:
        return warned(CLOCK, found, f"{SYNC_FIX} Logs, status times and the audit trail of the two hosts will "
                      "not line up until then.", **facts)
    return failed(CLOCK, found, f"{SYNC_FIX} Beyond {FAIL_S / 60:.0f} minutes, certificates issued now are not yet "
                  "valid for one of the two hosts.", **facts)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"
