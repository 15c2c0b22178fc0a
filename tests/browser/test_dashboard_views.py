"""The dashboard's views without a browser: the best round by the run's selection metric, the timeline, messages
dropped with their sender and reason, incremental snapshots, the results panel and finished-run folders."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedmqtt.dashboard.finished import run_view_from_report
from fedmqtt.dashboard.results import results
from fedmqtt.dashboard.rundir import DOWNLOADS, available, find_runs, open_download, read_audit, read_report
from fedmqtt.dashboard.state import RunView, best_round_of
from fedmqtt.errors import FedMqttError
from fedmqtt.transport import topics
from fedmqtt.transport.signing import FederationKeys
from ps_daemon.report import baseline_rows
from schemas import messages as m
from schemas.codec import encode

RUN = "dash-views"
KEYS = FederationKeys(RUN, ["ps", "a", "b", "c"])  # every party signs what it publishes; the page verifies
RING = KEYS.identity("observer").ring


def _sealed(topic: str, payload: bytes) -> bytes:
    """`payload` as the topic's owner publishes it."""
    return KEYS.identity(topics.parse_topic(topic).owner).seal(topic, payload)
MAX = 1 << 20


def _feed(view: RunView, topic: str, msg: object, now: float = 100.0) -> None:
    view.on_message(topic, _sealed(topic, encode(msg)), now=now, max_bytes=MAX)


def _status(state: str = "training", round_no: int = 1, **kw: object) -> m.DaemonStatus:
    return m.DaemonStatus(run_id=RUN, sender="ps", round=round_no, state=state, algorithm="fedavg", rounds_total=5,
                          sites_expected=("a", "b"), **kw)


def _round(n: int, auroc: float, loss: float, stragglers: tuple[str, ...] = ()) -> m.RoundMetrics:
    sites = tuple(s for s in ("a", "b") if s not in stragglers)
    return m.RoundMetrics(run_id=RUN, sender="ps", round=n, sites=sites, stragglers=stragglers,
                          per_site={s: {"auroc": auroc, "loss": loss} for s in sites},
                          mean={"auroc": auroc, "loss": loss}, train_loss=loss + 0.1, duration_s=1.5)


@pytest.mark.parametrize(("metric", "best"), [("auroc", 2), ("loss", 3), ("", None)])
def test_live_best_round_is_the_pss_rule_on_the_selection_metric_it_says(metric: str, best: int | None) -> None:
    """auroc is highest in rounds 2 and 3 (a tie keeps the earlier), loss lowest in round 3: the page marks the
    round the PS's own metric picks, and none when the PS does not say its metric (an older PS)."""
    view = RunView(run_id=RUN, keys=RING)
    _feed(view, topics.ps_status_topic(RUN), _status(selection_metric=metric))
    for n, auroc, loss in ((1, 0.7, 0.6), (2, 0.8, 0.5), (3, 0.8, 0.4)):
        _feed(view, topics.ps_metrics_topic(RUN), _round(n, auroc, loss))
    chosen = view.snapshot(now=1.0)["best_round"]
    assert (chosen or {}).get("round") == best
    if best is not None:
        assert chosen["metric"] == f"val {metric}"


def test_the_best_round_of_a_real_run_is_the_reports(finished_runs: Path) -> None:
    for directory in find_runs(finished_runs):
        report = read_report(directory)
        view = run_view_from_report(report, label="x", directory=directory)
        rounds = [view.rounds[n] for n in sorted(view.rounds)]
        derived = best_round_of(rounds, report["config"]["selection_metric"])
        assert derived is not None and derived["round"] == report["best_round"]["round"], directory
        assert view.snapshot(now=1.0)["best_round"]["round"] == report["best_round"]["round"]


def test_snapshots_after_a_cursor_carry_only_new_rounds_and_events() -> None:
    view = RunView(run_id=RUN, keys=RING)
    _feed(view, topics.ps_status_topic(RUN), _status(selection_metric="auroc"))
    _feed(view, topics.ps_metrics_topic(RUN), _round(1, 0.7, 0.6))
    whole = view.snapshot(now=1.0)
    cursor = view.cursor()
    assert [r["round"] for r in whole["rounds"]] == [1] and whole["delta"] is False
    assert view.snapshot(now=1.0, since=cursor)["rounds"] == [] and view.snapshot(now=1.0, since=cursor)["events"] == []
    _feed(view, topics.ps_metrics_topic(RUN), _round(2, 0.8, 0.5))
    delta = view.snapshot(now=2.0, since=cursor)
    assert [r["round"] for r in delta["rounds"]] == [2] and delta["delta"] is True
    assert [e["text"] for e in delta["events"]] == ["round 2 closed in 1.5 s: 2 updates"]
    assert delta["best_round"]["round"] == 2  # derived from every round, not only those sent
    assert len(json.dumps(delta)) < len(json.dumps(view.snapshot(now=2.0)))


def test_the_timeline_says_offline_back_refusals_stalls_and_deadlines() -> None:
    view = RunView(run_id=RUN, keys=RING)
    site = topics.site_status_topic
    _feed(view, topics.ps_status_topic(RUN), _status(detail="round 1: training on 2 sites", deadline=4e9), now=1.0)
    _feed(view, site(RUN, "a"), m.SiteStatus(run_id=RUN, sender="a", round=1, state="training"), now=2.0)
    _feed(view, site(RUN, "a"), m.SiteStatus(run_id=RUN, sender="a", round=1, state="offline",
                                             detail="connection lost"), now=3.0)
    _feed(view, topics.ps_status_topic(RUN), _status(detail="round 1: nothing arrived for 120 s; re-published the "
                                                            "model and the tasks of a (attempt 1)"), now=4.0)
    _feed(view, topics.ps_status_topic(RUN), _status(detail="round 1: 1/2 updates",
                                                     rejected={"b": {"stale or future round": 2}}), now=5.0)
    _feed(view, topics.ps_status_topic(RUN), _status(detail="round 1: 1/2 updates",
                                                     rejected={"b": {"stale or future round": 3, "schema": 1}}),
          now=6.0)
    _feed(view, topics.ps_metrics_topic(RUN), _round(1, 0.7, 0.6, stragglers=("a",)), now=7.0)
    _feed(view, site(RUN, "a"), m.SiteStatus(run_id=RUN, sender="a", round=2, state="online"), now=8.0)
    _feed(view, topics.ps_metrics_topic(RUN), _round(2, 0.7, 0.6, stragglers=("b",)), now=9.0)  # b: not offline
    events = [(e["kind"], e["site"], e["text"]) for e in view.snapshot(now=9.0)["events"]]
    assert view.snapshot(now=9.0)["events"][0]["deadline"] == 4e9  # shown in the reader's time zone
    assert events == [
        ("round", None, "round 1 started: training on 2 sites"),
        ("site", "a", "a seen (training)"),
        ("offline", "a", "a offline: connection lost"),
        ("stall", None, "round 1: nothing arrived for 120 s; re-published the model and the tasks of a (attempt 1)"),
        ("refused", "b", "PS refused 2 messages from b: stale or future round"),
        ("refused", "b", "PS refused 1 message from b: schema"),
        ("refused", "b", "PS refused 1 message from b: stale or future round"),
        ("round", None, "round 1 closed in 1.5 s: 1 update"),
        ("offline", None, "round 1 closed without a (offline)"),
        ("back", "a", "a back (online)"),
        ("round", None, "round 2 closed in 1.5 s: 1 update"),
        ("deadline", None, "round 2 closed at its deadline without b"),
    ]


def test_sites_the_ps_goes_on_without_are_shown_with_why_and_never_as_waited_for() -> None:
    """ps/status `dropped` reaches the page: which selected sites the round goes on without and why, one timeline
    event per site when it is first dropped (not again on a repeated or retained status)."""
    view = RunView(run_id=RUN, keys=RING)
    status = topics.ps_status_topic(RUN)
    _feed(view, status, _status(detail="round 1: training on 2 sites", waiting_for=("a", "b")), now=1.0)
    assert view.snapshot(now=1.0)["sites_dropped"] == []
    why = "offline since 2026-11-26T08:00:00Z"
    for now in (2.0, 3.0):  # the same status twice (a reconnect reads the retained copy again)
        _feed(view, status, _status(round_no=2, detail="round 2: training on 1 sites (1 offline, not waited for)",
                                    waiting_for=("a",), dropped={"b": why}), now=now)
    snap = view.snapshot(now=3.0)
    assert snap["waiting_for"] == ["a"] and snap["sites_dropped"] == [{"site": "b", "why": why}]
    dropped_events = [e for e in snap["events"] if e["text"].startswith("PS goes on without")]
    assert [(e["kind"], e["site"], e["round"], e["text"]) for e in dropped_events] == [
        ("offline", "b", 2, f"PS goes on without b: {why}")]
    _feed(view, status, _status(state="done", round_no=6, detail="done; no final report from b",
                                dropped={"b": "deadline missed: no final report"}), now=4.0)
    assert view.snapshot(now=4.0)["sites_dropped"] == [{"site": "b", "why": "deadline missed: no final report"}]


def test_dropped_messages_name_their_sender_and_reason_not_an_exception_type() -> None:
    view = RunView(run_id=RUN, keys=RING)
    _feed(view, topics.site_status_topic(RUN, "a"), m.SiteStatus(run_id=RUN, sender="b", round=0, state="online"))
    too_long = json.loads(encode(m.SiteStatus(run_id=RUN, sender="c", round=0, state="online")))
    too_long["device"] = "d" * 257  # the schema allows 256 characters
    for _ in range(8):
        topic = topics.site_status_topic(RUN, "c")
        view.on_message(topic, _sealed(topic, json.dumps(too_long).encode()), now=1.0, max_bytes=MAX)
    snap = view.snapshot(now=2.0)
    dropped = {(d["sender"], d["reason"]): d for d in snap["dropped"]}
    assert snap["invalid"] == 9 and set(dropped) == {("a", "wrong sender"), ("c", "too large")}
    too_large = dropped[("c", "too large")]
    assert too_large["count"] == 8 and "device" in too_large["last"] and "WireError" not in json.dumps(snap["dropped"])
    assert "claims another identity" in dropped[("a", "wrong sender")]["last"]
    texts = [e["text"] for e in snap["events"] if e["kind"] == "invalid"]
    assert len(texts) == 2  # eight from c within ten seconds: one event, counted in the facts
    assert texts[0].startswith("dropped 1 message from a: wrong sender: ")


def test_the_results_panel_holds_the_reports_numbers(finished_runs: Path) -> None:
    report = read_report(finished_runs / "fedavg")
    panel = results(report)
    final, best = panel["models"]
    assert panel["metrics"][:2] == ["auroc", "accuracy"] and final["round"] == len(report["rounds"])
    for model, section, mean in ((final, report["final"], report["final"]["mean"]["test"]),
                                 (best, report["best"], report["best"]["mean"]["test"])):
        sites = {r["label"]: r for r in model["rows"] if r["kind"] == "site"}
        assert set(sites) == set(section["per_site"])
        for name, entry in section["per_site"].items():
            assert sites[name]["n"] == entry["n_samples"]["test"]
            for metric, value in entry["metrics"]["test"].items():
                assert sites[name]["cells"][metric] == {"text": f"{value:.3f}", "value": value}
        (mean_row,) = [r for r in model["rows"] if r["kind"] == "mean"]
        assert {k: c["value"] for k, c in mean_row["cells"].items()} == {k: mean[k] for k in panel["metrics"]}
    assert best["round"] == report["best_round"]["round"] and best["metric"] == report["best_round"]["metric"]
    assert [r["label"] for r in panel["references"]] == [b.label for b in baseline_rows(report)]
    assert panel["references"] and any(r["label"] == "pooled reference" for r in panel["references"])


def test_a_finished_runs_timeline_has_its_rounds_and_audit_records(finished_runs: Path) -> None:
    directory = finished_runs / "fedavg"
    report = read_report(directory)
    view = run_view_from_report(report, label="fedavg", directory=directory, audit=read_audit(directory))
    events = view.snapshot(now=1.0)["events"]
    closed = [e for e in events if e["text"].startswith("round ") and " closed in " in e["text"]]
    assert [e["round"] for e in closed] == [r["round"] for r in report["rounds"]]
    assert [round(e["duration_s"], 6) for e in closed] == [round(r["duration_s"], 6) for r in report["rounds"]]
    assert events[0]["text"].startswith("PS started") and events[-1]["text"].startswith("run finished; best round")
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    sites = {s["name"]: s for s in view.snapshot(now=1.0)["sites"]}
    for name, entry in report["final"]["per_site"].items():  # the "data" column is filled from the report
        assert (sites[name]["n_val"], sites[name]["n_test"]) == (entry["n_samples"]["val"], entry["n_samples"]["test"])
        assert sites[name]["n_train"] == report["rounds"][-1]["n_samples"][name]


def test_downloads_are_the_known_regular_files_of_the_folder_itself(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "report.json").write_text("{}")
    (run / "checkpoints" / "round-000001.ckpt").write_bytes(b"x")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the page")
    (run / "report.md").symlink_to(secret)  # planted: a link to a file outside the run
    os.mkfifo(run / "per_site.csv")  # planted: a FIFO would block a reader forever
    assert [f["name"] for f in available(run)] == ["report.json"]
    for name in ("report.md", "per_site.csv", "checkpoints/round-000001.ckpt", "../secret.txt", "secret.txt", "",
                 ".", "report.json/", "/etc/passwd"):
        assert open_download(run, name) is None, name
    opened = open_download(run, "report.json")
    assert opened is not None and opened[1] == 2
    opened[0].close()
    assert set(DOWNLOADS) == {"report.json", "report.md", "per_site.csv", "final_model.safetensors",
                              "best_model.safetensors"}


def test_find_runs_lists_an_output_folders_runs_newest_first(tmp_path: Path) -> None:
    for i, rel in enumerate(("a", "grid/p1", "grid/p2", "grid/p2/checkpoints/x", "deep/1/2/3/4")):
        (tmp_path / rel).mkdir(parents=True, exist_ok=True)
        (tmp_path / rel / "report.json").write_text("{}")
        os.utime(tmp_path / rel / "report.json", (1000 + i, 1000 + i))
    assert [p.relative_to(tmp_path).as_posix() for p in find_runs(tmp_path)] == ["grid/p2", "grid/p1", "a"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FedMqttError, match="no report.json"):
        find_runs(tmp_path / "empty")


def test_each_sites_record_level_epsilon_is_shown_live_and_from_a_report() -> None:
    """ps/status `epsilon` (live) and the report's privacy.record_level (finished) reach the site rows; an entry of
    the report that does not validate as PrivacySpent is left out, not shown."""
    spent = m.PrivacySpent(epsilon=1.25, delta=1e-5, accountant="prv", noise_multiplier=1.1, sample_rate=0.1,
                           steps=40)
    view = RunView(run_id=RUN, keys=RING)
    _feed(view, topics.ps_status_topic(RUN), _status(epsilon={"a": spent}), now=1.0)
    sites = {s["name"]: s for s in view.snapshot(now=2.0)["sites"]}
    assert sites["a"]["epsilon"] == {"epsilon": 1.25, "delta": 1e-5, "accountant": "prv", "steps": 40,
                                     "noise_multiplier": 1.1}
    assert sites["b"]["epsilon"] is None
    report = {"run_id": RUN, "algorithm": "fedavg", "rounds": [], "config": {"sites": ["a", "b"], "rounds": 1},
              "final": {"per_site": {}, "mean": {}},
              "privacy": {"record_level": {"a": spent.model_dump(), "b": {**spent.model_dump(), "epsilon": -1.0}}}}
    finished = {s["name"]: s for s in run_view_from_report(report, label="x").snapshot(now=2.0)["sites"]}
    assert finished["a"]["epsilon"]["epsilon"] == 1.25 and finished["b"]["epsilon"] is None
