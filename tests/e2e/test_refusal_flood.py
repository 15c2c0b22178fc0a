"""A flood of junk from one site's valid credentials: every message is counted, but the PS log grows by a bounded
number of lines (before, 2,000 junk messages wrote 2,000 log lines in a second: about 1 GB an hour)."""

from __future__ import annotations

import re
import time

import msgpack
import pytest
from harness import CliFederation

from fedmqtt.transport import topics
from schemas import messages as m

pytestmark = pytest.mark.e2e
RUN = "e2e-flood"
SITE = "cleveland"
FLOOD = 2000
BATCH = 100  # published, then acknowledged by the broker, before the next: the PS's queue never overflows


def _log_lines(fed: CliFederation) -> list[str]:
    return (fed.logs / "ps.log").read_text(errors="replace").splitlines()


def test_a_flood_of_junk_is_counted_in_full_and_logged_at_a_bounded_rate(cli_federation, paho_client) -> None:  # noqa: ANN001
    # Prepare: broker and PS up (waiting for sites), a client with cleveland's own credentials.
    fed = cli_federation("flood", run_id=RUN, rounds=1, sites=(SITE, "hungary"))
    fed.start_broker()
    fed.start_ps()
    fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus), 60, "the PS's first status")
    lines_before = len(_log_lines(fed))
    junk = paho_client(fed.layout.settings(SITE))
    seal = fed.layout.identity(SITE).seal
    update = topics.site_update_topic(RUN, SITE)
    wrong_version = msgpack.packb({"kind": "client_update", "schema_version": 99, "run_id": RUN, "sender": SITE})

    # Execute: half garbage bytes, half a message of a schema version that does not exist.
    start = time.monotonic()
    for first in range(0, FLOOD, BATCH):
        # signed with the site's own key, as a compromised or buggy site would send them: past the signature check
        sent = [junk.publish(update, seal(update, b"\x00junk %d" % i if i % 2 else wrong_version), qos=1)
                for i in range(first, first + BATCH)]
        for info in sent:
            info.wait_for_publish(10)
        time.sleep(0.05)
    status = fed.wait_message(lambda msg: isinstance(msg, m.DaemonStatus) and sum(
        msg.rejected.get(SITE, {}).values()) >= FLOOD, 60, f"ps/status counting {FLOOD} refusals")
    flood_s = time.monotonic() - start
    fed.stop_all()  # SIGTERM: the PS writes what it still holds back

    # Assert: every message counted; the log grew by a few lines per reason and a summary per interval.
    assert isinstance(status, m.DaemonStatus)
    assert status.rejected[SITE] == {"malformed": FLOOD // 2, "wrong version": FLOOD // 2}
    grown = _log_lines(fed)[lines_before:]
    verbatim = [line for line in grown if "rejected (" in line]
    summaries = [match for line in grown
                 if (match := re.search(rf"{SITE}: ([\d,]+) more refusals \((.*)\) in the last \d+ s", line))]
    assert 1 <= len(summaries) <= flood_s // 60 + 2, "\n".join(grown)
    assert 0 < len(verbatim) <= 10 * len(summaries), f"{len(verbatim)} refusal lines in {flood_s:.0f} s"
    assert len(verbatim) + sum(int(s.group(1).replace(",", "")) for s in summaries) == FLOOD
    assert all("malformed: " in s.group(2) and "wrong version: " in s.group(2) for s in summaries)
    assert len(grown) <= 40, "\n".join(grown[:60])
