"""Participant-level DP on the dashboard's overview, in headless Chromium: live from ps/status and ps/metrics
published on a real broker with the PS's own credentials and key (a status whose epsilon the schema refuses is
dropped and counted, the last good one stays), and from the report.json of a real DP-FedAvg run (`fedmqtt
simulate -a dp-fedavg`: the PS's own code writes it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from page_wait import wait_for

from fedmqtt.transport import topics
from schemas import messages as m
from schemas.codec import encode

FACT = "participant-level DP"
READ = """
const run = document.querySelector('section.run');
if (!run) return null;
const facts = {};
run.querySelectorAll('dl.facts dt').forEach(dt => { facts[dt.textContent] = dt.nextElementSibling.textContent; });
const dd = run.querySelector("dl.facts dd[data-fact='participant-level DP']");
const span = dd && dd.firstElementChild;
return {facts, html: dd && dd.innerHTML, title: span && span.getAttribute('title')};
"""


def _wait(driver, predicate, what: str, timeout_s: float = 30) -> dict:
    return wait_for(driver, READ, predicate, what, timeout_s)


@pytest.mark.integration
@pytest.mark.e2e
def test_live_participant_level_epsilon_is_on_the_overview(federation, paho_client, dashboard, chrome) -> None:
    run = federation.run_id
    chrome.get(dashboard("--federation", str(federation.layout.fed_dir)))
    ps = paho_client(federation.settings("ps"))
    topic = topics.ps_status_topic(run)

    def publish(topic: str, payload: bytes) -> None:
        sealed = federation.layout.identity("ps").seal(topic, payload)
        ps.publish(topic, sealed, qos=1, retain=True).wait_for_publish(10)

    def status(**kw: object) -> m.DaemonStatus:
        return m.DaemonStatus(run_id=run, sender="ps", round=8, state="training", algorithm="dp-fedavg",
                              rounds_total=10, sites_expected=("site-a", "site-b"), **kw)

    publish(topic, encode(status()))
    page = _wait(chrome, lambda p: p["facts"].get("round", "").startswith("8 of 10"), "round 8")
    assert FACT not in page["facts"]  # a run without participant-level DP says nothing of it
    spent = m.ParticipantSpent(epsilon=2.3149, delta=1e-5, accountant="prv", rounds=7, round=7)
    publish(topic, encode(status(participant_dp=spent)))
    page = _wait(chrome, lambda p: FACT in p["facts"], "the participant-level epsilon")
    assert page["facts"][FACT] == "ε 2.31 at δ 1e-5 after 7 rounds (prv accountant)"
    assert "<" not in page["html"].replace("<span", "").replace("</span>", "")  # text only, in one span
    assert "q = 1" in page["title"]
    # ps/metrics of the next round moves it on
    publish(topics.ps_metrics_topic(run), encode(m.RoundMetrics(
        run_id=run, sender="ps", round=8, sites=("site-a",), per_site={}, mean={},
        participant_dp=spent.model_copy(update={"epsilon": 2.5, "rounds": 8, "round": 8}))))
    _wait(chrome, lambda p: p["facts"].get(FACT) == "ε 2.50 at δ 1e-5 after 8 rounds (prv accountant)",
          "round 8's epsilon")
    # A status signed by the PS's key whose epsilon is out of range (and whose accountant is markup): dropped whole
    # and counted, never shown; the last good value stays.
    hostile = json.loads(encode(status(participant_dp=spent)))
    hostile["participant_dp"] |= {"epsilon": 1e300, "accountant": "<img src=x onerror=alert(1)>"}
    publish(topic, json.dumps(hostile).encode())
    page = _wait(chrome, lambda p: "dropped by this page" in p["facts"], "the hostile status dropped")
    assert page["facts"][FACT] == "ε 2.50 at δ 1e-5 after 8 rounds (prv accountant)"
    assert "ps: " in page["facts"]["dropped by this page"]
    assert chrome.execute_script("return document.querySelectorAll('img').length") == 0


@pytest.mark.e2e
def test_a_finished_dp_fedavg_runs_epsilon_is_on_its_overview(dashboard, chrome, tmp_path: Path) -> None:
    out = tmp_path / "dp-run"
    done = subprocess.run([sys.executable, "-m", "fedmqtt", "simulate", "-a", "dp-fedavg", "-H", "noise_multiplier=1.0",
                           "-H", "clip_norm=1.0", "--lr", "0.01", "--rounds", "3", "--seed", "1", "--out", str(out),
                           "--no-progress"], capture_output=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout.decode(errors="replace")[-3000:]
    final = json.loads((out / "report.json").read_text())["privacy"]["participant_level"]["final"]
    assert final["rounds"] == 3 and final["accountant"] in ("rdp", "prv")
    chrome.get(dashboard("--run", str(out)))
    page = _wait(chrome, lambda p: "report.json" in p["facts"].get("source", "") and FACT in p["facts"],
                 "the finished run's participant-level epsilon")
    assert page["facts"][FACT] == (f"ε {final['epsilon']:.2f} at δ 1e-5 after 3 rounds "
                                   f"({final['accountant']} accountant)")
    assert "## Differential privacy" in (out / "report.md").read_text()
