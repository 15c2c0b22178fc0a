"""Headless Chromium watches a real federation (Mosquitto, PS, four sites as processes) through
`fedmqtt dashboard`: sites come online, rounds advance, a killed site goes offline, and a hostile status
string from a real paho client with that site's credentials is rendered as text. Screenshots are saved."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from harness import FAST_TRAIN, CliFederation

from fedmqtt.transport import topics
from schemas import messages as m
from schemas.codec import encode

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

HOSTILE = '<img src=x onerror="document.title=\'pwned\'"><script>document.title="pwned"</script>'

# Reads the rendered page (not the API): what a person would see.
READ_PAGE = """
const run = document.querySelector('section.run');
if (!run) return null;
const facts = {};
run.querySelectorAll('dl.facts dt').forEach(dt => { facts[dt.textContent] = dt.nextElementSibling.textContent; });
const sites = {};
run.querySelectorAll('table.sites tr[data-site]').forEach(tr => {
  const td = tr.querySelectorAll('td');
  sites[tr.dataset.site] = {state: td[1].querySelector('.state').textContent,
                            dropped: (td[1].querySelector('.dropped-why') || {}).textContent || '',
                            rounds: Number(td[3].textContent), usage: td[7].textContent,
                            data: td[5].textContent,
                            detail: tr.querySelector('td.detail').textContent,
                            // elements in the detail cell besides the <bdi> that isolates the text: none
                            detail_children: [...tr.querySelector('td.detail').querySelectorAll('*')].filter(
                                e => e.tagName !== 'BDI').length};
});
return {facts, sites, plots: run.querySelectorAll('figure.plot svg polyline').length,
        events: [...run.querySelectorAll('ol.timeline li')].map(
            li => [li.dataset.kind, li.lastElementChild.textContent]),
        history: (run.querySelector('.history') || {}).textContent || '',
        header: document.getElementById('status').textContent};
"""


def wait_page(driver, predicate: Callable[[dict], bool], timeout_s: float, what: str, fed: CliFederation) -> dict:
    end, page = time.monotonic() + timeout_s, None
    while time.monotonic() < end:
        fed.check_alive()
        page = driver.execute_script(READ_PAGE)
        if page and predicate(page):
            return page
        time.sleep(0.3)
    raise AssertionError(f"page never showed {what}; last seen: {json.dumps(page)[:2000]}\nps log:\n{fed.tail('ps')}")


def _publish_as(settings, topic: str, payload: bytes) -> None:
    """A real paho client with a site's own credentials (the site is dead, so its login is free)."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"hostile-{time.monotonic_ns()}",
                         protocol=mqtt.MQTTv5)
    client.username_pw_set(settings.username, settings.password)
    client.connect(settings.host, settings.port)
    client.loop_start()
    try:
        client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


@pytest.fixture
def federation(mosquitto_bin: str, tmp_path: Path):
    fed = CliFederation(tmp_path / "fed", run_id="dash-live", rounds=10, round_timeout_s=8,
                        train={**FAST_TRAIN, "epochs": 60}, share_label_histogram=True)
    yield fed
    fed.stop_all()


def test_dashboard_follows_a_live_federation(federation: CliFederation, dashboard, chrome, screenshots: Path) -> None:
    fed = federation
    fed.start_broker()
    url = dashboard("--federation", str(fed.layout.fed_dir))
    chrome.get(url)
    fed.start_ps()
    for site in fed.sites:
        fed.start_site(site)

    # Sites come online and rounds advance.
    page = wait_page(chrome, lambda p: len(p["sites"]) == 4 and all(
        s["state"] in ("online", "training", "evaluating") for s in p["sites"].values()), 90, "all sites up", fed)
    chrome.save_screenshot(str(screenshots / "01-sites-online.png"))
    page = wait_page(chrome, lambda p: p["facts"].get("round", "").startswith(("2 ", "3 ", "4 ")) or
                     int(p["facts"].get("round", "0 ").split()[0]) >= 2, 120, "round 2", fed)
    assert page["facts"]["algorithm"] == "fedavg" and page["facts"]["round"].endswith("of 10")
    assert page["plots"] > 0 and "live" in page["facts"]["source"]
    assert page["header"] == "live" and page["facts"]["status"] == "live"
    assert page["facts"]["quorum"].startswith("1 of 4") and page["facts"]["min sites"].startswith("4 of 4")
    # The data column: each site's rows per split and its label histogram, from its status.
    assert all(re.match(r"\d+ / \d+ / \d+labels 0: \d+, 1: \d+", s["data"])
               for s in page["sites"].values()), page["sites"]
    # Live from ps/metrics: each site's last round's compute time (milliseconds, never "0.0 s") and update size.
    seconds = r"(<1 ms|[0-9.]+ ms|[0-9.]+ s)"
    assert all(re.search(rf"last round {seconds} \(CPU {seconds}\); update [0-9.]+ KiB", s["usage"])
               for s in page["sites"].values() if s["rounds"] > 0), page["sites"]
    assert "0.0 s" not in json.dumps(page["sites"])
    chrome.save_screenshot(str(screenshots / "02-rounds-advance.png"))

    # A killed site goes offline (its Last Will), and the others carry on.
    fed.kill("va")
    page = wait_page(chrome, lambda p: p["sites"]["va"]["state"] == "offline", 60, "va offline", fed)
    rounds_when_killed = page["sites"]["va"]["rounds"]
    # The timeline says so, and then that rounds close without it, not waiting for their deadline.
    assert ["offline", "va offline: connection lost"] in page["events"]
    without_va = re.compile(r"round \d+ closed without va \(offline\)")
    page = wait_page(chrome, lambda p: any(k == "offline" and without_va.fullmatch(t) for k, t in p["events"]),
                     60, "a round closed without va", fed)
    # ps/status's truth: va is not waited for; the PS goes on without it and says why, in the facts, in va's row
    # and on the timeline.
    page = wait_page(chrome, lambda p: p["facts"].get("dropped by the PS", "").startswith("va: offline since 20"), 30,
                     "va among the sites the PS goes on without", fed)
    assert "va" not in page["facts"]["waiting for"].split(", ")
    assert page["sites"]["va"]["dropped"].startswith("dropped: offline since 20"), page["sites"]["va"]
    assert all(not s["dropped"] for name, s in page["sites"].items() if name != "va"), page["sites"]
    assert any(k == "offline" and t.startswith("PS goes on without va: offline since 20") for k, t in page["events"])
    chrome.save_screenshot(str(screenshots / "03-site-killed.png"))  # docs/img/dashboard-site-killed.png
    part = chrome.find_element("css selector", "section.run .part[id$='-timeline']")
    chrome.execute_script("arguments[0].scrollIntoView()", part)
    part.screenshot(str(screenshots / "dashboard-timeline-live.png"))

    # A hostile status string with va's own credentials is shown as text, never run or parsed as markup.
    settings = fed.layout.settings("va")
    hostile = m.SiteStatus(run_id=fed.layout.run_id, sender="va", round=0, state="error", detail=HOSTILE)
    va_status = topics.site_status_topic(fed.layout.run_id, "va")  # signed with va's key, as va itself would
    _publish_as(settings, va_status, fed.layout.identity("va").seal(va_status, encode(hostile)))
    page = wait_page(chrome, lambda p: p["sites"]["va"]["detail"] == HOSTILE, 30, "the hostile detail as text", fed)
    assert page["sites"]["va"]["detail_children"] == 0 and page["sites"]["va"]["state"] == "error"
    assert chrome.title != "pwned" and not chrome.find_elements("css selector", "td.detail img, td.detail script")
    chrome.save_screenshot(str(screenshots / "04-hostile-status-as-text.png"))

    # The run finishes without va; the page says so.
    fed.wait_ps_done(300)
    page = wait_page(chrome, lambda p: p["facts"].get("phase", "").startswith("done"), 30, "phase done", fed)
    assert page["facts"]["round"] == "10 of 10" and page["header"] == "finished"
    assert page["facts"]["phase"] != "done — done"
    # Rounds per site as the PS recorded them (a slow machine may leave any site out of a round at its deadline).
    report = json.loads((fed.work / "ps" / "report.json").read_text())
    for site in fed.sites:
        assert page["sites"][site]["rounds"] == sum(site in r["sites"] for r in report["rounds"]), site
    # Its count stopped: an update it sent just before it was killed may still close that round with it.
    assert rounds_when_killed <= page["sites"]["va"]["rounds"] <= rounds_when_killed + 1 < 10
    chrome.save_screenshot(str(screenshots / "05-run-done.png"))
    # The live page's best round is the report's (the same rule on the same metric, from ps/status).
    assert page["facts"]["best round"].startswith(f"round {report['best_round']['round']} by "
                                                  f"{report['best_round']['metric']} ")

    # The finished run directory shows the same page without a broker.
    fed.stop_all()
    chrome.get(dashboard("--run", str(fed.work / "ps")))
    page = wait_page(chrome, lambda p: "report.json" in p["facts"].get("source", ""), 30, "the finished run", fed)
    assert page["facts"]["round"] == "10 of 10" and page["plots"] > 0 and page["facts"].get("best round")
    assert page["header"] == "finished" and page["facts"]["quorum"].startswith("1 of 4")
    chrome.save_screenshot(str(screenshots / "06-finished-run.png"))


def test_a_dashboard_started_mid_run_says_earlier_rounds_are_missing(federation: CliFederation, dashboard, chrome,
                                                                     screenshots: Path) -> None:
    fed = federation
    fed.start_broker()
    fed.start_ps()
    for site in fed.sites:
        fed.start_site(site)
    fed.wait_message(lambda msg: isinstance(msg, m.RoundMetrics) and msg.round >= 3, 120, "round 3 closed")
    chrome.get(dashboard("--federation", str(fed.layout.fed_dir)))
    page = wait_page(chrome, lambda p: p["history"], 30, "the missing-history note", fed)
    assert "not available" in page["history"] and page["header"] == "live"
    chrome.save_screenshot(str(screenshots / "07-started-mid-run.png"))
    # The PS dies mid-run: its Last Will turns the run offline, not "live" with a frozen round.
    fed.kill("ps")
    page = wait_page(chrome, lambda p: p["header"] == "offline", 60, "the run offline", fed)
    assert page["facts"]["status"].startswith("offline")
    chrome.save_screenshot(str(screenshots / "08-ps-gone.png"))
