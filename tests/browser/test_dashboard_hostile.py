"""The longest strings the schema allows, with a right-to-left override, published on a real broker with the
parties' own credentials (real paho clients), read by a real `fedmqtt dashboard --federation` process and shown
in headless Chromium 420 px wide: the page stays within the viewport, nothing is reversed, the full text is on
hover; the live best round follows the PS's selection metric; refused and dropped messages show sender and
reason on the timeline."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from page_wait import wait_for

from fedmqtt.transport import topics
from schemas import messages as m
from schemas.codec import encode

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

RLO = "\u202e"
DEVICE = RLO + "GPU " + "D" * 251  # 256 characters: Label's limit
DETAIL = (RLO + "abc " + ("x" * 60 + " ") * 40)[:2000]  # 2,000 characters: Detail's limit
PS_DETAIL = (RLO + "abc " + "ps detail " * 200)[:2000]
DROPPED_WHY = (RLO + "abc why " + "w" * 300)[:256]  # a reason in ps/status `dropped`: Label's limit

READ = """
const run = document.querySelector('section.run');
if (!run) return null;
const facts = {};
run.querySelectorAll('dl.facts dt').forEach(dt => { facts[dt.textContent] = dt.nextElementSibling.textContent; });
const detail = run.querySelector("tr[data-site='site-a'] td.detail bdi");
const refused = run.querySelector("tr[data-site='site-b'] td.rejected");
return {facts, detail: detail && detail.textContent, detail_title: detail && detail.getAttribute('title'),
        refused: refused && refused.textContent,
        events: [...run.querySelectorAll('ol.timeline li')].map(
            li => [li.dataset.kind, li.lastElementChild.textContent]),
        width: [window.innerWidth, document.documentElement.scrollWidth, document.body.scrollWidth],
        height: document.documentElement.scrollHeight,
        raw_controls: /[\\u202a-\\u202e\\u2066-\\u2069]/.test(document.body.innerText + document.title)};
"""

# The x positions of three characters of a text node, as laid out: increasing when shown left to right.
ORDER = """
const bdi = document.querySelector(arguments[0]);
const node = bdi.firstChild, at = node.textContent.indexOf(arguments[1]);
return [0, 1, 2].map(i => { const r = document.createRange(); r.setStart(node, at + i); r.setEnd(node, at + i + 1);
                             return r.getBoundingClientRect().left; });
"""


def _stream(url: str) -> Iterator[dict]:
    """The dashboard's /events, one parsed event at a time (what the page receives)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/events")
    response = conn.getresponse()
    try:
        while line := response.fp.readline():
            if line.startswith(b"data: "):
                yield json.loads(line[6:])
    finally:
        conn.close()


def _wait(driver, predicate, what: str, timeout_s: float = 30) -> dict:
    return wait_for(driver, READ, predicate, what, timeout_s)


def test_hostile_strings_stay_within_420_px_unreversed_and_the_best_round_is_the_pss(
        federation, paho_client, dashboard, chrome, screenshots: Path) -> None:
    run = federation.run_id
    chrome.set_window_size(420, 1000)
    url = dashboard("--federation", str(federation.layout.fed_dir))
    chrome.get(url)
    ps, site_a, site_b = (paho_client(federation.settings(u)) for u in ("ps", "site-a", "site-b"))

    def sealed(topic: str, payload: bytes) -> bytes:  # as the topic's owner signs it
        return federation.layout.identity(topics.parse_topic(topic).owner).seal(topic, payload)

    def publish(client, topic: str, msg: object) -> None:
        client.publish(topic, sealed(topic, encode(msg)), qos=1, retain=True).wait_for_publish(10)

    def status(round_no: int, **kw: object) -> m.DaemonStatus:
        return m.DaemonStatus(run_id=run, sender="ps", round=round_no, state="training", algorithm="fedavg",
                              rounds_total=5, sites_expected=("site-a", "site-b"), sites_online=("site-a",),
                              selection_metric="auroc", quorum=1, min_sites=2, deadline=time.time() + 300, **kw)

    publish(ps, topics.ps_status_topic(run), status(1, detail="round 1: training on 2 sites"))
    _wait(chrome, lambda p: p["facts"].get("round", "").startswith("1 of 5"), "round 1")
    publish(site_a, topics.site_status_topic(run, "site-a"), m.SiteStatus(
        run_id=run, sender="site-a", round=1, state="training", device=DEVICE, detail=DETAIL, n_train=120, n_val=40,
        n_test=40, label_histogram={"0": 70, "1": 50}))
    # Two rounds: auroc is best in round 1, loss in round 2; the PS selects by auroc. The event stream sends
    # everything once, then only the round that changed and the events added (the page merges them).
    events = _stream(url)
    first = next(events)
    assert first["delta"] is False and first["runs"][0]["rounds"] == []
    for n, auroc, loss in ((1, 0.81, 0.60), (2, 0.78, 0.50)):
        publish(ps, topics.ps_metrics_topic(run), m.RoundMetrics(
            run_id=run, sender="ps", round=n, sites=("site-a",), stragglers=("site-b",),
            per_site={"site-a": {"auroc": auroc, "loss": loss}}, mean={"auroc": auroc, "loss": loss},
            train_loss=loss + 0.05, duration_s=3.0))
        update = next(e for e in events if e["runs"] and e["runs"][0]["rounds"])
        assert update["delta"] is True and [r["round"] for r in update["runs"][0]["rounds"]] == [n]
        assert {e["round"] for e in update["runs"][0]["events"] if e["kind"] in ("round", "deadline")} == {n}
    events.close()
    publish(ps, topics.ps_status_topic(run),
            status(3, detail=PS_DETAIL, rejected={"site-b": {"stale or future round": 3}},
                   dropped={"site-b": DROPPED_WHY}))
    # A status the schema refuses (a device name over 256 characters), from site-b's own login.
    too_long = json.loads(encode(m.SiteStatus(run_id=run, sender="site-b", round=3, state="online")))
    too_long["device"] = "d" * 300
    topic_b = topics.site_status_topic(run, "site-b")
    site_b.publish(topic_b, sealed(topic_b, json.dumps(too_long).encode()), qos=1).wait_for_publish(10)

    page = _wait(chrome, lambda p: p["detail"] and p["facts"].get("round", "").startswith("3 of 5") and any(
        k == "invalid" for k, _ in p["events"]), "every message")
    # Whole at 420 px: nothing wider than the viewport, whatever the strings.
    inner, doc, body = page["width"]
    assert inner == 420 and doc <= inner and body <= inner, page["width"]
    assert page["height"] < 9000, page["height"]
    # Unreversed: the override is shown as a code, never obeyed; the text after it reads left to right.
    assert not page["raw_controls"]
    assert page["detail"] == DETAIL.replace(RLO, "⟨U+202E⟩") == page["detail_title"]
    a, b, c = chrome.execute_script(ORDER, "tr[data-site='site-a'] td.detail bdi", "abc")
    assert a < b < c
    a, b, c = chrome.execute_script(ORDER, "dl.facts dd[data-fact='phase'] bdi", "abc")  # the PS's detail
    assert a < b < c
    assert page["facts"]["phase"].startswith("training — ⟨U+202E⟩abc ps detail")
    # The sites the PS goes on without, with its reason: isolated and cut short like every other party string.
    assert page["facts"]["dropped by the PS"].startswith("site-b: ⟨U+202E⟩abc why www")
    for where in ("dl.facts dd[data-fact='dropped by the PS'] bdi:last-of-type",
                  "tr[data-site='site-b'] .dropped-why bdi"):
        a, b, c = chrome.execute_script(ORDER, where, "abc")
        assert a < b < c, where
    # The live best round is the PS's, by its selection metric (auroc: round 1), not the lowest loss (round 2).
    assert page["facts"]["best round"].startswith("round 1 by val auroc = 0.810")
    # Refused (by the PS) and dropped (by this page) messages: with their sender and reason.
    texts = [t for _, t in page["events"]]
    assert "PS refused 3 messages from site-b: stale or future round (counted before this page connected)" not in texts
    assert "PS refused 3 messages from site-b: stale or future round" in texts
    dropped = [t for k, t in page["events"] if k == "invalid"]
    assert dropped and dropped[0].startswith("dropped 1 message from site-b: too large: ")
    assert "site-b: too large ×1" in page["facts"]["dropped by this page"]
    assert page["refused"] == "stale or future round ×3"  # the sites table: per sender, per reason
    assert "round 1 closed at its deadline without site-b" in texts
    chrome.save_screenshot(str(screenshots / "dashboard-phone-hostile.png"))
    chrome.execute_script("document.querySelector(\"section.run .part[id$='-sites']\").scrollIntoView()")
    chrome.save_screenshot(str(screenshots / "dashboard-phone-hostile-sites.png"))
    height = chrome.execute_script("return document.documentElement.scrollHeight")
    chrome.set_window_size(420, min(height + 120, 9000))
    chrome.save_screenshot(str(screenshots / "dashboard-phone-hostile-full.png"))
