"""docs/monitoring.md, the PS's metrics: the table of every metric its endpoint exports and the values its labels
take, rendered from the catalogue the endpoint itself uses (ps_daemon.monitoring.METRICS), so the page is the
code's.

Only the text between the two marker lines is generated; the rest of the file is written by hand.
"""

from __future__ import annotations

from fedmqtt.docgen import markers
from fedmqtt.docgen.paths import REPO
from fedmqtt.docgen.tables import code, table
from ps_daemon.monitoring import KNOWN_REASONS, METRICS, OTHER, PHASES, MetricDoc

PATH = "docs/monitoring.md"
BEGIN = "<!-- BEGIN GENERATED: PS metrics (python -m fedmqtt.docgen) -->"
END = "<!-- END GENERATED: PS metrics -->"


def series_name(name: str, doc: MetricDoc) -> str:
    """The name as a scrape shows it: a counter's samples end in `_total`, an info's in `_info`."""
    return name + {"counter": "_total", "info": "_info"}.get(doc.kind, "")


def metrics_table() -> str:
    rows = [(code(series_name(name, doc)), doc.kind, ", ".join(code(label) for label in doc.labels) or "—", doc.help)
            for name, doc in METRICS.items()]
    return table(("metric", "type", "labels", "meaning"), rows)


def label_values() -> str:
    reasons = ", ".join(code(r) for r in sorted(KNOWN_REASONS))
    return "\n".join([
        "Label values, each from a fixed set:\n",
        f"- `site`: a site of the config's `sites` list, or {code(OTHER)} (any other sender);",
        f"- `reason`: {reasons}, or {code(OTHER)} (a category added to the code later);",
        f"- `phase`: {', '.join(code(p) for p in PHASES)};",
        "- `problem`: `duplicate`, `stale`, `corrupt`; `result`: `completed`, `failed`;",
        "- `metric`: the config's `selection_metric`; `run_id`, `algorithm`, `session`: this PS's.",
    ]) + "\n"


def render() -> dict[str, str]:
    """{"docs/monitoring.md": the committed file with its generated part brought up to date}."""
    text = (REPO / PATH).read_text(encoding="utf-8")
    return {PATH: markers.splice(text, f"{metrics_table()}\n{label_values()}", begin=BEGIN, end=END, path=PATH)}
