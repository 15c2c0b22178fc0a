"""The results panel of a finished run: test metrics of the final and of the best-round model, per site with its
sample count and as the mean over sites, followed by the reference rows report.md has (each metric-optimal
constant, the pooled reference model, the site alone).

Numbers are formatted here, as report.md formats them (`ps_daemon.report`), so the page and the report read
the same; each cell also carries the full value for the page's hover text.
"""

from __future__ import annotations

from typing import Any

from ps_daemon.report import baseline_rows, baseline_warnings, report_metrics

# Shown after the task's own metrics (report_metrics) when the report has them
MORE_METRICS = ("auprc", "balanced_accuracy", "loss", "mape", "mse", "msle", "mae", "auroc", "accuracy")


def _cell(value: Any) -> dict[str, Any]:
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return {"text": "n/a" if number is None else f"{number:.3f}", "value": number}  # report.md's format


def _metrics(report: dict[str, Any]) -> list[str]:
    """The task's metrics first (as report.md), then the others every site's test split has."""
    first = list(report_metrics(report))
    seen = set((report.get("final") or {}).get("mean", {}).get("test", {}))
    return first + [m for m in MORE_METRICS if m in seen and m not in first]


def _model_rows(per_site: dict[str, Any], mean: dict[str, Any], metrics: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for site, entry in per_site.items():
        if not isinstance(entry, dict):
            continue
        if "missing" in entry:
            rows.append({"kind": "site", "label": site, "n": None, "cells": {m: _cell(None) for m in metrics},
                         "note": str(entry["missing"])})
            continue
        test = (entry.get("metrics") or {}).get("test") or {}
        undefined = entry.get("undefined") or {}
        notes = [f"{k.split('.', 1)[-1]}: {v}" for k, v in sorted(undefined.items())
                 if k.startswith("test.") and k.split(".", 1)[1] in metrics]
        n = (entry.get("n_samples") or {}).get("test")
        rows.append({"kind": "site", "label": site, "n": n if isinstance(n, int) else None,
                     "cells": {m: _cell(test.get(m)) for m in metrics}, "note": "; ".join(notes)})
    rows.append({"kind": "mean", "label": "mean", "n": sum(r["n"] or 0 for r in rows) or None,
                 "cells": {m: _cell(mean.get(m)) for m in metrics},
                 "note": "unweighted, over sites where defined; n: test rows of all sites"})
    return rows


def results(report: dict[str, Any]) -> dict[str, Any]:
    """What the results panel shows; read defensively (a report of an older version lacks sections)."""
    metrics = _metrics(report)
    final = report.get("final") or {}
    models = [{"model": "final", "title": "final model",
               "round": max((r.get("round", 0) for r in report.get("rounds") or []), default=None),
               "rows": _model_rows(final.get("per_site") or {}, (final.get("mean") or {}).get("test") or {}, metrics)}]
    best, chosen = report.get("best"), report.get("best_round") or {}
    if isinstance(best, dict):
        models.append({"model": "best", "title": "best-round model", "round": best.get("round"),
                       "metric": chosen.get("metric"),
                       "rows": _model_rows(best.get("per_site") or {}, (best.get("mean") or {}).get("test") or {},
                                           metrics)})
    references = [{"kind": "reference", "label": row.label, "n": None, "note": row.note,
                   "cells": {m: {"text": row.cell(m), "value": None if "constant" in row.cell(m) else row.test.get(m)}
                             for m in metrics}}
                  for row in baseline_rows(report)]
    section = report.get("baselines") or {}
    notes = []
    if section.get("fitted_on"):
        notes.append(f"References fitted on {section['fitted_on']} and scored on every site's test split.")
    if section.get("ranking_note"):
        notes.append(str(section["ranking_note"]))
    reference = section.get("pooled_reference") or {}
    if reference and not reference.get("fitted"):
        notes.append(f"No pooled reference model: {reference.get('why', '?')}.")
    return {"metrics": metrics, "models": models, "references": references, "notes": notes,
            "warnings": baseline_warnings(report)}
