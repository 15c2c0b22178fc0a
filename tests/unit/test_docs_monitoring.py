"""docs/monitoring.md's metrics table is the endpoint's catalogue, and the Grafana dashboard asks only for metrics
the endpoint exports."""

from __future__ import annotations

import json
import re

from fedmqtt.docgen import REPO, stale
from fedmqtt.docgen import monitoring as gen
from ps_daemon.monitoring import METRICS

DOC = REPO / gen.PATH
DASHBOARD = REPO / "docs" / "grafana" / "fedmqtt.json"
SUFFIXES = {"counter": ("_total",), "info": ("_info",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"), "gauge": ("",)}


def test_committed_file_equals_render() -> None:
    """Run `python -m fedmqtt.docgen` after changing ps_daemon/monitoring.py's METRICS."""
    assert gen.render()[gen.PATH] == DOC.read_text(encoding="utf-8")
    assert gen.PATH not in stale()


def test_every_metric_is_a_row_of_the_doc() -> None:
    text = DOC.read_text(encoding="utf-8").split(gen.BEGIN, 1)[1].split(gen.END, 1)[0]
    for name, doc in METRICS.items():
        assert f"| `{gen.series_name(name, doc)}` | {doc.kind} |" in text, name


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out += [panel, *panel.get("panels", [])]
    return out


def test_the_grafana_dashboard_uses_a_datasource_variable_and_only_exported_series() -> None:
    # Prepare
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    series = {name + suffix for name, doc in METRICS.items() for suffix in SUFFIXES[doc.kind]}
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    # Execute
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    asked = {name for expr in exprs for name in re.findall(r"\bfedmqtt_\w+", expr)}
    # Check
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p["targets"])
    assert asked and asked <= series, sorted(asked - series)
    assert len({p["id"] for p in _panels(dashboard)}) == len(_panels(dashboard))
    # the panels an operator looks for first
    for wanted in ("round", "phase", "sites_online", "updates_accepted_total", "refused_total",
                   "round_duration_seconds_bucket", "bytes_sent_total"):
        assert f"fedmqtt_ps_{wanted}" in asked, wanted
    assert any("by (reason)" in expr and "fedmqtt_ps_refused_total" in expr for expr in exprs)
