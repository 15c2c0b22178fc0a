"""Headless Chromium on `fedmqtt dashboard --runs` over two real finished runs (`fedmqtt simulate`): the results
panel shows the report's numbers, one best round everywhere (the report's), the comparison lists both runs with
their final metrics, the plots have ticks, hover values and site toggles; the downloads return the files' bytes
and refuse anything else. Screenshots are saved (docs/img has copies)."""

from __future__ import annotations

import http.client
import json
import shutil
import urllib.parse
from pathlib import Path

import pytest
from page_wait import wait_for
from selenium.webdriver.common.action_chains import ActionChains

from fedmqtt.dashboard.rundir import DOWNLOADS, find_runs

READ_RUN = """
const run = document.querySelector('section.run');
if (!run) return null;
const facts = {};
run.querySelectorAll('dl.facts dt').forEach(dt => { facts[dt.textContent] = dt.nextElementSibling.textContent; });
const tables = {};
run.querySelectorAll('table.results').forEach(t => {
  const rows = {};
  t.querySelectorAll('tr[data-row]').forEach(tr => {
    const cells = {};
    tr.querySelectorAll('td[data-metric]').forEach(td => { cells[td.dataset.metric] = td.textContent; });
    rows[tr.dataset.label] = {kind: tr.dataset.row, n: tr.children[1].textContent, cells};
  });
  tables[t.dataset.model] = {caption: t.querySelector('caption').textContent, rows};
});
return {key: run.dataset.runKey, heading: run.querySelector('h2').textContent, facts, tables,
        best_labels: [...run.querySelectorAll('figure.plot .best-label')].map(t => t.textContent),
        links: [...run.querySelectorAll('ul.downloads a')].map(a => a.getAttribute('href')),
        events: [...run.querySelectorAll('ol.timeline li')].map(li => li.dataset.kind),
        yticks: [...run.querySelectorAll('figure.plot[data-plot="val-auroc"] text.tick')].map(t => t.textContent),
        lines: run.querySelectorAll('figure.plot[data-plot="val-auroc"] polyline').length,
        train_points: [...run.querySelectorAll('figure.plot[data-plot="train-loss"] circle title')].map(
            t => t.textContent)};
"""




def _open(driver, label: str) -> dict:
    key = driver.execute_script("""
        const b = [...document.querySelectorAll('table.runlist button.open')].find(b => b.textContent === arguments[0]);
        if (!b) return null;
        b.click();
        return b.closest('tr').dataset.key;""", label)
    assert key is not None, f"no run {label} in the list"
    return wait_for(driver, READ_RUN, lambda p: p["key"] == key and p["tables"], f"run {label} opened")


@pytest.mark.e2e
def test_results_best_round_and_comparison_show_the_reports(finished_runs: Path, dashboard, chrome,
                                                              screenshots: Path) -> None:
    chrome.get(dashboard("--runs", str(finished_runs)))
    wait_for(chrome, "return document.querySelectorAll('table.runlist tr[data-key]').length", lambda n: n == 2,
          "both runs listed")
    for directory in find_runs(finished_runs):
        report = json.loads((directory / "report.json").read_text())
        page = _open(chrome, directory.name)
        best = report["best_round"]["round"]
        metrics = ("auroc", "accuracy", "auprc", "balanced_accuracy", "loss")
        # The results panel: per site (with its test rows) and the mean, of the final and the best-round model.
        for model, section in (("final", report["final"]), ("best", report["best"])):
            rows = page["tables"][model]["rows"]
            for site, entry in section["per_site"].items():
                assert rows[site]["kind"] == "site" and rows[site]["n"] == str(entry["n_samples"]["test"])
                assert rows[site]["cells"] == {k: f"{entry['metrics']['test'][k]:.3f}" for k in metrics}, site
            assert rows["mean"]["cells"] == {k: f"{section['mean']['test'][k]:.3f}" for k in metrics}
        # The reference rows the report has, as report.md writes them.
        md = (directory / "report.md").read_text()
        for label in ("pooled reference", "site alone"):
            row = page["tables"]["final"]["rows"][label]
            assert row["kind"] == "reference"
            assert f"| {label} |  | {row['cells']['auroc']} | {row['cells']['accuracy']} |" in md, label
        # One best round everywhere: the report's, by its selection metric.
        assert report["best_round"]["metric"] == "val auroc"
        assert page["facts"]["best round"].startswith(f"round {best} by val auroc")
        assert f"(round {best})" in page["tables"]["best"]["caption"]
        assert page["best_labels"] and set(page["best_labels"]) == {f"best r{best}"}
        listed = chrome.execute_script(
            "return document.querySelector(`table.runlist tr[data-key='${arguments[0]}']`).children[6].textContent",
            page["key"])
        assert listed == f"{best} (val auroc)"
        # Downloads link the run's files; the timeline has its rounds.
        assert page["links"] == [f"/runs/{page['key']}/files/{name}" for name in DOWNLOADS]
        assert page["events"].count("round") == 2 * len(report["rounds"])
        assert len(page["yticks"]) >= 3 and page["lines"] == 5  # the mean and four sites
        # The training loss is plotted: a point per round with its value on hover, the report's.
        assert page["train_points"] == [f"mean, round {r['round']}: {r['train_loss']:.4f}" for r in report["rounds"]]
    part = chrome.find_element("css selector", "section.run .part[id$='-results']")
    chrome.execute_script("arguments[0].scrollIntoView()", part)
    part.screenshot(str(screenshots / "dashboard-results.png"))
    chrome.find_element("css selector", "section.run .part[id$='-timeline']").screenshot(
        str(screenshots / "dashboard-timeline-finished.png"))

    # Values on hover: the crosshair lists the mean at the round under the pointer (of the run open last).
    report = json.loads((directory / "report.json").read_text())
    hit = chrome.find_element("css selector", "figure.plot[data-plot='val-auroc'] rect.hit")
    chrome.execute_script("arguments[0].scrollIntoView({block: 'center'})", hit)
    width = hit.size["width"]
    ActionChains(chrome).move_to_element_with_offset(hit, int(width / 2 - 2), 0).perform()
    tip = wait_for(chrome, "const t = document.querySelector(\"figure.plot[data-plot='val-auroc'] .tip\"); "
                        "return t && !t.classList.contains('hidden') ? t.textContent : null", bool, "the hover values")
    shown_round = int(tip.split("round ")[1].split("mean")[0])
    mean = next(r["mean"]["auroc"] for r in report["rounds"] if r["round"] == shown_round)
    assert f"mean: {mean:.4f}" in tip
    # Sites toggled off leave the plots, and come back.
    chrome.execute_script("document.querySelector(\"button.series[data-series='va']\").click()")
    assert wait_for(chrome, READ_RUN, lambda p: p["lines"] == 4, "va hidden")["lines"] == 4
    chrome.execute_script("document.querySelector(\"button.series[data-series='va']\").click()")
    wait_for(chrome, READ_RUN, lambda p: p["lines"] == 5, "va shown again")

    # The comparison: both runs on the same axes, and a table of their final metrics (the reports').
    compare = chrome.execute_script("""
        const c = document.querySelector('section.compare');
        return {lines: c.querySelectorAll('figure.plot polyline').length,
                rows: [...c.querySelectorAll('table.compare tr[data-key]')].map(tr => ({
                    label: tr.children[0].textContent, model: tr.dataset.model,
                    cells: Object.fromEntries([...tr.querySelectorAll('td[data-metric]')].map(
                        td => [td.dataset.metric, td.textContent]))}))};""")
    assert compare["lines"] == 2
    assert sorted((r["label"], r["model"]) for r in compare["rows"]) == [
        ("fedadam", "best"), ("fedadam", "final"), ("fedavg", "best"), ("fedavg", "final")]
    for row in compare["rows"]:
        report = json.loads((finished_runs / row["label"] / "report.json").read_text())
        mean = report["final" if row["model"] == "final" else "best"]["mean"]["test"]
        assert row["cells"] == {k: f"{mean[k]:.3f}" for k in row["cells"]} and "auroc" in row["cells"]
    section = chrome.find_element("css selector", "section.compare")
    chrome.execute_script("arguments[0].scrollIntoView()", section)
    section.screenshot(str(screenshots / "dashboard-compare.png"))
    logs = [e["message"] for e in chrome.get_log("browser") if e["level"] == "SEVERE"]
    assert not logs, logs


def _get(url: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """One GET with the path sent exactly as given (no client-side normalisation)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=20)
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        conn.close()


@pytest.mark.e2e
def test_downloads_return_the_files_bytes_and_refuse_everything_else(finished_runs: Path, dashboard,
                                                                     tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    shutil.copytree(finished_runs / "fedavg", planted)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"never served")
    (planted / "report.md").unlink()
    (planted / "report.md").symlink_to(secret)
    url = dashboard("--run", str(finished_runs / "fedavg"), "--run", str(planted))
    for name in DOWNLOADS:
        status, headers, body = _get(url, f"/runs/0/files/{name}")
        assert status == 200 and body == (finished_runs / "fedavg" / name).read_bytes(), name
        assert headers["Content-Disposition"] == f'attachment; filename="{name}"'
        assert headers["Content-Security-Policy"].startswith("default-src 'none'")
        assert headers["X-Content-Type-Options"] == "nosniff"
    assert _get(url, "/runs/1/files/report.json")[2] == (planted / "report.json").read_bytes()
    for path in ("/favicon.ico", "/static/favicon.svg"):  # the page's icon, served before any login too
        status, headers, body = _get(url, path)
        assert status == 200 and headers["Content-Type"].startswith("image/svg+xml") and body.startswith(b"<svg"), path
    for path in ("/runs/1/files/report.md",  # a symbolic link out of the run: refused
                 "/runs/0/files/..%2F..%2Fsecret.txt", "/runs/0/files/%2e%2e%2freport.json",
                 "/runs/0/files/../../../../etc/passwd", "/runs/0/files/checkpoints%2Fround-000008.ckpt",
                 "/runs/0/files/audit%2Fps.jsonl", "/runs/0/files/audit/ps.jsonl", "/runs/0/files/",
                 "/runs/0/files/report.json%00.md", "/runs/0/files/REPORT.JSON", "/runs/2/files/report.json",
                 "/runs/-1/files/report.json", "/runs/00000000/files/report.json", "/runs/0/files/spool"):
        status, _, body = _get(url, path)
        assert status == 404 and b"never served" not in body, path


@pytest.mark.e2e
def test_a_reports_record_level_epsilon_is_in_its_sites_table(finished_runs: Path, dashboard, chrome,
                                                             tmp_path: Path) -> None:
    """The sites table shows each site's epsilon from the report's privacy section (a copy of a finished run whose
    report is given one: the view is what is tested, not DP training), and a dash for a site without one."""
    copy = tmp_path / "runs" / "with-dp"
    shutil.copytree(finished_runs / "fedavg", copy)
    shutil.copytree(finished_runs / "fedadam", tmp_path / "runs" / "fedadam")  # with one run, no list to open from
    report = json.loads((copy / "report.json").read_text())
    sites = sorted(report["final"]["per_site"])
    report["privacy"] = {"record_level": {sites[0]: {"epsilon": 1.2345, "delta": 1e-5, "accountant": "rdp",
                                                     "noise_multiplier": 1.1, "sample_rate": 0.2, "steps": 40}}}
    (copy / "report.json").write_text(json.dumps(report))
    chrome.get(dashboard("--runs", str(copy.parent)))
    wait_for(chrome, "return document.querySelectorAll('table.runlist tr[data-key]').length", lambda n: n == 2,
          "both runs listed")
    _open(chrome, "with-dp")
    read = """return [...document.querySelectorAll('table.sites tr[data-site]')].map(
        tr => [tr.dataset.site, tr.querySelector('td.epsilon').textContent]);"""
    cells = dict(wait_for(chrome, read, lambda rows: len(rows) == len(sites), "the sites table"))
    assert cells[sites[0]] == "ε 1.234 at δ 0.00001"
    assert all(cells[s] == "–" for s in sites[1:])
