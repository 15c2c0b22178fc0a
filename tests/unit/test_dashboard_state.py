"""The dashboard's state model (pure) and HTTP surface (a real `fedmqtt dashboard --run` process); no browser."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fedmqtt.dashboard.finished import run_view_from_report
from fedmqtt.dashboard.server import CSP, check_exposure
from fedmqtt.dashboard.state import RunView
from fedmqtt.errors import FedMqttError
from fedmqtt.transport import topics
from fedmqtt.transport.signing import FederationKeys
from schemas import messages as m
from schemas.codec import encode

RUN = "dash-unit"
MAX = 1 << 20
KEYS = FederationKeys(RUN, ["ps", "a", "b", "c"])


def _live() -> RunView:
    """A live view, verifying what arrives with the observer's key list."""
    return RunView(run_id=RUN, keys=KEYS.identity("observer").ring)


def _feed(view: RunView, topic: str, msg: object, now: float = 100.0) -> None:
    """`msg` as the topic's owner signs and publishes it."""
    owner = topics.parse_topic(topic).owner
    view.on_message(topic, KEYS.identity(owner).seal(topic, encode(msg)), now=now, max_bytes=MAX)


def _metrics(r: int, sites: tuple[str, ...], loss: float, phase: str = "train") -> m.RoundMetrics:
    return m.RoundMetrics(run_id=RUN, sender="ps", round=r, phase=phase, sites=sites,
                          per_site={s: {"loss": loss + i / 10} for i, s in enumerate(sites)},
                          mean={"loss": loss}, duration_s=2.0)


def test_live_view_accumulates_rounds_and_says_history_is_missing() -> None:
    view = _live()
    _feed(view, topics.ps_status_topic(RUN), m.DaemonStatus(
        run_id=RUN, sender="ps", round=3, state="training", algorithm="fedavg", rounds_total=10,
        selection_metric="loss",
        sites_expected=("a", "b"), sites_online=("a", "b"), waiting_for=("b",), rejected={"b": {"schema": 2}},
        upload_turns={"b": 7}))
    _feed(view, topics.site_status_topic(RUN, "a"), m.SiteStatus(run_id=RUN, sender="a", round=3, state="training",
                                                                   n_train=50, detail="<b>x</b>"), now=123.0)
    _feed(view, topics.ps_metrics_topic(RUN), _metrics(3, ("a", "b"), 0.7))  # the retained one: round 3 only
    _feed(view, topics.ps_metrics_topic(RUN), _metrics(4, ("a",), 0.5))
    snap = view.snapshot(now=130.0)
    assert [r["round"] for r in snap["rounds"]] == [3, 4]
    assert snap["history_missing_before"] == 3
    assert snap["seconds_per_round"] == 2.0 and snap["eta_s"] == 2.0 * 7
    sites = {s["name"]: s for s in snap["sites"]}
    assert sites["a"]["state"] == "training" and sites["a"]["last_seen"] == 123.0 and sites["a"]["detail"] == "<b>x</b>"
    assert sites["a"]["rounds_participated"] == 2 and sites["b"]["rounds_participated"] == 1
    assert sites["b"]["rejected"] == {"schema": 2} and sites["b"]["state"] == "unknown"
    assert snap["best_round"]["round"] == 4
    assert snap["upload_turns"] == ["b"]
    json.dumps(snap)  # what the server sends


def test_a_site_cannot_speak_for_another_and_other_runs_are_dropped() -> None:
    view = _live()
    _feed(view, topics.site_status_topic(RUN, "a"), m.SiteStatus(run_id=RUN, sender="b", round=0, state="error"))
    _feed(view, topics.site_status_topic("other", "a"),
          m.SiteStatus(run_id="other", sender="a", round=0, state="online"))
    assert view.sites == {} and view.invalid == 2


def test_an_unsigned_or_forged_status_is_counted_never_shown() -> None:
    """The dashboard verifies like any receiver: a status without the owner's signature changes nothing."""
    view = _live()
    topic = topics.ps_status_topic(RUN)
    status = encode(m.DaemonStatus(run_id=RUN, sender="ps", round=7, state="done"))
    view.on_message(topic, status, now=1.0, max_bytes=MAX)  # unsigned
    view.on_message(topic, KEYS.identity("a").seal(topic, status), now=1.0, max_bytes=MAX)  # a site's key
    assert view.ps_state == "unknown" and view.invalid == 2
    assert {(d.sender, d.reason): d.count for d in view.dropped.values()} == {("ps", "unsigned"): 1,
                                                                              ("ps", "wrong signer"): 1}


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["ps/status", "ps/metrics", "site/a/status", "site/a/update"]),
       payload=st.binary(max_size=300))
def test_garbage_is_counted_never_raised_or_shown(kind: str, payload: bytes) -> None:
    view = _live()
    view.on_message(f"{topics.run_prefix(RUN)}/{kind}", payload, now=1.0, max_bytes=MAX)
    snap = view.snapshot(now=2.0)
    assert snap["sites"] == [] and snap["rounds"] == [] and snap["ps"]["state"] == "unknown"
    assert view.invalid == (1 if payload else 0)


def test_plain_http_is_served_on_loopback_only() -> None:
    assert check_exposure("127.0.0.1", secure=False) and check_exposure("::1", secure=False)
    assert check_exposure("localhost", secure=False)
    for host in ("0.0.0.0", "192.168.1.5", "example.org"):
        assert check_exposure(host, secure=True) == host  # HTTPS with a login may face the network
        try:
            check_exposure(host, secure=False)
        except FedMqttError as exc:
            assert "TLS and a login" in str(exc)
        else:
            raise AssertionError(f"{host} was accepted over plain HTTP")


def _status(state: str, **kw: object) -> m.DaemonStatus:
    return m.DaemonStatus(run_id=RUN, sender="ps", round=2, state=state, algorithm="fedavg", rounds_total=5,
                          sites_expected=("a", "b", "c"), **kw)


def test_quorum_and_min_sites_come_from_ps_status() -> None:
    view = _live()
    assert view.snapshot(now=1.0)["status"] == "waiting"  # nothing from the PS yet
    _feed(view, topics.ps_status_topic(RUN), _status("training", quorum=2, min_sites=3))
    snap = view.snapshot(now=1.0)
    assert (snap["quorum"], snap["min_sites"], len(snap["sites_expected"])) == (2, 3, 3)
    assert snap["status"] == "live"


def test_each_sites_last_update_size_and_compute_time_come_live_from_ps_metrics() -> None:
    """Observers may not read updates, so ps/metrics repeats what each accepted one cost and weighed."""
    # Prepare
    view = _live()
    usage = m.ResourceUsage(device="cpu", wall_s=1.5, cpu_s=1.25)
    msg = _metrics(1, ("a", "b"), 0.7).model_copy(update={"usage": {"a": usage}, "update_bytes": {"a": 4096, "b": 10}})
    # Execute
    _feed(view, topics.ps_metrics_topic(RUN), msg)
    sites = {s["name"]: s for s in view.snapshot(now=1.0)["sites"]}
    # Assert
    assert sites["a"]["last_compute"] == {"wall_s": 1.5, "cpu_s": 1.25}
    assert sites["a"]["last_update_bytes"] == 4096 and sites["b"]["last_update_bytes"] == 10
    assert sites["b"]["last_compute"] == {}


def test_secure_aggregation_and_each_rounds_dropped_and_recovered_are_shown() -> None:
    """ps/status says the run aggregates securely and how the last round's sum went; ps/metrics carries each
    round's own; a run in the clear says so; a finished run's report gives the same view."""
    # Prepare
    view = _live()
    _feed(view, topics.ps_status_topic(RUN), _status("training"))
    assert view.snapshot(now=1.0)["secure_aggregation"] is False  # the clear run (the default)
    note1 = m.SecureRoundNote(round=1, included=3, dropped=0, recovered=0, tries=1)
    note2 = m.SecureRoundNote(round=2, included=2, dropped=1, recovered=1, tries=2)
    # Execute
    _feed(view, topics.ps_metrics_topic(RUN), _metrics(1, ("a", "b", "c"), 0.7).model_copy(update={"secure": note1}))
    _feed(view, topics.ps_metrics_topic(RUN), _metrics(2, ("a", "b"), 0.6).model_copy(update={"secure": note2}))
    _feed(view, topics.ps_status_topic(RUN), _status("training", secure_aggregation=True, secure_last_round=note2))
    snap = view.snapshot(now=2.0)
    # Assert
    assert snap["secure_aggregation"] is True
    assert snap["secure_last_round"] == {"round": 2, "included": 2, "dropped": 1, "recovered": 1, "tries": 2}
    per_round = {r["round"]: r["secure"] for r in snap["rounds"]}
    assert per_round[1] == {"round": 1, "included": 3, "dropped": 0, "recovered": 0, "tries": 1}
    assert per_round[2] == snap["secure_last_round"]
    # An older round's note (a retained message again) does not replace the latest
    _feed(view, topics.ps_metrics_topic(RUN), _metrics(1, ("a", "b", "c"), 0.7).model_copy(update={"secure": note1}))
    assert view.snapshot(now=3.0)["secure_last_round"]["round"] == 2
    # A finished run: the report's per-round counts (a malformed entry is skipped)
    report = {"run_id": RUN, "algorithm": "fedavg", "rounds": [{"round": 1, "sites": ["a", "b"]}],
              "final": {"mean": {}},
              "secure_aggregation": {"enabled": True, "per_round": [
                  {"round": 1, "included": 2, "dropped": 1, "recovered": 1, "tries": 1},
                  {"round": "x", "included": 2, "dropped": 0, "recovered": 0, "tries": 1}]}}
    finished = run_view_from_report(report, label="done").snapshot(now=4.0)
    assert finished["secure_aggregation"] is True
    assert finished["rounds"][0]["secure"] == {"round": 1, "included": 2, "dropped": 1, "recovered": 1, "tries": 1}
    assert finished["secure_last_round"] == finished["rounds"][0]["secure"]
    json.dumps(snap)


def test_status_says_live_finished_or_offline() -> None:
    view = _live()
    for ps_state, shown in (("waiting_for_sites", "live"), ("evaluating", "live"), ("offline", "offline"),
                            ("training", "live"), ("error", "error"), ("done", "finished")):
        _feed(view, topics.ps_status_topic(RUN), _status(ps_state))
        assert view.snapshot(now=1.0)["status"] == shown, ps_state
    view.ps_state = "training"
    view.broker_connected = False  # the last known state may be stale: say so instead of "live"
    assert view.snapshot(now=1.0)["status"] == "unknown"
    assert view.messages == 6


def _report(tmp: Path) -> Path:
    run = tmp / "run"
    run.mkdir()
    rounds = [{"round": r, "sites": ["a", "b"], "stragglers": [],
               "per_site": {"a": {"loss": 1 / r}, "b": {"loss": 2 / r}},
               "mean": {"loss": 1.5 / r}, "train_loss": None, "duration_s": 1.0} for r in (1, 2, 3)]
    report = {"run_id": "rep", "algorithm": "fedprox", "config": {"rounds": 3, "sites": ["b", "a"], "quorum": 1},
              "rounds": rounds,
              "final": {"per_site": {"a": {"metrics": {"test": {"loss": 0.3}}}, "b": {"missing": "offline"}},
                        "mean": {"test": {"loss": 0.3}}},
              "best_round": {"round": 3, "score": 0.5, "metric": "val loss"}, "recruitment": None,
              "usage": {"per_site_total": {"a": {"rounds": 3, "wall_s": 2.0, "cpu_s": 1.5, "energy_j": 0.0}},
                        "per_round": {"3": {"a": {"wall_s": 0.7, "cpu_s": 0.5}, "b": {"wall_s": None}}}}}
    (run / "report.json").write_text(json.dumps(report))
    return run


def test_http_is_read_only_with_a_strict_csp(dashboard, tmp_path: Path) -> None:
    url = dashboard("--run", str(_report(tmp_path)))
    with urllib.request.urlopen(url, timeout=10) as page:
        assert page.headers["Content-Security-Policy"] == CSP and "innerHTML" not in page.read().decode()
    with urllib.request.urlopen(url + "api/state", timeout=10) as resp:
        state = json.loads(resp.read())
    run = state["runs"][0]
    assert run["algorithm"] == "fedprox" and [r["round"] for r in run["rounds"]] == [1, 2, 3]
    assert run["status"] == "finished"
    assert (run["quorum"], run["min_sites"], run["sites_expected"]) == (1, 2, ["a", "b"])
    assert run["best_round"]["round"] == 3 and {s["name"]: s["usage"].get("cpu_s") for s in run["sites"]}["a"] == 1.5
    sites = {s["name"]: s for s in run["sites"]}
    assert sites["a"]["state"] == "finished" and sites["a"]["last_compute"] == {"wall_s": 0.7, "cpu_s": 0.5}
    assert sites["b"]["state"] == "offline" and sites["b"]["detail"] == "offline" and sites["b"]["last_compute"] == {}
    assert "password" not in json.dumps(state)
    for method, path, code in (("POST", "api/state", 405), ("PUT", "", 405), ("GET", "static/..%2Fstate.py", 404),
                               ("GET", "static/state.py", 404)):
        try:
            request = urllib.request.Request(url + path, method=method, data=b"x" if method != "GET" else None)
            urllib.request.urlopen(request, timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == code, (method, path, exc.code)
        else:
            raise AssertionError(f"{method} /{path} succeeded")
    for path in ("favicon.ico", "static/favicon.svg"):  # served from static/, no external resource
        with urllib.request.urlopen(url + path, timeout=10) as icon:
            assert icon.headers["Content-Type"] == "image/svg+xml" and icon.read().startswith(b"<svg")
    js = urllib.request.urlopen(url + "static/app.js", timeout=10).read().decode()
    for sink in (".innerHTML", ".outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink
    assert "http" not in js.replace("http://www.w3.org/2000/svg", "")
