"""Each run's validation curve and the round its best-round rule picked, from the runs' report.json alone.

    python bench/validation_curves.py runs/los/fedstats/*-icutype --metric msle --out DIR/validation-icutype.md

Reads only validation metrics (never a test number), so what it shows can guide a validation-based choice
(which model to report, how long to train) without looking at the test split:

- per round, the unweighted mean of the selection metric over the sites that evaluated that round's model
  (docs/algorithms.md 17.1; with `selection = "fraction"` these are the round's sampled sites only, so
  rounds are compared on different sites' validation splits);
- the run's best round and its score, and the final model's validation score (every site evaluates it
  after the last round), so overfitting shows as final >> best.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def round_scores(report: dict[str, Any], metric: str) -> list[tuple[int, float | None, int]]:
    """(round, mean validation metric over the sites that evaluated it, how many sites) per round record."""
    rows = []
    for rec in report.get("rounds") or []:
        values = [m[metric] for m in (rec.get("per_site") or {}).values() if isinstance(m, dict) and metric in m]
        rows.append((int(rec["round"]), statistics.fmean(values) if values else None, len(values)))
    return rows


def final_validation(report: dict[str, Any], metric: str) -> float | None:
    """Unweighted mean over sites of the final model's validation metric."""
    values = [s["metrics"]["val"][metric] for s in (report.get("final") or {}).get("per_site", {}).values()
              if metric in (s.get("metrics") or {}).get("val", {})]
    return statistics.fmean(values) if values else None


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (each with report.json)")
    ap.add_argument("--metric", default="msle")
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = ap.parse_args()
    runs = sorted(p for p in args.runs if (p / "report.json").is_file())
    reports = {p.name: json.loads((p / "report.json").read_text()) for p in runs}
    n_rounds = max((len(r.get("rounds") or []) for r in reports.values()), default=0)
    head = ["run", "best round", "best val", "final val", *(f"r{i}" for i in range(1, n_rounds + 1)), "sites/round"]
    lines = [f"Validation {args.metric} (unweighted mean over the sites that evaluated each round's model; "
             "validation split only)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, report in reports.items():
        curve = round_scores(report, args.metric)
        best = report.get("best_round") or {}
        final = final_validation(report, args.metric)
        cells = [name, str(best.get("round", "n/a")), fmt(best.get("score")), fmt(final),
                 *(fmt(score) for _, score, _ in curve), *([""] * (n_rounds - len(curve))),
                 ",".join(sorted({str(n) for _, _, n in curve}))]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
