"""The dashboard's participant-level DP (fedmqtt/dashboard/state.py, finished.py): from ps/status and ps/metrics live
and from a report's privacy.participant_level; hostile values (signed by the PS's own key, or written into a
report) are refused whole and counted, never shown, never raised."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from fedmqtt.dashboard.finished import run_view_from_report
from fedmqtt.dashboard.state import RunView
from fedmqtt.transport import topics
from fedmqtt.transport.signing import FederationKeys
from schemas import messages as m
from schemas.codec import encode

RUN = "dash-pdp"
MAX = 1 << 20
KEYS = FederationKeys(RUN, ["ps", "a", "b"])
STATUS = topics.ps_status_topic(RUN)
SPENT = m.ParticipantSpent(epsilon=2.31, delta=1e-5, accountant="prv", rounds=7, round=7)


def _live() -> RunView:
    return RunView(run_id=RUN, keys=KEYS.identity("observer").ring)


def _raw(view: RunView, topic: str, payload: bytes, now: float = 100.0) -> None:
    """`payload` as the topic's owner signs and publishes it (a PS key in hostile hands signs anything)."""
    view.on_message(topic, KEYS.identity(topics.parse_topic(topic).owner).seal(topic, payload), now=now,
                    max_bytes=MAX)


def _status(round_no: int = 8, state: str = "training", **kw: Any) -> m.DaemonStatus:
    return m.DaemonStatus(run_id=RUN, sender="ps", round=round_no, state=state, algorithm="dp-fedavg",
                          rounds_total=10, sites_expected=("a", "b"), **kw)


def test_live_it_comes_from_ps_status_and_ps_metrics_and_the_newest_round_wins() -> None:
    view = _live()
    assert view.snapshot(now=1.0)["participant_dp"] is None
    _raw(view, STATUS, encode(_status(participant_dp=SPENT)))
    shown = {"epsilon": 2.31, "delta": 1e-5, "accountant": "prv", "rounds": 7, "round": 7}
    assert view.snapshot(now=1.0)["participant_dp"] == shown
    newer = SPENT.model_copy(update={"epsilon": 2.5, "rounds": 8, "round": 8})
    _raw(view, topics.ps_metrics_topic(RUN), encode(m.RoundMetrics(
        run_id=RUN, sender="ps", round=8, sites=("a",), per_site={}, mean={}, participant_dp=newer)))
    assert view.snapshot(now=1.0)["participant_dp"]["round"] == 8
    _raw(view, STATUS, encode(_status(participant_dp=SPENT)))  # an older round's (a retained copy): kept out
    _raw(view, STATUS, encode(_status(state="offline", detail="PS disconnected")))  # the Last Will carries none
    assert view.snapshot(now=1.0)["participant_dp"] == {**shown, "epsilon": 2.5, "rounds": 8, "round": 8}


HOSTILE = (st.floats(allow_nan=True, allow_infinity=True) | st.integers(-2**80, 2**80) | st.text(max_size=40)
           | st.none() | st.booleans() | st.lists(st.integers(), max_size=3)
           | st.just("<img src=x onerror=alert(1)>") | st.just("\u202eprv"))


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(["epsilon", "delta", "accountant", "rounds", "round", "extra"]), value=HOSTILE)
def test_a_hostile_status_is_refused_whole_never_shown_never_raised(field: str, value: Any) -> None:
    view = _live()
    payload = json.loads(encode(_status(participant_dp=SPENT)))
    payload["participant_dp"][field] = value
    try:
        m.ParticipantSpent.model_validate_json(json.dumps(payload["participant_dp"]))
        valid = True
    except ValueError:
        valid = False
    _raw(view, STATUS, json.dumps(payload).encode())  # NaN/Infinity travel as JSON's non-standard words
    shown = view.snapshot(now=1.0)["participant_dp"]
    if valid:
        assert shown is not None and view.invalid == 0
    else:
        assert shown is None and view.invalid == 1
    if shown is not None:  # whatever is shown is finite and in range, the accountant one of three words
        assert math.isfinite(shown["epsilon"]) and 0 <= shown["epsilon"] <= 1e9 and 0 < shown["delta"] < 1
        assert shown["accountant"] in ("rdp", "prv", "skellam")


def _report(participant: Any) -> dict[str, Any]:
    return {"run_id": RUN, "algorithm": "dp-fedavg", "rounds": [], "config": {"sites": ["a", "b"], "rounds": 7},
            "final": {"per_site": {}, "mean": {}}, "privacy": {"record_level": {}, "participant_level": participant}}


def test_a_finished_run_shows_the_reports_final_spending() -> None:
    view = run_view_from_report(_report({"per_round": [SPENT.model_dump()], "final": SPENT.model_dump()}), label="x")
    assert view.snapshot(now=1.0)["participant_dp"] == {"epsilon": 2.31, "delta": 1e-5, "accountant": "prv",
                                                         "rounds": 7, "round": 7}
    for missing in (None, {}, {"per_round": []}, [], "none"):
        assert run_view_from_report(_report(missing), label="x").snapshot(now=1.0)["participant_dp"] is None


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(["epsilon", "delta", "accountant", "rounds", "round"]), value=HOSTILE,
       shape=st.sampled_from(["field", "final", "section"]))
def test_a_hostile_report_is_left_out_never_raised(field: str, value: Any, shape: str) -> None:
    if shape == "field":
        participant: Any = {"final": {**SPENT.model_dump(), field: value}}
    elif shape == "final":
        participant = {"final": value}
    else:
        participant = value
    shown = run_view_from_report(_report(participant), label="x").snapshot(now=1.0)["participant_dp"]
    if shown is not None:
        assert math.isfinite(shown["epsilon"]) and 0 <= shown["epsilon"] <= 1e9 and 0 < shown["delta"] < 1
        assert shown["accountant"] in ("rdp", "prv", "skellam") and isinstance(shown["rounds"], int)
