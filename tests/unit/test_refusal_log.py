"""Refusals are logged at a bounded rate: the first few per party and reason as they come, then one summary per
party and interval; a flood of junk cannot fill the disk (2,000 junk messages wrote 2,000 lines a second)."""

from __future__ import annotations

import logging

import pytest
from signed_wire import identity, signed

from fedmqtt.logs import MAX_REFUSING_PARTIES, OTHER_PARTIES, REFUSALS_VERBATIM, RefusalLog, summary_line
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.memory import SIMULATION_SETTINGS, MemoryBroker, MemoryTransport
from fedmqtt.transport.mqtt import RawMessage

LOG = logging.getLogger("test.refusals")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_the_first_few_per_party_and_reason_verbatim_then_one_summary_per_interval(caplog) -> None:
    # Prepare
    clock = Clock()
    refusals = RefusalLog(LOG, verbatim=3, interval_s=60, clock=clock)
    caplog.set_level(logging.WARNING)

    # Execute: 1,900 of one reason and 87 of another from site-a, 2 from site-b, within one interval
    for i in range(1900):
        refusals.refused("site-a", "wrong layout", LOG, "layout %d", i)
    for i in range(87):
        refusals.refused("site-a", "too large", LOG, "large %d", i)
    refusals.refused("site-b", "malformed", LOG, "junk")
    refusals.refused("site-b", "malformed", LOG, "junk")
    clock.now += 59
    refusals.flush()
    before_the_end = _messages(caplog)
    clock.now += 1
    refusals.flush()

    # Assert
    assert before_the_end == ["layout 0", "layout 1", "layout 2", "large 0", "large 1", "large 2", "junk", "junk"]
    assert _messages(caplog)[8:] == ["site-a: 1,981 more refusals (wrong layout: 1,897, too large: 84) in the last "
                                     "60 s"]  # site-b held nothing back: no summary for it


def test_a_new_interval_shows_a_few_again_and_close_says_what_was_held_back(caplog) -> None:
    # Prepare
    clock = Clock()
    refusals = RefusalLog(LOG, verbatim=1, interval_s=60, clock=clock)
    caplog.set_level(logging.WARNING)
    for i in range(5):
        refusals.refused("site-a", "malformed", LOG, "first %d", i)
    clock.now += 61

    # Execute: the next refusal ends the old interval (summary first) and opens a new one
    for i in range(3):
        refusals.refused("site-a", "malformed", LOG, "second %d", i)
    clock.now += 10
    refusals.close()

    # Assert
    assert _messages(caplog) == ["first 0", "site-a: 4 more refusals (malformed: 4) in the last 61 s", "second 0",
                                 "site-a: 2 more refusals (malformed: 2) in the last 10 s"]


def test_parties_beyond_the_bound_share_one_entry() -> None:
    clock = Clock()
    refusals = RefusalLog(LOG, verbatim=0, interval_s=60, clock=clock)
    for i in range(MAX_REFUSING_PARTIES + 50):
        refusals.refused(f"p{i}", "malformed", LOG, "x")
    assert len(refusals._windows) == MAX_REFUSING_PARTIES + 1
    assert sum(refusals._windows[OTHER_PARTIES].held_back.values()) == 50


def test_summary_names_the_most_frequent_reasons_first_and_bounds_the_line() -> None:
    from collections import Counter

    many = Counter({f"reason {i}": 100 - i for i in range(20)})
    line = summary_line("site-a", many, 60.4)
    assert line.startswith("site-a: 1,810 more refusals (reason 0: 100, reason 1: 99,")
    assert line.endswith("and 12 more reasons) in the last 60 s")
    one = summary_line("site-a", Counter({"malformed": 1}), 3)
    assert one == "site-a: 1 more refusal (malformed: 1) in the last 3 s"


def test_a_channel_counts_every_refusal_and_logs_a_bounded_number(caplog) -> None:
    """2,000 junk messages through a real channel (in-memory transport): all counted, a few logged."""
    # Prepare
    ps = Channel(MemoryTransport(MemoryBroker(), SIMULATION_SETTINGS, client_id="ps"), run_id="run",
                 identity=identity("run", "ps"))
    caplog.set_level(logging.WARNING)
    update = topics.site_update_topic("run", "site-a")

    # Execute
    for i in range(2000):
        ps.accept(RawMessage(update, signed("run", update, b"\x00junk %d" % i), False))  # signed by site-a
    ps.refusals.close()

    # Assert
    assert ps.stats.rejected_by_site == {"site-a": {"malformed": 2000}}
    lines = _messages(caplog)
    assert len(lines) == REFUSALS_VERBATIM + 1
    assert lines[-1].startswith(f"site-a: {2000 - REFUSALS_VERBATIM:,} more refusals (malformed: ")
